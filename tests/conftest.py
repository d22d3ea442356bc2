"""Shared test set-up: everything offline, assets built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set before anything imports huggingface_hub / datasets, which read these once.
for _name in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE', 'TRANSFORMERS_OFFLINE', 'TWINKLE_OFFLINE', 'MODELSCOPE_OFFLINE'):
    os.environ[_name] = '1'
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
# W&B runs stay offline files (its sink's default too), with no console chatter.
os.environ['WANDB_MODE'] = 'offline'
os.environ.setdefault('WANDB_SILENT', 'true')
# One asset cache for the whole run (CI sets TWINKLE_HOME to reuse it across runs).
os.environ.setdefault('TWINKLE_HOME', str(Path(__file__).resolve().parent.parent / '.twinkle_home'))
# Arrow caches of the datasets the tests load stay beside the assets, not in the user's cache.
os.environ.setdefault('HF_DATASETS_CACHE', str(Path(os.environ['TWINKLE_HOME']) / 'hf-datasets'))


@pytest.fixture(scope='session')
def tiny_model_dir() -> str:
    from twinkle import assets

    return assets.tiny_model()


@pytest.fixture(scope='session')
def self_cognition_path() -> str:
    from twinkle import assets

    return assets.dataset('self-cognition')
