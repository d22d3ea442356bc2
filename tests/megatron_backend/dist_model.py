"""``MegatronModel`` trained at one layout; ``test_megatron_model.py`` runs it at several and compares.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=N \
        tests/megatron_backend/dist_model.py OUT LAYOUT INIT MODEL

``LAYOUT`` is one of ``LAYOUTS``; ``MODEL`` an embedded model (``tiny-qwen3``, ``tiny-qwen3-moe``);
``INIT`` an adapter directory every layout of the model starts from (random A and B, so every
LoRA weight gets a gradient). Each scenario takes one SGD step with ``lr=1`` and no clipping, so
the change of each weight is its gradient (the token-mean loss's); rank 0 writes the losses and
gradient norms (``results.json``) and the gradients by their Hugging Face names
(``<scenario>-grads.safetensors``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import twinkle
from twinkle import DeviceMesh, assets
from twinkle.infra import distributed
from twinkle.model.megatron import MegatronModel, convert, lora_files

LAYOUTS: dict[str, dict[str, int]] = {
    'tp1': {},
    'tp2': {'tp_size': 2},
    'pp2': {'pp_size': 2},
    'tp2pp2': {'tp_size': 2, 'pp_size': 2},
    'dp2': {'dp_size': 2},
    # A mixture of experts: each of 2 data-parallel ranks holds 4 of the 8 experts of every layer.
    'ep2': {'dp_size': 2, 'ep_size': 2},
}
#: A row whose logits after the LoRA step are compared with plain peft's on the saved adapter.
PROBE = [5, 9, 200, 17, 31, 8, 44]


def batch() -> list[dict[str, Any]]:
    """Four rows of different lengths (right padding), the same on every rank."""
    lengths = (12, 7, 10, 5)
    rows = []
    for i, n in enumerate(lengths):
        ids = [(17 * i + 5 * t) % 3000 + 10 for t in range(n)]
        rows.append({'input_ids': ids, 'labels': [-100] * 2 + ids[2:]})
    return rows


def my_rows(mesh: DeviceMesh | None) -> list[dict[str, Any]]:
    rows = batch()
    if mesh is None or mesh.dp_world_size == 1:
        return rows
    shard = distributed.data_rank(mesh)
    return rows[shard :: mesh.dp_world_size]


def step(model: MegatronModel, rows: list[dict[str, Any]], export: Any) -> dict[str, Any]:
    before = export()
    output = model.forward_backward(inputs=rows)
    norm = model.clip_grad_and_step(max_grad_norm=math.inf)
    after = export()
    grads = {name: before[name] - after[name] for name in before}
    model.forward_only(inputs=rows)
    model.calculate_loss()
    metrics = model.calculate_metric(is_training=False)
    return {'loss': float(output.loss), 'grad_norm': norm, 'loss_after': metrics['loss'], 'grads': grads}


def main(out: Path, layout: str, init: str, model_name: str) -> None:
    sizes = LAYOUTS[layout]
    mesh = DeviceMesh.from_sizes(device_type='cpu', **sizes) if sizes else None
    twinkle.initialize(mode='local', global_device_mesh=mesh, seed=0)
    results: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {}
    model = MegatronModel(model_id=assets.tiny_model(model_name), device_mesh=mesh)
    model.add_adapter_to_model('a', init)
    model.set_optimizer('SGD', lr=1.0)
    runs['lora'] = step(model, my_rows(mesh), lambda: lora_files.peft_state_dict(model.model.gpt, 'a'))
    model.save('lora-ckpt', str(out))
    probe = model.forward_only(inputs=[{'input_ids': PROBE, 'labels': PROBE}]).logits
    if distributed.is_main():
        save_file({'logits': probe.detach().float().contiguous()}, str(out / 'lora-probe.safetensors'))
    if layout == 'tp2' and 'moe' not in model_name:
        results['mixed'] = mixed_against_alone(model_name, mesh, init)
    if layout == 'pp2' and 'moe' not in model_name:
        results['refused'] = pipeline_refusals(model_name, mesh)
    if layout == 'ep2':
        results['mixed'] = uneven_mixed_pass(model_name, mesh, init)
    full = MegatronModel(model_id=assets.tiny_model(model_name), device_mesh=mesh)
    full.set_optimizer('SGD', lr=1.0)
    runs['full'] = step(full, my_rows(mesh), lambda: convert.export_hf_state_dict(full.model.gpt))
    for name, run in runs.items():
        grads = run.pop('grads')
        results[name] = run
        if distributed.is_main():
            save_file({k: v.contiguous() for k, v in grads.items()}, str(out / f'{name}-grads.safetensors'))
    if distributed.is_main():
        (out / 'results.json').write_text(json.dumps(results))


def mixed_against_alone(model_name: str, mesh: DeviceMesh | None, init: str) -> dict[str, float]:
    """Three adapters' calls in one ``forward_backward_mixed`` pass against each adapter alone, on
    models built alike: the largest difference of their losses and of their gradients (peft keys)."""
    from twinkle.model import AdapterCall

    rows = batch()
    calls = [AdapterCall('a', rows[:2]), AdapterCall('b', rows[2:3]), AdapterCall('c', rows[3:])]
    models = []
    for _ in range(2):
        model = MegatronModel(model_id=assets.tiny_model(model_name), device_mesh=mesh)
        for call in calls:
            model.add_adapter_to_model(call.adapter_name, init)
        models.append(model)
    mixed, alone = models
    mixed_losses = [out.loss for out in mixed.forward_backward_mixed(calls)]  # type: ignore[union-attr]
    alone_losses = [alone.forward_backward(inputs=c.inputs, adapter_name=c.adapter_name).loss for c in calls]
    loss_gap = max(abs(float(m) - float(a)) for m, a in zip(mixed_losses, alone_losses, strict=True))  # type: ignore[arg-type]
    grad_gap = 0.0
    for call in calls:
        got = lora_files.peft_state_dict(mixed.model.gpt, call.adapter_name, grads=True)
        want = lora_files.peft_state_dict(alone.model.gpt, call.adapter_name, grads=True)
        # Relative to each gradient's scale: these are sums over the call's tokens (the step divides them).
        gaps = ((got[k] - want[k]).abs().max().item() / max(1.0, want[k].abs().max().item()) for k in want)
        grad_gap = max(grad_gap, *gaps)
    return {'loss_gap': loss_gap, 'grad_gap': grad_gap, 'loss': float(alone_losses[0])}  # type: ignore[arg-type]


def uneven_mixed_pass(model_name: str, mesh: DeviceMesh | None, init: str) -> dict[str, float]:
    """Expert parallel, a mixed pass whose data ranks hold different rows: adapter 'a' has rows of
    other lengths on each rank, 'b' rows on rank 0 alone (rank 1 runs a forward without rows of its
    own, which the experts' dispatch needs). 'a''s loss against its own forward_backward."""
    from twinkle.model import AdapterCall

    rows, rank = batch(), distributed.data_rank(mesh) if mesh is not None else 0
    mine = rows[:2] if rank == 0 else rows[2:]
    models = []
    for _ in range(2):
        model = MegatronModel(model_id=assets.tiny_model(model_name), device_mesh=mesh)
        for name in ('a', 'b'):
            model.add_adapter_to_model(name, init)
        models.append(model)
    mixed, alone = models
    calls = [AdapterCall('a', mine), AdapterCall('b', rows[3:] if rank == 0 else [])]
    outputs = mixed.forward_backward_mixed(calls)
    want = alone.forward_backward(inputs=mine, adapter_name='a').loss
    got = outputs[0].loss  # type: ignore[union-attr]
    return {'loss_gap': abs(float(got) - float(want)), 'loss': float(want), 'b': float(outputs[1].loss)}  # type: ignore[arg-type,union-attr]


def pipeline_refusals(model_name: str, mesh: DeviceMesh | None) -> dict[str, str]:
    """What two stages refuse, on every rank: an adapter with no layer on stage 0 (its backward would
    not meet stage 1's sends), and embeddings tied across the stages (trained whole; on the CPU, built at all)."""
    from peft import LoraConfig

    from twinkle.assets.models import qwen3_config
    from twinkle.errors import ConfigurationError

    refused: dict[str, str] = {}
    model = MegatronModel(model_id=assets.tiny_model(model_name), device_mesh=mesh)
    try:
        model.add_adapter_to_model('late', LoraConfig(r=2, target_modules=r'model\.layers\.1\..*'))
    except ConfigurationError as e:
        refused['empty_stage'] = str(e)
    refused['adapters_after'] = ','.join(model.adapter_names)
    config = qwen3_config(model_name)
    config.tie_word_embeddings = True
    try:  # on the CPU megatron cannot build it (it moves the last stage's copy to CUDA); on a GPU it trains LoRA
        tied = MegatronModel(config=config, device_mesh=mesh)
        tied.set_template('Template', model_id=assets.tiny_model(model_name))
        tied.forward_backward(inputs=batch())
    except ConfigurationError as e:
        refused['tied'] = str(e)
    return refused


def transformers_main(out: Path, init: str, model_name: str) -> None:
    """The same steps on ``TransformersModel`` in this process: what every layout is held to (1e-4)."""
    from twinkle.model import TransformersModel
    from twinkle.model.lora import multi as multi_lora

    results: dict[str, Any] = {}
    model = TransformersModel(model_id=assets.tiny_model(model_name), router_aux_loss_coef=0.0)
    model.add_adapter_to_model('a', init)
    model.set_optimizer('SGD', lr=1.0)
    lora_run = step(
        model,
        batch(),
        lambda: {k: v.detach().clone() for k, v in multi_lora.peft_state_dict(model.model, 'a').items()},
    )  # type: ignore[arg-type]
    full = TransformersModel(model_id=assets.tiny_model(model_name), router_aux_loss_coef=0.0)
    full.set_optimizer('SGD', lr=1.0)
    full_run = step(full, batch(), lambda: {k: v.detach().clone() for k, v in full.model.state_dict().items()})  # type: ignore[arg-type]
    for name, run in (('lora', lora_run), ('full', full_run)):
        grads = run.pop('grads')
        results[name] = run
        save_file({k: v.contiguous() for k, v in grads.items()}, str(out / f'{name}-grads.safetensors'))
    (out / 'results.json').write_text(json.dumps(results))


if __name__ == '__main__':
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
