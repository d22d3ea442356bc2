"""The optimizer side of a ``TransformersModel``: each adapter's optimizer and schedule, built by
name, and its gradients clipped and stepped at its accumulation boundaries, one adapter at a
time or several together (``multi_step``), with idle optimizers' state moved off the device
(``offload``).

Every method takes the adapter's ``TrainGroup``; ``TransformersModel`` looks it up by name.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from twinkle.errors import StateError
from twinkle.model.base import OptimizerStep, StepCall
from twinkle.model.layout import ModelParallel
from twinkle.model.optim import multi_step
from twinkle.model.optim.offload import OptimizerOffloader
from twinkle.model.optim.registry import build_optimizer, build_scheduler, set_hyperparams
from twinkle.model.train_group import TrainGroup
from twinkle.utils.logger import get_logger

logger = get_logger()
#: The optimizer an adapter steps with when none was set, and the ``lr`` of ``set_optimizer``.
DEFAULT_OPTIMIZER = 'AdamW'
DEFAULT_LR = 1e-5


class Stepper:
    """Builds and steps the adapters' optimizers of one model, over its ``parallel`` layout."""

    def __init__(self, parallel: ModelParallel):
        self.parallel = parallel
        #: Moves idle adapters' optimizer state off the device (to CPU memory, then disk); the
        #: server sets one. None: every optimizer state stays where its parameters are.
        self.offloader: OptimizerOffloader | None = None

    # ---- optimizers and schedules ---------------------------------------------------------------
    def set_optimizer(self, group: TrainGroup, optimizer_cls: str | type[Optimizer], kwargs: dict[str, Any]) -> None:
        """A new optimizer for the group (``lr`` defaults to ``DEFAULT_LR``; parameters of fewer
        than 2 dimensions, biases and norms, get no weight decay); its schedule is dropped."""
        kwargs.setdefault('lr', DEFAULT_LR)
        self.forget(group.name)  # the old optimizer's state, wherever it was
        group.optimizer = build_optimizer(optimizer_cls, _param_groups(group.params), kwargs)
        group.scheduler = None

    def set_lr_scheduler(
        self, group: TrainGroup, scheduler_cls: str | type[LRScheduler], kwargs: dict[str, Any]
    ) -> None:
        group.scheduler = build_scheduler(scheduler_cls, self._optimizer(group, 'set_lr_scheduler'), kwargs)

    def set_hyperparams(self, group: TrainGroup, values: dict[str, Any]) -> None:
        set_hyperparams(self._optimizer(group, 'set_optimizer_hyperparams'), values)

    def _optimizer(self, group: TrainGroup, wanted_by: str) -> Optimizer:
        if group.optimizer is None:
            raise StateError(f'set_optimizer(...) before {wanted_by}(...) for adapter {group.name!r}')
        return group.optimizer

    def forget(self, name: str) -> None:
        """Drop what the offloader holds of the adapter's optimizer (replaced or removed)."""
        if self.offloader is not None:
            self.offloader.forget(name)

    def optimizer_ready(self, group: TrainGroup) -> None:
        """The group's optimizer state back on the device, if the offloader moved it away."""
        if self.offloader is not None and group.optimizer is not None:
            self.offloader.touch(group.name, group.optimizer)

    # ---- one adapter ----------------------------------------------------------------------------
    def clip_grad_norm(self, group: TrainGroup, max_grad_norm: float, norm_type: float = 2.0) -> float | None:
        """At an accumulation boundary: normalise the summed gradient, clip it to
        ``max_grad_norm`` and return its norm before clipping; ``None`` elsewhere."""
        if not group.window.at_boundary('clip'):
            return None
        started = time.perf_counter()
        group.normalize_grads(self.parallel.reduce_gradients)
        norm = self.parallel.clip_grad_norm_(group.params, max_grad_norm, norm_type)
        return self._clipped(group, norm, time.perf_counter() - started)

    def step(self, group: TrainGroup) -> bool:
        """At an accumulation boundary, take an optimizer step and close the window (its
        gradients are spent, ``TrainGroup.close_window``); returns whether it stepped (a gradient
        norm that is not finite skips the step, and its gradient is dropped all the same)."""
        if not group.window.at_boundary('step'):
            return False
        started = time.perf_counter()
        stepped = self._ready_to_step(group)
        if stepped:
            cast(Optimizer, group.optimizer).step()  # _ready_to_step made one
            self._stepped(group, time.perf_counter() - started)
        group.close_window()
        return stepped

    def zero_grad(self, group: TrainGroup) -> None:
        """At an accumulation boundary, drop the window's gradients (nothing left after a step)."""
        if group.window.at_boundary('zero_grad'):
            group.close_window()

    def lr_step(self, group: TrainGroup) -> None:
        if group.window.at_boundary('lr_step') and group.scheduler is not None:
            group.scheduler.step()

    def _clipped(self, group: TrainGroup, norm: torch.Tensor, elapsed_s: float) -> float:
        """Book a clip: the norm before clipping is the group's ``last_grad_norm``, returned."""
        value = self.parallel.norm_value(norm)
        group.pending.clipped(value)
        group.stats.accumulate(grad_norm=value, elapsed_s=elapsed_s)
        group.step_log.grad_norm = value
        return value

    def _ready_to_step(self, group: TrainGroup) -> bool:
        """Before a step: normalised gradients and an optimizer whose state is on the device
        (``DEFAULT_OPTIMIZER`` if none was set); False, the step skipped, when the gradient
        norm is NaN or infinite."""
        group.normalize_grads(self.parallel.reduce_gradients)
        if group.pending.grad_norm is not None and not math.isfinite(group.pending.grad_norm):
            logger.warning(f'adapter {group.name!r}: gradient norm is {group.pending.grad_norm}; step skipped')
            group.pending.clipped(None)
            return False
        if group.optimizer is None:
            logger.info(f'adapter {group.name!r} has no optimizer: using {DEFAULT_OPTIMIZER}(lr={DEFAULT_LR})')
            self.set_optimizer(group, DEFAULT_OPTIMIZER, {})
        self.optimizer_ready(group)
        return True

    def _stepped(self, group: TrainGroup, elapsed_s: float) -> None:
        step = group.window.count_step()
        group.pending.clipped(None)
        lr = group.current_lr()
        group.stats.accumulate(elapsed_s=elapsed_s, lr=lr, stepped=True)
        group.step_log.on_step(step, lr, elapsed_s)

    # ---- several adapters -----------------------------------------------------------------------
    def step_fused(self, groups: Sequence[TrainGroup], calls: Sequence[StepCall]) -> dict[int, OptimizerStep]:
        """``clip_grad_and_step`` of the groups (``calls[i]`` is ``groups[i]``'s) that can be
        clipped and stepped together: at an open accumulation boundary, with an optimizer that
        ``multi_step.fusable`` allows and whole (not sharded) parameters, at most as many at once
        as the offloader keeps on the device. Returns their results by index; the others are left
        for one-by-one calls. Under a mesh every rank's gradients are reduced first, so every
        rank decides alike."""
        results: dict[int, OptimizerStep] = {}
        ready = [i for i, group in enumerate(groups) if group.window.at_open_boundary() and group.optimizer is not None]
        ready = [i for i in ready if not self.parallel.holds_shards(groups[i].params)]
        if self.parallel.enabled:
            for i in ready:
                groups[i].normalize_grads(self.parallel.reduce_gradients)
        if not ready:
            return results
        size = self._hot_optimizers(len(ready))
        for chunk in (ready[start : start + size] for start in range(0, len(ready), size)):
            for i in chunk:
                self.optimizer_ready(groups[i])
            together = [i for i in chunk if multi_step.fusable(groups[i].optimizer)]
            if len(together) > 1:
                stepped = self._step_together([groups[i] for i in together], [calls[i] for i in together])
                results.update(zip(together, stepped, strict=True))
        return results

    def _step_together(self, groups: list[TrainGroup], calls: list[StepCall]) -> list[OptimizerStep]:
        """``clip_grad_and_step`` of groups at an open boundary with ``fusable`` optimizers on
        the device, as one clip and one optimizer update; each group books an equal share of the time."""
        started = time.perf_counter()
        for group in groups:
            group.window.at_boundary('clip')
            group.normalize_grads(self.parallel.reduce_gradients)
        norms = multi_step.clip_together([g.params for g in groups], [c.max_grad_norm for c in calls])
        share = (time.perf_counter() - started) / len(groups)
        grad_norms = [self._clipped(group, norm, share) for group, norm in zip(groups, norms, strict=True)]
        started = time.perf_counter()
        stepping = [group for group in groups if group.window.at_boundary('step') and self._ready_to_step(group)]
        multi_step.step_together([cast(Optimizer, group.optimizer) for group in stepping])
        share = (time.perf_counter() - started) / max(len(stepping), 1)
        for group in stepping:
            self._stepped(group, share)
        for group in groups:
            self.zero_grad(group)
            self.lr_step(group)
        return [OptimizerStep(norm, group in stepping) for norm, group in zip(grad_norms, groups, strict=True)]

    def _hot_optimizers(self, wanted: int) -> int:
        """How many optimizers may be on the device at once to step together (the offloader's limit)."""
        capacity = None if self.offloader is None else self.offloader.hot_capacity
        return max(1, wanted if capacity is None else min(wanted, capacity))


def _param_groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups: list[dict[str, Any]] = [{'params': decay}]
    if no_decay:
        groups.append({'params': no_decay, 'weight_decay': 0.0})
    return groups


def describe_optimizer(optimizer: Optimizer | None) -> str:
    """``AdamW({'lr': 1e-05, ...})``: the optimizer's class and numeric hyperparameters."""
    if optimizer is None:
        return 'None'
    hyper = {k: v for k, v in optimizer.defaults.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return f'{type(optimizer).__name__}({hyper})'


__all__ = ['DEFAULT_LR', 'DEFAULT_OPTIMIZER', 'Stepper', 'describe_optimizer']
