"""Pipeline parallel inside one forward: each stage runs its layers, hands its hidden states to
the next stage, and every stage gets the last stage's logits back, so the project's losses,
metrics and per-adapter steps run on every rank as they do in one process.

The hand-offs are autograd functions over point-to-point sends (gloo on the CPU, NCCL on GPUs):

- ``receive_hidden`` (every stage but the first): its forward receives the previous stage's
  hidden states; its backward sends their gradient back.
- ``stage_logits`` (every stage but the last): its forward sends this stage's hidden states on
  and receives the logits the last stage broadcasts; its backward ignores the logits' gradient
  (the last stage's loss is the one that trains: every stage computed the same loss) and
  receives the gradient of the hidden states it sent.
- ``share_logits`` (the last stage): broadcasts its logits to the other stages.

Every rank calls ``backward`` on the same loss, in the same order, so each receive meets its
send. The stages run one after another within a forward and within a backward: the layers and
their activations are split across stages, the time is not (microbatches do not overlap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Stage:
    """This rank's place in its pipeline: stage ``rank`` of ``size``, and the global ranks of its
    neighbours, of the last stage, and the pipeline's process group."""

    rank: int
    size: int
    previous: int | None
    next: int | None
    last: int
    group: Any

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @classmethod
    def single(cls) -> Stage:
        """The only stage of a model that is not pipelined."""
        return cls(rank=0, size=1, previous=None, next=None, last=0, group=None)


class _ReceiveHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, stage: Stage) -> Any:
        ctx.stage = stage
        hidden = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(hidden, src=stage.previous)
        return hidden

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        dist.send(grad.contiguous(), dst=ctx.stage.previous)
        return None, None, None, None


class _StageLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, logits_shape: tuple[int, ...], stage: Stage) -> Any:
        ctx.stage, ctx.shape, ctx.dtype = stage, tuple(hidden.shape), hidden.dtype
        dist.send(hidden.detach().contiguous(), dst=stage.next)
        logits = torch.empty(logits_shape, dtype=torch.float32, device=hidden.device)
        dist.broadcast(logits, src=stage.last, group=stage.group)
        return logits

    @staticmethod
    def backward(ctx: Any, grad_logits: torch.Tensor) -> Any:
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_logits.device)
        dist.recv(grad, src=ctx.stage.next)
        return grad, None, None


class _ShareLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, stage: Stage) -> Any:
        out = logits.float().contiguous()
        dist.broadcast(out.detach(), src=stage.last, group=stage.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None


def receive_hidden(shape: tuple[int, ...], dtype: torch.dtype, stage: Stage, device: torch.device) -> torch.Tensor:
    """The previous stage's hidden states (``[sequence, batch, hidden]``); their gradient goes back to it."""
    anchor = torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())
    hidden: torch.Tensor = _ReceiveHidden.apply(anchor, shape, dtype, stage)  # type: ignore[no-untyped-call]
    return hidden


def stage_logits(hidden: torch.Tensor, logits_shape: tuple[int, ...], stage: Stage) -> torch.Tensor:
    """Send this stage's hidden states on; the last stage's logits (float32) come back."""
    logits: torch.Tensor = _StageLogits.apply(hidden, logits_shape, stage)  # type: ignore[no-untyped-call]
    return logits


def share_logits(logits: torch.Tensor, stage: Stage) -> torch.Tensor:
    """The last stage's logits (float32), broadcast to every stage of the pipeline."""
    shared: torch.Tensor = _ShareLogits.apply(logits, stage)  # type: ignore[no-untyped-call]
    return shared


__all__ = ['Stage', 'receive_hidden', 'share_logits', 'stage_logits']
