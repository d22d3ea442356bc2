"""Embedded default assets: tiny models, a tokenizer and datasets, built here, never downloaded.

Everything is generated deterministically on first use into ``twinkle_home()/assets`` (see
``cache.py`` for the layout) and reused after; two builds give byte-identical files.

>>> from twinkle.assets import DATASETS, MODELS
>>> MODELS, DATASETS
(('tiny-qwen3', 'small-qwen3', 'tiny-qwen3.5', 'tiny-qwen3-moe', 'tiny-qwen3.5-moe'), ('self-cognition', 'gsm8k'))

Typical use (``path`` is a normal Hugging Face folder)::

    path = tiny_model('tiny-qwen3')
    model = AutoModelForCausalLM.from_pretrained(path)
    rows = datasets.load_dataset('json', data_files=dataset('gsm8k', 'train'))
"""

from twinkle.assets.cache import twinkle_home
from twinkle.assets.data import DATASETS, dataset, dataset_splits
from twinkle.assets.models import MODELS, tiny_model

__all__ = ['DATASETS', 'MODELS', 'dataset', 'dataset_splits', 'tiny_model', 'twinkle_home']
