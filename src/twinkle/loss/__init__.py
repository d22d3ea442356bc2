"""Losses, looked up by name with ``model.set_loss('CrossEntropyLoss')``."""

from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.cross_entropy import CrossEntropyLoss
from twinkle.loss.dpo import DPOLoss
from twinkle.loss.grpo import CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss, PPOLoss
from twinkle.loss.rl import align_per_token, sequence_index, token_logps

__all__ = [
    'LOSSES',
    'CISPOLoss',
    'CrossEntropyLoss',
    'DPOLoss',
    'DRGRPOLoss',
    'GRPOLoss',
    'GSPOLoss',
    'Loss',
    'LossOutput',
    'PPOLoss',
    'align_per_token',
    'sequence_index',
    'token_logps',
]
