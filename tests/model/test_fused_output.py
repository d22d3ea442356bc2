"""The chunked output layer (twinkle.model.output.fused) against the unfused path.

The unfused path builds the whole ``[N, V]`` float32 logits, takes ``log_softmax``, gathers the
labels and sums ``-p log p``; autograd differentiates it. The fused path must give the same values
and the same gradients (hidden, weight, bias, LoRA a and b) within 1e-5 in float32.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError
from twinkle.model.output import fused as fused_output
from twinkle.model.output.fused import HeadLora, fused_token_logprobs

TOL = 1e-5


def _unfused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora: HeadLora | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole logits, projection in the weight's dtype, the rest in float32: (logps, entropy)."""
    x = hidden.to(weight.dtype)
    z = (x @ weight.T).float()
    if bias is not None:
        z = z + bias.float()
    if lora is not None:
        z = z + lora.scale * ((x @ lora.a.T) @ lora.b.T).float()
    logp_all = (z / temperature).log_softmax(dim=-1)
    valid = labels != IGNORE_INDEX
    logps = logp_all.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    zero = torch.zeros_like(logps)
    return torch.where(valid, logps, zero), torch.where(valid, entropy, zero)


def _problem(
    n: int = 13, h: int = 8, v: int = 50, r: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HeadLora, torch.Tensor]:
    """Hidden, weight, bias, a LoRA (b nonzero, so its delta counts) and labels with ignored spans."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(dtype).requires_grad_()
    bias = (0.1 * torch.randn(v, generator=g)).to(dtype).requires_grad_()
    a = (torch.randn(r, h, generator=g) / math.sqrt(h)).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(v, r, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[:4] = IGNORE_INDEX  # a prompt
    labels[9] = IGNORE_INDEX  # a hole inside the completion
    return hidden, weight, bias, HeadLora(a, b, scale=2.0), labels


def _mixed_loss(logps: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """Per-token coefficients on both values, as a policy-gradient loss with an entropy bonus has."""
    coef = torch.linspace(-1.0, 2.0, logps.shape[0])
    return -(coef * logps).sum() - 0.01 * (coef.flip(0) * entropy).sum()


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def test_one_token_worked_by_hand() -> None:
    # x = [1], W = [0, ln 2, ln 3]^T: logits [0, ln 2, ln 3], p = [1/6, 2/6, 3/6], label 2.
    # logp = ln(1/2); entropy = -(1/6 ln 1/6 + 1/3 ln 1/3 + 1/2 ln 1/2) = 1.0114;
    # d logp / dW = (onehot(2) - p) * x = [-1/6, -1/3, 1/2].
    hidden = torch.ones(1, 1, requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(2)], [math.log(3)]], requires_grad=True)
    out = fused_token_logprobs(hidden, weight, torch.tensor([2]), with_entropy=True, chunk_size=1)
    assert out.entropy is not None
    assert out.logps.item() == pytest.approx(math.log(0.5), abs=1e-6)
    expected_entropy = -(1 / 6 * math.log(1 / 6) + 1 / 3 * math.log(1 / 3) + 1 / 2 * math.log(1 / 2))
    assert out.entropy.item() == pytest.approx(expected_entropy, abs=1e-6)
    (grad_weight,) = torch.autograd.grad(out.logps.sum(), [weight])
    assert grad_weight.squeeze(1).tolist() == pytest.approx([-1 / 6, -1 / 3, 1 / 2], abs=1e-6)


@pytest.mark.parametrize('chunk_size', [1, 3, 4, 7, 13, 1000])
@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_values_and_gradients_match_unfused(chunk_size: int, temperature: float) -> None:
    # 13 tokens (9 trained): chunks of 3, 4 and 7 do not divide 9 or 13; 1000 is one chunk.
    hidden, weight, bias, lora, labels = _problem()
    tensors = [hidden, weight, bias, lora.a, lora.b]
    out = fused_token_logprobs(
        hidden, weight, labels, bias=bias, lora=lora, chunk_size=chunk_size, temperature=temperature, with_entropy=True
    )
    assert out.entropy is not None
    ref_logps, ref_entropy = _unfused(hidden, weight, labels, bias, lora, temperature)
    torch.testing.assert_close(out.logps, ref_logps, atol=TOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref_entropy, atol=TOL, rtol=0)
    got = _grads(_mixed_loss(out.logps, out.entropy), tensors)
    expected = _grads(_mixed_loss(ref_logps, ref_entropy), tensors)
    for name, g, e in zip(['hidden', 'weight', 'bias', 'lora a', 'lora b'], got, expected, strict=True):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, atol=TOL, rtol=0, msg=f'{name}: the gradients differ')


@pytest.mark.parametrize('with_entropy', [False, True])
@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_a_frozen_head_takes_its_gradient_from_the_forward_and_recomputes_no_logits(
    with_entropy: bool, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # LoRA below the head: only the hidden states take a gradient; the head (with a frozen LoRA of its own) does not.
    hidden, weight, bias, lora, labels = _problem()
    weight, bias = weight.detach(), bias.detach()
    lora = HeadLora(lora.a.detach(), lora.b.detach(), lora.scale)
    kwargs = {'bias': bias, 'lora': lora, 'chunk_size': 4, 'temperature': temperature, 'with_entropy': with_entropy}
    out = fused_token_logprobs(hidden, weight, labels, **kwargs)
    ref_logps, ref_entropy = _unfused(hidden, weight, labels, bias, lora, temperature)
    torch.testing.assert_close(out.logps, ref_logps, atol=TOL, rtol=0)
    projections = []
    monkeypatch.setattr(fused_output._Head, 'logits', lambda head, x: projections.append(x) or (None, None))
    loss, ref_loss = (-(torch.linspace(-1.0, 2.0, 13) * lp).sum() for lp in (out.logps, ref_logps))  # a PG loss
    torch.testing.assert_close(_grads(loss, [hidden])[0], _grads(ref_loss, [hidden])[0], atol=TOL, rtol=0)
    assert projections == []  # the backward recomputed no logits
    if with_entropy:  # an entropy bonus needs the entropy's gradient: the recomputing backward gives both
        monkeypatch.undo()
        again = fused_token_logprobs(hidden, weight, labels, **kwargs)
        ref_logps, ref_entropy = _unfused(hidden, weight, labels, bias, lora, temperature)
        got = _grads(_mixed_loss(again.logps, again.entropy), [hidden])[0]
        torch.testing.assert_close(got, _grads(_mixed_loss(ref_logps, ref_entropy), [hidden])[0], atol=TOL, rtol=0)


def test_under_no_grad_nothing_is_kept_for_a_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reference forward of an RL step (adapter off, no_grad) pays no gradient in its forward.
    hidden, weight, _, _, labels = _problem()
    kept = []
    real = fused_output._dlogp_dx
    monkeypatch.setattr(fused_output, '_dlogp_dx', lambda *a: kept.append(1) or real(*a))
    fused_token_logprobs(hidden, weight.detach(), labels, chunk_size=4)
    assert kept  # with grad on, the frozen head's forward keeps the gradient (the same hidden and head)
    kept.clear()
    with torch.no_grad():
        out = fused_token_logprobs(hidden, weight.detach(), labels, chunk_size=4)
    assert out.logps.grad_fn is None and kept == []
    torch.testing.assert_close(out.logps, _unfused(hidden, weight, labels)[0].detach(), atol=TOL, rtol=0)


def test_cross_entropy_from_logps_is_torchs() -> None:
    # CE = mean of -logp over trained tokens = F.cross_entropy(ignore_index=-100) on the logits.
    hidden, weight, bias, _, labels = _problem()
    out = fused_token_logprobs(hidden, weight, labels, bias=bias, chunk_size=4)
    assert out.entropy is None
    trained = labels != IGNORE_INDEX
    ce = -out.logps.sum() / trained.sum()
    ref = F.cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(ce, ref, atol=TOL, rtol=0)
    for g, e in zip(_grads(ce, [hidden, weight, bias]), _grads(ref, [hidden, weight, bias]), strict=True):
        torch.testing.assert_close(g, e, atol=TOL, rtol=0)


def test_dpo_sequence_sums_through_logps_only() -> None:
    # DPO sums logps per sequence: two sequences of 6 and 7 tokens, their difference differentiated.
    hidden, weight, _, lora, labels = _problem()
    out = fused_token_logprobs(hidden, weight, labels, lora=lora, chunk_size=5)
    ref_logps, _ = _unfused(hidden, weight, labels, lora=lora)
    margin, ref_margin = (lp[:6].sum() - lp[6:].sum() for lp in (out.logps, ref_logps))
    torch.testing.assert_close(margin, ref_margin, atol=TOL, rtol=0)
    tensors = [hidden, lora.a, lora.b]
    for g, e in zip(_grads(margin, tensors), _grads(ref_margin, tensors), strict=True):
        torch.testing.assert_close(g, e, atol=TOL, rtol=0)


def test_ignored_chunks_give_zero_values_and_gradients() -> None:
    hidden, weight, bias, lora, labels = _problem()
    labels[:8] = IGNORE_INDEX  # with chunks of 4 the first two would be all ignored
    out = fused_token_logprobs(hidden, weight, labels, bias=bias, lora=lora, chunk_size=4, with_entropy=True)
    assert out.entropy is not None
    ref_logps, ref_entropy = _unfused(hidden, weight, labels, bias, lora)
    torch.testing.assert_close(out.logps, ref_logps, atol=TOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref_entropy, atol=TOL, rtol=0)
    (grad_hidden,) = _grads(_mixed_loss(out.logps, out.entropy), [hidden])
    assert torch.count_nonzero(grad_hidden[:8]) == 0 and torch.count_nonzero(grad_hidden[10:]) > 0

    nothing = torch.full_like(labels, IGNORE_INDEX)  # every token ignored: zeros, and zero gradients
    out = fused_token_logprobs(hidden, weight, nothing, lora=lora, chunk_size=4, with_entropy=True)
    assert out.entropy is not None
    assert torch.count_nonzero(out.logps) == 0 and torch.count_nonzero(out.entropy) == 0
    grads = _grads(_mixed_loss(out.logps, out.entropy), [hidden, weight, lora.a, lora.b])
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_bf16_matches_the_unfused_path_computed_the_same_way() -> None:
    # bf16 hidden, weight and LoRA: both paths project in bf16 and upcast the logits to float32,
    # so the values agree to float32 rounding (the chunks' bf16 matmuls give the same rows).
    # The gradients differ by bf16 rounding: the unfused autograd rounds dL/dlogits to bf16 and
    # the weight gradient once in bf16; the fused path accumulates it in float32 and rounds once
    # at the end. Tolerance: 2 bf16 ulps relative (2 * 2^-7) plus 1e-3 absolute.
    hidden, weight, bias, lora, labels = _problem(n=40, h=16, v=300, dtype=torch.bfloat16)
    labels[4:40:3] = torch.arange(100, 112)
    tensors = [hidden, weight, bias, lora.a, lora.b]
    out = fused_token_logprobs(hidden, weight, labels, bias=bias, lora=lora, chunk_size=7, with_entropy=True)
    assert out.entropy is not None and out.logps.dtype == out.entropy.dtype == torch.float32
    ref_logps, ref_entropy = _unfused(hidden, weight, labels, bias, lora)
    torch.testing.assert_close(out.logps, ref_logps, atol=TOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref_entropy, atol=TOL, rtol=0)
    got = _grads(_mixed_loss(out.logps, out.entropy), tensors)
    expected = _grads(_mixed_loss(ref_logps, ref_entropy), tensors)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e.float(), atol=1e-3, rtol=2 * 2**-7)


def test_float32_weight_with_bf16_hidden_returns_a_bf16_hidden_gradient() -> None:
    hidden, weight, _, _, labels = _problem()
    hidden16 = hidden.detach().bfloat16().requires_grad_()
    out = fused_token_logprobs(hidden16, weight, labels, chunk_size=4)
    ref_logps, _ = _unfused(hidden16, weight, labels)
    torch.testing.assert_close(out.logps, ref_logps, atol=TOL, rtol=0)
    (grad,) = _grads(out.logps.sum(), [hidden16])
    (ref_grad,) = _grads(ref_logps.sum(), [hidden16])
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize(
    ('kwargs', 'error', 'match'),
    [
        ({'chunk_size': 0}, ConfigurationError, 'chunk_size must be a positive number of tokens; got 0'),
        ({'temperature': 0.0}, ConfigurationError, r'temperature must be finite and > 0; got 0\.0'),
        ({'labels': torch.tensor([0, 1, 2, 50])}, DataError, r'labels must be in \[0, 50\) or -100; got 0\.\.50'),
        ({'labels': torch.zeros(3, dtype=torch.long)}, DataError, r'labels must be \[N\] = \(4,\); got \(3,\)'),
    ],
)
def test_bad_arguments_name_the_value(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    args: dict[str, object] = {'labels': torch.tensor([0, 1, 2, 3])} | kwargs
    labels = args.pop('labels')
    assert isinstance(labels, torch.Tensor)
    with pytest.raises(error, match=match):
        fused_token_logprobs(torch.zeros(4, 8), torch.zeros(50, 8), labels, **args)  # type: ignore[arg-type]


# Run in a child process: glibc raises its mmap threshold each time a large block is freed, after
# which freed [chunk, V] buffers stay in the heap and the resident set measures the allocator's
# retention, not the live tensors. A fixed threshold (MALLOC_MMAP_THRESHOLD_) returns each one.
_PEAK_SCRIPT = """
import math, sys
from pathlib import Path
import torch
from twinkle.model.output.fused import fused_token_logprobs

def kib(field):
    return next(int(l.split()[1]) for l in Path('/proc/self/status').read_text().splitlines() if l.startswith(field))

n, h, v, chunk = (int(a) for a in sys.argv[1:])
g = torch.Generator().manual_seed(0)
hidden = torch.randn(n, h, generator=g).requires_grad_()
weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).requires_grad_()
labels = torch.randint(0, v, (n,), generator=g)
Path('/proc/self/clear_refs').write_text('5')  # the high-water mark restarts from the current RSS
before = kib('VmRSS:')
out = fused_token_logprobs(hidden, weight, labels, chunk_size=chunk, with_entropy=True)
(out.logps.sum() + out.entropy.sum()).backward()
assert torch.isfinite(weight.grad).all() and torch.isfinite(hidden.grad).all()
print((kib('VmHWM:') - before) * 1024)
"""


@pytest.mark.integration
@pytest.mark.skipif(not os.access('/proc/self/clear_refs', os.W_OK), reason='needs Linux /proc/self/clear_refs')
def test_peak_memory_is_chunk_by_vocab_not_tokens_by_vocab() -> None:
    # N = 4096 tokens, V = 32768: the unfused float32 logits alone are N * V * 4 = 512 MiB (and
    # autograd keeps their gradient too). In chunks of 128 tokens the backward holds about three
    # [128, V] float32 buffers (16 MiB each) and the weight's float32 gradient (V * H * 4 = 4 MiB);
    # measured 52 MiB. Bounds on the growth of the high-water mark of the resident set (VmHWM,
    # reset through /proc/self/clear_refs): five chunk buffers (80 MiB), so O(chunk x V), and a
    # quarter of the unfused logits (128 MiB). About 7 s on 2 idle cores.
    n, h, v, chunk = 4096, 32, 32768, 128
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    args = [sys.executable, '-c', _PEAK_SCRIPT, *(str(x) for x in (n, h, v, chunk))]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    growth = int(done.stdout.split()[-1])
    chunk_buffer, unfused_logits = chunk * v * 4, n * v * 4
    assert growth < 5 * chunk_buffer, (
        f'peak grew {growth / 2**20:.0f} MiB; a chunk buffer is {chunk_buffer / 2**20} MiB'
    )
    assert growth < unfused_logits / 4
