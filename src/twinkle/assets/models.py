"""Embedded causal LMs with random weights in the seeds' families, for tests and benchmarks without a hub.

``tiny-qwen3`` (about 0.9M parameters) is for unit and end-to-end tests; ``small-qwen3``
(about 25.7M) for benchmarks. ``wide-qwen3`` (about 187M) has Qwen3's full vocabulary (151,936
outputs, tied to the embedding as Qwen3-0.6B ties them) on two layers of Qwen3-0.6B's width, so
the output layer's share of a step is that of a real model (the small vocabulary of the others
hides it); its inputs are still the embedded tokenizer's 4,096 ids. ``tiny-qwen3.5`` has
Qwen3.5's hybrid layers (gated-deltanet linear attention beside full attention);
``tiny-qwen3-moe`` and ``tiny-qwen3.5-moe`` are mixtures of experts (fused 3-D expert weights, a
top-k router; Qwen3.5-MoE adds a gated shared expert). All share the embedded tokenizer. Weights
are drawn from a seeded generator as Qwen initialises them (normal(0, initializer_range) matrices,
expert stacks and router; RMSNorm scales of one, or of zero where the norm computes
``1 + weight``), so a model folder is the same bytes on every build.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle.assets import tokenizer as tok
from twinkle.assets.cache import build_asset
from twinkle.errors import UnknownNameError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, Qwen3Config

MODEL_VERSION = 2  # bump when the config or weight recipe below changes
# Scale of the output head. With normal(0, 0.02) and a 128-wide model, logits stay within about
# +-3 however the hidden state turns, so the loss cannot fall far below 6 whatever LoRA learns;
# at 0.1 the head can express confident predictions, as a trained model's does.
LM_HEAD_STD = 0.1

#: Qwen3's vocabulary (embedding rows and head outputs; its tokenizer has 151,669 tokens).
QWEN3_VOCAB_SIZE = 151_936

#: Model families the recipes build: transformers' causal-LM classes by family.
FAMILIES = ('qwen3', 'qwen3_moe', 'qwen3_5', 'qwen3_5_moe')


@dataclass(frozen=True)
class ModelRecipe:
    """The shape of one embedded model; everything else is shared (see ``model_config``)."""

    # Width of the residual stream.
    hidden_size: int
    # Number of decoder layers.
    num_hidden_layers: int
    # Query heads, and key/value heads (grouped-query attention when fewer).
    num_attention_heads: int
    num_key_value_heads: int
    # Width of one attention head (Qwen3 sets it apart from hidden_size / heads).
    head_dim: int
    # Width of the SwiGLU MLP (of each expert in an MoE family).
    intermediate_size: int
    # Seed of the weight generator.
    seed: int = 0
    # One of FAMILIES.
    family: str = 'qwen3'
    # Mixture of experts: experts per layer and experts each token is routed to.
    num_experts: int = 0
    experts_per_token: int = 0
    # Qwen3.5-MoE's shared expert width.
    shared_expert_size: int = 0
    # Rows of the embedding and outputs of the head: 0 for the tokenizer's size; more, as Qwen pads
    # its vocabulary past its tokenizer, to give the output layer a real model's width.
    vocab_size: int = 0
    # One matrix for the embedding and the head (Qwen3 up to 4B ties them).
    tie_word_embeddings: bool = False


MODEL_RECIPES: dict[str, ModelRecipe] = {
    'tiny-qwen3': ModelRecipe(128, 2, 4, 2, 32, 384),
    'small-qwen3': ModelRecipe(512, 8, 8, 4, 64, 1408),
    # Qwen3-0.6B's width, vocabulary and tied head on 2 of its 28 layers.
    'wide-qwen3': ModelRecipe(1024, 2, 16, 8, 128, 3072, vocab_size=QWEN3_VOCAB_SIZE, tie_word_embeddings=True),
    # Layers: linear attention, then full attention (Qwen3.5 alternates them 3:1).
    'tiny-qwen3.5': ModelRecipe(128, 2, 4, 2, 32, 384, family='qwen3_5'),
    'tiny-qwen3-moe': ModelRecipe(128, 2, 4, 2, 32, 96, family='qwen3_moe', num_experts=8, experts_per_token=2),
    'tiny-qwen3.5-moe': ModelRecipe(
        128, 2, 4, 2, 32, 96, family='qwen3_5_moe', num_experts=8, experts_per_token=2, shared_expert_size=128
    ),
}
#: The embedded causal LMs (``twinkle.assets.catalog.MODELS`` adds the vision-language models).
TEXT_MODELS: tuple[str, ...] = tuple(MODEL_RECIPES)
#: The embedded models whose MLPs are mixtures of experts.
MOE_MODELS: tuple[str, ...] = tuple(name for name, r in MODEL_RECIPES.items() if r.num_experts)


def recipe(name: str) -> ModelRecipe:
    """The recipe of causal LM ``name``; raises ``UnknownNameError`` listing ``TEXT_MODELS``."""
    if name not in MODEL_RECIPES:
        raise UnknownNameError('model', name, TEXT_MODELS)
    return MODEL_RECIPES[name]


def _shared_settings(r: ModelRecipe) -> dict[str, Any]:
    """Config fields every family shares: the tokenizer's ids and lengths, fp32; the vocabulary
    (the tokenizer's unless the recipe widens it) and the head's tying are the recipe's."""
    return {
        'vocab_size': r.vocab_size or tok.VOCAB_SIZE,
        'max_position_embeddings': tok.MODEL_MAX_LENGTH,
        'initializer_range': 0.02,
        'rms_norm_eps': 1e-6,
        'tie_word_embeddings': r.tie_word_embeddings,
        'bos_token_id': tok.TOKEN_IDS[tok.PAD_TOKEN],
        'eos_token_id': tok.TOKEN_IDS[tok.EOS_TOKEN],
        'pad_token_id': tok.TOKEN_IDS[tok.PAD_TOKEN],
        'dtype': 'float32',
    }


def qwen3_config(name: str) -> Qwen3Config:
    """The ``Qwen3Config`` of a dense Qwen3 model ``name`` (no weights are built)."""
    from transformers import Qwen3Config

    r = recipe(name)
    if r.family != 'qwen3':
        raise UnknownNameError('Qwen3 model', name, [n for n, m in MODEL_RECIPES.items() if m.family == 'qwen3'])
    return Qwen3Config(
        hidden_size=r.hidden_size,
        intermediate_size=r.intermediate_size,
        num_hidden_layers=r.num_hidden_layers,
        num_attention_heads=r.num_attention_heads,
        num_key_value_heads=r.num_key_value_heads,
        head_dim=r.head_dim,
        rope_parameters={'rope_type': 'default', 'rope_theta': 1_000_000.0},
        **_shared_settings(r),
    )


def model_config(name: str) -> PretrainedConfig:
    """The transformers config of model ``name``, in its family (no weights are built)."""
    r = recipe(name)
    if r.family == 'qwen3':
        return qwen3_config(name)
    import transformers

    shape: dict[str, object] = {
        'hidden_size': r.hidden_size,
        'num_hidden_layers': r.num_hidden_layers,
        'num_attention_heads': r.num_attention_heads,
        'num_key_value_heads': r.num_key_value_heads,
        'head_dim': r.head_dim,
        'rope_parameters': {'rope_type': 'default', 'rope_theta': 1_000_000.0},
    }
    if r.family in ('qwen3_5', 'qwen3_5_moe'):
        shape['rope_parameters'] = {'rope_type': 'default', 'rope_theta': 1_000_000.0, 'partial_rotary_factor': 0.25}
        shape['layer_types'] = ['linear_attention', 'full_attention'] * (r.num_hidden_layers // 2)
        shape |= {'linear_key_head_dim': 32, 'linear_value_head_dim': 32}
        shape |= {'linear_num_key_heads': 2, 'linear_num_value_heads': 4, 'linear_conv_kernel_dim': 4}
    if r.num_experts:
        shape |= {'num_experts': r.num_experts, 'num_experts_per_tok': r.experts_per_token}
        shape |= {'moe_intermediate_size': r.intermediate_size, 'norm_topk_prob': True}
        shape |= {'router_aux_loss_coef': 0.001}
    else:
        shape['intermediate_size'] = r.intermediate_size
    if r.shared_expert_size:
        shape['shared_expert_intermediate_size'] = r.shared_expert_size
    config_class = {
        'qwen3_moe': transformers.Qwen3MoeConfig,
        'qwen3_5': transformers.Qwen3_5TextConfig,
        'qwen3_5_moe': transformers.Qwen3_5MoeTextConfig,
    }[r.family]
    # transformers' lazy module attributes are Any to mypy, so the class is too.
    config: PretrainedConfig = config_class(**shape, **_shared_settings(r))
    return config


def init_weights(model: PreTrainedModel, seed: int) -> None:
    """Fill every parameter from one seeded stream, in ``named_parameters`` order.

    Matrices and stacks (projections, the embedding, expert weights, the router, the short
    convolution) ~ normal(0, initializer_range), an untied output head ~ normal(0, LM_HEAD_STD) (a
    tied one is the embedding, listed once, under the embedding's name); vectors
    keep the constant their module starts with (RMSNorm scales of one, or of zero where the norm
    computes ``1 + weight``; gated deltanet's ``dt_bias`` of one), and gated deltanet's ``A_log``
    spans log 1 .. log 16 evenly (the range Qwen3.5 draws it from). Independent of transformers'
    own init code.
    """
    import torch

    std = model.config.initializer_range
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith('A_log'):
                param.copy_(torch.linspace(1.0, 16.0, param.numel()).log())
            elif param.ndim == 1:
                if not bool((param == param.flatten()[0]).all()):
                    raise ValueError(f'{name} starts with varying values: give it a rule in init_weights')
            else:
                param.normal_(0.0, LM_HEAD_STD if name == 'lm_head.weight' else std, generator=generator)


def build_model(name: str) -> PreTrainedModel:
    """Model ``name`` in memory, with its seeded random weights (float32)."""
    import transformers

    config = model_config(name)
    model_class = {
        'qwen3': transformers.Qwen3ForCausalLM,
        'qwen3_moe': transformers.Qwen3MoeForCausalLM,
        'qwen3_5': transformers.Qwen3_5ForCausalLM,
        'qwen3_5_moe': transformers.Qwen3_5MoeForCausalLM,
    }[recipe(name).family]
    model: PreTrainedModel = model_class(config).float()  # transformers' lazy module attributes are Any
    init_weights(model, recipe(name).seed)
    model.train(False)  # eval mode; transformers leaves eval() unannotated
    return model


def write_model(name: str, folder: Path) -> None:
    """Save model ``name`` as a Hugging Face folder, with its tokenizer files, into ``folder``."""
    model = build_model(name)
    model.config.architectures = [type(model).__name__]
    save_model_folder(model, folder, tok.tokenizer_dir(), tok.TOKENIZER_FILES)


def save_model_folder(model: PreTrainedModel, folder: Path, source: Path, files: Sequence[str]) -> None:
    """Write ``model`` into ``folder`` and copy its tokenizer (and processor) ``files`` from ``source``.

    Files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (written directly:
    the bytes ``save_pretrained`` writes, without its progress bar; the header metadata is fixed,
    so the bytes are too), and ``files``.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    model.config.save_pretrained(folder)
    pad, eos = tok.TOKEN_IDS[tok.PAD_TOKEN], tok.TOKEN_IDS[tok.EOS_TOKEN]
    # transformers leaves GenerationConfig.__init__(**kwargs) unannotated.
    generation = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)  # type: ignore[no-untyped-call]
    generation.save_pretrained(folder)
    weights = {key: param.detach().contiguous() for key, param in model.named_parameters()}
    save_file(weights, str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    for file in files:
        shutil.copyfile(source / file, folder / file)


def model_dir_name(name: str) -> str:
    """Cache folder name of model ``name``: both recipe versions, so a change to either rebuilds."""
    return f'{name}-v{MODEL_VERSION}.{tok.TOKENIZER_VERSION}'


def text_model(name: str) -> str:
    """Path of the local Hugging Face folder of causal LM ``name``, built on first use
    (``twinkle.assets.tiny_model`` takes the vision-language models too)."""
    recipe(name)  # fail on an unknown name before touching the cache
    folder = build_asset('models', model_dir_name(name), lambda tmp: write_model(name, tmp))
    return str(folder)
