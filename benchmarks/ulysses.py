"""Ulysses sequence parallel against one process on one long sequence: activation memory per
rank and step time.

Both sides train the same LoRA step (r=16, ``all-linear``, AdamW lr 1e-4) of ``--model`` on the
same batch: one row of ``--tokens`` token ids (seeded, every position trained). ``one`` is this
file as a worker in a process of its own; ``ulysses`` is the same worker under
``torch.distributed.run`` on 2 ranks (gloo) with a mesh ``dp_size=2, ulysses_size=2``: both ranks
hold the row and each runs half of its positions. Every process has ``--threads`` torch threads
(1: one core per rank, as one GPU per rank; the Ulysses side uses twice the cores). The two
sides run one after the other, never at once. Each side first trains one step on a short row
(64 tokens), so that one-time allocations (thread pools, the optimizer's state, gloo's buffers)
are not counted as activations.

Memory: activations are what a step holds between its forward and its backward. On the CPU
torch has no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin), so a
thread samples the process's resident set (``/proc/self/statm``) every millisecond during the
first long ``forward_backward`` and the figure is its peak minus the resident set just before:
the activations, the logits and the gradients that step allocates. Only the first long step is
measured: later steps re-use pages the allocator kept. ``activation_ratio`` is the larger rank's growth
over one process's (the aim is about 1/2). The gathered logits (``[tokens, vocab]`` on every
rank, so that any loss sees the whole sequence) are not split, so the ratio stays above 1/2.

Step time: the median of ``--steps`` timed steps after the measured one (``forward_backward``
then ``clip_grad_and_step``; the ranks' slower). Each rank runs half the positions of every
layer and the whole sequence of half the attention heads, plus two all-to-alls per attention
layer and the logits' all-gather; on a shared 2-core machine the figure moves with the load.

Usage::

    .venv/bin/python benchmarks/ulysses.py    # ~6 min on 2 idle cores; writes benchmarks/results/ulysses.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import machine
import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, assets
from twinkle.infra import distributed
from twinkle.model import TransformersModel

RANKS = 2
LOSS_TOLERANCE = 1e-5
PAGE = os.sysconf('SC_PAGE_SIZE')


class PeakRss:
    """The peak resident set of this process while the ``with`` block runs, sampled every ms."""

    def __init__(self) -> None:
        self.before = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakRss:
        self.before = self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.before


def _rss() -> int:
    with open('/proc/self/statm') as statm:
        return int(statm.read().split()[1]) * PAGE


def worker(out: Path, model: str, tokens: int, steps: int) -> None:
    """One side: the measured first step, then ``steps`` timed ones; each rank writes its figures."""
    world = int(os.environ.get('WORLD_SIZE', '1'))
    mesh = DeviceMesh.from_sizes(dp_size=world, ulysses_size=world, device_type='cpu') if world > 1 else None
    twinkle.initialize(mode='local', seed=0, global_device_mesh=mesh)
    trained = TransformersModel(model_id=assets.tiny_model(model), device='cpu', mixed_precision='no')
    trained.add_adapter_to_model('default', LoraConfig(r=16, lora_alpha=32, target_modules='all-linear'))
    trained.set_optimizer('AdamW', lr=1e-4)
    vocab = trained.model.config.vocab_size
    ids = torch.randint(0, vocab, (tokens + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    row = {'input_ids': ids[:-1], 'labels': ids[1:]}
    trained.forward_backward(inputs=[{'input_ids': ids[:64], 'labels': ids[1:65]}])
    trained.clip_grad_and_step()
    with PeakRss() as rss:
        losses = [trained.forward_backward(inputs=[row]).loss]
    trained.clip_grad_and_step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        losses.append(trained.forward_backward(inputs=[row]).loss)
        trained.clip_grad_and_step()
        times.append(time.perf_counter() - started)
    figures = {'rss_growth_bytes': rss.growth, 'step_s': times, 'losses': losses, 'threads': torch.get_num_threads()}
    (out / f'rank{distributed.rank()}.json').write_text(json.dumps(figures))


def run_side(script: Path, args: argparse.Namespace, ranks: int, folder: Path) -> list[dict[str, Any]]:
    command = [sys.executable, str(script), '--worker', str(folder), '--model', args.model]
    command += ['--tokens', str(args.tokens), '--steps', str(args.steps)]
    if ranks > 1:
        command[1:2] = ['-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={ranks}', str(script)]
    threads = str(args.threads)
    env = {**os.environ, 'OMP_NUM_THREADS': threads, 'HF_DATASETS_DISABLE_PROGRESS_BARS': '1'}
    subprocess.run(command, env=env, check=True, timeout=args.timeout_s, capture_output=True)
    return [json.loads((folder / f'rank{rank}.json').read_text()) for rank in range(ranks)]


def summarize(one: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    step_one = statistics.median(one['step_s'])
    step_ulysses = statistics.median(max(times) for times in zip(*(r['step_s'] for r in ranks), strict=True))
    growth = max(r['rss_growth_bytes'] for r in ranks)
    loss_diff = max(abs(a - b) for a, b in zip(one['losses'], ranks[0]['losses'], strict=True))
    if loss_diff > LOSS_TOLERANCE * max(1.0, abs(one['losses'][0])):
        raise AssertionError(f'Ulysses losses {ranks[0]["losses"]} differ from one process {one["losses"]}')
    return {
        'one': {'activation_mib': one['rss_growth_bytes'] / 2**20, 'step_s': step_one, 'threads': one['threads']},
        'ulysses': {
            'activation_mib_per_rank': [r['rss_growth_bytes'] / 2**20 for r in ranks],
            'step_s': step_ulysses,
            'threads_per_rank': ranks[0]['threads'],
        },
        'activation_ratio': growth / one['rss_growth_bytes'],
        'step_ratio': step_ulysses / step_one,
        'max_loss_abs_diff': loss_diff,
        'losses': one['losses'],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='small-qwen3')
    parser.add_argument('--tokens', type=int, default=4096)
    parser.add_argument('--steps', type=int, default=2)
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--timeout-s', type=float, default=900.0)
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'ulysses.json')
    parser.add_argument('--worker', type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.model, args.tokens, args.steps)
    assets.tiny_model(args.model)  # built once, before the sides start
    script = Path(__file__).resolve()
    with tempfile.TemporaryDirectory() as one_dir, tempfile.TemporaryDirectory() as two_dir:
        (one,) = run_side(script, args, 1, Path(one_dir))
        ranks = run_side(script, args, RANKS, Path(two_dir))
    settings = {k: v for k, v in vars(args).items() if k not in ('output', 'worker')}
    result = {'benchmark': 'ulysses', 'settings': settings, **summarize(one, ranks), 'environment': machine.describe()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + '\n')
    one_side, two_side = result['one'], result['ulysses']
    print(
        f'activation memory per rank: {result["activation_ratio"]:.2f} of one process '
        f'({max(two_side["activation_mib_per_rank"]):.0f} MiB vs {one_side["activation_mib"]:.0f} MiB); '
        f'step time: x{result["step_ratio"]:.2f} ({two_side["step_s"]:.1f} s vs {one_side["step_s"]:.1f} s)'
    )


if __name__ == '__main__':
    main()
