"""Models: the methods a training loop calls, over a Hugging Face model with named adapters."""

from twinkle.model.base import TwinkleModel
from twinkle.model.optim import OPTIMIZERS, SCHEDULERS, CosineWarmupScheduler, LinearWarmupScheduler
from twinkle.model.transformers import TransformersModel

__all__ = [
    'OPTIMIZERS',
    'SCHEDULERS',
    'CosineWarmupScheduler',
    'LinearWarmupScheduler',
    'TransformersModel',
    'TwinkleModel',
]
