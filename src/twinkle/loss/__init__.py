"""Losses, looked up by name with ``model.set_loss('CrossEntropyLoss')``."""

from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.cross_entropy import CrossEntropyLoss

__all__ = ['LOSSES', 'CrossEntropyLoss', 'Loss', 'LossOutput']
