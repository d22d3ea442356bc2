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

``--curves``: reward against samples seen for each staleness bound ``k`` and seed, in one process
per run (``--mode local``, one torch thread each, ``--jobs`` runs at a time) with ``--fill-pipeline``:
the loop waits until the sampler is ``k`` batches ahead, so every batch from step ``k + 1`` on is
exactly ``k`` steps old (the bound's worst case, and the same at every run of a seed; ``k = 0``
is the synchronous loop). ``--runs`` names the recipe's variants (``VARIANTS``) and the bounds each
runs at: ``default`` (the decoupled loss, prompts that all scored alike left out), ``before`` (the
recipe as it was: GRPO's clip against the sampler, every prompt trained), and one change at a time
(``coupled``, ``keep_flat``). Each variant is compared with the ``k = 0`` runs that train the same
prompts (the cap changes nothing on-policy). Written to ``benchmarks/results/async_rl_staleness.json``:
each run's per-step reward, staleness, clip fraction, importance weights and skipped steps, and per
variant and ``k`` the mean, min and max over the seeds of the 10-step mean reward at ``--at``
samples, and whether the mean stays within the synchronous runs' min-max at each of them.

``--modes``: the recipe (``--max-staleness 1``, its defaults otherwise, ``--steps`` steps) in one
process (``local``) and against a server started in the run's process with a sampler group of its
own (``server``: ``--mode server --sampler-group``), and ``server_unsplit``, that server with each
of its two processes on every core as before ``sampler_group.cpu_split`` (patched off), each run a
fresh process, the modes' order turning with the seed. Each run times the client's calls (sample,
forward_backward, the step, the weight sync) beside its samples/s. Written to
``benchmarks/results/async_rl_modes.json``: samples/s per mode and seed, server / local per seed,
and the calls' counts and mean seconds.

Usage::

    .venv/bin/python benchmarks/async_rl.py                       # 3 seeds x 2 loops, ~5 min on 2 idle cores
    .venv/bin/python benchmarks/async_rl.py --curves              # 8 (variant, k) x 3 seeds, 24 runs
    .venv/bin/python benchmarks/async_rl.py --modes --seeds 2 --steps 10   # local, server, server_unsplit
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
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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
        command += ['--no-skip-flat-groups']  # every step trains, as when these figures were first taken
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


# ---- --curves: reward against samples seen, per staleness bound ------------------------------------
#: The recipe's variants: (--correction-cap, --skip-flat-groups).
VARIANTS: dict[str, tuple[float, bool]] = {
    'default': (2.0, True),  # the decoupled loss; prompts whose samples all scored alike left out
    'before': (0.0, False),  # as the recipe was: GRPO's clip against the sampler, every prompt trained
    'coupled': (0.0, True),  # GRPO's clip against the sampler alone
    'keep_flat': (2.0, False),  # every prompt trained alone
}
KEEP = ('total_reward', 'staleness_mean', 'clip_frac', 'is_weight_min', 'is_weight_max', 'entropy', 'skipped')


def curve_run(variant: str, k: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One recipe run in one process, every batch exactly ``k`` steps old (``--fill-pipeline``); with
    ``--keep DIR`` its result is kept there, and a run already there is not run again."""
    kept = Path(args.keep) / f'{variant}_k{k}_seed{seed}_steps{args.steps}.json' if args.keep else None
    if kept is not None and kept.exists():
        return dict(json.loads(kept.read_text()))
    cap, skip_flat = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / 'run.json'
        command = [
            sys.executable, str(RECIPE), '--mode', 'local', '--threads', '1', '--seed', str(seed),
            '--steps', str(args.steps), '--max-staleness', str(k), '--fill-pipeline',
            '--correction-cap', str(cap), '--skip-flat-groups' if skip_flat else '--no-skip-flat-groups',
            '--output', str(output),
        ]  # fmt: skip
        env = {**os.environ, 'OMP_NUM_THREADS': '1'}
        subprocess.run(command, check=True, env=env, cwd=ROOT / 'cookbook', capture_output=not args.verbose)
        result = json.loads(output.read_text())
    history = [{key: record[key] for key in KEEP if key in record} for record in result['history']]
    print(f'{variant} k={k} seed={seed}: 10-step mean reward at the end {smoothed(history)[-1]:.3f}', flush=True)
    run = {'variant': variant, 'k': k, 'seed': seed, 'seconds': result['seconds'], 'history': history}
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(run))
    return run


def curve_table(runs: list[dict[str, Any]], at: list[int], samples_per_step: int) -> list[dict[str, Any]]:
    """Per variant and k: mean, min and max over seeds of the 10-step mean reward at each sample
    count in ``at``; whether the mean stays within the min-max of the k = 0 runs that train the same
    prompts (skip_flat alike) at every one of them, and where it falls below their min; the clip
    fraction and the skipped steps."""

    def reward_at(run: dict[str, Any], samples: int) -> float:
        return smoothed(run['history'])[samples // samples_per_step - 1]

    rows = []
    for variant, k in sorted(
        {(r['variant'], r['k']) for r in runs}, key=lambda key: (list(VARIANTS).index(key[0]), key[1])
    ):
        group = [r for r in runs if (r['variant'], r['k']) == (variant, k)]
        sync = [r for r in runs if r['k'] == 0 and VARIANTS[r['variant']][1] == VARIANTS[variant][1]]
        rewards = {n: [reward_at(r, n) for r in group] for n in at}
        means = {n: statistics.fmean(values) for n, values in rewards.items()}
        low = {n: min((reward_at(r, n) for r in sync), default=0.0) for n in at}
        high = {n: max((reward_at(r, n) for r in sync), default=1.0) for n in at}
        records = [record for r in group for record in r['history']]
        rows.append({
            'variant': variant, 'cap': VARIANTS[variant][0], 'skip_flat_groups': VARIANTS[variant][1], 'k': k,
            'seeds': [r['seed'] for r in group], 'reward_mean': means,
            'reward_min': {n: min(v) for n, v in rewards.items()},
            'reward_max': {n: max(v) for n, v in rewards.items()},
            'within_sync_spread': all(low[n] <= means[n] <= high[n] for n in at) if sync else None,
            # Where the mean falls below every synchronous run: the curve learns slower than the noise allows.
            'below_sync_min_at': [n for n in at if means[n] < low[n]] if sync else None,
            'clip_frac_mean': statistics.fmean(record.get('clip_frac', 0.0) for record in records),
            'skipped_steps_mean': sum(record.get('skipped', 0.0) for record in records) / len(group),
        })  # fmt: skip
    return rows


def parse_runs(specs: list[str]) -> list[tuple[str, int]]:
    """``['default=0,1,2', 'before=2']`` as (variant, k) pairs."""
    pairs = []
    for spec in specs:
        variant, _, bounds = spec.partition('=')
        if variant not in VARIANTS:
            raise SystemExit(f'unknown variant {variant!r}; the variants are {sorted(VARIANTS)}')
        pairs += [(variant, int(k)) for k in bounds.split(',')]
    return pairs


def curves_main(args: argparse.Namespace) -> None:
    plan = [(variant, k, seed) for variant, k in parse_runs(args.runs) for seed in range(args.seeds)]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: curve_run(*job, args), plan))
    samples_per_step = 6 * 8  # the recipe's prompts_per_step x num_generations
    rows = curve_table(runs, args.at, samples_per_step)
    print(f'10-step mean reward, mean [min-max] over {args.seeds} seeds, at samples {args.at}:')
    for row in rows:
        cells = '  '.join(
            f'{row["reward_mean"][n]:.2f} [{row["reward_min"][n]:.2f}-{row["reward_max"][n]:.2f}]' for n in args.at
        )
        print(
            f'{row["variant"]:9s} k={row["k"]}: {cells}  clip {row["clip_frac_mean"]:.3f}  '
            f'within sync spread: {row["within_sync_spread"]}, below its min at {row["below_sync_min_at"]}'
        )
    summary = {
        'machine': platform.machine(), 'cpus': os.cpu_count(), 'load_average_end': os.getloadavg(),
        'config': vars(args), 'variants': VARIANTS, 'samples_per_step': samples_per_step, 'table': rows,
    }  # fmt: skip
    # Each run's per-step figures as columns (a list per figure, None where a step has none), one line a run.
    columns = [{**run, 'history': _columns(run['history'])} for run in runs]
    text = json.dumps(summary, indent=1)[:-2] + ',\n "runs": [\n  ' + ',\n  '.join(map(json.dumps, columns)) + '\n ]\n}'
    Path(args.output or ROOT / 'benchmarks' / 'results' / 'async_rl_staleness.json').write_text(text)


def _columns(history: list[dict[str, float]]) -> dict[str, list[float | None]]:
    return {key: [None if key not in r else round(r[key], 4) for r in history] for key in KEEP}


# ---- --modes: one process against a server with a sampler group -------------------------------------
MODES: dict[str, list[str]] = {
    'local': ['--mode', 'local'],
    'server': ['--mode', 'server', '--sampler-group'],
    'server_unsplit': ['--mode', 'server', '--sampler-group'],  # the child patches cpu_split off
}
#: The client calls a --modes run times (the runtime's model and sampler methods).
TIMED = ('forward_backward', 'clip_grad_and_step', 'calculate_metric', 'log_step_figures')


def modes_main(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for seed in range(args.seeds):
        order = list(MODES)[seed % len(MODES) :] + list(MODES)[: seed % len(MODES)]
        for mode in order:
            with tempfile.TemporaryDirectory() as tmp:
                output = Path(tmp) / 'run.json'
                command = [sys.executable, __file__, '--child', mode, '--seed', str(seed), '--steps', str(args.steps)]
                subprocess.run([*command, '--output', str(output)], check=True, capture_output=not args.verbose)
                result = json.loads(output.read_text())
            runs[mode].append(result)
            print(f'seed {seed} {mode:14s}: {result["samples_per_s"]:.1f} samples/s', flush=True)
    ratios = {
        mode: [r['samples_per_s'] / local['samples_per_s'] for r, local in zip(runs[mode], runs['local'], strict=True)]
        for mode in MODES
        if mode != 'local'
    }
    summary = {
        'machine': platform.machine(), 'cpus': os.cpu_count(), 'load_average_end': os.getloadavg(),
        'config': vars(args),
        'samples_per_s': {mode: [r['samples_per_s'] for r in results] for mode, results in runs.items()},
        'ratio_to_local': ratios,
        'calls': {mode: [r['calls'] for r in results] for mode, results in runs.items()},
    }  # fmt: skip
    for mode, values in ratios.items():
        print(f'{mode} / local samples/s: {statistics.fmean(values):.2f} ({", ".join(f"{v:.2f}" for v in values)})')
    Path(args.output or ROOT / 'benchmarks' / 'results' / 'async_rl_modes.json').write_text(
        json.dumps(summary, indent=1)
    )


def child_main(args: argparse.Namespace) -> None:
    """One --modes run in this process: the recipe, its client calls timed."""
    sys.path.insert(0, str(RECIPE.parent))
    import grpo_async

    if args.child == 'server_unsplit':
        from twinkle.server.execution.groups import sampler_group

        sampler_group.cpu_split = lambda *_: None  # type: ignore[assignment]  # every process on every core
    calls: dict[str, list[float]] = {}
    started = grpo_async.start

    @contextmanager
    def timed_start(config: Any) -> Iterator[Any]:
        with started(config) as parts:
            for name in TIMED:
                setattr(parts.model, name, _timed(getattr(parts.model, name), calls.setdefault(name, [])))
            parts.sampler.sample = _timed(parts.sampler.sample, calls.setdefault('sample', []))
            stage = parts.stage_weights
            applied = calls.setdefault('weight_sync', [])

            def timed_stage() -> tuple[int, Any]:
                version, apply = stage()
                return version, None if apply is None else _timed(apply, applied)

            parts.stage_weights = timed_stage
            yield parts

    grpo_async.start = timed_start
    # Every prompt trained, so that each step does the same work in every mode.
    flags = [*MODES[args.child], '--seed', str(args.seed), '--steps', str(args.steps), '--no-skip-flat-groups']
    result = grpo_async.train(grpo_async.parse_args(flags))
    result['calls'] = {
        name: {'count': len(t), 'mean_s': statistics.fmean(t) if t else 0.0} for name, t in calls.items()
    }
    Path(args.output).write_text(json.dumps(result))


def _timed(fn: Any, seconds: list[float]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    return timed


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
    parser.add_argument('--curves', action='store_true', help='reward against samples seen per staleness bound')
    parser.add_argument(
        '--runs', nargs='+', default=['default=0,1,2,4', 'before=0,2', 'coupled=2', 'keep_flat=2'],
        help='with --curves: VARIANT=k,k,... (variants: ' + ', '.join(VARIANTS) + ')',
    )  # fmt: skip
    parser.add_argument('--at', type=int, nargs='+', default=[480, 960, 1440, 1920, 2400, 2880])
    parser.add_argument('--jobs', type=int, default=2)
    parser.add_argument('--keep', default='', help='with --curves: a folder that keeps each run (a rerun skips them)')
    parser.add_argument('--output', default='')
    parser.add_argument('--modes', action='store_true', help='one process against a server with a sampler group')
    parser.add_argument('--child', choices=list(MODES), help=argparse.SUPPRESS)  # one --modes run, of --seed
    parser.add_argument('--seed', type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    if args.curves or args.modes:
        (curves_main if args.curves else modes_main)(args)
        return
    args.output = args.output or str(ROOT / 'benchmarks' / 'results' / 'async_rl.json')
    speed_main(args)


def speed_main(args: argparse.Namespace) -> None:
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
    # --sync's wait_s is the weights' loading (stats' apply_s over the run) and the sampling.
    steps = sum(len(r['history']) for r in runs['sync'])
    waited, loaded = (sum(record['wait_s'] for r in runs['sync'] for record in r['history']),
                      sum(r['stats']['apply_s'] for r in runs['sync']))  # fmt: skip
    train_s = statistics.fmean(record['train_s'] for r in runs['sync'] for record in r['history'])
    parts = {'sync_s': loaded / steps, 'sample_s': (waited - loaded) / steps, 'train_s': train_s}
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
