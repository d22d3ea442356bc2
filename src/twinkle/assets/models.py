"""Embedded Qwen3 causal LMs with random weights, for tests and benchmarks without a hub.

``tiny-qwen3`` (about 0.9M parameters) is for unit and end-to-end tests; ``small-qwen3``
(about 25.7M) for benchmarks. Both share the embedded tokenizer. Weights are drawn from a seeded
generator as Qwen3 initialises them (normal(0, initializer_range) matrices, RMSNorm scales of
one), so a model folder is the same bytes on every build.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.assets import tokenizer as tok
from twinkle.assets.cache import build_asset
from twinkle.errors import UnknownNameError

if TYPE_CHECKING:
    from transformers import Qwen3Config, Qwen3ForCausalLM

MODEL_VERSION = 2  # bump when the config or weight recipe below changes
# Scale of the output head. With normal(0, 0.02) and a 128-wide model, logits stay within about
# +-3 however the hidden state turns, so the loss cannot fall far below 6 whatever LoRA learns;
# at 0.1 the head can express confident predictions, as a trained model's does.
LM_HEAD_STD = 0.1


@dataclass(frozen=True)
class ModelRecipe:
    """The shape of one embedded Qwen3 model; everything else is shared (see ``qwen3_config``)."""

    # Width of the residual stream.
    hidden_size: int
    # Number of decoder layers.
    num_hidden_layers: int
    # Query heads, and key/value heads (grouped-query attention when fewer).
    num_attention_heads: int
    num_key_value_heads: int
    # Width of one attention head (Qwen3 sets it apart from hidden_size / heads).
    head_dim: int
    # Width of the SwiGLU MLP.
    intermediate_size: int
    # Seed of the weight generator.
    seed: int = 0


MODEL_RECIPES: dict[str, ModelRecipe] = {
    'tiny-qwen3': ModelRecipe(128, 2, 4, 2, 32, 384),
    'small-qwen3': ModelRecipe(512, 8, 8, 4, 64, 1408),
}
MODELS: tuple[str, ...] = tuple(MODEL_RECIPES)


def recipe(name: str) -> ModelRecipe:
    """The recipe of model ``name``; raises ``UnknownNameError`` listing ``MODELS``."""
    if name not in MODEL_RECIPES:
        raise UnknownNameError('model', name, MODELS)
    return MODEL_RECIPES[name]


def qwen3_config(name: str) -> Qwen3Config:
    """The ``Qwen3Config`` of model ``name`` (no weights are built)."""
    from transformers import Qwen3Config

    r = recipe(name)
    return Qwen3Config(
        vocab_size=tok.VOCAB_SIZE,
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_hidden_layers,
        num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads,
        head_dim=r.head_dim,
        max_position_embeddings=tok.MODEL_MAX_LENGTH,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        rope_parameters={'rope_type': 'default', 'rope_theta': 1_000_000.0},
        tie_word_embeddings=False,
        bos_token_id=tok.TOKEN_IDS[tok.PAD_TOKEN],
        eos_token_id=tok.TOKEN_IDS[tok.EOS_TOKEN],
        pad_token_id=tok.TOKEN_IDS[tok.PAD_TOKEN],
        dtype='float32',
    )


def init_weights(model: Qwen3ForCausalLM, seed: int) -> None:
    """Fill every parameter from one seeded stream, in ``named_parameters`` order.

    Matrices (projections, the embedding) ~ normal(0, initializer_range), the output head
    ~ normal(0, LM_HEAD_STD); vectors (the RMSNorm scales; Qwen3 has no biases) = 1.
    Independent of transformers' own init code.
    """
    import torch

    std = model.config.initializer_range
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, LM_HEAD_STD if name == 'lm_head.weight' else std, generator=generator)


def build_model(name: str) -> Qwen3ForCausalLM:
    """Model ``name`` in memory, with its seeded random weights (float32)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(qwen3_config(name)).float()
    init_weights(model, recipe(name).seed)
    return model.eval()


def write_model(name: str, folder: Path) -> None:
    """Save model ``name`` as a Hugging Face folder, with its tokenizer files, into ``folder``.

    Files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (written directly:
    the bytes ``save_pretrained`` writes, without its progress bar), tokenizer files.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    model = build_model(name)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    pad, eos = tok.TOKEN_IDS[tok.PAD_TOKEN], tok.TOKEN_IDS[tok.EOS_TOKEN]
    GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad).save_pretrained(folder)
    # The header metadata is fixed, so the bytes are too.
    weights = {key: param.detach().contiguous() for key, param in model.named_parameters()}
    save_file(weights, str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    source = tok.tokenizer_dir()
    for file in tok.TOKENIZER_FILES:
        shutil.copyfile(source / file, folder / file)


def model_dir_name(name: str) -> str:
    """Cache folder name of model ``name``: both recipe versions, so a change to either rebuilds."""
    return f'{name}-v{MODEL_VERSION}.{tok.TOKENIZER_VERSION}'


def tiny_model(name: str = 'tiny-qwen3') -> str:
    """Path of a local Hugging Face folder with model ``name`` and its tokenizer.

    Built on first use under ``twinkle_home()/assets/models`` and reused after. Load it with
    ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``.

    >>> from twinkle.assets import tiny_model
    >>> tiny_model('gpt-2')
    Traceback (most recent call last):
    ...
    twinkle.errors.UnknownNameError: Unknown model 'gpt-2'. Valid model names are: [...]
    """
    recipe(name)  # fail on an unknown name before touching the cache
    folder = build_asset('models', model_dir_name(name), lambda tmp: write_model(name, tmp))
    return str(folder)
