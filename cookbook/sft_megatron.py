"""Self-cognition LoRA SFT on megatron-core: the seeds' SFT loop with ``MegatronModel`` for ``TransformersModel``.

The loop of ``sft_self_cognition.py`` (the seed's SFT: a LoRA on ``all-linear``, AdamW, a cosine
schedule, evaluation before and after, the adapter saved in peft's format) on the embedded tiny
model and self-cognition set, with the model split by megatron-core over ``--tp`` (tensor
parallel: each rank holds a slice of every linear layer), ``--pp`` (pipeline stages: each rank
holds some of the layers) and ``--dp`` (data-parallel replicas). ``start`` (over
``twinkle.recipe.start_runtime``) is the only code that knows the runtime; the loop is the same
in all of them:

- one process (``--tp 1 --pp 1 --dp 1``, the default): no mesh;
- torchrun: ``DeviceMesh(tp_size=tp, pp_size=pp, dp_size=dp)`` over ``tp * pp * dp`` processes;
- Ray (``--mode ray``): a device group ``'model'`` of ``tp * pp * dp`` workers with that mesh; the
  model built with ``remote_group='model'`` is one actor per rank, each a torchrun process in all
  but name, and the driver holds the batch.

Every layout computes the losses of one process on the same global batch: the runs print the
same per-step losses up to float rounding (1e-5). On a CPU the ranks talk over gloo.

    python cookbook/sft_megatron.py                                                  # one process
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 cookbook/sft_megatron.py --tp 2    # tensor parallel
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 cookbook/sft_megatron.py --pp 2    # two pipeline stages
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 cookbook/sft_megatron.py --tp 2 --pp 2
    python cookbook/sft_megatron.py --mode ray --tp 2             # or TWINKLE_MODE=ray; 2 Ray workers

``torchrun`` is ``python -m torch.distributed.run``. It needs megatron-core (``make setup-megatron``,
then ``.venv-megatron/bin/python`` or ``.venv-megatron/bin/torchrun``). ``--lora-rank 0`` trains
every weight instead of an adapter. Ray mode starts a local Ray with one CPU per rank, or joins the
cluster ``RAY_ADDRESS`` names. On GPUs the meshes and groups use CUDA (nccl).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peft import LoraConfig

from twinkle import DeviceMesh, assets, get_logger
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError
from twinkle.infra import distributed
from twinkle.metric import MetricWriter, add_sink_arguments
from twinkle.model import MegatronModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.recipe import ModeSettings, start_runtime

logger = get_logger()
MODES = ('local', 'ray')


@dataclass
class Config:
    # Tensor-parallel size, pipeline stages, data-parallel replicas: tp * pp * dp ranks in all.
    tp: int = 1
    pp: int = 1
    dp: int = 1
    # 'local' (one process, or torchrun) or 'ray'; the TWINKLE_MODE environment variable sets the default.
    mode: str = 'local'
    steps: int = 24
    # The global batch: every data-parallel replica trains on batch_size / dp of its rows.
    batch_size: int = 8
    lr: float = 5e-3
    # LoRA rank on all-linear (alpha = 2 * rank); 0 trains every weight.
    lora_rank: int = 16
    max_length: int = 128
    seed: int = 0
    # Embedded model name (twinkle.assets.MODELS) or a Qwen3 directory in Hugging Face format.
    model: str = 'tiny-qwen3'
    output_dir: str = 'output/sft-megatron'
    # A JSON file for the per-step losses and the evaluation before and after, if given (rank 0 writes it).
    losses: str = ''

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp


@contextmanager
def start(config: Config) -> Iterator[DeviceMesh | None]:
    """The runtime of ``config.mode``; gives the model's mesh (None: one process)."""
    world = distributed.world_size()
    if config.mode == 'local' and world != config.ranks:
        raise ConfigurationError(
            f'--tp {config.tp} --pp {config.pp} --dp {config.dp} make {config.ranks} rank(s), but {world} '
            f'process(es) run this script: start torchrun with --nproc_per_node={config.ranks}'
            + (f', or set --dp {world // (config.tp * config.pp)}' if world % (config.tp * config.pp) == 0 else '')
        )
    mode = ModeSettings(config.mode, config.seed, model_ranks=config.ranks, sampler_ranks=0)  # type: ignore[arg-type]
    sizes = {'tp_size': config.tp, 'pp_size': config.pp, 'dp_size': config.dp}
    with start_runtime(mode, mesh=lambda ranks, device: DeviceMesh.from_sizes(**sizes, device_type=device)) as mesh:
        yield mesh


def build_dataset(model_id: str, rows: range, max_length: int) -> Dataset:
    dataset = Dataset(dataset_meta=DatasetMeta(assets.dataset('self-cognition'), data_slice=rows))
    dataset.set_template('Template', model_id=model_id, max_length=max_length)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()
    return dataset


def evaluate(model: MegatronModel, dataset: Dataset, batch_size: int) -> dict[str, float]:
    for batch in DataLoader(dataset=dataset, batch_size=batch_size):
        model.forward_only(inputs=batch)
        model.calculate_loss()
    return model.calculate_metric(is_training=False)


def build_model(config: Config, model_id: str, mesh: DeviceMesh | None) -> MegatronModel:
    """The seed's model set-up, on megatron-core: the adapter (or every weight), AdamW, the schedule."""
    model = MegatronModel(model_id=model_id, device_mesh=mesh, remote_group='model')
    if config.lora_rank:
        lora_config = LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, target_modules='all-linear')
        model.add_adapter_to_model('default', lora_config, gradient_accumulation_steps=1)
    model.set_optimizer(optimizer_cls='AdamW', lr=config.lr)
    warmup = min(2, config.steps)
    model.set_lr_scheduler('CosineWarmupScheduler', num_warmup_steps=warmup, num_training_steps=config.steps)
    return model


def train(config: Config, sinks: argparse.Namespace) -> dict[str, Any]:
    """The SFT loop; returns the per-step losses and the evaluation loss before and after."""
    with start(config) as mesh:
        return train_on(mesh, config, sinks)


def train_on(mesh: DeviceMesh | None, config: Config, sinks: argparse.Namespace) -> dict[str, Any]:
    model_id = assets.tiny_model(config.model) if config.model in assets.MODELS else config.model
    dataset = build_dataset(model_id, range(config.steps * config.batch_size), config.max_length)
    eval_rows = range(config.steps * config.batch_size, (config.steps + 2) * config.batch_size)
    eval_dataset = build_dataset(model_id, eval_rows, config.max_length)
    # The global batch, in a seeded order (the same in every runtime); each data rank gets its slice.
    dataloader = DataLoader(dataset=dataset, batch_size=config.batch_size, shuffle=True)
    model = build_model(config, model_id, mesh)
    log(model.get_train_configs())
    # Every rank computes the metrics (they gather across ranks); rank 0 writes them.
    writer = MetricWriter(sinks.report_to, sinks.log_dir, config=asdict(config)) if distributed.is_main() else None
    before = evaluate(model, eval_dataset, config.batch_size)
    log(f'eval before training: {_short(before)}')
    losses = []
    for step, batch in enumerate(dataloader, start=1):
        losses.append(float(model.forward_backward(inputs=batch).loss))
        model.clip_grad_and_step()
        log(f'step {step}/{len(dataloader)} loss {losses[-1]:.6f}')
        if step % 5 == 0:
            metric = model.calculate_metric(is_training=True)  # on every rank: it gathers over them
            if writer is not None:
                writer.write(metric, step=step)
    after = evaluate(model, eval_dataset, config.batch_size)
    log(f'eval after training: {_short(after)}')
    if writer is not None:
        writer.write(before, step=0, prefix='eval')
        writer.write(after, step=len(dataloader), prefix='eval')
        writer.close()
    output_dir = str(Path(config.output_dir).resolve())  # Ray's actors write it too: no relative paths
    log(f'saved {model.save("last-checkpoint", output_dir=output_dir)}')
    return {'losses': losses, 'eval_before': before['loss'], 'eval_after': after['loss']}


def log(message: str) -> None:
    """Rank 0 speaks for all (under torchrun every process runs this script)."""
    if distributed.is_main():
        logger.info(message)


def _short(metric: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4 if k != 'lr' else 6) for k, v in metric.items()}


def parse_args() -> tuple[Config, argparse.Namespace]:
    """The run's ``Config`` (one flag per field) and the metric sinks' flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = asdict(Config(mode=os.environ.get('TWINKLE_MODE', 'local')))
    for name, default in defaults.items():
        choices = MODES if name == 'mode' else None
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(default), default=default, choices=choices)
    add_sink_arguments(parser, log_dir='output/sft-megatron/logs')
    args = vars(parser.parse_args())
    sinks = argparse.Namespace(report_to=args.pop('report_to'), log_dir=args.pop('log_dir'))
    config = Config(**args)
    for name in ('tp', 'pp', 'dp', 'steps', 'batch_size'):
        if getattr(config, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be at least 1; got {getattr(config, name)}')
    return config, sinks


def main() -> None:
    config, sinks = parse_args()
    result = train(config, sinks)
    if config.losses and distributed.is_main():
        Path(config.losses).write_text(json.dumps(result))


if __name__ == '__main__':
    main()
