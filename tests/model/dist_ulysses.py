"""The training loops ``test_ulysses.py`` runs in one process and under torchrun (2 ranks, gloo),
where both ranks form one Ulysses group (``ulysses_size=2``) and share every batch.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 tests/model/dist_ulysses.py OUT_DIR

Each scenario writes its per-step losses and gradient norms, the training metrics, and the
label logprobs of a ``forward_only`` (the whole sequence's, on every rank).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from transformers import Qwen3Config

import twinkle
from twinkle import DeviceMesh, assets
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError
from twinkle.infra import distributed
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

# Scenario -> (model, layout beside Ulysses, packed rows, loss, gradient checkpointing).
SCENARIOS: dict[str, tuple[str, str, bool, str, bool]] = {
    'qwen3-dp': ('tiny-qwen3', 'dp', False, 'ce', False),
    'qwen3-fsdp-packed': ('tiny-qwen3', 'fsdp', True, 'ce', False),
    'qwen3.5-fsdp': ('tiny-qwen3.5', 'fsdp', False, 'ce', False),
    'qwen3.5-dp-packed': ('tiny-qwen3.5', 'dp', True, 'ce', False),
    'qwen3-grpo-packed': ('tiny-qwen3', 'dp', True, 'grpo', False),
    # The layers recomputed in the backward: the collectives run again there.
    'qwen3.5-checkpointed': ('tiny-qwen3.5', 'dp', True, 'ce', True),
    # One key/value head for 2 ranks: repeated to scatter; every weight trained.
    'gqa-one-kv-head': ('config', 'dp', False, 'ce', False),
    # The output layer fused (``fused_output=True``): each rank scores its slice of the sequence.
    'qwen3-grpo-packed-fused': ('tiny-qwen3', 'dp', True, 'grpo', False),
    'qwen3.5-dp-fused': ('tiny-qwen3.5', 'dp', False, 'ce', False),
}
GLOBAL_BATCH = 4
STEPS = 3


def rows() -> list[dict[str, Any]]:
    dataset = Dataset(DatasetMeta(assets.dataset('self-cognition'), data_slice=range(GLOBAL_BATCH * STEPS)))
    dataset.set_template('Template', model_id=assets.tiny_model(), max_length=96)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()
    # Rows cut by 0, 1 or 2 tokens: odd widths, which Ulysses pads to a multiple of its 2 ranks.
    return [
        {k: v[: len(v) - i % 3] if isinstance(v, list) else v for k, v in row.items()} for i, row in enumerate(dataset)
    ]


def small_config(heads: int, kv_heads: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
    )  # fmt: skip


def build(name: str, mesh: DeviceMesh | None, packed: bool, checkpointing: bool) -> TransformersModel:
    torch.manual_seed(0)
    if name == 'config':
        model = TransformersModel(config=small_config(4, 1), device_mesh=mesh)
        model.set_template('Template', model_id=assets.tiny_model())
        model.set_optimizer('AdamW', lr=1e-3)
    else:
        model = TransformersModel(
            model_id=assets.tiny_model(name), device_mesh=mesh, gradient_checkpointing=checkpointing
        )
        config = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
        model.add_adapter_to_model('a', config)
        model.set_optimizer('AdamW', lr=1e-3)
    if packed:
        model.set_processor('InputProcessor', padding_free=True)
    return model


def rl_inputs(batch: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows with their prompt half untrained, an advantage per row and a sampler logprob per
    trained token (per-token loss inputs the loss lays onto the whole sequence)."""
    rows, advantages, old_logps = [], [], []
    for index, row in enumerate(batch):
        prompt = len(row['input_ids']) // 2
        labels = [-100] * prompt + list(row['labels'][prompt:])
        trained = sum(label != -100 for label in labels)
        rows.append({'input_ids': row['input_ids'], 'labels': labels})
        advantages.append((-1.0) ** index * (0.5 + index / 10))
        old_logps.append([-2.0 - 0.01 * (index + t) for t in range(trained)])
    return rows, {'advantages': advantages, 'old_logps': old_logps}


def train(scenario: str, data: list[dict[str, Any]], mesh: DeviceMesh | None) -> dict[str, Any]:
    name, _, packed, loss, checkpointing = SCENARIOS[scenario]
    model = build(name, mesh, packed, checkpointing)
    model.fused_output = scenario.endswith('-fused')
    if model.fused_output:  # the scenario runs the fused layer, not a silent fallback to the logits
        assert model._runner.fused_reads([model.train_group(None).spec.loss]) is not None, scenario
    if loss == 'grpo':
        model.set_loss('GRPOLoss', epsilon=0.2)
    losses, norms = [], []
    for batch in DataLoader(data, batch_size=GLOBAL_BATCH, device_mesh=mesh):
        inputs, loss_inputs = rl_inputs(list(batch)) if loss == 'grpo' else (list(batch), {})
        losses.append(model.forward_backward(inputs=inputs, **loss_inputs).loss)
        norms.append(model.clip_grad_and_step())
    metrics = model.calculate_metric(is_training=True)
    metrics.pop('tokens_per_s')
    evaluated, loss_inputs = rl_inputs(data[:GLOBAL_BATCH]) if loss == 'grpo' else (data[:GLOBAL_BATCH], {})
    out = model.forward_only(inputs=evaluated)
    eval_loss = model.calculate_loss(**loss_inputs)
    return {
        'losses': losses,
        'grad_norms': norms,
        'metrics': metrics,
        'eval_loss': eval_loss,
        'logps': out.logps.tolist(),
        'logits_shape': list(out.logits.shape),
        'parallel': next(line for line in model.get_train_configs().splitlines() if line.startswith('parallel:')),
    }


def refusal(mesh: DeviceMesh) -> str:
    """The error a model with 3 attention heads gives on a Ulysses group of 2."""
    try:
        TransformersModel(config=small_config(3, 1), device_mesh=mesh)
    except ConfigurationError as error:
        return str(error)
    return 'accepted'


def main(out_dir: Path) -> None:
    world = int(os.environ.get('WORLD_SIZE', '1'))
    twinkle.initialize(mode='local', seed=0, global_device_mesh=None if world == 1 else _mesh('dp', world))
    data = rows()
    results: dict[str, Any] = {}
    for scenario, (_, layout, *_) in SCENARIOS.items():
        results[scenario] = train(scenario, data, _mesh(layout, world) if world > 1 else None)
    if world > 1:
        results['refusal'] = refusal(_mesh('dp', world))
    if distributed.is_main():
        (out_dir / 'results.json').write_text(json.dumps(results, indent=2))


def _mesh(layout: str, world: int) -> DeviceMesh:
    sizes = {'dp_size': world} if layout == 'dp' else {'fsdp_size': world}
    return DeviceMesh.from_sizes(**sizes, ulysses_size=world, device_type='cpu')


if __name__ == '__main__':
    main(Path(sys.argv[1]))
