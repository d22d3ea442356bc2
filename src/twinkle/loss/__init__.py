"""Losses, looked up by name with ``model.set_loss('CrossEntropyLoss')``."""

from twinkle.loss.base import LOSSES, Loss, LossOutput
from twinkle.loss.cross_entropy import CrossEntropyLoss
from twinkle.loss.dpo import DPOLoss
from twinkle.loss.gkd import GKDLoss, generalized_jsd, teacher_logits
from twinkle.loss.grpo import CISPOLoss, DRGRPOLoss, GRPOLoss, GSPOLoss, PPOLoss
from twinkle.loss.preference import CPOLoss, KTOLoss, ORPOLoss, SimPOLoss, kto_kl_rows
from twinkle.loss.rl import RolloutCorrection, align_per_token, sequence_index, token_logps
from twinkle.loss.value import ValueLoss

__all__ = [
    'LOSSES',
    'CISPOLoss',
    'CPOLoss',
    'CrossEntropyLoss',
    'DPOLoss',
    'DRGRPOLoss',
    'GKDLoss',
    'GRPOLoss',
    'GSPOLoss',
    'KTOLoss',
    'Loss',
    'LossOutput',
    'ORPOLoss',
    'PPOLoss',
    'RolloutCorrection',
    'SimPOLoss',
    'ValueLoss',
    'align_per_token',
    'generalized_jsd',
    'kto_kl_rows',
    'sequence_index',
    'teacher_logits',
    'token_logps',
]
