"""LoRA on a mixture of experts (``tiny-qwen3-moe``): what adapting the experts costs, and what
mixing tenants' calls into one pass gives on an MoE model.

* ``experts vs attention``: one LoRA r=16 training step (``forward_backward`` then
  ``clip_grad_and_step``, AdamW) of the same batch with an adapter on every linear layer and
  every expert stack ('all-linear') against one on the attention projections only; rounds
  alternate, tokens/s of the medians.
* ``4 tenants mixed vs combined``: 4 'all-linear' adapters, each with its own rows, through one
  mixed pass (``forward_backward_mixed``) and their steps together (``clip_grad_and_step_many``),
  against one adapter training the same rows as one batch; tokens/s of the medians.

Expert parallel (``ep_size=2``) is not built yet, so it is not measured here.

Usage::

    .venv/bin/python benchmarks/moe_lora.py    # writes benchmarks/results/moe_lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig

from twinkle import assets
from twinkle.model import AdapterCall, StepCall, TransformersModel


def rows(seed: int, count: int, length: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(5, 4000, (length,), generator=generator).tolist()
        out.append({'input_ids': ids, 'labels': ids})
    return out


def model_with(name: str, adapters: dict[str, LoraConfig]) -> TransformersModel:
    model = TransformersModel(assets.tiny_model(name), device='cpu')
    for adapter, config in adapters.items():
        model.add_adapter_to_model(adapter, config)
        model.set_optimizer('AdamW', lr=1e-4, adapter_name=adapter)
    return model


def alternate(calls: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Each call once untimed, then ``rounds`` timed rounds, the calls alternating."""
    for call in calls.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def experts_against_attention(name: str, batch: list[dict], rank: int, rounds: int) -> dict:
    lora = {'r': rank, 'lora_alpha': 2 * rank}
    models = {
        'experts + all linear': model_with(name, {'a': LoraConfig(**lora, target_modules='all-linear')}),
        'attention only': model_with(
            name, {'a': LoraConfig(**lora, target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'])}
        ),
    }

    def step(model: TransformersModel) -> Callable[[], None]:
        def call() -> None:
            model.forward_backward(inputs=batch, adapter_name='a')
            model.clip_grad_and_step(adapter_name='a')

        return call

    seconds = alternate({label: step(model) for label, model in models.items()}, rounds)
    tokens = sum(len(r['input_ids']) for r in batch)
    figures = {
        label: {'median_s': statistics.median(s), 'tokens_per_s': tokens / statistics.median(s), 'rounds_s': s}
        for label, s in seconds.items()
    }
    trainable = {label: sum(p.numel() for p in model.groups['a'].params) for label, model in models.items()}
    ratio = figures['experts + all linear']['tokens_per_s'] / figures['attention only']['tokens_per_s']
    return {'systems': figures, 'trainable_parameters': trainable, 'experts_over_attention': ratio}


def mixed_against_combined(name: str, tenants: int, rows_each: int, length: int, rank: int, rounds: int) -> dict:
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules='all-linear')
    names = [f't{i}' for i in range(tenants)]
    mixed = model_with(name, dict.fromkeys(names, config))
    combined = model_with(name, {'all': config})
    own = {tenant: rows(i, rows_each, length) for i, tenant in enumerate(names)}
    everything = [row for tenant in names for row in own[tenant]]

    def mixed_step() -> None:
        mixed.forward_backward_mixed([AdapterCall(tenant, own[tenant]) for tenant in names])
        mixed.clip_grad_and_step_many([StepCall(adapter_name=tenant) for tenant in names])

    def combined_step() -> None:
        combined.forward_backward(inputs=everything, adapter_name='all')
        combined.clip_grad_and_step(adapter_name='all')

    seconds = alternate({f'{tenants} tenants mixed': mixed_step, 'one tenant, combined batch': combined_step}, rounds)
    tokens = len(everything) * length
    figures = {
        label: {'median_s': statistics.median(s), 'tokens_per_s': tokens / statistics.median(s), 'rounds_s': s}
        for label, s in seconds.items()
    }
    ratio = figures[f'{tenants} tenants mixed']['tokens_per_s'] / figures['one tenant, combined batch']['tokens_per_s']
    return {'systems': figures, 'mixed_over_combined': ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='tiny-qwen3-moe')
    parser.add_argument('--rank', type=int, default=16)
    parser.add_argument('--rows', type=int, default=8, help='rows per tenant (the step batch: 4x this)')
    parser.add_argument('--length', type=int, default=128)
    parser.add_argument('--tenants', type=int, default=4)
    parser.add_argument('--rounds', type=int, default=10)
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'moe_lora.json')
    args = parser.parse_args()
    batch = rows(99, args.rows * args.tenants, args.length)
    result = {
        'settings': vars(args) | {'output': str(args.output)},
        'experts_vs_attention': experts_against_attention(args.model, batch, args.rank, args.rounds),
        'mixed_vs_combined': mixed_against_combined(
            args.model, args.tenants, args.rows, args.length, args.rank, args.rounds
        ),
        'environment': {
            'python': platform.python_version(),
            'torch': torch.__version__,
            'cpu_count': os.cpu_count(),
            'torch_threads': torch.get_num_threads(),
            'load_average': os.getloadavg(),
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + '\n')
    print(f'{args.model}, LoRA r={args.rank}, {len(batch)} rows x {args.length} tokens, median of {args.rounds} rounds')
    for case, ratio_key in (
        ('experts_vs_attention', 'experts_over_attention'),
        ('mixed_vs_combined', 'mixed_over_combined'),
    ):
        for label, system in result[case]['systems'].items():
            print(f'  {label:28s} {system["tokens_per_s"]:9.0f} tokens/s  (median {system["median_s"] * 1000:.1f} ms)')
        print(f'  {ratio_key}: x{result[case][ratio_key]:.2f}')
    trainable = result['experts_vs_attention']['trainable_parameters']
    print(f'  trainable parameters: {trainable}')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
