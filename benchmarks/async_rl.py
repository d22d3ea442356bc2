"""Async GRPO against synchronous GRPO on the same workload.

The workload is ``cookbook/grpo_async.py`` on the embedded tiny model: the letter-words task,
``--prompts`` prompts per step, 8 samples each, ``--max-tokens`` new tokens (16), one sampler
call per step, GRPO with the rollout correction (``--correction-cap``). Both
loops run in Ray mode: the sampler in one actor, the trainer in another, **one CPU thread each**,
so the two can overlap on two cores. ``sync`` is the synchronous loop (sync weights, sample,
train, repeat); ``async`` is ``AsyncRollouts`` with ``--max-staleness`` (the sampler draws step
``b + 1`` while the trainer trains step ``b``). Each run is a fresh process; the seeds alternate
the order of the two loops.

Printed and written (``benchmarks/results/async_rl.json``):

* ``async_vs_sync_samples_per_s_ratio``: mean over seeds of async samples/s / sync samples/s
  (the time of the loop only, after both components are built);
* wall time to a reward: the first step whose 10-step mean reward reaches ``--target``, per run;
* reward against samples seen: each loop's 10-step mean reward per step, averaged over the
  seeds, and the largest gap between the two curves next to the seed-to-seed spread of the
  synchronous curve (the noise they are compared with);
* the staleness each async run actually saw, against its bound;
* where a synchronous step's time goes (weight sync, sampling, training) and the ratio an
  overlap of sampling with the rest would give if those parts stayed as they are
  (``overlap_bound_ratio``, sum over max: an estimate, not a ceiling, since the parts include
  the driver's round trips to the actors, which the async loop overlaps too).

Usage::

    .venv/bin/python benchmarks/async_rl.py                       # 3 seeds x 2 loops, ~5 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / 'cookbook' / 'grpo_async.py'


def run(loop: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / 'run.json'
        command = [
            sys.executable, str(RECIPE), '--mode', 'ray', '--threads', '1', '--seed', str(seed),
            '--steps', str(args.steps), '--prompts-per-step', str(args.prompts),
            '--prompts-per-call', str(args.prompts), '--max-tokens', str(args.max_tokens),
            '--correction-cap', str(args.correction_cap), '--output', str(output),
        ]  # fmt: skip
        command += ['--sync'] if loop == 'sync' else ['--max-staleness', str(args.max_staleness)]
        env = {**os.environ, 'OMP_NUM_THREADS': '1'}
        subprocess.run(command, check=True, env=env, cwd=ROOT / 'cookbook', capture_output=not args.verbose)
        return json.loads(output.read_text())


def smoothed(history: list[dict[str, Any]], window: int = 10) -> list[float]:
    rewards = [record['total_reward'] for record in history]
    return [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]


def time_to(result: dict[str, Any], target: float) -> float | None:
    """Seconds of loop until the 10-step mean reward first reaches ``target`` (steps pro rata)."""
    curve = smoothed(result['history'])
    for step, value in enumerate(curve, start=1):
        if value >= target:
            return result['seconds'] * step / len(curve)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--seeds', type=int, default=3)
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--prompts', type=int, default=6)
    parser.add_argument('--max-tokens', type=int, default=16)
    parser.add_argument('--max-staleness', type=int, default=1)
    # Both loops train with the decoupled loss (rollout_correction, token-level truncation at this cap): on the
    # synchronous loop's on-policy samples it changes nothing; on stale ones it lets a step move as far as a fresh one.
    parser.add_argument('--correction-cap', type=float, default=2.0)
    parser.add_argument('--target', type=float, default=0.5)
    parser.add_argument('--verbose', action='store_true')
    parser.add_argument('--output', default=str(ROOT / 'benchmarks' / 'results' / 'async_rl.json'))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {'sync': [], 'async': []}
    for seed in range(args.seeds):
        for loop in ('sync', 'async') if seed % 2 == 0 else ('async', 'sync'):
            result = run(loop, seed, args)
            runs[loop].append(result)
            print(f'seed {seed} {loop:5s}: {result["samples_per_s"]:.1f} samples/s in {result["seconds"]:.1f} s')
    ratios = [a['samples_per_s'] / s['samples_per_s'] for a, s in zip(runs['async'], runs['sync'], strict=True)]
    curves = {loop: [smoothed(r['history']) for r in results] for loop, results in runs.items()}
    mean_curves = {loop: [statistics.fmean(values) for values in zip(*c, strict=True)] for loop, c in curves.items()}
    gap = max(abs(a - s) for a, s in zip(mean_curves['async'], mean_curves['sync'], strict=True))
    spread = max(statistics.pstdev(values) for values in zip(*curves['sync'], strict=True))
    staleness = [r['stats'] for r in runs['async']]
    # The synchronous step's parts: with sampling fully overlapped the best ratio is sum / max.
    parts = {
        part: statistics.fmean(record[part] for r in runs['sync'] for record in r['history'])
        for part in ('sync_s', 'sample_s', 'train_s')
    }
    overlap_bound = sum(parts.values()) / max(parts['sample_s'], parts['sync_s'] + parts['train_s'])
    summary = {
        'machine': platform.machine(),
        'cpus': os.cpu_count(),
        'config': vars(args),
        'async_vs_sync_samples_per_s_ratio': statistics.fmean(ratios),
        'ratio_per_seed': ratios,
        'samples_per_s': {loop: [r['samples_per_s'] for r in results] for loop, results in runs.items()},
        'seconds': {loop: [r['seconds'] for r in results] for loop, results in runs.items()},
        'seconds_to_target': {loop: [time_to(r, args.target) for r in results] for loop, results in runs.items()},
        'final_reward': {loop: [smoothed(r['history'])[-1] for r in results] for loop, results in runs.items()},
        'sync_step_parts_s': parts,
        'overlap_bound_ratio': overlap_bound,
        'reward_curve_gap_max': gap,
        'sync_seed_spread_max': spread,
        'mean_reward_curves': mean_curves,
        'async_staleness': staleness,
        'async_staleness_max_seen': max(s['staleness_max'] for s in staleness),
        'async_staleness_bound': args.max_staleness,
    }
    print(
        f'async / sync samples/s: {summary["async_vs_sync_samples_per_s_ratio"]:.2f} '
        f'({", ".join(f"{r:.2f}" for r in ratios)}); seconds to reward {args.target}: {summary["seconds_to_target"]}'
    )
    print(f'sync step: {parts}; the most overlap can give: {overlap_bound:.2f}x')
    print(f'reward curves: largest gap {gap:.3f}, sync seed-to-seed spread up to {spread:.3f}')
    print(f'staleness seen: max {summary["async_staleness_max_seen"]} (bound {args.max_staleness})')
    Path(args.output).write_text(json.dumps(summary, indent=1))


if __name__ == '__main__':
    main()
