"""The training loop ``test_distributed.py`` runs in one process and under torchrun (2 ranks, gloo).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 tests/infra/dist_train.py OUT_DIR

Only the ``initialize`` line differs between the two (a mesh under torchrun); every scenario
writes its per-step global losses, gradient norms and metrics, and saves its last checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, assets
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import StateError
from twinkle.infra import distributed
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

# Scenario -> (what is trained, how the ranks split the model: 'dp' is the runtime's mesh).
SCENARIOS: dict[str, tuple[str, str]] = {
    'dp-lora': ('lora', 'dp'),
    'dp-full': ('full', 'dp'),
    'fsdp-lora': ('lora', 'fsdp'),
    'fsdp-full': ('full', 'fsdp'),
}
GLOBAL_BATCH = 4
STEPS = 6


def rows() -> Dataset:
    dataset = Dataset(DatasetMeta(assets.dataset('self-cognition'), data_slice=range(GLOBAL_BATCH * STEPS)))
    dataset.set_template('Template', model_id=assets.tiny_model(), max_length=128)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()
    return dataset


def build(training: str, mesh: DeviceMesh | None) -> TransformersModel:
    """LoRA: adapters 'alice' (2 accumulation steps) and 'bob'; full: every weight."""
    model = TransformersModel(model_id=assets.tiny_model(), device_mesh=mesh)
    if training == 'full':
        model.set_optimizer('AdamW', lr=1e-3)
        return model
    for index, (name, accumulation) in enumerate((('alice', 2), ('bob', 1))):
        torch.manual_seed(index)
        config = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
        model.add_adapter_to_model(name, config, gradient_accumulation_steps=accumulation)
        model.set_optimizer('AdamW', lr=1e-2, adapter_name=name)
    return model


def train(scenario: str, out_dir: Path, mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """Six global batches of 4; LoRA alternates alice, alice, bob. Returns what rank 0 writes to JSON."""
    training, _ = SCENARIOS[scenario]
    data = rows()
    model = build(training, mesh)
    adapter = (lambda step: 'bob' if step % 3 == 2 else 'alice') if training == 'lora' else (lambda step: None)
    losses, norms = [], []
    for step, batch in enumerate(DataLoader(data, batch_size=GLOBAL_BATCH, device_mesh=mesh)):
        losses.append(model.forward_backward(inputs=batch, adapter_name=adapter(step)).loss)
        norms.append(model.clip_grad_and_step(adapter_name=adapter(step)))
    train_metrics = model.calculate_metric(is_training=True, adapter_name=adapter(0))
    for batch in DataLoader(data, batch_size=GLOBAL_BATCH, device_mesh=mesh):
        model.forward_only(inputs=batch, adapter_name=adapter(0))
        model.calculate_loss(adapter_name=adapter(0))
    eval_metrics = model.calculate_metric(is_training=False, adapter_name=adapter(0))
    checkpoint = model.save('final', output_dir=str(out_dir / scenario), adapter_name=adapter(0))
    train_metrics.pop('tokens_per_s')
    result = {
        'losses': losses,
        'grad_norms': norms,
        'train_metrics': train_metrics,
        'eval_metrics': eval_metrics,
        'checkpoint': checkpoint,
        # What a rank worker reads of the model (TransformersModel.device_mesh, uses_fsdp).
        'layout': {
            'world_size': model.device_mesh.world_size if model.device_mesh is not None else 1,
            'uses_fsdp': model.uses_fsdp,
        },
    }
    if training == 'lora':
        result.update(resume_losses(model, data, out_dir / scenario, mesh))
        result['late_adapter'] = add_late_adapter(model)
    return result


def add_late_adapter(model: TransformersModel) -> str:
    """'added', or why not: FSDP2 has sharded the model by now (data parallel broadcasts it)."""
    try:
        model.add_adapter_to_model('late', LoraConfig(r=2, target_modules='all-linear'))
    except StateError as error:
        return str(error)
    return 'added'


def resume_losses(model: TransformersModel, data: Dataset, out_dir: Path, mesh: DeviceMesh | None) -> dict:
    """Save alice with her optimizer, train two more batches; then the same two batches after
    ``load`` into this (sharded, under FSDP2) model, and after ``resume_from_checkpoint`` into a
    fresh one (before its first forward): all three must give the same losses."""
    saved = model.save('resume', output_dir=str(out_dir), adapter_name='alice', save_optimizer=True)

    def two_steps(trained: TransformersModel) -> list[float]:
        batches = DataLoader(data, batch_size=GLOBAL_BATCH, device_mesh=mesh)
        losses = []
        for _, batch in zip(range(2), batches, strict=False):
            losses.append(trained.forward_backward(inputs=batch, adapter_name='alice').loss)
            trained.clip_grad_and_step(adapter_name='alice')
        return losses

    continued = two_steps(model)
    model.load(saved, adapter_name='alice', load_optimizer=True)
    reloaded = two_steps(model)
    fresh = build('lora', mesh)
    fresh.resume_from_checkpoint(saved, adapter_name='alice')
    resumed = two_steps(fresh)
    return {'continued': continued, 'reloaded': reloaded, 'resumed': resumed, **pending(model, data, out_dir, mesh)}


def pending(model: TransformersModel, data: Dataset, out_dir: Path, mesh: DeviceMesh | None) -> dict:
    """Alice's window half full (the first of her 2 accumulation steps), saved with her optimizer:
    the gradients each rank holds are saved as one process holding every row would hold them, so
    after ``resume_from_checkpoint`` into a fresh model her next calls give the losses they give
    uninterrupted (under FSDP2 her adapter is sharded: its gradients are gathered, then cut again)."""
    loader = DataLoader(data, batch_size=GLOBAL_BATCH, device_mesh=mesh)
    batches = [batch for _, batch in zip(range(3), loader, strict=False)]
    model.forward_backward(inputs=batches[0], adapter_name='alice')
    assert model.clip_grad_and_step(adapter_name='alice') is None  # between boundaries: waits
    saved = model.save('pending', output_dir=str(out_dir), adapter_name='alice', save_optimizer=True)

    def rest(trained: TransformersModel) -> list[float]:
        losses = []
        for batch in batches[1:]:
            losses.append(trained.forward_backward(inputs=batch, adapter_name='alice').loss)
            trained.clip_grad_and_step(adapter_name='alice')
        return losses

    uninterrupted = rest(model)
    fresh = build('lora', mesh)
    fresh.resume_from_checkpoint(saved, adapter_name='alice')
    return {'pending_continued': uninterrupted, 'pending_resumed': rest(fresh)}


def main(out_dir: Path) -> None:
    world = int(os.environ.get('WORLD_SIZE', '1'))
    mesh = DeviceMesh.from_sizes(dp_size=world, device_type='cpu') if world > 1 else None
    twinkle.initialize(mode='local', seed=0, global_device_mesh=mesh)  # the one line that differs
    results = {}
    for scenario, (_, layout) in SCENARIOS.items():
        fsdp = DeviceMesh.from_sizes(fsdp_size=world, device_type='cpu') if world > 1 and layout == 'fsdp' else None
        results[scenario] = train(scenario, out_dir, fsdp)
    if distributed.is_main():
        (out_dir / 'results.json').write_text(json.dumps(results, indent=2))


if __name__ == '__main__':
    main(Path(sys.argv[1]))
