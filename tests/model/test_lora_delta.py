"""``add_run_deltas``: runs of rows through their own adapters as one autograd node, checked
against autograd's own derivative (gradcheck, float64) and against the plain per-run formula."""

from __future__ import annotations

import pytest
import torch

from twinkle.model.lora.delta import Run, add_run_deltas

IN, OUT = 6, 5


def _weights(ranks: list[int], dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weights = []
    for r in ranks:
        weights += [torch.randn(r, IN, generator=gen, dtype=dtype), torch.randn(OUT, r, generator=gen, dtype=dtype)]
    return [w.requires_grad_() for w in weights]


# Rows 0-1 adapter 0 (rank 2), row 2 no adapter, rows 3-5 adapter 1 (rank 3, dropout).
RUNS = [Run(0, 2, scaling=0.5, dropout=0.0), Run(3, 6, scaling=2.0, dropout=0.3)]


def _reference(out: torch.Tensor, x: torch.Tensor, runs: list[Run], weights: list[torch.Tensor]) -> torch.Tensor:
    """The delta by autograd on pieces: what a run's rows get, written plainly."""
    pieces, at = [], 0
    for k, run in enumerate(runs):
        pieces.append(out[at : run.start])
        x_run = torch.nn.functional.dropout(x[run.start : run.end].to(weights[2 * k].dtype), run.dropout)
        delta = x_run @ weights[2 * k].t() @ weights[2 * k + 1].t() * run.scaling
        pieces.append(out[run.start : run.end] + delta.to(out.dtype))
        at = run.end
    pieces.append(out[at:])
    return torch.cat(pieces)


def _inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 4, IN, generator=gen, dtype=dtype).requires_grad_()
    out = torch.randn(7, 4, OUT, generator=gen, dtype=dtype).requires_grad_()
    return out, x


@pytest.mark.slow
def test_gradients_match_autograd_numerically():
    out, x = _inputs()
    weights = _weights([2, 3])

    def seeded(out: torch.Tensor, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(3)  # the same dropout mask on every evaluation
        return add_run_deltas(out, x, RUNS, list(weights))

    assert torch.autograd.gradcheck(seeded, (out, x, *weights))


@pytest.mark.parametrize('base_dtype', [torch.float32, torch.bfloat16])
def test_output_and_gradients_equal_the_per_run_formula(base_dtype):
    out, x = _inputs(base_dtype)
    weights = _weights([2, 3], torch.float32)  # adapters stay float32 on a half-precision base
    upstream = torch.randn(out.shape, dtype=base_dtype, generator=torch.Generator().manual_seed(2))
    results = []
    for fn in (add_run_deltas, _reference):
        torch.manual_seed(3)
        y = fn(out, x, RUNS, weights)
        grads = torch.autograd.grad(y, (out, x, *weights), upstream)
        results.append((y, grads))
    (y, grads), (y_ref, grads_ref) = results
    assert y.dtype == base_dtype
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=1e-6)


def test_rows_outside_every_run_keep_the_base_output_and_get_no_input_gradient():
    out, x = _inputs()
    y = add_run_deltas(out, x, RUNS, _weights([2, 3]))
    assert torch.equal(y[2], out[2]) and torch.equal(y[6], out[6])
    (grad_x,) = torch.autograd.grad(y.sum(), x)
    assert not grad_x[2].any() and not grad_x[6].any()
    assert grad_x[0].any() and grad_x[5].any()


def test_under_bf16_autocast_the_gradients_are_autograds_own():
    # A TransformersModel runs its forward under bf16 autocast on a GPU; CPU autocast is the same
    # mechanism. The saved activations are bf16 there, so the backward must run under it too.
    out, x = _inputs(torch.float32)
    weights = _weights([2, 3], torch.float32)
    runs = [Run(0, 2, scaling=0.5, dropout=0.0), Run(3, 6, scaling=2.0, dropout=0.0)]
    results = []
    for fn in (add_run_deltas, _reference):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            y = fn(out, x, runs, weights)
        results.append((y, torch.autograd.grad(y.sum(), (out, x, *weights))))
    (y, grads), (y_ref, grads_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        assert grad.dtype == grad_ref.dtype
        torch.testing.assert_close(grad, grad_ref, rtol=1e-2, atol=1e-2)  # bf16 matmuls, summed in another order
