"""A model group of 1 and 2 ranks (``twinkle.server.execution.hosts.multi_rank``): memory, step time, dispatch.

All in one run on small-qwen3, each group a ``MultiRankHost`` (worker processes joined over gloo,
the server's side in this process), against an in-process ``ModelHost`` as the baseline:

* **memory**: per rank, the bytes of base weights it holds (its FSDP2 shard of the decoder
  layers; the embeddings and norms FSDP2 keeps gathered between passes are counted whole) and
  its resident set (``VmRSS``), for 1 rank, 2 ranks data parallel and 2 ranks FSDP2;
* **step time**: a pass of ``--tenants`` tenants (one ``--seq-len``-token row each, rank-16
  adapters, AdamW) then their optimizer steps, median over ``--rounds``, 1 rank against 2; and
  against one tenant sending all those rows as one batch (one step), rounds alternating: the
  ratio of issue 7 on the group itself, without HTTP (the aim is 0.9, on one rank and on two);
* **dispatch**: the cost a group adds to a request, a no-op ``host.call`` through the group
  against the same call on the in-process host (target under 5 ms), and one 1-row
  ``forward_only`` both ways.

On the CPU the ranks share the machine's cores (each rank takes ``cores / ranks`` threads), so two
ranks do not have twice the compute of one: the figures show what the split costs, not a speedup.

Usage::

    .venv/bin/python benchmarks/model_group.py            # ~3 min on 2 CPU cores; results/model_group.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from twinkle.server.config import ServerConfig
from twinkle.server.execution.hosts.model_host import ModelHost
from twinkle.server.execution.hosts.multi_rank import MultiRankHost

MIB = 2**20
LAYOUTS = {'1 rank': (1, 1), '2 ranks, data parallel': (2, 1), '2 ranks, FSDP2': (2, 2)}


def rank_figures(host: MultiRankHost) -> list[dict[str, float]]:
    """Per rank: MiB of base weights held (its FSDP2 shard), of all of them, and the resident set."""
    return [
        {
            'base_weights_mib': rank['base_bytes_held'] / MIB,
            'whole_base_mib': rank['base_bytes'] / MIB,
            'rss_mib': rank['resident_mib'],
        }
        for rank in host.footprint()
    ]


def setup(host: Any, tenants: int) -> list[str]:
    names = [f't{i}' for i in range(tenants)]
    for name in names:
        host.add_adapter(name, {'r': 16, 'lora_alpha': 32, 'target_modules': 'all-linear'}, 1, seed=1)
        host.run(name, 'set_optimizer', {'optimizer_cls': 'AdamW', 'lr': 1e-4})
    return names


def step(host: Any, names: list[str], seq_len: int, rows_each: int = 1) -> float:
    """One mixed pass of every tenant's rows, then their optimizer steps; seconds."""
    rows = [{'input_ids': list(range(5, 5 + seq_len)), 'labels': list(range(5, 5 + seq_len))}] * rows_each
    started = time.perf_counter()
    host.run_mixed('forward_backward', [(name, {'inputs': rows}) for name in names])
    host.run_steps([(name, {'max_grad_norm': 1.0}) for name in names])
    return time.perf_counter() - started


def timed(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_layout(config: ServerConfig, args: argparse.Namespace) -> dict[str, Any]:
    host = MultiRankHost(config)
    try:
        names = setup(host, args.tenants + 1)
        tenants, solo = names[:-1], names[-1:]
        step(host, tenants, args.seq_len)  # warm-up: optimizer states, FSDP2's lazy set-up
        step(host, solo, args.seq_len, args.tenants)
        steps, combined = [], []
        for _ in range(args.rounds):  # alternating: the tenants' mixed pass, one tenant's combined batch
            steps.append(step(host, tenants, args.seq_len))
            combined.append(step(host, solo, args.seq_len, args.tenants))
        row = [{'input_ids': [11, 23, 5, 42], 'labels': [11, 23, 5, 42]}]
        return {
            'ranks': rank_figures(host),
            'step_s': statistics.median(steps),
            'steps_s': steps,
            'combined_step_s': statistics.median(combined),
            'mixed_vs_combined': statistics.median(combined) / statistics.median(steps),
            'noop_call_ms': 1000 * timed(host.ping, args.calls),
            'forward_only_ms': 1000 * timed(lambda: host.run(names[0], 'forward_only', {'inputs': row}), args.calls),
        }
    finally:
        host.shutdown()


def measure_local(config: ServerConfig, args: argparse.Namespace) -> dict[str, Any]:
    host = ModelHost(config)
    names = setup(host, 1)
    row = [{'input_ids': [11, 23, 5, 42], 'labels': [11, 23, 5, 42]}]
    host.run(names[0], 'forward_only', {'inputs': row})
    return {
        'noop_call_ms': 1000 * timed(host.ping, args.calls),
        'forward_only_ms': 1000 * timed(lambda: host.run(names[0], 'forward_only', {'inputs': row}), args.calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='small-qwen3')
    parser.add_argument('--tenants', type=int, default=8)
    parser.add_argument('--seq-len', type=int, default=128)
    parser.add_argument('--rounds', type=int, default=8)
    parser.add_argument('--calls', type=int, default=50)
    parser.add_argument('--output', default='benchmarks/results/model_group.json')
    args = parser.parse_args()
    base = ServerConfig(base_model=args.model, device='cpu')
    layouts = {
        name: measure_layout(base.model_copy(update={'ranks': ranks, 'fsdp_size': fsdp}), args)
        for name, (ranks, fsdp) in LAYOUTS.items()
    }
    local = measure_local(base, args)
    one = layouts['1 rank']
    result = {
        'settings': vars(args),
        'environment': {'torch': torch.__version__, 'cpus': os.cpu_count(), 'loadavg': os.getloadavg()},
        'layouts': layouts,
        'in_process': local,
        'step_time_vs_one_rank': {name: one['step_s'] / figures['step_s'] for name, figures in layouts.items()},
        'dispatch_ms': {name: figures['noop_call_ms'] - local['noop_call_ms'] for name, figures in layouts.items()},
    }
    print(f'{args.model}, {args.tenants} tenants x one {args.seq_len}-token row per pass, rank-16 adapters:')
    for name, figures in layouts.items():
        held = ', '.join(f'{r["base_weights_mib"]:.0f}' for r in figures['ranks'])
        rss = ', '.join(f'{r["rss_mib"]:.0f}' for r in figures['ranks'])
        print(
            f'  {name:24s} base weights per rank {held} MiB (of {figures["ranks"][0]["whole_base_mib"]:.0f}); '
            f'RSS {rss} MiB; pass + steps {1000 * figures["step_s"]:.0f} ms '
            f'(x{result["step_time_vs_one_rank"][name]:.2f} the speed of one rank); '
            f'no-op call {figures["noop_call_ms"]:.2f} ms; 1-row forward_only {figures["forward_only_ms"]:.1f} ms; '
            f'mixed against one tenant combined x{figures["mixed_vs_combined"]:.2f}'
        )
    print(
        f'  in process               no-op call {local["noop_call_ms"]:.3f} ms; '
        f'1-row forward_only {local["forward_only_ms"]:.1f} ms'
    )
    Path(args.output).write_text(json.dumps(result, indent=2) + '\n')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
