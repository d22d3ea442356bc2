"""Several adapters' gradient clipping and optimizer steps as one multi-tensor update.

A shared training server steps many small adapters. One ``Optimizer.step()`` per adapter pays
each optimizer's fixed cost every time: on a CPU torch steps Adam one tensor at a time in Python,
on a GPU it launches a kernel per operation per optimizer. Stepping the adapters together runs
each operation once over all their tensors: with torch's fused kernel where the optimizers were
built with it (Adam's default here, ``optim.fused_by_default``), else with its multi-tensor
(``foreach``) kernels on an accelerator and one single-tensor loop on the CPU (where torch has no
multi-tensor kernels).

The arithmetic per tensor is torch's own (its functional ``adam``, and the norms and scaling of
``clip_grad_norm_``), and the multi-tensor kernels compute each tensor on its own, so an adapter
gets the numbers it gets alone, bit for bit (``tests/model/test_multi_step.py``): who steps beside it
does not change its training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.optim import Adam, AdamW, Optimizer
from torch.optim.adam import adam

from twinkle.errors import StateError

#: Optimizer classes whose step ``step_together`` runs (exactly these: a subclass may change the math).
FUSABLE = (Adam, AdamW)


def fusable(optimizer: Optimizer | None) -> bool:
    """Whether ``step_together`` can run ``optimizer``'s next step: torch's ``Adam`` or ``AdamW``
    with plain settings (no amsgrad, maximize, capturable or differentiable, a number for
    ``lr``), no step hooks, and its state made by a first ``step()`` already."""
    if optimizer is None or type(optimizer) not in FUSABLE:
        return False
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    for group in optimizer.param_groups:
        plain = not any(group.get(flag) for flag in ('amsgrad', 'maximize', 'capturable', 'differentiable'))
        # foreach=False asks for torch's single-tensor kernels, which a GPU may round differently.
        if not plain or group.get('foreach') is False or isinstance(group['lr'], torch.Tensor):
            return False
        for param in group['params']:
            if param.grad is not None and ('step' not in optimizer.state.get(param, {}) or param.is_complex()):
                return False
    return True


def clip_together(
    params: Sequence[Sequence[torch.Tensor]], max_norms: Sequence[float], norm_type: float = 2.0
) -> list[torch.Tensor]:
    """``torch.nn.utils.clip_grad_norm_(params[i], max_norms[i], norm_type)`` for every ``i``, the
    per-tensor norms of all the gradients taken in one multi-tensor call. Returns each list's
    total gradient norm before clipping (0 for a list without gradients)."""
    with_grads = [[p for p in plist if p.grad is not None] for plist in params]
    norms = _norms([cast(torch.Tensor, p.grad) for plist in with_grads for p in plist], norm_type)
    totals: list[torch.Tensor] = []
    start = 0
    for plist, max_norm in zip(with_grads, max_norms, strict=True):
        own = norms[start : start + len(plist)]
        start += len(plist)
        if not own:
            totals.append(torch.tensor(0.0))
            continue
        # As clip_grad_norm_ takes it: the norm of the per-tensor norms, on the first one's device.
        total = torch.linalg.vector_norm(torch.stack([n.to(own[0].device) for n in own]), norm_type)
        torch.nn.utils.clip_grads_with_norm_(plist, max_norm, total, foreach=True)
        totals.append(total)
    return totals


def _norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each tensor's norm, in order: one multi-tensor call per device and dtype (as torch's own
    ``clip_grad_norm_`` groups them)."""
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, grad in enumerate(grads):
        kinds.setdefault((grad.device, grad.dtype), []).append(index)
    norms: list[torch.Tensor] = [torch.empty(0)] * len(grads)
    for indices in kinds.values():
        for index, norm in zip(indices, torch._foreach_norm([grads[i] for i in indices], norm_type), strict=True):
            norms[index] = norm
    return norms


def _multi_tensor(tensor: torch.Tensor) -> bool:
    """Whether to run Adam's multi-tensor (``foreach``) kernels: on an accelerator. On the CPU
    torch has none (its ``foreach`` ops loop over the tensors one by one, slower than its
    single-tensor Adam: x0.88 against x1.12 for 8 adapters, ``benchmarks/multi_step.py``), and
    ``AdamW.step()`` itself takes the single-tensor path there."""
    return tensor.device.type != 'cpu'


@dataclass
class _Bucket:
    """Tensors stepped with one set of hyperparameters."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)


def step_together(optimizers: Sequence[Optimizer]) -> None:
    """One ``step()`` of each optimizer (each ``fusable``), as one multi-tensor Adam update per
    set of equal hyperparameters (usually one for all)."""
    buckets: dict[tuple[float, float, float, float, float, bool, bool], _Bucket] = {}
    for optimizer in optimizers:
        if not fusable(optimizer):
            raise StateError(f'{type(optimizer).__name__} cannot be stepped together with others; see fusable()')
        for group in optimizer.param_groups:
            beta1, beta2 = group['betas']
            decoupled = bool(group.get('decoupled_weight_decay', type(optimizer) is AdamW))
            fused = bool(group.get('fused'))  # its kernel: an adapter steps as it would alone
            key = (group['lr'], beta1, beta2, group['eps'], group['weight_decay'], decoupled, fused)
            bucket = buckets.setdefault(key, _Bucket())
            for param in group['params']:
                if param.grad is None:
                    continue
                state = optimizer.state[param]
                bucket.params.append(param)
                bucket.grads.append(param.grad)
                bucket.exp_avgs.append(state['exp_avg'])
                bucket.exp_avg_sqs.append(state['exp_avg_sq'])
                bucket.steps.append(state['step'])
    with torch.no_grad():
        for (lr, beta1, beta2, eps, weight_decay, decoupled, fused), bucket in buckets.items():
            adam(
                bucket.params, bucket.grads, bucket.exp_avgs, bucket.exp_avg_sqs, [], bucket.steps,
                foreach=not fused and _multi_tensor(bucket.params[0]), fused=fused or None,
                decoupled_weight_decay=decoupled, amsgrad=False,
                beta1=beta1, beta2=beta2,
                lr=lr, weight_decay=weight_decay, eps=eps, maximize=False,
            )  # fmt: skip
