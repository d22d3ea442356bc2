"""Full-parameter AdamW on ``MegatronModel`` at one layout; ``test_megatron_distopt.py`` compares them.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=N \
        tests/megatron_backend/dist_distopt.py OUT LAYOUT

``LAYOUT`` ``tp1`` (one process: the reference, and the refusal of ``distributed_optimizer`` without data
parallel) or ``dp2`` (two data-parallel ranks, each half of the rows: the project's per-parameter reduction
as ``plain``, megatron's DDP and distributed optimizer as ``distopt``). Each run takes ``STEPS`` AdamW steps on
the same global batch (clipped at ``MAX_NORM``, below the gradient's norm, under a warmup schedule) and rank 0
writes its losses, gradient norms, learning rates, the loss after the steps and the optimizer state bytes of
every rank (``results.json``), and the weights by their Hugging Face names (``<run>-weights.safetensors``).
At dp2 the distributed optimizer's run is then saved with its optimizer state and resumed in a new model:
one more step on each (``resume``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import twinkle
from twinkle import DeviceMesh, assets
from twinkle.errors import ConfigurationError, StateError
from twinkle.infra import distributed
from twinkle.model.megatron import MegatronModel, convert

sys.path.insert(0, str(Path(__file__).parent))
from dist_model import my_rows

MODEL = 'tiny-qwen3'
STEPS = 2
MAX_NORM = 1.0
ADAMW = {'lr': 1e-3, 'betas': (0.9, 0.95), 'eps': 1e-8, 'weight_decay': 0.1}


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer state tensors this rank holds (the moments and step counts), read from them."""
    return sum(
        tensor.numel() * tensor.element_size()
        for state in optimizer.state.values()
        for tensor in state.values()
        if isinstance(tensor, torch.Tensor)
    )


def train(mesh: DeviceMesh | None, distributed_optimizer: bool) -> tuple[dict[str, Any], MegatronModel]:
    model = MegatronModel(
        model_id=assets.tiny_model(MODEL), device_mesh=mesh, distributed_optimizer=distributed_optimizer
    )
    model.set_optimizer('AdamW', **ADAMW)
    model.set_lr_scheduler('LinearWarmupScheduler', num_warmup_steps=1, num_training_steps=10)
    rows = my_rows(mesh)
    losses, norms, lrs = [], [], []
    for _ in range(STEPS):
        lrs.append(model.train_group().current_lr())
        losses.append(float(model.forward_backward(inputs=rows).loss))
        norms.append(model.clip_grad_and_step(max_grad_norm=MAX_NORM))
    model.forward_only(inputs=rows)
    model.calculate_loss()
    loss_after = model.calculate_metric(is_training=False)['loss']
    state_bytes = distributed.all_gather_object(optimizer_state_bytes(model.train_group().optimizer))
    run = {'losses': losses, 'grad_norms': norms, 'lrs': lrs, 'loss_after': loss_after, 'state_bytes': state_bytes}
    return run, model


def refusals(mesh: DeviceMesh | None, model: MegatronModel | None, out: Path) -> dict[str, str]:
    """What the switch refuses, each message kept: without data parallel; then on ``model`` (the distributed
    optimizer at dp2): an adapter after it, another optimizer, and saving its sharded optimizer state."""
    refused: dict[str, str] = {}
    attempts: dict[str, Any] = {}
    if model is None:
        attempts['dp1'] = lambda: MegatronModel(
            model_id=assets.tiny_model(MODEL), device_mesh=mesh, distributed_optimizer=True
        )
    else:
        from peft import LoraConfig

        attempts['adapter'] = lambda: model.add_adapter_to_model('a', LoraConfig(r=2, target_modules='all-linear'))
        attempts['optimizer'] = lambda: model.set_optimizer('RMSprop', lr=1e-3)
        attempts['argument'] = lambda: model.set_optimizer('AdamW', lr=1e-3, amsgrad=True)
        attempts['dtype'] = lambda: MegatronModel(
            model_id=assets.tiny_model(MODEL), device_mesh=mesh, distributed_optimizer=True, dtype=torch.bfloat16
        )
    for name, attempt in attempts.items():
        try:
            attempt()
        except ConfigurationError as e:
            refused[name] = str(e)
    if model is not None:  # gradients in megatron's buffers, waiting for a step: not in a checkpoint's window
        model.forward_backward(inputs=my_rows(mesh))
        try:
            model.save('mid-window', str(out), save_optimizer=True)
        except StateError as e:
            refused['mid_window'] = str(e)
        model.zero_grad()
    return refused


def resumed(mesh: DeviceMesh, model: MegatronModel, out: Path) -> dict[str, Any]:
    """``model``'s checkpoint with its optimizer state (gathered to rank 0), one more step on it, and the
    same step on a model resumed from the checkpoint: both steps' losses and weights."""
    path = model.save('resume', str(out), save_optimizer=True)
    rows = my_rows(mesh)
    continued = float(model.forward_backward(inputs=rows).loss)
    model.clip_grad_and_step(max_grad_norm=MAX_NORM)
    again = MegatronModel(model_id=path, device_mesh=mesh, distributed_optimizer=True)
    again.set_optimizer('AdamW', **ADAMW)
    again.set_lr_scheduler('LinearWarmupScheduler', num_warmup_steps=1, num_training_steps=10)
    counters = again.resume_from_checkpoint(path)
    resumed_loss = float(again.forward_backward(inputs=rows).loss)
    again.clip_grad_and_step(max_grad_norm=MAX_NORM)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(
            convert.export_hf_state_dict(model.model.gpt).values(),
            convert.export_hf_state_dict(again.model.gpt).values(),
            strict=True,
        )
    )
    return {'continued': continued, 'resumed': resumed_loss, 'weights_diff': diff, 'optim_step': counters['optim_step']}


def from_step_zero(mesh: DeviceMesh, out: Path) -> dict[str, Any]:
    """A checkpoint saved before the first step (an optimizer with no state yet), restored by a model that
    has stepped since and holds gradients of other rows in megatron's buffers: its next step against a
    new model's first (the restore drops both the optimizer's state and the pending gradients)."""
    rows = my_rows(mesh)
    other_rows = [{'input_ids': [7, 300, 9, 41, 11, 5], 'labels': [-100, 300, 9, 41, 11, 5]}]

    def fresh() -> MegatronModel:
        model = MegatronModel(model_id=assets.tiny_model(MODEL), device_mesh=mesh, distributed_optimizer=True)
        model.set_optimizer('AdamW', **ADAMW)
        return model

    model = fresh()
    path = model.save('step-0', str(out), save_optimizer=True)
    model.forward_backward(inputs=rows)
    model.clip_grad_and_step(max_grad_norm=MAX_NORM)
    model.forward_backward(inputs=other_rows)  # pending when the checkpoint comes back
    model.resume_from_checkpoint(path)
    model.forward_backward(inputs=rows)
    model.clip_grad_and_step(max_grad_norm=MAX_NORM)
    first = fresh()
    first.forward_backward(inputs=rows)
    first.clip_grad_and_step(max_grad_norm=MAX_NORM)
    pairs = zip(
        convert.export_hf_state_dict(model.model.gpt).values(),
        convert.export_hf_state_dict(first.model.gpt).values(),
        strict=True,
    )
    return {'weights_diff': max((a - b).abs().max().item() for a, b in pairs)}


def main(out: Path, layout: str) -> None:
    mesh = DeviceMesh.from_sizes(device_type='cpu', dp_size=2) if layout == 'dp2' else None
    twinkle.initialize(mode='local', global_device_mesh=mesh, seed=0)
    results: dict[str, Any] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    if layout == 'tp1':
        results['one'], model = train(mesh, False)
        weights['one'] = convert.export_hf_state_dict(model.model.gpt)
        results['refused'] = refusals(mesh, None, out)
    else:
        results['plain'], plain = train(mesh, False)
        weights['plain'] = convert.export_hf_state_dict(plain.model.gpt)
        results['distopt'], model = train(mesh, True)
        weights['distopt'] = convert.export_hf_state_dict(model.model.gpt)
        model.save('full', str(out))  # the whole Hugging Face weights, whatever the optimizer holds
        results['refused'] = refusals(mesh, model, out)
        assert mesh is not None
        results['resume'] = resumed(mesh, model, out)
        results['step_zero'] = from_step_zero(mesh, out)
    if distributed.is_main():
        for name, tensors in weights.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f'{name}-weights.safetensors'))
        (out / 'results.json').write_text(json.dumps(results))


if __name__ == '__main__':
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2])
