"""twinkle: post-training for large language models with a training loop you own.

>>> import twinkle
>>> twinkle.__version__
'0.1.0'
"""

from twinkle.utils.logger import get_logger

__version__ = '0.1.0'
__all__ = ['__version__', 'get_logger']
