"""The Megatron backend where megatron-core is not installed (this environment): importing it works,
building a model says how to install it."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from twinkle import assets
from twinkle.errors import ConfigurationError


def megatron_core_installed() -> bool:
    try:
        return importlib.util.find_spec('megatron.core') is not None
    except ModuleNotFoundError:
        return False


pytestmark = pytest.mark.skipif(
    megatron_core_installed(), reason='megatron-core is installed here (make test-megatron)'
)


def test_building_a_megatron_model_without_megatron_core_says_how_to_install_it():
    from twinkle.model import MegatronModel

    with pytest.raises(
        ConfigurationError,
        match=r"needs megatron-core, which is not installed: pip install 'twinkle-train\[megatron\]'",
    ):
        MegatronModel(model_id=assets.tiny_model())
    assert not any(name.startswith('megatron.') for name in sys.modules)
