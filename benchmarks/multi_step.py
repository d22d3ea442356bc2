"""Several adapters' optimizer steps: one by one against one multi-tensor update, and torch's
default Adam kernel against the fused one.

A shared server steps many small adapters. ``clip_grad_and_step`` per adapter with torch's
default AdamW kernel (``fused=False`` here, what ``torch.optim.AdamW(params)`` takes on the CPU)
is the baseline. Beside it: the same one by one with the fused kernel (twinkle's default,
``twinkle.model.optim.registry.fused_by_default``), and ``clip_grad_and_step_many``, which steps the
adapters together (``twinkle.model.optim.multi_step``) with each kernel, with the numbers of one by one
bit for bit. Each round gives every adapter a gradient (one ``forward_backward``, not timed), then
times the steps of each way in turn; the first round makes the optimizers' state and is not counted.

Usage::

    .venv/bin/python benchmarks/multi_step.py                 # 8 rank-16 adapters on small-qwen3
    .venv/bin/python benchmarks/multi_step.py --adapters 32 --output /tmp/multi_step_32.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from peft import LoraConfig

from twinkle import assets
from twinkle.model import StepCall, TransformersModel

ROW = {'input_ids': list(range(5, 37)), 'labels': list(range(5, 37))}


def build(model: TransformersModel, adapters: int, rank: int, fused: bool) -> list[str]:
    names = [f'{"fused" if fused else "default"}{i}' for i in range(adapters)]
    for name in names:
        model.add_adapter_to_model(name, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules='all-linear'))
        model.set_optimizer('AdamW', lr=1e-4, adapter_name=name, fused=fused)
    return names


def gradients(model: TransformersModel, names: list[str]) -> None:
    for name in names:
        model.forward_backward(inputs=[ROW], adapter_name=name)


def one_by_one(model: TransformersModel, names: list[str]) -> float:
    started = time.perf_counter()
    for name in names:
        model.clip_grad_and_step(1.0, adapter_name=name)
    return time.perf_counter() - started


def together(model: TransformersModel, names: list[str]) -> float:
    started = time.perf_counter()
    model.clip_grad_and_step_many([StepCall(name, 1.0) for name in names])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='small-qwen3')
    parser.add_argument('--adapters', type=int, default=8)
    parser.add_argument('--rank', type=int, default=16)
    parser.add_argument('--rounds', type=int, default=10)
    parser.add_argument('--output', default='benchmarks/results/multi_step.json')
    args = parser.parse_args()
    model = TransformersModel(assets.tiny_model(args.model), device='cpu')
    kernels = {fused: build(model, args.adapters, args.rank, fused) for fused in (False, True)}
    ways = {
        'one_by_one': (one_by_one, kernels[False]),
        'together': (together, kernels[False]),
        'one_by_one_fused': (one_by_one, kernels[True]),
        'together_fused': (together, kernels[True]),
    }
    for names in kernels.values():
        gradients(model, names)
        one_by_one(model, names)  # the optimizers' state: made by their first step
    times: dict[str, list[float]] = {way: [] for way in ways}
    for round_index in range(args.rounds):
        for way, (run, names) in list(ways.items())[:: 1 if round_index % 2 else -1]:
            gradients(model, names)
            times[way].append(run(model, names))
    medians = {way: statistics.median(values) for way, values in times.items()}
    params = sum(p.numel() for p in model.groups[kernels[True][0]].params)
    result = {
        'settings': vars(args),
        'environment': {'torch': torch.__version__, 'threads': torch.get_num_threads()},
        'parameters_per_adapter': params,
        'median_ms': {way: 1000 * value for way, value in medians.items()},
        'speedup_vs_one_by_one': {way: medians['one_by_one'] / value for way, value in medians.items()},
        'seconds': times,
    }
    print(f'{args.adapters} adapters of rank {args.rank} on {args.model} ({params} parameters each), clip + step:')
    for way, value in medians.items():
        print(f'  {way:17s} {1000 * value:6.1f} ms  x{result["speedup_vs_one_by_one"][way]:.2f}')
    print(f"  (median of {args.rounds} rounds; x against one by one with torch's default kernel)")
    Path(args.output).write_text(json.dumps(result, indent=2) + '\n')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
