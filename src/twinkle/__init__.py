"""twinkle: post-training for large language models with a training loop you own.

>>> import twinkle
>>> twinkle.__version__
'0.1.0'

The public names below resolve on first use (PEP 562), so that ``import twinkle`` (which every
``twinkle.*`` import runs first, the torch-free client's ``twinkle.wire`` and ``twinkle.errors``
among them) loads none of the runtime: ``twinkle.DeviceMesh`` imports ``twinkle.infra`` when it
is first read.

>>> twinkle.DeviceMesh is __import__('twinkle.infra', fromlist=['DeviceMesh']).DeviceMesh
True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports each on first use
    from twinkle.infra import DeviceGroup, DeviceMesh, get_device_placement, get_runtime
    from twinkle.launch import initialize
    from twinkle.tinker_sdk import init_tinker_client
    from twinkle.utils.logger import get_logger

__version__ = '0.1.0'

#: Each lazily resolved public name -> the module that defines it.
_LAZY = {
    'DeviceGroup': 'twinkle.infra',
    'DeviceMesh': 'twinkle.infra',
    'get_device_placement': 'twinkle.infra',
    'get_runtime': 'twinkle.infra',
    'initialize': 'twinkle.launch',
    'init_tinker_client': 'twinkle.tinker_sdk',
    'get_logger': 'twinkle.utils.logger',
}


if not TYPE_CHECKING:  # hidden from type checkers, which see the imports above (and flag a misspelt name)

    def __getattr__(name: str) -> object:
        """Import the module of a public name on first use and keep the value here. Any other
        name is an ``AttributeError``, so ``from twinkle import assets`` still imports it."""
        if name not in _LAZY:
            raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
        value: object = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    'DeviceGroup',
    'DeviceMesh',
    '__version__',
    'get_device_placement',
    'get_logger',
    'get_runtime',
    'init_tinker_client',
    'initialize',
]
