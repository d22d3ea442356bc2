"""The reward curve of the GRPO cookbook recipe (``cookbook/grpo_letter_words.py``) over
several seeds: mean reward, KL to the base model and policy entropy per block of steps, as a
markdown table docs/rl.md quotes, plus the per-step log as JSON.

Usage::

    .venv/bin/python benchmarks/grpo_reward_curve.py                 # seeds 0 1 2, ~1.5 min
    .venv/bin/python benchmarks/grpo_reward_curve.py --seeds 0 1 2 3 4 --steps 120
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'cookbook'))

from grpo_letter_words import Config, train


def blocks(values: list[float], size: int) -> list[float]:
    return [statistics.mean(values[i : i + size]) for i in range(0, len(values), size)]


def table(runs: dict[int, list[dict[str, float]]], size: int) -> str:
    seeds = list(runs)
    steps = len(next(iter(runs.values())))
    header = '| steps | ' + ' | '.join(f'reward (seed {s})' for s in seeds) + ' | mean KL | mean entropy |'
    lines = [header, '|' + ' --- |' * (len(seeds) + 3)]
    rewards = {s: blocks([r['total_reward'] for r in runs[s]], size) for s in seeds}
    kls = {s: blocks([r.get('kl', 0.0) for r in runs[s]], size) for s in seeds}
    entropies = {s: blocks([r['entropy'] for r in runs[s]], size) for s in seeds}
    for b in range(len(rewards[seeds[0]])):
        first, last = b * size + 1, min((b + 1) * size, steps)
        cells = ' | '.join(f'{rewards[s][b]:.3f}' for s in seeds)
        kl = statistics.mean(kls[s][b] for s in seeds)
        entropy = statistics.mean(entropies[s][b] for s in seeds)
        lines.append(f'| {first}-{last} | {cells} | {kl:.3f} | {entropy:.2f} |')
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    parser.add_argument('--steps', type=int, default=Config.steps)
    parser.add_argument('--block', type=int, default=10)
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'grpo_reward_curve.json')
    args = parser.parse_args()
    runs, seconds = {}, {}
    for seed in args.seeds:
        started = time.perf_counter()
        runs[seed] = train(Config(steps=args.steps, seed=seed))
        seconds[seed] = time.perf_counter() - started
    markdown = table(runs, args.block)
    print(markdown)
    for seed in args.seeds:
        print(f'seed {seed}: {seconds[seed]:.0f} s')
    args.output.parent.mkdir(parents=True, exist_ok=True)
    result = {'config': asdict(Config(steps=args.steps)), 'seconds': seconds, 'table': markdown, 'runs': runs}
    args.output.write_text(json.dumps(result, indent=1) + '\n')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
