"""FSDP2 LoRA SFT on self-cognition: one script for one process, torchrun and Ray.

The "Local Multi-GPU Training" loop of the seed's Qwen3.5 best-practices page, on the embedded
tiny model and self-cognition set. ``twinkle.recipe.start_runtime`` is the only code that knows
the runtime:

- one process: no mesh;
- torchrun: ``DeviceMesh(fsdp_size=WORLD_SIZE // dp, dp_size=dp)``, one rank per process;
- Ray: a device group ``'model'`` of ``--ranks`` workers with that mesh; the model built with
  ``remote_group='model'`` is one actor per rank, each a torchrun process in all but name.

The loop is the same in all three: the data loader yields the global batch of ``--batch-size``
rows (under torchrun each process gets its slice; in Ray mode the driver holds the batch and each
actor takes its slice), and the losses are those of one process running that batch: the three
runs print the same numbers up to float rounding. On a CPU the ranks talk over gloo.

    python cookbook/fsdp_self_cognition.py                                  # one process, ~10 s
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 cookbook/fsdp_self_cognition.py          # ~20 s
    python cookbook/fsdp_self_cognition.py --mode ray --ranks 2   # or TWINKLE_MODE=ray; ~35 s

``torchrun`` is ``python -m torch.distributed.run``. Ray mode starts a local Ray with one CPU per
rank, or joins the cluster ``RAY_ADDRESS`` names. On GPUs the meshes and groups use CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from peft import LoraConfig

from twinkle import DeviceMesh, assets, get_logger
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.infra import distributed
from twinkle.metric import MetricWriter, add_sink_arguments
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.recipe import ModeSettings, start_runtime

logger = get_logger()
MODES = ('local', 'ray')
ACCUMULATION = 2  # batches per optimizer step, as in the seed


def build_dataset(model_id: str, rows: range) -> Dataset:
    dataset = Dataset(dataset_meta=DatasetMeta(assets.dataset('self-cognition'), data_slice=rows))
    dataset.set_template('Template', model_id=model_id, max_length=128)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()
    return dataset


def evaluate(model: TransformersModel, dataset: Dataset, batch_size: int) -> dict[str, float]:
    for batch in DataLoader(dataset=dataset, batch_size=batch_size):
        model.forward_only(inputs=batch)
        model.calculate_loss()
    return model.calculate_metric(is_training=False)


def train(args: argparse.Namespace) -> list[float]:
    """The runtime of ``--mode``: one process, torchrun, or a Ray group ``'model'`` of ``--ranks`` workers."""
    mode = ModeSettings(args.mode, seed=0, model_ranks=args.ranks, sampler_ranks=0)
    with start_runtime(mode, mesh=lambda ranks, device: fsdp_mesh(ranks, args.dp, device)) as mesh:
        return train_on(mesh, args)


def fsdp_mesh(ranks: int, dp: int, device_type: str) -> DeviceMesh:
    """The model's ranks as ``dp`` data-parallel replicas, each sharded over ``ranks // dp`` ranks (FSDP2)."""
    return DeviceMesh.from_sizes(fsdp_size=ranks // dp, dp_size=dp, device_type=device_type)


def train_on(mesh: DeviceMesh | None, args: argparse.Namespace) -> list[float]:
    model_id = assets.tiny_model()
    dataset = build_dataset(model_id, range(args.steps * args.batch_size))
    eval_dataset = build_dataset(model_id, range(2 * args.batch_size))  # as the seed: rows it also trains on
    # The global batch, in a seeded order (the same in every runtime); each data rank gets its slice.
    dataloader = DataLoader(dataset=dataset, batch_size=args.batch_size, shuffle=True)
    model = TransformersModel(model_id=model_id, device_mesh=mesh, remote_group='model')
    lora_config = LoraConfig(r=8, lora_alpha=32, target_modules='all-linear')
    model.add_adapter_to_model('default', lora_config, gradient_accumulation_steps=ACCUMULATION)
    model.set_optimizer(optimizer_cls='AdamW', lr=args.lr)
    optimizer_steps = args.steps // ACCUMULATION
    model.set_lr_scheduler('CosineWarmupScheduler', num_warmup_steps=2, num_training_steps=optimizer_steps)
    log(model.get_train_configs())
    losses = []
    # Every rank computes the metrics (they gather across ranks); rank 0 writes them.
    writer = MetricWriter(args.report_to, args.log_dir, config=vars(args)) if distributed.is_main() else None
    for step, batch in enumerate(dataloader, start=1):
        losses.append(float(model.forward_backward(inputs=batch).loss))
        model.clip_grad_and_step()
        log(f'step {step}/{len(dataloader)} loss {losses[-1]:.6f}')
        if step % 5 == 0:
            metric = model.calculate_metric(is_training=True)
            log(f'metric at step {step}: {metric}')
            if writer is not None:
                writer.write(metric, step=step)
    evaluation = evaluate(model, eval_dataset, args.batch_size)
    log(f'eval: {evaluation}')
    if writer is not None:
        writer.write(evaluation, step=len(dataloader), prefix='eval')
        writer.close()
    output_dir = str(Path(args.output_dir).resolve())  # Ray's actors write it too: no relative paths
    log(f'saved {model.save("last-checkpoint", output_dir=output_dir)}')
    return losses


def log(message: str) -> None:
    """Rank 0 speaks for all (under torchrun every process runs this script)."""
    if distributed.is_main():
        logger.info(message)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--mode', choices=MODES, default=os.environ.get('TWINKLE_MODE', 'local'))
    parser.add_argument('--ranks', type=int, default=2, help="Ray mode: workers in the 'model' group")
    parser.add_argument('--dp', type=int, default=1, help='data-parallel replicas (fsdp_size = ranks / dp)')
    parser.add_argument('--steps', type=int, default=24)
    parser.add_argument('--batch-size', type=int, default=8, help='the global batch')
    parser.add_argument('--lr', type=float, default=5e-3)
    parser.add_argument('--output-dir', default='output/fsdp-self-cognition')
    parser.add_argument('--losses', default='', help='a JSON file for the per-step losses (rank 0 writes it)')
    add_sink_arguments(parser, log_dir='output/fsdp-self-cognition/logs')
    args = parser.parse_args()
    losses = train(args)
    if args.losses and distributed.is_main():
        Path(args.losses).write_text(json.dumps(losses))


if __name__ == '__main__':
    main()
