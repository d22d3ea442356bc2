"""The chunked output layer (``twinkle.model.output.fused``) against the unfused one, on the CPU.

One forward and backward of the output projection and a cross-entropy loss over 800 tokens at
Qwen3's vocabulary (H = 1024, V = 151,936, float32), the way a LoRA step sees it: the projection's
weight is frozen, the gradient goes to the hidden states. Ways, in alternating order each round:

* ``unfused``: ``hidden @ weight.T`` whole (486 MB of float32 logits), ``log_softmax``, gather,
  autograd;
* ``fused_256`` / ``fused_1024``: ``fused_token_logprobs`` in chunks of 256 / 1,024 tokens;
* ``torch_lce_256``: torch's own ``F.linear_cross_entropy(reduction='none')`` chunked by 256 (label
  loss only, no entropy: the maintained option that does not cover what the RL losses need).

Figures: the median wall time of a forward+backward, and the growth of the resident set's
high-water mark during it (VmHWM, reset through ``/proc/self/clear_refs``), each also as a ratio
to ``unfused`` measured in the same process. glibc's mmap threshold is fixed at 1 MiB first, so
freed buffers go back to the system and the resident set follows the live tensors. ``--entropy``
adds the per-token entropy to the loss (the RL case; ``torch_lce_256`` is then left out).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/fused_output.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import describe

from twinkle.data_format import IGNORE_INDEX
from twinkle.model.output.fused import fused_token_logprobs

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def unfused(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, entropy: bool) -> torch.Tensor:
    logp_all = (hidden @ weight.T).float().log_softmax(dim=-1)
    trained = labels != IGNORE_INDEX
    logps = logp_all.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * trained
    loss = -logps.sum() / trained.sum()
    if entropy:
        loss = loss - 0.01 * (-(logp_all.exp() * logp_all).sum(dim=-1) * trained).sum() / trained.sum()
    return loss


def fused(chunk_size: int) -> Step:
    def step(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, entropy: bool) -> torch.Tensor:
        out = fused_token_logprobs(hidden, weight, labels, chunk_size=chunk_size, with_entropy=entropy)
        trained = (labels != IGNORE_INDEX).sum()
        loss = -out.logps.sum() / trained
        if out.entropy is not None:
            loss = loss - 0.01 * out.entropy.sum() / trained
        return loss

    return step


def torch_lce(chunk_size: int) -> Step:
    def step(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, entropy: bool) -> torch.Tensor:
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size, chunking_method=None)
        nll = F.linear_cross_entropy(hidden, weight, labels, reduction='none', options=options)
        return nll.sum() / (labels != IGNORE_INDEX).sum()

    return step


def _kib(field: str) -> int:
    line = next(x for x in Path('/proc/self/status').read_text().splitlines() if x.startswith(field + ':'))
    return int(line.split()[1])


def measure(
    step: Step, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, entropy: bool
) -> tuple[float, int, float]:
    """(seconds, peak resident growth in bytes, loss) of one forward+backward."""
    hidden.grad = None
    Path('/proc/self/clear_refs').write_text('5')
    before = _kib('VmRSS')
    started = time.perf_counter()
    loss = step(hidden, weight, labels, entropy)
    loss.backward()  # type: ignore[no-untyped-call]
    seconds = time.perf_counter() - started
    return seconds, (_kib('VmHWM') - before) * 1024, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokens', type=int, default=800)
    parser.add_argument('--hidden', type=int, default=1024)
    parser.add_argument('--vocab', type=int, default=151936)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--entropy', action='store_true')
    parser.add_argument('--output', default='benchmarks/results/fused_output.json')
    args = parser.parse_args()
    ctypes.CDLL('libc.so.6').mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, so freed buffers are returned
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_()
    weight = torch.randn(args.vocab, args.hidden, generator=g) / math.sqrt(args.hidden)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    labels[: args.tokens // 4] = IGNORE_INDEX  # a prompt
    ways: dict[str, Step] = {'unfused': unfused, 'fused_256': fused(256), 'fused_1024': fused(1024)}
    if not args.entropy:
        ways['torch_lce_256'] = torch_lce(256)
    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name in ways}
    for round_index in range(args.rounds):
        for name in list(ways)[:: 1 if round_index % 2 == 0 else -1]:
            runs[name].append(measure(ways[name], hidden, weight, labels, args.entropy))
    figures = {}
    for name, values in runs.items():
        seconds = statistics.median(v[0] for v in values)
        peak = max(v[1] for v in values)
        figures[name] = {'median_s': seconds, 'peak_growth_mib': peak / 2**20, 'loss': values[0][2]}
    base = figures['unfused']
    for row in figures.values():
        row['time_ratio'] = row['median_s'] / base['median_s']
        row['peak_ratio'] = row['peak_growth_mib'] / base['peak_growth_mib']
        row['loss_diff'] = abs(row['loss'] - base['loss'])
    result = {
        'benchmark': 'fused_output',
        'settings': vars(args),
        'environment': describe(),
        'unfused_logits_mib': args.tokens * args.vocab * 4 / 2**20,
        'figures': figures,
    }
    print(f'{args.tokens} tokens, H={args.hidden}, V={args.vocab}, float32, frozen weight, entropy={args.entropy}:')
    for name, row in figures.items():
        print(
            f'  {name:14s} {row["median_s"]:6.2f} s (x{row["time_ratio"]:.2f})  '
            f'peak +{row["peak_growth_mib"]:7.1f} MiB (x{row["peak_ratio"]:.3f})  '
            f'|loss - unfused| {row["loss_diff"]:.1e}'
        )
    Path(args.output).write_text(json.dumps(result, indent=2) + '\n')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
