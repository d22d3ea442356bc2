"""GRPO on the letter-words task: one script for one process, torchrun and Ray.

The GRPO loop of the seed's Qwen3.5 best-practices page (model and sampler as two components,
``CheckpointEngineManager.sync_weights`` before each sampling step, group-relative advantages,
``GRPOLoss``), with ``TorchSampler`` instead of vLLM, on the task and reward of
``grpo_letter_words.py`` (``twinkle.reward.letter_words``). ``twinkle.recipe.start_parts`` is the
only code that knows the runtime:

- one process: the model and the sampler side by side;
- torchrun: the model is data parallel over the processes (``dp_size=WORLD_SIZE``) and **every
  process has its own sampler** that samples that process's share of the prompts. That is the
  correct split because data parallelism keeps every rank's weights equal (so every rank's sync
  gives its sampler the same policy), GRPO's groups never cross ranks (a prompt's
  ``num_generations`` samples come from one sampler, so each rank computes its advantages
  alone), and each rank then trains on exactly the rows it sampled, as the model expects under
  torchrun. A sampler on rank 0 alone would make the others wait and move every sequence twice.
  (An FSDP-sharded model would first have to gather its weights to export them: use data
  parallel here.) Rewards are gathered over the ranks only for the log;
- Ray: the model on a group ``'model'`` of ``--model-ranks`` workers (data parallel), the
  sampler on a separate group ``'sampler'`` of ``--sampler-ranks`` workers; the driver holds the
  prompts, the sampler group splits them, the model group splits the sequences, and each sync
  sends model rank 0's adapter through Ray's object store to every sampler worker.

The step is the same in all three, and so are the numbers: sampling seeds depend on the prompt
and the step only, never on which rank or batch a prompt is in, and the model's losses and
updates are those of one process with the whole batch. (Up to float rounding: after some dozens of
steps a rounding difference flips a sampled token and the runs part, with the same trend.)

    python cookbook/grpo_every_mode.py                                      # one process, 15-50 s
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 cookbook/grpo_every_mode.py               # ~25 s
    python cookbook/grpo_every_mode.py --mode ray --model-ranks 2 --sampler-ranks 1   # or TWINKLE_MODE=ray; ~60 s

``torchrun`` is ``python -m torch.distributed.run``. Ray mode starts a local Ray with one CPU per
rank of both groups, or joins the cluster ``RAY_ADDRESS`` names. Each log line shows the mean
reward (which rises from about 0.1 towards 1 within the default steps in one process), the loss,
the KL to the base model, and the seconds spent sampling and syncing weights.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peft import LoraConfig

from twinkle import assets, get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.data_format import SampledSequence, SamplingParams
from twinkle.dataloader import DataLoader
from twinkle.infra import distributed
from twinkle.metric import CompletionRewardMetric, MetricWriter, add_sink_arguments
from twinkle.recipe import ModeSettings, add_config_arguments, start_parts
from twinkle.reward import LetterWordsReward
from twinkle.reward.letter_words import letter_words_prompts

logger = get_logger()
ADAPTER = 'default'
MODES = ('local', 'ray')


@dataclass
class ModeConfig:
    # The task, the model and the optimizer: grpo_letter_words.py's settings (there 80 steps of 6 prompts).
    steps: int = 60
    # The global batch of prompts; under torchrun each process samples prompts_per_step / WORLD_SIZE.
    prompts_per_step: int = 2
    num_generations: int = 8
    max_tokens: int = 8
    target_words: int = 4
    lr: float = 3e-3
    lora_rank: int = 16
    beta: float = 0.01
    temperature: float = 1.0
    seed: int = 0
    letters: str = 's'  # the letters prompts ask for ('scp': the policy must read the prompt)
    model: str = 'tiny-qwen3'
    output: str = ''  # a JSON file for the per-step log, if given
    # 'local' (one process, or torchrun) or 'ray'; the TWINKLE_MODE environment variable sets the default.
    mode: str = 'local'
    # Ray mode: workers of the 'model' group (data parallel) and of the 'sampler' group.
    model_ranks: int = 2
    sampler_ranks: int = 1


def configure(model: Any, config: ModeConfig) -> None:
    """The seed's GRPO set-up: a LoRA on every linear layer, AdamW, GRPOLoss with a small KL penalty."""
    lora = LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, target_modules='all-linear')
    model.add_adapter_to_model(ADAPTER, lora)
    model.set_optimizer('AdamW', lr=config.lr)
    model.set_loss('GRPOLoss', epsilon=0.2, beta=config.beta)
    model.add_metric('GRPOMetric')


def sample(sampler: Any, prompts: list[dict[str, Any]], config: ModeConfig, step: int) -> list[SampledSequence]:
    params = SamplingParams(
        max_tokens=config.max_tokens,
        num_samples=config.num_generations,
        temperature=config.temperature,
        seed=config.seed * 100_003 + step,
    )
    return [seq for response in sampler.sample(prompts, params) for seq in response.sequences]


def train(config: ModeConfig, writer: MetricWriter | None = None) -> list[dict[str, float]]:
    """The GRPO loop; each step's record also goes to ``writer`` (rank 0's) when given."""
    # Ray: the model on a 'model' group, the sampler on a 'sampler' group. torchrun: a sampler per process.
    mode = ModeSettings.of(config)
    with start_parts(mode, assets.tiny_model(config.model)) as parts:
        model, sampler = parts.model, parts.sampler
        configure(model, config)
        # Every step's prompts, drawn up front from the run's seed (the same on every rank), in global batches:
        # under torchrun each process gets its slice.
        prompts = letter_words_prompts(config.letters, config.steps * config.prompts_per_step, config.seed)
        loader = DataLoader(prompts, batch_size=config.prompts_per_step)
        reward_fn, advantage_fn = LetterWordsReward(config.target_words), GRPOAdvantage()
        history = []
        for step, batch in enumerate(loader, start=1):
            started = time.perf_counter()
            sync = parts.sync_weights()
            sampled = time.perf_counter()
            sequences = sample(sampler, batch, config, step)
            generate_time = time.perf_counter() - sampled
            features = [seq.new_input_feature for seq in sequences]
            rewards = reward_fn(features)
            advantages = advantage_fn(rewards, num_generations=config.num_generations, scale='group').tolist()
            output = model.forward_backward(
                inputs=features, old_logps=[seq.token_logprobs for seq in sequences], advantages=advantages
            )
            model.clip_grad_and_step()
            record = {'step': step, 'loss': float(output.loss), 'seconds': time.perf_counter() - started}
            record.update(reward_metrics(rewards, sequences, generate_time, sync.seconds))
            record.update(model.calculate_metric(is_training=True))
            history.append(record)
            log(record)
            if writer is not None:
                writer.write({k: v for k, v in record.items() if k != 'step'}, step=step)
    return history


def reward_metrics(
    rewards: list[float], sequences: list[SampledSequence], generate_time: float, sync_time: float
) -> dict[str, float]:
    """The step's reward and completion length over every rank's samples (under torchrun each
    process scored its own; elsewhere these are all of them)."""
    metric = CompletionRewardMetric()
    lengths = [len(seq.tokens) for seq in sequences]
    metric.accumulate(
        rewards={'total': gather(rewards)},
        completion_lengths=gather(lengths),
        generate_time=generate_time,
        weight_sync_time=sync_time,
    )
    return metric.calculate()


def gather(values: list[Any]) -> list[Any]:
    return [value for part in distributed.all_gather_object(values) for value in part]


def log(record: dict[str, float]) -> None:
    """Rank 0 speaks for all (under torchrun every process runs this script)."""
    if distributed.is_main():
        logger.info(
            f'step {record["step"]:4d}  reward {record["total_reward"]:.3f}  loss {record["loss"]:.6f}  '
            f'kl {record.get("kl", 0.0):.4f}  sample {record["generate_time_s"]:.2f} s  '
            f'sync {record["weight_sync_time_s"]:.3f} s  step {record["seconds"]:.2f} s'
        )


def parse_args() -> tuple[ModeConfig, argparse.Namespace]:
    """The run's ``ModeConfig`` and the metric sinks' flags."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser, ModeConfig(mode=os.environ.get('TWINKLE_MODE', 'local')), choices={'mode': MODES})
    add_sink_arguments(parser, log_dir='output/grpo-every-mode/logs')
    args = vars(parser.parse_args())
    sinks = argparse.Namespace(report_to=args.pop('report_to'), log_dir=args.pop('log_dir'))
    return ModeConfig(**args), sinks


def main() -> None:
    config, sinks = parse_args()
    # Rank 0 writes the metrics (under torchrun every process runs this script).
    writer = MetricWriter(sinks.report_to, sinks.log_dir, config=asdict(config)) if distributed.is_main() else None
    try:
        history = train(config, writer)
    finally:
        if writer is not None:
            writer.close()
    if not distributed.is_main():
        return
    window = min(10, len(history))
    first = sum(r['total_reward'] for r in history[:window]) / window
    last = sum(r['total_reward'] for r in history[-window:]) / window
    logger.info(f'mean reward: first {window} steps {first:.3f}, last {window} steps {last:.3f}')
    if config.output:
        Path(config.output).write_text(json.dumps({'config': asdict(config), 'history': history}, indent=1))


if __name__ == '__main__':
    main()
