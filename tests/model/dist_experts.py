"""The expert-parallel loop ``test_expert_parallel.py`` runs in one process and under torchrun (2 ranks, gloo).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 tests/model/dist_experts.py OUT_DIR

On ``tiny-qwen3-moe`` (8 experts, top 2) two adapters train, 'a' on every linear layer and every
expert stack, 'b' on the experts' ``down_proj`` alone, alternating, then both in one mixed pass.
Each scenario writes per-step global losses and gradient norms, each adapter's first normalised
gradient (``grads-<scenario>.pt``) and its final saved adapter. In one process there is no mesh;
under torchrun each scenario's mesh splits the experts over the two ranks (``ep_size=2``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from torch.distributed.tensor import DTensor

import twinkle
from twinkle import DeviceMesh, assets
from twinkle.errors import ConfigurationError, StateError
from twinkle.infra import distributed
from twinkle.model import AdapterCall, TransformersModel
from twinkle.model.lora.experts import MultiLoraExperts

# Scenario -> (the mesh under torchrun, the router's loss coefficient). 'dp-aux' has no ep: the
# router's loss is each rank's own (as data parallel has it), so 'ep-aux' is compared with it.
SCENARIOS: dict[str, tuple[dict[str, int], float]] = {
    'ep': ({'dp_size': 2, 'ep_size': 2}, 0.0),
    'ep-fsdp': ({'fsdp_size': 2, 'ep_size': 2}, 0.0),
    'ep-aux': ({'dp_size': 2, 'ep_size': 2}, 0.01),
    'dp-aux': ({'dp_size': 2}, 0.01),
}
ADAPTERS = {
    'a': LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False),
    'b': LoraConfig(r=2, lora_alpha=4, target_parameters=['mlp.experts.down_proj'], init_lora_weights=False),
}
GLOBAL_BATCH = 4
STEPS = 3


def batch(step: int, adapter: str, rank: int, ranks: int) -> list[dict]:
    """This rank's slice of the global batch of ``step`` (rows of different lengths)."""
    generator = torch.Generator().manual_seed(1000 * step + ord(adapter))
    rows = []
    for index in range(GLOBAL_BATCH):
        ids = torch.randint(0, 4000, (6 + 5 * index + step,), generator=generator).tolist()
        rows.append({'input_ids': ids, 'labels': [-100, *ids[1:]]})
    share = GLOBAL_BATCH // ranks
    return rows[rank * share : (rank + 1) * share]


def build(mesh: DeviceMesh | None, aux: float) -> TransformersModel:
    model = TransformersModel(
        model_id=assets.tiny_model('tiny-qwen3-moe'), device='cpu', device_mesh=mesh, router_aux_loss_coef=aux
    )
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model.add_adapter_to_model(name, config)
        model.set_optimizer('AdamW', lr=1e-3, adapter_name=name)
    return model


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def train(scenario: str, out_dir: Path, mesh: DeviceMesh | None) -> dict[str, Any]:
    rank, ranks = (distributed.rank(), mesh.world_size) if mesh is not None else (0, 1)
    model = build(mesh, SCENARIOS[scenario][1])
    losses: list[float] = []
    norms: list[float | None] = []
    first_grads: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        for name in ADAPTERS:
            losses.append(model.forward_backward(inputs=batch(step, name, rank, ranks), adapter_name=name).loss)
            norms.append(model.clip_grad_norm(1e9, adapter_name=name))  # reduced and normalised, not clipped
            if step == 0:
                params = model.groups[name].params
                first_grads.update({f'{name}.{i}': whole(p.grad) for i, p in enumerate(params)})
            model.step(adapter_name=name)
            model.zero_grad(adapter_name=name)
    calls = [AdapterCall(name, batch(STEPS, name, rank, ranks)) for name in ADAPTERS]
    losses += [output.loss for output in model.forward_backward_mixed(calls)]
    experts = [m for m in model.model.modules() if isinstance(m, MultiLoraExperts)]
    checkpoints = {
        name: model.save(f'{scenario}-{name}', output_dir=str(out_dir), adapter_name=name) for name in ADAPTERS
    }
    if distributed.is_main() or mesh is None:
        torch.save(first_grads, out_dir / f'grads-{scenario}.pt')
    return {
        'losses': losses,
        'grad_norms': norms,
        'held_experts': sorted({m.stack('down_proj').shape[0] for m in experts}),
        'checkpoints': checkpoints,
    }


def refusals(mesh: DeviceMesh) -> dict[str, str]:
    """What expert parallel refuses, each as its error message: training every weight (each rank
    holds a share of the experts), merging an adapter into the experts, a dense model."""
    said = {}
    model = TransformersModel(model_id=assets.tiny_model('tiny-qwen3-moe'), device='cpu', device_mesh=mesh)
    try:
        model.forward_backward(inputs=batch(0, 'a', distributed.rank(), mesh.world_size))
    except ConfigurationError as error:
        said['full'] = str(error)
    model.add_adapter_to_model('a', ADAPTERS['a'])
    experts = next(m for m in model.model.modules() if isinstance(m, MultiLoraExperts))
    try:
        experts.merged_stacks('a')
    except StateError as error:
        said['merged'] = str(error)
    try:
        TransformersModel(model_id=assets.tiny_model(), device='cpu', device_mesh=mesh)
    except ConfigurationError as error:
        said['dense'] = str(error)
    return said


def main(out_dir: Path) -> None:
    world = int(os.environ.get('WORLD_SIZE', '1'))
    mesh = DeviceMesh.from_sizes(dp_size=world, device_type='cpu') if world > 1 else None
    twinkle.initialize(mode='local', seed=0, global_device_mesh=mesh)
    results = {}
    for scenario, (sizes, _) in SCENARIOS.items():
        layout = DeviceMesh.from_sizes(**sizes, device_type='cpu') if world > 1 else None
        results[scenario] = train(scenario, out_dir, layout)
    if world > 1:
        results['refusals'] = refusals(DeviceMesh.from_sizes(dp_size=world, ep_size=world, device_type='cpu'))
    if distributed.is_main() or world == 1:
        (out_dir / 'results.json').write_text(json.dumps(results, indent=2))


if __name__ == '__main__':
    main(Path(sys.argv[1]))
