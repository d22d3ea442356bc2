"""The embedded models by name: the causal LMs of ``models.py`` and the vision-language models
of ``vlm.py`` (which builds on them), in one list and behind one function."""

from __future__ import annotations

from twinkle.assets.models import MODEL_RECIPES, text_model
from twinkle.assets.vlm import VLM_RECIPES, vlm_model
from twinkle.errors import UnknownNameError

#: The embedded models: the causal LMs, then the vision-language models.
MODELS: tuple[str, ...] = (*MODEL_RECIPES, *VLM_RECIPES)


def tiny_model(name: str = 'tiny-qwen3') -> str:
    """Path of a local Hugging Face folder with model ``name`` and its tokenizer.

    Built on first use under ``twinkle_home()/assets/models`` and reused after. Load it with
    ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``
    (a VLM, ``tiny-qwen3.5-vl`` or ``tiny-qwen3-vl``, with ``AutoModelForImageTextToText``).

    >>> from twinkle.assets import tiny_model
    >>> tiny_model('gpt-2')
    Traceback (most recent call last):
    ...
    twinkle.errors.UnknownNameError: Unknown model 'gpt-2'. Valid model names are: [...]
    """
    if name in VLM_RECIPES:  # a vision tower in front of a language model
        return vlm_model(name)
    if name in MODEL_RECIPES:
        return text_model(name)
    raise UnknownNameError('model', name, MODELS)
