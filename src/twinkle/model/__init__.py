"""Models: the methods a training loop calls, over a Hugging Face model with named adapters."""

from typing import TYPE_CHECKING

from twinkle.infra.ray import remote_class
from twinkle.model.base import AdapterCall, OptimizerStep, StepCall, TwinkleModel
from twinkle.model.optim.registry import OPTIMIZERS, SCHEDULERS, CosineWarmupScheduler, LinearWarmupScheduler
from twinkle.model.transformers import TransformersModel

# In ray mode, TransformersModel(..., remote_group='model') is one actor per rank: each gets its
# data shard of the batch (and of per-row loss inputs); methods not listed run on every rank and
# return rank 0's result.
remote_class(
    TransformersModel,
    {
        'forward_backward': ('slice_dp', 'mean'),
        'forward': ('slice_dp', 'flatten'),
        'forward_only': ('slice_dp', 'flatten'),
        'calculate_loss': ('slice_dp', 'mean'),
    },
)

if TYPE_CHECKING:
    from twinkle.model.megatron import MegatronModel


def __getattr__(name: str) -> object:
    """``MegatronModel`` on first use: ``twinkle.model.megatron`` (and, when a model is built,
    megatron-core) loads only for the scripts that use it."""
    if name == 'MegatronModel':
        from twinkle.model.megatron import MegatronModel

        return MegatronModel
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = [
    'OPTIMIZERS',
    'SCHEDULERS',
    'AdapterCall',
    'CosineWarmupScheduler',
    'LinearWarmupScheduler',
    'MegatronModel',
    'OptimizerStep',
    'StepCall',
    'TransformersModel',
    'TwinkleModel',
]
