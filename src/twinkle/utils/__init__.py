"""Small shared helpers."""

from twinkle.utils.logger import get_logger

__all__ = ['get_logger']
