"""The output layer and its per-token log-probabilities in chunks of tokens: the ``[N, V]`` logits never exist whole.

At Qwen3's vocabulary (151,936) the float32 logits of 800 tokens take 486 MB, and autograd keeps
them (and their gradient) for the backward. Every loss twinkle trains with needs only two numbers
per token from them: the label's log-probability (cross entropy, the RL losses, DPO's sequence
sums, Tinker's losses) and, for some, the entropy of the distribution. ``fused_token_logprobs``
computes those two per chunk of tokens, keeps one ``logsumexp`` and one entropy per token for the
backward, and recomputes each chunk's logits there: the extra memory is O(chunk x V), not O(N x V).

When only ``hidden`` takes a gradient (a frozen head: LoRA on the layers below it, the usual case) and
it is the log-probabilities' gradient, the forward also keeps ``d logp / d hidden`` per token (``[N, H]``,
the size of ``hidden``), and the backward scales it by the loss's gradient: no logits are recomputed, so
a step projects onto the vocabulary twice (forward, and ``(onehot - p) @ W``), as the unfused layer does,
rather than three times. A gradient to the entropy (a loss with an entropy bonus: four projections, the
forward's being unused), or to the head's weights (three), takes the recomputing path.

Per trained token ``n`` with label ``y``, logits ``z = (x W^T + b + s (x A^T) B^T) / T``:

* ``logp[n] = z[y] - logsumexp(z)``,
* ``entropy[n] = -sum_j p_j log p_j`` with ``p = softmax(z)``,

and, for any loss built on them, the gradient to the logits is
``d logp / dz = onehot(y) - p`` and ``d entropy / dz_j = -p_j (log p_j + entropy)``.

Positions labelled ``IGNORE_INDEX`` get 0 for both values and no gradient; they are dropped before
the first chunk, so a prompt costs nothing here.

Why written here rather than wrapped (checked 2026-11): torch 2.13's
``F.linear_cross_entropy(..., reduction='none', options=LinearCrossEntropyOptions(...))`` chunks on
the CPU and on GPUs, but gives the label's loss only (no entropy, no temperature, no low-rank
term); Liger Kernel 0.8.5's ``LigerFusedLinearScaledCrossEntropyFunction`` gives loss and entropy
with a torch fallback off Hopper, but its package imports Triton, its chunk is fixed at 512, it
has no bias or LoRA, and its bf16 path returns the entropy in bf16; Apple's ``cut-cross-entropy``
25.1.1 is Triton-only apart from a ``torch_compile`` path that builds the whole logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError

#: Tokens per chunk when none is named: 1,024 x 151,936 float32 logits are 622 MB.
DEFAULT_CHUNK_SIZE = 1024


@dataclass(frozen=True)
class HeadLora:
    """A LoRA delta on the output projection: the logits gain ``scale * (x @ a.T) @ b.T``.

    ``a`` is ``[r, H]`` (PEFT's ``lora_A.weight``), ``b`` is ``[V, r]`` (``lora_B.weight``),
    ``scale`` is ``alpha / r``. The delta is applied per chunk; ``W + scale * b @ a`` is never built.
    Dropout on the LoRA input is not applied (use 0 on the head)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


class TokenLogprobs(NamedTuple):
    """Per-token results, float32, 0 where the label is ``IGNORE_INDEX``."""

    #: ``[N]``: the label's log-probability.
    logps: torch.Tensor
    #: ``[N]``: the entropy of the token's distribution (``None`` unless asked for).
    entropy: torch.Tensor | None
    #: ``[N]`` bool, no gradient: the label's logit is the largest (ties count), what ``Accuracy`` counts.
    hits: torch.Tensor


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    lora: HeadLora | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> TokenLogprobs:
    """The label log-probabilities (and entropies) of ``hidden @ weight.T``, ``chunk_size`` tokens at a time.

    ``hidden`` is ``[N, H]`` (the last hidden states, after the final norm), ``weight`` ``[V, H]``,
    ``bias`` ``[V]``, ``labels`` ``[N]`` (int, ``IGNORE_INDEX`` where untrained). The projection
    runs in the weight's dtype, the softmax and every reduction in float32; gradients reach
    ``hidden``, ``weight``, ``bias`` and the LoRA's ``a`` and ``b`` where they require them.
    ``temperature`` divides the logits before the softmax, as the sampler did.

    >>> h, w = torch.zeros(2, 4), torch.zeros(3, 4)
    >>> out = fused_token_logprobs(h, w, torch.tensor([1, IGNORE_INDEX]), with_entropy=True)
    >>> out.logps  # uniform over 3 tokens: log(1/3); the ignored token gets 0
    tensor([-1.0986,  0.0000])
    >>> out.entropy
    tensor([1.0986, 0.0000])
    """
    _check_inputs(hidden, weight, labels, bias, lora, chunk_size, temperature)
    lora_a, lora_b, scale = (lora.a, lora.b, float(lora.scale)) if lora is not None else (None, None, 0.0)
    frozen_head = not any(t is not None and t.requires_grad for t in (weight, bias, lora_a, lora_b))
    grad_in_forward = torch.is_grad_enabled() and hidden.requires_grad and frozen_head
    logps, entropy, hits = _FusedTokenLogprobs.apply(  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        hidden,
        weight,
        bias,
        lora_a,
        lora_b,
        labels,
        scale,
        float(temperature),
        chunk_size,
        with_entropy,
        grad_in_forward,
    )
    return TokenLogprobs(logps, entropy if with_entropy else None, hits)


def _check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    lora: HeadLora | None,
    chunk_size: int,
    temperature: float,
) -> None:
    """Shapes, chunk and temperature, each error naming the value it got."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise DataError(f'hidden must be [N, H] and weight [V, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}')
    if labels.shape != hidden.shape[:1]:
        raise DataError(f'labels must be [N] = {tuple(hidden.shape[:1])}; got {tuple(labels.shape)}')
    if bias is not None and bias.shape != weight.shape[:1]:
        raise DataError(f'bias must be [V] = {tuple(weight.shape[:1])}; got {tuple(bias.shape)}')
    if lora is not None and (
        lora.a.dim() != 2
        or lora.a.shape[1] != weight.shape[1]
        or lora.b.shape
        != (
            weight.shape[0],
            lora.a.shape[0],
        )
    ):
        raise DataError(
            f'the LoRA needs a [r, H] and b [V, r] with H, V = {tuple(weight.shape[::-1])}; '
            f'got a {tuple(lora.a.shape)} and b {tuple(lora.b.shape)}'
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigurationError(f'chunk_size must be a positive number of tokens; got {chunk_size!r}')
    if not math.isfinite(temperature) or temperature <= 0:
        raise ConfigurationError(f'temperature must be finite and > 0; got {temperature!r}')


@dataclass(frozen=True)
class _Head:
    """The output projection as one chunk sees it."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_a: torch.Tensor | None
    lora_b: torch.Tensor | None
    scale: float
    temperature: float

    def logits(self, x_cH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 ``[c, V]`` logits over the temperature, and the LoRA's ``x @ a.T`` ``[c, r]``."""
        z_cV = (x_cH @ self.weight.T).float()
        if self.bias is not None:
            z_cV.add_(self.bias.float())
        u_cr = None
        if self.lora_a is not None and self.lora_b is not None:
            # In the LoRA's own dtype, as the unfused layer runs it (float32 adapters on a bf16 base).
            u_cr = x_cH.to(self.lora_a.dtype) @ self.lora_a.T
            if z_cV.dtype == u_cr.dtype:
                z_cV.addmm_(u_cr, self.lora_b.T, alpha=self.scale)
            else:
                z_cV.add_((u_cr @ self.lora_b.T).float(), alpha=self.scale)
        if self.temperature != 1.0:
            z_cV.div_(self.temperature)
        return z_cV, u_cr


def _forward_chunk(
    head: _Head, x_cH: torch.Tensor, y_c: torch.Tensor, with_entropy: bool, grad_in_forward: bool
) -> tuple[torch.Tensor, ...]:
    """``(logp, lse, entropy, hit, dlogp_dx)`` of one chunk, ``[c]`` each but ``dlogp_dx`` ``[c, H]`` (entropy
    empty when not asked, ``dlogp_dx`` when not ``grad_in_forward``)."""
    z_cV, u_cr = head.logits(x_cH)
    # logsumexp by hand, shifting z in place, so the chunk holds two [c, V] buffers at most.
    max_c = z_cV.amax(dim=-1)
    shifted_cV = z_cV.sub_(max_c[:, None])
    target_c = shifted_cV.gather(1, y_c[:, None]).squeeze(1)
    hit_c = target_c >= 0  # the label's logit minus the largest
    none = max_c.new_empty(0)
    if not with_entropy:  # one [c, V] buffer: exp in place
        exp_cV = shifted_cV.exp_()
        log_sum_c = exp_cV.sum(dim=-1).log_()
        dlogp_dx_cH = (
            _dlogp_dx(head, x_cH, u_cr, y_c, exp_cV.div_(log_sum_c.exp()[:, None])) if grad_in_forward else none
        )
        return target_c - log_sum_c, max_c + log_sum_c, none, hit_c, dlogp_dx_cH
    log_sum_c = torch.exp(shifted_cV).sum(dim=-1).log_()
    logp_c, lse_c = target_c - log_sum_c, max_c + log_sum_c
    # entropy = -sum_j p_j log p_j over log p = z - lse (in place) and p = exp(log p): subtracting
    # lse first keeps a peaked distribution's small entropy exact, where lse - sum_j p_j z_j cancels.
    logp_cV = shifted_cV.sub_(log_sum_c[:, None])
    p_cV = torch.exp(logp_cV)
    entropy_c = -logp_cV.mul_(p_cV).sum(dim=-1)
    dlogp_dx_cH = _dlogp_dx(head, x_cH, u_cr, y_c, p_cV) if grad_in_forward else none
    return logp_c, lse_c, entropy_c, hit_c, dlogp_dx_cH


def _dlogp_dx(
    head: _Head, x_cH: torch.Tensor, u_cr: torch.Tensor | None, y_c: torch.Tensor, p_cV: torch.Tensor
) -> torch.Tensor:
    """``d logp / d x`` ``[c, H]`` from the softmax ``p_cV`` (overwritten): ``(onehot(y) - p) dz/dx``, in
    the weight's dtype (what the recomputing backward's product is in)."""
    grad_cV = p_cV.neg_().scatter_add_(1, y_c[:, None], torch.ones_like(y_c, dtype=p_cV.dtype)[:, None])
    return _backward_chunk(head, x_cH, grad_cV, u_cr, _Grads(None, None, None, None))  # in the weight's dtype


def _grad_logits(
    logp_cV: torch.Tensor,
    y_c: torch.Tensor,
    g_logp_c: torch.Tensor | None,
    g_entropy_c: torch.Tensor | None,
    entropy_c: torch.Tensor,
) -> torch.Tensor:
    """dL/dz ``[c, V]`` float32 from the log-softmax ``logp_cV`` (overwritten).

    d logp / dz = onehot(y) - p; d entropy / dz_j = -p_j (log p_j + entropy)."""
    if g_entropy_c is None:  # one [c, V] buffer: p in place of log p
        assert g_logp_c is not None  # the caller skips a backward with neither gradient
        return logp_cV.exp_().mul_(-g_logp_c[:, None]).scatter_add_(1, y_c[:, None], g_logp_c[:, None])
    p_cV = logp_cV.exp()
    grad_cV = logp_cV.add_(entropy_c[:, None]).mul_(p_cV).mul_(-g_entropy_c[:, None])
    if g_logp_c is not None:
        grad_cV.sub_(p_cV.mul_(g_logp_c[:, None])).scatter_add_(1, y_c[:, None], g_logp_c[:, None])
    return grad_cV


@dataclass
class _Grads:
    """float32 accumulators over the chunks (``None`` for what needs no gradient)."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    lora_a: torch.Tensor | None
    lora_b: torch.Tensor | None


def _backward_chunk(
    head: _Head, x_cH: torch.Tensor, grad_cV: torch.Tensor, u_cr: torch.Tensor | None, acc: _Grads
) -> torch.Tensor:
    """Adds one chunk's weight, bias and LoRA gradients to ``acc``; returns the chunk's hidden gradient."""
    if head.temperature != 1.0:
        grad_cV.div_(head.temperature)
    g_cV = grad_cV.to(head.weight.dtype)
    grad_x_cH = g_cV @ head.weight
    x32_cH = x_cH.float()
    if acc.weight is not None:
        acc.weight.addmm_(grad_cV.T, x32_cH)
    if acc.bias is not None:
        acc.bias.add_(grad_cV.sum(dim=0))
    if head.lora_a is not None and head.lora_b is not None and u_cr is not None:
        gb_cr = grad_cV.to(head.lora_b.dtype) @ head.lora_b
        grad_x_cH.add_((gb_cr @ head.lora_a).to(grad_x_cH.dtype), alpha=head.scale)
        if acc.lora_a is not None:
            acc.lora_a.addmm_(gb_cr.float().T, x32_cH, alpha=head.scale)
        if acc.lora_b is not None:
            acc.lora_b.addmm_(grad_cV.T, u_cr.float(), alpha=head.scale)
    return grad_x_cH


class _FusedTokenLogprobs(torch.autograd.Function):
    """Forward and backward chunk by chunk over the trained tokens only."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor | None,
        lora_b: torch.Tensor | None,
        labels: torch.Tensor,
        scale: float,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        grad_in_forward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        rows_n = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        y_n = labels.index_select(0, rows_n).long()
        if y_n.numel() and bool(((y_n < 0) | (y_n >= weight.shape[0])).any()):
            raise DataError(f'labels must be in [0, {weight.shape[0]}) or {IGNORE_INDEX}; got {y_n.min()}..{y_n.max()}')
        x_nH = hidden.index_select(0, rows_n).to(weight.dtype)
        head = _Head(weight, bias, lora_a, lora_b, scale, temperature)
        parts = [
            _forward_chunk(head, x_nH[i : i + chunk_size], y_n[i : i + chunk_size], with_entropy, grad_in_forward)
            for i in range(0, len(rows_n), chunk_size)
        ]
        empty = hidden.new_empty(0, dtype=torch.float32)
        logp_n, lse_n, entropy_n, hit_n, dlogp_dx_nH = (
            (torch.cat(p) for p in zip(*parts, strict=True))
            if parts
            else (empty, empty, empty, hidden.new_empty(0, dtype=torch.bool), empty)
        )
        ctx.grad_in_forward = grad_in_forward and bool(parts)
        ctx.save_for_backward(x_nH, y_n, rows_n, lse_n, entropy_n, dlogp_dx_nH, weight, bias, lora_a, lora_b)
        ctx.meta = (hidden.shape, hidden.dtype, scale, temperature, chunk_size, with_entropy)
        n = hidden.shape[0]
        out_logps = logp_n.new_zeros(n).index_copy_(0, rows_n, logp_n)
        out_entropy = logp_n.new_zeros(n)
        if with_entropy:
            out_entropy.index_copy_(0, rows_n, entropy_n)
        out_hits = hit_n.new_zeros(n).index_copy_(0, rows_n, hit_n)
        ctx.mark_non_differentiable(out_hits)
        return out_logps, out_entropy, out_hits

    @staticmethod
    def backward(
        ctx: Any, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None, _grad_hits: Any
    ) -> tuple[Any, ...]:
        x_nH, y_n, rows_n, lse_n, entropy_n, dlogp_dx_nH, weight, bias, lora_a, lora_b = ctx.saved_tensors
        hidden_shape, hidden_dtype, scale, temperature, chunk_size, with_entropy = ctx.meta
        head = _Head(weight, bias, lora_a, lora_b, scale, temperature)
        needs = ctx.needs_input_grad
        params = (weight, bias, lora_a, lora_b)
        acc = _Grads(
            *(_zeros32(t) if t is not None and need else None for t, need in zip(params, needs[1:5], strict=True))
        )
        g_logp_n = grad_logps.index_select(0, rows_n).float() if grad_logps is not None else None
        g_entropy_n = (
            grad_entropy.index_select(0, rows_n).float() if grad_entropy is not None and with_entropy else None
        )
        grad_x_nH = torch.zeros_like(x_nH) if needs[0] else None
        if ctx.grad_in_forward and g_entropy_n is None and g_logp_n is not None and grad_x_nH is not None:
            grad_x_nH = (dlogp_dx_nH.float() * g_logp_n[:, None]).to(x_nH.dtype)  # the head takes no gradient here
        elif g_logp_n is not None or g_entropy_n is not None:
            for i in range(0, len(rows_n), chunk_size):
                s = slice(i, i + chunk_size)
                z_cV, u_cr = head.logits(x_nH[s])  # recomputed: the forward kept only lse and entropy
                logp_cV = z_cV.sub_(lse_n[s, None])
                grad_cV = _grad_logits(logp_cV, y_n[s], _part(g_logp_n, s), _part(g_entropy_n, s), entropy_n[s])
                grad_x_cH = _backward_chunk(head, x_nH[s], grad_cV, u_cr, acc)
                del z_cV, logp_cV, grad_cV  # before the next chunk allocates its own
                if grad_x_nH is not None:
                    grad_x_nH[s] = grad_x_cH
        grad_hidden = None
        if grad_x_nH is not None:
            grad_hidden = grad_x_nH.new_zeros(hidden_shape, dtype=hidden_dtype)
            grad_hidden.index_copy_(0, rows_n, grad_x_nH.to(hidden_dtype))
        grads = (_cast(g, t) for g, t in zip((acc.weight, acc.bias, acc.lora_a, acc.lora_b), params, strict=True))
        return (grad_hidden, *grads, None, None, None, None, None, None)


def _zeros32(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=torch.float32, device=t.device)


def _part(t: torch.Tensor | None, s: slice) -> torch.Tensor | None:
    return t[s] if t is not None else None


def _cast(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return grad.to(like.dtype) if grad is not None and like is not None else None
