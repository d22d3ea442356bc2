"""Embedded default assets: tiny models, a tokenizer and datasets, built here, never downloaded.

Everything is generated deterministically on first use into ``twinkle_home()/assets`` (see
``cache.py`` for the layout) and reused after; two builds give byte-identical files.

>>> from twinkle.assets import DATASETS, MODELS
>>> MODELS  # doctest: +NORMALIZE_WHITESPACE
('tiny-qwen3', 'small-qwen3', 'wide-qwen3', 'tiny-qwen3.5', 'tiny-qwen3-moe', 'tiny-qwen3.5-moe',
 'tiny-qwen3.5-vl', 'tiny-qwen3-vl')
>>> DATASETS
('self-cognition', 'gsm8k', 'shapes')

Typical use (``path`` is a normal Hugging Face folder)::

    path = tiny_model('tiny-qwen3')
    model = AutoModelForCausalLM.from_pretrained(path)
    rows = datasets.load_dataset('json', data_files=dataset('gsm8k', 'train'))
    vlm = AutoModelForImageTextToText.from_pretrained(tiny_model('tiny-qwen3.5-vl'))  # a vision tower too
    pictures = resolve_images(dataset('shapes', 'train'))  # rows with image paths made absolute
"""

from twinkle.assets.cache import twinkle_home
from twinkle.assets.catalog import MODELS, tiny_model
from twinkle.assets.data import DATASETS, dataset, dataset_splits
from twinkle.assets.images import resolve_images

__all__ = ['DATASETS', 'MODELS', 'dataset', 'dataset_splits', 'resolve_images', 'tiny_model', 'twinkle_home']
