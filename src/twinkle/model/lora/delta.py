"""The LoRA deltas of a batch laid out as runs of rows, one adapter per run, as one autograd node.

``MultiLoraLinear`` could split the batch into runs, add each run's delta and join the pieces
again, but autograd then copies every activation and gradient of the layer once more: the
forward joins the pieces with ``cat``, and the backward joins the pieces' gradients twice (those
of the output and of the input). On a CPU that was an eighth of a mixed pass. Here the
output is copied once, as ``base(x) + delta`` copies it for one adapter, and each run's delta
is added into its rows of that copy; the backward reads the runs' rows of the incoming gradient
in place and writes each run's input gradient into its rows of one tensor.

For a run of rows ``x`` of adapter (A, B, scaling s, dropout p)::

    h = drop(x) @ A^T            y[run] += s * h @ B^T
    dB = s * g^T @ h             dh = s * g @ B
    dA = dh^T @ drop(x)          dx = drop'(dh @ A)

with ``g`` the gradient of the run's output rows, flattened over rows and positions for the
weight gradients, and ``drop(x) = x * mask / (1 - p)`` with the mask ``nn.Dropout`` would draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch


@dataclass(frozen=True)
class Run:
    """Rows ``start:end`` of the batch through one adapter: its scaling, and its dropout
    probability (0 when the adapter is in eval mode)."""

    start: int
    end: int
    scaling: float
    dropout: float


def add_run_deltas(out: torch.Tensor, x: torch.Tensor, runs: list[Run], weights: list[torch.Tensor]) -> torch.Tensor:
    """``out`` [B, ..., out] plus, on each run's rows, that run's LoRA delta of ``x`` [B, ..., in].

    ``weights`` holds each run's ``lora_A`` [r, in] and ``lora_B`` [out, r] in turn; rows in
    no run keep ``out``."""
    # torch leaves Function.apply unannotated; it returns what _RunDeltas.forward does, one tensor.
    return cast(Callable[..., torch.Tensor], _RunDeltas.apply)(out, x, runs, *weights)


class _RunDeltas(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, runs: list[Run], *weights: torch.Tensor) -> torch.Tensor:
        y = out.clone()
        saved = []
        for k, run in enumerate(runs):
            lora_A, lora_B = weights[2 * k], weights[2 * k + 1]
            x_run, mask = _dropped(x[run.start : run.end].to(lora_A.dtype), run.dropout)
            h = torch.nn.functional.linear(x_run, lora_A)
            y[run.start : run.end] += (torch.nn.functional.linear(h, lora_B) * run.scaling).to(y.dtype)
            saved += [x_run, h, mask]
        ctx.runs = runs
        ctx.x_meta = (x.shape, x.dtype)
        # The backward's matmuls run under the forward's autocast, as autograd's own would: the
        # saved activations are in the dtype autocast gave them (bf16 under a bf16 autocast).
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(*weights, *[t for t in saved if t is not None])
        ctx.has_mask = [mask is not None for mask in saved[2::3]]
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _RunDeltas._backward(ctx, g)

    @staticmethod
    def _backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        n = len(ctx.runs)
        tensors = list(ctx.saved_tensors)
        weights, rest = tensors[: 2 * n], iter(tensors[2 * n :])
        grad_x = g.new_zeros(ctx.x_meta[0], dtype=ctx.x_meta[1]) if ctx.needs_input_grad[1] else None
        grads: list[torch.Tensor | None] = []
        for k, run in enumerate(ctx.runs):
            lora_A, lora_B = weights[2 * k], weights[2 * k + 1]
            x_run, h = next(rest), next(rest)
            mask = next(rest) if ctx.has_mask[k] else None
            g_run = g[run.start : run.end].to(lora_B.dtype) * run.scaling
            grad_h = g_run @ lora_B
            grads.append(_flat(grad_h).t() @ _flat(x_run) if ctx.needs_input_grad[3 + 2 * k] else None)
            grads.append(_flat(g_run).t() @ _flat(h) if ctx.needs_input_grad[4 + 2 * k] else None)
            if grad_x is not None:
                grad_run = grad_h @ lora_A
                grad_x[run.start : run.end] = grad_run if mask is None else grad_run * mask
        return g, grad_x, None, *grads


def _dropped(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` through dropout ``p`` and the scaled mask it used (None when ``p`` is 0); the same
    draws as ``nn.Dropout`` on a CPU."""
    if p == 0:
        return x, None
    mask = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    return x * mask, mask


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])
