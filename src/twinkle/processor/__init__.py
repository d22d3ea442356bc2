"""Input processors turn encoded rows into model inputs."""

from twinkle.processor.base import PROCESSORS, InputProcessor

__all__ = ['PROCESSORS', 'InputProcessor']
