"""LoRA on a mixture of experts (``tiny-qwen3-moe``): what adapting the experts costs, and what
mixing tenants' calls into one pass gives on an MoE model.

* ``experts vs attention``: one LoRA r=16 training step (``forward_backward`` then
  ``clip_grad_and_step``, AdamW) of the same batch with an adapter on every linear layer and
  every expert stack ('all-linear') against one on the attention projections only; rounds
  alternate, tokens/s of the medians.
* ``4 tenants mixed vs combined``: 4 'all-linear' adapters, each with its own rows, through one
  mixed pass (``forward_backward_mixed``) and their steps together (``clip_grad_and_step_many``),
  against one adapter training the same rows as one batch; tokens/s of the medians.

* ``ep_size=2 vs one process``: the 'all-linear' step on the global batch in this process
  (``torch`` threads as set) against 2 torchrun processes (gloo, the threads split between
  them), each with half the batch: with ``ep_size=2`` (each holds half of every layer's experts
  and sends tokens to the other's by all_to_all) and with plain data parallel (each holds every
  expert). The one-process block runs before and after the torchrun block (its rounds pooled);
  a distributed step's time is its slower rank's. tokens/s of the medians, the losses of the
  three compared (1e-5), and the expert weights each process holds.

Usage::

    .venv/bin/python benchmarks/moe_lora.py    # writes benchmarks/results/moe_lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import machine
import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, assets
from twinkle.infra import distributed
from twinkle.model import AdapterCall, StepCall, TransformersModel
from twinkle.model.lora.experts import MultiLoraExperts


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


def train_rounds(model: TransformersModel, batch: list[dict], rounds: int) -> tuple[list[float], list[float]]:
    """One untimed step, then ``rounds`` timed ones: (seconds, losses)."""
    model.forward_backward(inputs=batch, adapter_name='a')
    model.clip_grad_and_step(adapter_name='a')
    seconds, losses = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        losses.append(model.forward_backward(inputs=batch, adapter_name='a').loss)
        model.clip_grad_and_step(adapter_name='a')
        seconds.append(time.perf_counter() - started)
    return seconds, losses


def ep_model(name: str, rank: int, mesh: DeviceMesh | None) -> TransformersModel:
    # No router loss: with it each data rank adds its own rows' (as data parallel has it), and the
    # losses of one process and of two ranks would differ by design.
    model = TransformersModel(assets.tiny_model(name), device='cpu', device_mesh=mesh, router_aux_loss_coef=0.0)
    torch.manual_seed(0)
    model.add_adapter_to_model('a', LoraConfig(r=rank, lora_alpha=2 * rank, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=1e-4, adapter_name='a')
    return model


def expert_bytes(model: TransformersModel) -> int:
    """Bytes of the base expert stacks this process holds."""
    return sum(
        m.stack(stack).numel() * m.stack(stack).element_size()
        for m in model.model.modules()
        if isinstance(m, MultiLoraExperts)
        for stack in ('gate_up_proj', 'down_proj')
    )


def ep_worker(workdir: Path) -> None:
    """One torchrun rank: the ep_size=2 scenario, then plain data parallel; rank 0 writes both."""
    settings = json.loads((workdir / 'settings.json').read_text())
    torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))
    world = int(os.environ['WORLD_SIZE'])
    twinkle.initialize(mode='local', seed=0, global_device_mesh=DeviceMesh.from_sizes(dp_size=world, device_type='cpu'))
    batch = rows(99, settings['rows'], settings['length'])
    share = len(batch) // world
    mine = batch[distributed.rank() * share : (distributed.rank() + 1) * share]
    out = {}
    for label, sizes in (('ep', {'dp_size': world, 'ep_size': world}), ('dp', {'dp_size': world})):
        model = ep_model(settings['model'], settings['rank'], DeviceMesh.from_sizes(**sizes, device_type='cpu'))
        seconds, losses = train_rounds(model, mine, settings['rounds'])
        every = distributed.all_gather_object(seconds)
        out[label] = {'seconds': [max(s) for s in zip(*every, strict=True)], 'losses': losses}
        out[label]['expert_bytes'] = expert_bytes(model)
    if distributed.is_main():
        (workdir / 'ranks.json').write_text(json.dumps(out))


def ep_against_one_process(name: str, batch: list[dict], rank: int, rounds: int, ranks: int) -> dict:
    one = ep_model(name, rank, None)
    threads = torch.get_num_threads()
    first, losses = train_rounds(one, batch, rounds)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        settings = {
            'model': name,
            'rank': rank,
            'rounds': rounds,
            'rows': len(batch),
            'length': len(batch[0]['input_ids']),
        }
        (workdir / 'settings.json').write_text(json.dumps(settings))
        command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={ranks}']
        env = {**os.environ, 'OMP_NUM_THREADS': str(max(1, threads // ranks))}
        done = subprocess.run([*command, __file__, '--worker', str(workdir)], env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f'torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}')
        distributed_runs = json.loads((workdir / 'ranks.json').read_text())
    second, _ = train_rounds(ep_model(name, rank, None), batch, rounds)
    tokens = sum(len(r['input_ids']) for r in batch)
    timed = {
        'one process': first + second,
        f'{ranks} ranks, ep_size={ranks}': distributed_runs['ep']['seconds'],
        f'{ranks} ranks, data parallel': distributed_runs['dp']['seconds'],
    }
    figures = {
        label: {'median_s': statistics.median(s), 'tokens_per_s': tokens / statistics.median(s), 'rounds_s': s}
        for label, s in timed.items()
    }
    agree = all(
        abs(a - b) <= 1e-5 * max(1.0, abs(b))
        for run in ('ep', 'dp')
        for a, b in zip(distributed_runs[run]['losses'], losses, strict=True)
    )
    ep_label, dp_label = f'{ranks} ranks, ep_size={ranks}', f'{ranks} ranks, data parallel'
    return {
        'systems': figures,
        'losses_agree_1e-5': agree,
        'expert_bytes_per_process': {
            'one process': expert_bytes(one),
            ep_label: distributed_runs['ep']['expert_bytes'],
            dp_label: distributed_runs['dp']['expert_bytes'],
        },
        'one_process_threads': threads,
        'rank_threads': max(1, threads // ranks),
        'ep_over_one_process': figures[ep_label]['tokens_per_s'] / figures['one process']['tokens_per_s'],
        'ep_over_data_parallel': figures[ep_label]['tokens_per_s'] / figures[dp_label]['tokens_per_s'],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='tiny-qwen3-moe')
    parser.add_argument('--rank', type=int, default=16)
    parser.add_argument('--rows', type=int, default=8, help='rows per tenant (the step batch: 4x this)')
    parser.add_argument('--length', type=int, default=128)
    parser.add_argument('--tenants', type=int, default=4)
    parser.add_argument('--rounds', type=int, default=10)
    parser.add_argument('--ranks', type=int, default=2, help='torchrun processes of the ep_size comparison')
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'moe_lora.json')
    parser.add_argument('--worker', type=Path, help='internal: run as one torchrun rank')
    args = parser.parse_args()
    if args.worker is not None:
        ep_worker(args.worker)
        return
    batch = rows(99, args.rows * args.tenants, args.length)
    result = {
        'settings': vars(args) | {'output': str(args.output)},
        'experts_vs_attention': experts_against_attention(args.model, batch, args.rank, args.rounds),
        'mixed_vs_combined': mixed_against_combined(
            args.model, args.tenants, args.rows, args.length, args.rank, args.rounds
        ),
        'ep_vs_one_process': ep_against_one_process(args.model, batch, args.rank, args.rounds, args.ranks),
        'environment': machine.describe(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + '\n')
    print(f'{args.model}, LoRA r={args.rank}, {len(batch)} rows x {args.length} tokens, median of {args.rounds} rounds')
    for case, ratio_key in (
        ('experts_vs_attention', 'experts_over_attention'),
        ('mixed_vs_combined', 'mixed_over_combined'),
        ('ep_vs_one_process', 'ep_over_one_process'),
    ):
        for label, system in result[case]['systems'].items():
            print(f'  {label:28s} {system["tokens_per_s"]:9.0f} tokens/s  (median {system["median_s"] * 1000:.1f} ms)')
        print(f'  {ratio_key}: x{result[case][ratio_key]:.2f}')
    ep = result['ep_vs_one_process']
    print(
        f'  ep_over_data_parallel: x{ep["ep_over_data_parallel"]:.2f}; losses agree (1e-5): {ep["losses_agree_1e-5"]}'
    )
    print(f'  expert weights per process (bytes): {ep["expert_bytes_per_process"]}')
    trainable = result['experts_vs_attention']['trainable_parameters']
    print(f'  trainable parameters: {trainable}')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
