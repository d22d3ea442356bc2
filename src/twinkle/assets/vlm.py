"""Embedded vision-language models: a vision tower and merger in front of a tiny language model.

``tiny-qwen3.5-vl`` is a ``Qwen3_5ForConditionalGeneration`` (the layout of the Qwen3.5
checkpoints: ``model.visual``, ``model.language_model``, ``lm_head``) whose language model is
shaped like ``tiny-qwen3.5``; ``tiny-qwen3-vl`` a ``Qwen3VLForConditionalGeneration`` (deepstack
features from the tower into the first decoder layer) shaped like ``tiny-qwen3``. Each folder
holds what the real ones do: ``config.json``, ``generation_config.json``, ``model.safetensors``, the
tokenizer, ``preprocessor_config.json`` (Qwen2-VL's image processor: 16-pixel patches, 2 x 2
merged into one token, so a 64 x 64 image is 4 tokens), ``video_preprocessor_config.json`` and
``chat_template.jinja``.

The tokenizer is the embedded one (``tokenizer.py``) with Qwen's five vision tokens added after
its 4096 ids (``VISION_TOKEN_IDS``); the text models' files and ids stay as they are. The
vocabulary is padded to ``VLM_VOCAB_SIZE``, as Qwen pads its own past the tokenizer.

Loading notes (transformers 5.24): ``AutoTokenizer`` loads the ``qwen3_5`` folder as its
``Qwen3_5Tokenizer``, as it does the real checkpoints (NFC-normalised, the same ids for text that
is already NFC); ``AutoProcessor`` needs torchvision for the video processor the Qwen3-VL
processor always builds, while ``AutoImageProcessor`` (its PIL backend) and ``AutoTokenizer``
need nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle.assets import models
from twinkle.assets import tokenizer as tok
from twinkle.assets.cache import build_asset

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PretrainedConfig, PreTrainedModel

VLM_VERSION = 1  # bump when anything below changes the files
#: Qwen's vision tokens in Qwen's relative order, added after the embedded tokenizer's ids.
VISION_TOKENS = ('<|vision_start|>', '<|vision_end|>', '<|vision_pad|>', '<|image_pad|>', '<|video_pad|>')
VISION_TOKEN_IDS: dict[str, int] = {token: tok.VOCAB_SIZE + i for i, token in enumerate(VISION_TOKENS)}
#: The embedded 4096 ids and the vision tokens, padded to a multiple of 8.
VLM_VOCAB_SIZE = 4104
IMAGE_TOKEN = '<|image_pad|>'
TOKENIZER_VLM_NAME = f'twinkle-bpe-{tok.VOCAB_SIZE}-v{tok.TOKENIZER_VERSION}-vision-v{VLM_VERSION}'
#: Pixels per patch side, patches merged per token side, frames per temporal patch.
PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
#: The image processor resizes every image to hold between these many pixels (1 to 16 tokens).
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2
MAX_PIXELS = 128 * 128
VLM_FILES = ('preprocessor_config.json', 'video_preprocessor_config.json', 'chat_template.jinja')


@dataclass(frozen=True)
class VisionRecipe:
    """The vision tower of one embedded VLM; the language model is ``text_model``'s shape."""

    # The embedded text model whose shape (and seed) the language model takes.
    text_model: str
    # transformers' conditional-generation class.
    architecture: str
    # Vision transformer blocks, their width, MLP width and heads.
    depth: int = 2
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2
    # Learned position embeddings of the tower: a square grid of this many (resampled per image).
    num_position_embeddings: int = 16
    # Qwen3-VL's deepstack: vision blocks whose features join the first decoder layers.
    deepstack_visual_indexes: tuple[int, ...] = ()
    # M-RoPE: rotary frequencies for time, height and width (they sum to half the rotary width).
    mrope_section: tuple[int, int, int] = (2, 1, 1)


VLM_RECIPES: dict[str, VisionRecipe] = {
    # Rotary width 32 * 0.25 = 8: 4 frequencies.
    'tiny-qwen3.5-vl': VisionRecipe('tiny-qwen3.5', 'Qwen3_5ForConditionalGeneration'),
    # Rotary width 32: 16 frequencies, split as Qwen3-VL's 24/20/20 of 64.
    'tiny-qwen3-vl': VisionRecipe(
        'tiny-qwen3', 'Qwen3VLForConditionalGeneration', deepstack_visual_indexes=(0,), mrope_section=(6, 5, 5)
    ),
}


def _vision_config(r: VisionRecipe, out_hidden_size: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        'depth': r.depth,
        'hidden_size': r.hidden_size,
        'intermediate_size': r.intermediate_size,
        'num_heads': r.num_heads,
        'patch_size': PATCH_SIZE,
        'spatial_merge_size': MERGE_SIZE,
        'temporal_patch_size': TEMPORAL_PATCH_SIZE,
        'out_hidden_size': out_hidden_size,
        'num_position_embeddings': r.num_position_embeddings,
        'initializer_range': 0.02,
    }
    if r.deepstack_visual_indexes:
        config['deepstack_visual_indexes'] = list(r.deepstack_visual_indexes)
    return config


def vlm_config(name: str) -> PretrainedConfig:
    """The composite config (text and vision) of VLM ``name`` (no weights are built)."""
    import transformers

    r = VLM_RECIPES[name]
    # Any: the composite configs take extra fields (initializer_range) their signatures leave out.
    classes: dict[str, tuple[Any, Any]] = {
        'Qwen3_5ForConditionalGeneration': (transformers.Qwen3_5Config, transformers.Qwen3_5TextConfig),
        'Qwen3VLForConditionalGeneration': (transformers.Qwen3VLConfig, transformers.Qwen3VLTextConfig),
    }
    config_class, text_class = classes[r.architecture]
    # The text model's fields that the VLM's text config has (Qwen3's sliding-window ones it has not).
    fields = set(text_class().to_dict()) - {'architectures', 'transformers_version', 'model_type'}
    text = {k: v for k, v in models.model_config(r.text_model).to_dict().items() if k in fields}
    text['vocab_size'] = VLM_VOCAB_SIZE
    rope = dict(text['rope_parameters'])
    text['rope_parameters'] = rope | {'mrope_section': list(r.mrope_section), 'mrope_interleaved': True}
    ids = VISION_TOKEN_IDS
    config: PretrainedConfig = config_class(
        text_config=text,
        vision_config=_vision_config(r, text['hidden_size']),
        image_token_id=ids['<|image_pad|>'],
        video_token_id=ids['<|video_pad|>'],
        vision_start_token_id=ids['<|vision_start|>'],
        vision_end_token_id=ids['<|vision_end|>'],
        tie_word_embeddings=False,
        # Read by ``models.init_weights``; the sub-configs carry it too.
        initializer_range=0.02,
    )
    config.architectures = [r.architecture]
    return config


def build_vlm(name: str) -> PreTrainedModel:
    """VLM ``name`` in memory, float32, weights from the seeded stream of ``models.init_weights``
    (the vision tower's biases start at zero, as Qwen initialises them)."""
    import torch
    import transformers

    r = VLM_RECIPES[name]
    model: PreTrainedModel = getattr(transformers, r.architecture)(vlm_config(name)).float()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.startswith('model.visual.') and param_name.endswith('.bias'):
                param.zero_()
    models.init_weights(model, models.recipe(r.text_model).seed)
    model.train(False)  # eval mode; transformers leaves eval() unannotated
    return model


# ---- the tokenizer and processor files --------------------------------------------------------------


def vision_tokenizer() -> Tokenizer:
    """The embedded tokenizer with ``VISION_TOKENS`` added as special tokens at ``VISION_TOKEN_IDS``."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(tok.tokenizer_dir() / 'tokenizer.json'))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    got = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS}
    if got != VISION_TOKEN_IDS:
        raise RuntimeError(f'vision tokens got ids {got}; expected {VISION_TOKEN_IDS}')
    return tokenizer


#: Renders a message's content: a string, or Qwen-VL parts ({'type': 'image'}, {'type': 'text', 'text': ...}).
_RENDER_CONTENT = (
    '{%- macro render_content(content) -%}'
    '{%- if content is string -%}{{- content -}}'
    '{%- elif content is not none -%}{%- for item in content -%}'
    "{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}"
    '<|vision_start|><|image_pad|><|vision_end|>'
    "{%- elif item.type == 'video' or 'video' in item -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in item -%}{{- item.text -}}"
    '{%- endif -%}{%- endfor -%}{%- endif -%}'
    '{%- endmacro -%}'
)
#: Where the text template reads a message's content, and what reads it through ``render_content``.
_CONTENT_READS = {
    "messages[0]['content'] + '\\n\\n'": "render_content(messages[0]['content']) + '\\n\\n'",
    "'\\n<tool_response>\\n' + message['content']": "'\\n<tool_response>\\n' + render_content(message['content'])",
    "(message['content'] or '')": "render_content(message['content'])",
}


def vlm_chat_template() -> str:
    """The embedded chat template with image and video parts rendered as Qwen-VL's template does
    (``<|vision_start|><|image_pad|><|vision_end|>``); string contents render exactly as before."""
    template = tok.CHAT_TEMPLATE
    for old, new in _CONTENT_READS.items():
        if template.count(old) != 1:
            raise RuntimeError(f'the chat template reads {old!r} {template.count(old)} times; expected once')
        template = template.replace(old, new)
    return _RENDER_CONTENT + template


def vlm_tokenizer_config() -> dict[str, object]:
    """``tokenizer.py``'s config with the vision tokens as added special tokens and the VLM template."""
    config = tok.tokenizer_config()
    decoder = dict(config['added_tokens_decoder'])  # type: ignore[call-overload]  # a dict, typed as object
    for token, token_id in VISION_TOKEN_IDS.items():
        decoder[str(token_id)] = {
            'content': token,
            'lstrip': False,
            'normalized': False,
            'rstrip': False,
            'single_word': False,
            'special': True,
        }
    specials = list(config['additional_special_tokens'])  # type: ignore[call-overload]
    return config | {
        'added_tokens_decoder': decoder,
        'additional_special_tokens': specials + list(VISION_TOKENS),
        'chat_template': vlm_chat_template(),
    }


def _processor_config(kind: str, class_name: str) -> dict[str, object]:
    """``preprocessor_config.json`` (kind 'image') or ``video_preprocessor_config.json`` ('video')."""
    return {
        'size': {'longest_edge': MAX_PIXELS, 'shortest_edge': MIN_PIXELS},
        'patch_size': PATCH_SIZE,
        'temporal_patch_size': TEMPORAL_PATCH_SIZE,
        'merge_size': MERGE_SIZE,
        'image_mean': [0.5, 0.5, 0.5],
        'image_std': [0.5, 0.5, 0.5],
        'processor_class': 'Qwen3VLProcessor',
        f'{kind}_processor_type': class_name,
    }


def write_processor(folder: Path) -> None:
    """The tokenizer and processor files of every embedded VLM into ``folder``."""
    vision_tokenizer().save(str(folder / 'tokenizer.json'), pretty=True)
    tok.write_json(folder / 'tokenizer_config.json', vlm_tokenizer_config())
    tok.write_json(folder / 'preprocessor_config.json', _processor_config('image', 'Qwen2VLImageProcessor'))
    tok.write_json(folder / 'video_preprocessor_config.json', _processor_config('video', 'Qwen3VLVideoProcessor'))
    (folder / 'chat_template.jinja').write_text(vlm_chat_template(), encoding='utf-8')


def processor_dir() -> Path:
    """The cached tokenizer and processor files the VLMs share, built on first use."""
    return build_asset('tokenizers', TOKENIZER_VLM_NAME, write_processor)


def write_vlm(name: str, folder: Path) -> None:
    """Save VLM ``name`` as a Hugging Face folder, with its tokenizer and processor files."""
    models.save_model_folder(build_vlm(name), folder, processor_dir(), (*tok.TOKENIZER_FILES, *VLM_FILES))


def vlm_dir_name(name: str) -> str:
    """Cache folder name of VLM ``name``: its recipe version and the tokenizer's."""
    return f'{name}-v{VLM_VERSION}.{tok.TOKENIZER_VERSION}'


def vlm_model(name: str) -> str:
    """Path of the local Hugging Face folder of VLM ``name``, built on first use."""
    return str(build_asset('models', vlm_dir_name(name), lambda tmp: write_vlm(name, tmp)))
