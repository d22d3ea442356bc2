"""twinkle: post-training for large language models with a training loop you own.

>>> import twinkle
>>> twinkle.__version__
'0.1.0'
"""

from twinkle.infra import DeviceGroup, DeviceMesh, get_device_placement, get_runtime
from twinkle.launch import initialize
from twinkle.tinker_client import init_tinker_client
from twinkle.utils.logger import get_logger

__version__ = '0.1.0'
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
