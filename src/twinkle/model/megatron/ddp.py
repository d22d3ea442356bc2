"""Megatron's ``DistributedDataParallel`` and distributed optimizer for full-parameter training (ZeRO-1).

``MegatronModel(distributed_optimizer=True)`` wraps its ``GPTModel`` in megatron-core's
``DistributedDataParallel`` (``use_distributed_optimizer=True``) and steps the full model with
``get_megatron_optimizer``'s optimizer: each data-parallel rank holds the optimizer state (AdamW's
moments; the float32 main params, which for float32 weights are views of the weights) of its own
1/dp shard of every parameter. The backward's gradients go into megatron's contiguous grad buffers;
at the step ``finalize_model_grads`` reduce-scatters them over the data-parallel ranks (each rank
gets the sum of its shard) and sums the gradients megatron sums over tensor parallel (the query and
key norms, sequence-parallel weights); the optimizer clips by the whole gradient's norm, steps its
shard and all-gathers the updated weights.

The numbers are the project's (``TrainGroup.normalize_grads``): the gradients are summed over the
data shards and divided by the loss items of the whole step. Megatron's per-token mode does exactly
this (``TransformerConfig.calculate_per_token_loss``: the DDP's reduction sums instead of averaging,
``distributed_data_parallel.py:179``, and ``finalize_model_grads`` divides by the item count summed
over the data-parallel ranks, ``finalize_model_grads.py:680``).

``DistributedOptimizerStepper`` is the ``Stepper`` of such a model: its one group (``FULL``) is
clipped and stepped here; ``set_optimizer`` maps the project's optimizer names onto megatron's
``OptimizerConfig`` (``MEGATRON_OPTIMIZERS``), and the group's ``optimizer`` is a torch ``Optimizer``
view of megatron's (``MegatronOptimizerView``) whose ``param_groups`` are megatron's own, so the
project's learning-rate schedulers and ``set_optimizer_hyperparams`` act on it. Its ``state_dict`` is the
whole state gathered to data-parallel rank 0 (megatron's ``get_parameter_state_dp_zero``), which the
checkpointer writes; a resume scatters it back (at the same layout, as every optimizer state here).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from twinkle.errors import CheckpointError, ConfigurationError, StateError
from twinkle.model.base import OptimizerStep, StepCall
from twinkle.model.layout import ModelParallel
from twinkle.model.optim.registry import check_optimizer_args, set_hyperparams
from twinkle.model.optim.stepping import DEFAULT_LR, DEFAULT_OPTIMIZER, Stepper
from twinkle.model.train_group import TrainGroup
from twinkle.utils.logger import get_logger

logger = get_logger()
#: The optimizers ``set_optimizer`` takes under megatron's distributed optimizer, with the arguments each
#: takes: megatron builds torch's ``AdamW`` and ``Adam`` (``optimizer/__init__.py``) from them. Its SGD is
#: not offered: megatron builds it without the state initializer its distributed optimizer asserts
#: (``optimizer/__init__.py:617``, ``distrib_optimizer.py:688``), and saves moments SGD does not have.
MEGATRON_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    'AdamW': ('lr', 'betas', 'eps', 'weight_decay'),
    'Adam': ('lr', 'betas', 'eps', 'weight_decay'),
}
#: ``MegatronOptimizerView.state_dict`` of an optimizer that has not stepped: megatron's own ``state_dict``
#: asserts one step count among the (empty) states (``distrib_optimizer.py:837``).
FRESH = 'fresh'
#: The key of a distributed optimizer's state in a checkpoint (``MegatronOptimizerView.state_dict``).
STATE_KEY = 'megatron_distributed_optimizer'


def wrap(gpt: nn.Module) -> Any:
    """``gpt`` under megatron's ``DistributedDataParallel`` with the distributed optimizer's buffers.

    The weights become views of megatron's contiguous param buffer (the same ``Parameter`` objects: the
    project's groups, checkpoints and conversions still hold them); the backward adds each gradient into
    the grad buffer (``param.main_grad``) and leaves ``param.grad`` None."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config: Any = gpt.config
    # Sum over the data-parallel ranks (no 1/dp) and divide by the items of the whole step at finalize.
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, average_in_collective=False)
    return DistributedDataParallel(config, ddp_config, gpt)


def optimizer_config(name: str, kwargs: dict[str, Any]) -> Any:
    """megatron's ``OptimizerConfig`` for ``set_optimizer(name, **kwargs)``, torch's defaults for what is not
    given; ``ConfigurationError`` for another optimizer, an argument it does not take, or a value torch refuses."""
    from megatron.core.optimizer import OptimizerConfig

    if name not in MEGATRON_OPTIMIZERS:
        raise ConfigurationError(
            f"optimizer {name!r} is not one megatron's distributed optimizer builds; with distributed_optimizer=True "
            f'set_optimizer takes {list(MEGATRON_OPTIMIZERS)}'
        )
    accepted = MEGATRON_OPTIMIZERS[name]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigurationError(
            f"{name} under megatron's distributed optimizer does not take {unknown}; it takes {list(accepted)}"
        )
    check_optimizer_args(name, kwargs)  # torch's own checks of the values, with their messages
    torch_defaults = inspect.signature(getattr(torch.optim, name)).parameters
    values = {arg: kwargs.get(arg, torch_defaults[arg].default) for arg in accepted}
    common = {
        'lr': float(values['lr']),
        'weight_decay': float(values['weight_decay']),
        'use_distributed_optimizer': True,
        'clip_grad': 0.0,  # clip_grad_norm clips, with the norm it returns
        'params_dtype': torch.float32,
    }
    beta1, beta2 = values['betas']
    return OptimizerConfig(
        optimizer='adam',
        adam_beta1=float(beta1),
        adam_beta2=float(beta2),
        adam_eps=float(values['eps']),
        decoupled_weight_decay=name == 'AdamW',
        **common,
    )


class MegatronOptimizerView(Optimizer):
    """megatron's optimizer as a torch ``Optimizer``: ``param_groups`` are the dicts megatron's inner torch
    optimizers step with (this rank's shards), so a scheduler's ``lr`` reaches them; ``step`` is megatron's
    step with the gradients ready (the inner step, then the weights all-gathered); ``defaults`` are the
    hyperparameters it was built with. ``state`` is this rank's shard of the optimizer state."""

    def __init__(self, megatron_optimizer: Any, defaults: dict[str, Any]):
        super().__init__([nn.Parameter(torch.zeros(0))], defaults)  # torch's bookkeeping; groups replaced below
        self.megatron = megatron_optimizer
        self.param_groups = megatron_optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> dict[Any, Any]:
        """Every inner optimizer's state (this rank's shards), by shard parameter."""
        merged: dict[Any, Any] = {}
        for inner in self.inner_optimizers:
            merged.update(inner.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:  # Optimizer.__init__ sets an empty one
        del value

    @property
    def inner_optimizers(self) -> list[Optimizer]:
        """The torch optimizers megatron steps (one per chained optimizer)."""
        return [inner.optimizer for inner in self.chained if getattr(inner, 'optimizer', None) is not None]

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise StateError("megatron's distributed optimizer takes no closure")
        self.megatron.step_with_ready_grads()

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, on data-parallel rank 0 (every rank calls it: a gather over the
        data-parallel ranks): per chained optimizer, megatron's rank-independent state (parameter groups,
        step) and the parameter state of every shard (``get_parameter_state_dp_zero``: the moments, on the
        CPU; None on the other data-parallel ranks). ``FRESH`` before its first step, when it holds none."""
        if not any(inner.state for inner in self.inner_optimizers):
            return {STATE_KEY: FRESH}
        return {
            STATE_KEY: [
                {'common': inner.state_dict(), 'param_state': inner.get_parameter_state_dp_zero()}
                for inner in self.chained
            ]
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``state_dict``'s state into this rank's shards (every rank calls it: data-parallel rank 0's
        ``param_state`` is scattered over the data-parallel ranks, ``load_parameter_state_from_dp_zero``)."""
        saved = state_dict.get(STATE_KEY)
        if saved == FRESH:  # saved before its first step: as a new optimizer
            for inner in self.inner_optimizers:
                inner.state.clear()
            return
        if not isinstance(saved, list) or len(saved) != len(self.chained):
            found = f"{len(saved)} chained optimizers'" if isinstance(saved, list) else "a torch optimizer's"
            raise CheckpointError(
                f"the checkpoint holds {found} state; this model's distributed optimizer chains "
                f'{len(self.chained)}: resume with the distributed_optimizer it was saved with'
            )
        for inner, part in zip(self.chained, saved, strict=True):
            inner.load_state_dict(part['common'])
            with torch.no_grad(), _steps_aside(inner.optimizer):
                inner.load_parameter_state_from_dp_zero(part['param_state'])
        self.param_groups = self.megatron.param_groups  # torch's load_state_dict made new group dicts

    @property
    def chained(self) -> list[Any]:
        """megatron's optimizers behind this one (the dense weights', and the experts' on a mixture of experts)."""
        return list(getattr(self.megatron, 'chained_optimizers', [self.megatron]))

    def state_bytes(self) -> int:
        """Bytes of the optimizer state tensors this rank holds (its shard of the moments and step counts)."""
        return sum(
            tensor.numel() * tensor.element_size()
            for inner in self.inner_optimizers
            for state in inner.state.values()
            for tensor in state.values()
            if isinstance(tensor, torch.Tensor)
        )


def build_optimizer(ddp: Any, name: str, kwargs: dict[str, Any]) -> MegatronOptimizerView:
    """``get_megatron_optimizer`` over ``ddp`` for ``set_optimizer(name, **kwargs)``.

    Megatron's parameter groups keep ``wd_mult`` (0 for biases and 1-dimensional weights, as the project's
    ``set_optimizer`` does) for its own scheduler to apply; without it, each group's ``weight_decay`` is set
    here, once, and ``lr`` to the rate asked for."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = optimizer_config(name, kwargs)
    megatron_optimizer = get_megatron_optimizer(config, [ddp])
    for group in megatron_optimizer.param_groups:
        group['lr'] = config.lr * float(group.get('lr_mult', 1.0))
        group['weight_decay'] = config.weight_decay * float(group.get('wd_mult', 1.0))
    defaults = {key: value for key, value in megatron_optimizer.param_groups[0].items() if key != 'params'}
    defaults.update({arg: value for arg, value in kwargs.items() if arg in MEGATRON_OPTIMIZERS[name]})
    return MegatronOptimizerView(megatron_optimizer, defaults)


class DistributedOptimizerStepper(Stepper):
    """``Stepper`` of a full model under megatron's DDP and distributed optimizer (see the module docstring).

    Its group is ``FULL``; ``PendingStep.normalized`` marks a window whose gradients
    ``finalize_model_grads`` reduced already (megatron's buffer, not ``param.grad``, holds them)."""

    def __init__(self, parallel: ModelParallel, ddp: Any):
        super().__init__(parallel)
        self.ddp = ddp

    def watch(self, group: TrainGroup) -> None:
        """Make ``group``'s window end (a step, ``zero_grad``, a resume or restore) drop megatron's
        gradients too: they are in its grad buffers and the optimizer's shards, not in ``param.grad``."""

        def drop() -> None:
            self.ddp.zero_grad_buffer()
            if isinstance(group.optimizer, MegatronOptimizerView):
                group.optimizer.megatron.zero_grad()

        group.pending.when_closed(drop)

    def set_optimizer(self, group: TrainGroup, optimizer_cls: str | type[Optimizer], kwargs: dict[str, Any]) -> None:
        name = optimizer_cls if isinstance(optimizer_cls, str) else optimizer_cls.__name__
        kwargs.setdefault('lr', DEFAULT_LR)
        group.optimizer = build_optimizer(self.ddp, name, kwargs)
        group.scheduler = None

    def set_hyperparams(self, group: TrainGroup, values: dict[str, Any]) -> None:
        """``lr``, ``betas``, ``eps``: on every group; ``weight_decay`` times each group's ``wd_mult``
        (megatron's groups hold flat shards: their dimensions no longer tell a norm from a matrix)."""
        optimizer = self._view(group, 'set_optimizer_hyperparams')
        decay = values.pop('weight_decay', None)
        set_hyperparams(optimizer, values)
        if decay is not None:
            set_hyperparams(optimizer, {'weight_decay': decay})  # the checks; then each group's own multiple
            for param_group in optimizer.param_groups:
                param_group['weight_decay'] = float(decay) * float(param_group.get('wd_mult', 1.0))

    def clip_grad_norm(self, group: TrainGroup, max_grad_norm: float, norm_type: float = 2.0) -> float | None:
        if norm_type != 2.0:
            raise ConfigurationError(
                f"megatron's distributed optimizer clips by the 2-norm (norm_type=2.0); got norm_type={norm_type}"
            )
        if not group.window.at_boundary('clip'):
            return None
        started = time.perf_counter()
        optimizer = self._ready_grads(group)
        norm = float(optimizer.megatron.get_grad_norm())
        _clip(optimizer.megatron, max_grad_norm, norm)
        return self._clipped(group, torch.tensor(norm), time.perf_counter() - started)

    def step(self, group: TrainGroup) -> bool:
        if not group.window.at_boundary('step'):
            return False
        started = time.perf_counter()
        optimizer = self._ready_grads(group)
        stepped = group.pending.grad_norm is None or math.isfinite(group.pending.grad_norm)
        if stepped:
            optimizer.step()
            self._stepped(group, time.perf_counter() - started)
        else:
            logger.warning(f'adapter {group.name!r}: gradient norm is {group.pending.grad_norm}; step skipped')
            group.pending.clipped(None)
        self._close(group)
        return stepped

    def zero_grad(self, group: TrainGroup) -> None:
        if group.window.at_boundary('zero_grad'):
            self._close(group)

    def step_fused(self, groups: Sequence[TrainGroup], calls: Sequence[StepCall]) -> dict[int, OptimizerStep]:
        """Nothing fused: the one group steps through megatron's optimizer."""
        return {}

    def _ready_grads(self, group: TrainGroup) -> MegatronOptimizerView:
        """The window's gradients reduced (once) and copied to the optimizer's shards; its optimizer
        (``DEFAULT_OPTIMIZER`` if none was set)."""
        if group.optimizer is None:
            logger.info(f'the full model has no optimizer: using {DEFAULT_OPTIMIZER}(lr={DEFAULT_LR})')
            self.set_optimizer(group, DEFAULT_OPTIMIZER, {})
        optimizer = self._view(group, 'clip_grad_and_step')
        if not group.pending.normalized:
            from megatron.core.distributed import finalize_model_grads

            items = torch.as_tensor(group.pending.items, dtype=torch.float64).reshape(1).clone()
            finalize_model_grads([self.ddp], num_tokens=items.to(_device(self.ddp)))
            optimizer.megatron.prepare_grads()
            group.pending.mark_normalized()
        return optimizer

    def _close(self, group: TrainGroup) -> None:
        """The window's end (``watch`` made it drop megatron's gradients too)."""
        group.close_window()

    def _view(self, group: TrainGroup, wanted_by: str) -> MegatronOptimizerView:
        optimizer = group.optimizer
        if not isinstance(optimizer, MegatronOptimizerView):
            raise StateError(f'set_optimizer(...) before {wanted_by}(...) under distributed_optimizer=True')
        return optimizer


@contextlib.contextmanager
def _steps_aside(optimizer: Optimizer) -> Iterator[None]:
    """Each parameter's ``step`` out of torch's optimizer state while megatron loads the moments, then
    back as a tensor of its own.

    megatron's optimizer without Transformer Engine or Apex is torch's ``Adam``/``AdamW``, which keeps a
    ``step`` tensor per parameter. ``DistributedOptimizer.load_state_dict`` gives every parameter the same
    tensor (``optimizer/distrib_optimizer.py:1026-1032``), which torch's step would then add 1 to once per
    parameter; and ``load_parameter_state_from_dp_zero`` copies every tensor of a shard's state from the
    checkpoint's (``:1216-1225``), which holds the moments alone. The copies run without autograd
    (``torch.no_grad`` around it): for float32 weights the shards they copy into are views of the weights."""
    steps = {param: state.pop('step') for param, state in optimizer.state.items() if 'step' in state}
    try:
        yield
    finally:
        for param, step in steps.items():
            optimizer.state[param]['step'] = step.clone()


def _clip(megatron_optimizer: Any, max_norm: float, total_norm: float) -> None:
    """Scale every shard's gradient by ``max_norm / total_norm`` where that is below 1, as megatron's
    ``ChainedOptimizer.step`` does (``optimizer/optimizer.py:1906``), with the whole gradient's norm."""
    from megatron.core.optimizer import clip_grads

    for inner in getattr(megatron_optimizer, 'chained_optimizers', [megatron_optimizer]):
        params = inner.get_parameters()
        if params and math.isfinite(total_norm):
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=max_norm, total_norm=total_norm)


def _device(ddp: Any) -> torch.device:
    return next(ddp.module.parameters()).device  # type: ignore[no-any-return]


__all__ = [
    'MEGATRON_OPTIMIZERS',
    'DistributedOptimizerStepper',
    'MegatronOptimizerView',
    'build_optimizer',
    'optimizer_config',
    'wrap',
]
