"""The GRPO loop of the Qwen3.5 best-practices page, on GSM8K, in one process.

The seed document runs it on 8 GPUs with Ray and vLLM. Here the same loop runs on the CPU with
``TorchSampler`` and the embedded tiny model and GSM8K sample (set ``MODEL_ID`` and the dataset
id to a real model and ``ms://modelscope/gsm8k`` to train for real). What changed, and why:

- ``sampler.sample(prompts, SamplingParams(num_samples=NUM_GENERATIONS))`` instead of
  ``sampler.sample(prompts * NUM_GENERATIONS, ...)``: advantages normalise over contiguous groups,
  and repeating the whole list would interleave the prompts' groups.
- ``old_logps`` are ``sequence.token_logprobs``, the same numbers as
  ``[lp[0][1] for lp in sequence.logprobs]``.
- No ``DeviceGroup``/``remote_group``: one process holds the model and the sampler.

On a random tiny model the reward stays near zero (it cannot do arithmetic); the loop, the
rewards, the weight sync and the checkpoint are what this shows. ``cookbook/grpo_letter_words.py``
is a task the tiny model does learn.
"""

from __future__ import annotations

import argparse
from typing import Any

from peft import LoraConfig

from twinkle import assets, get_logger
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
from twinkle.sampler import TorchSampler

logger = get_logger()

MODEL_ID = assets.tiny_model()
DATASET_ID = assets.dataset('gsm8k')
NUM_GENERATIONS = 4
MAX_NEW_TOKENS = 48
LEARNING_RATE = 1e-4
BATCH_SIZE = 4
MINI_BATCH_SIZE = 8
MICRO_BATCH_SIZE = 4
ADAPTER_NAME = 'default'


def create_gsm8k_dataset() -> Dataset:
    dataset = Dataset(DatasetMeta(DATASET_ID, split='train'))
    dataset.set_template('Qwen3_5Template', model_id=MODEL_ID, max_length=1024)
    dataset.map(GSM8KProcessor())
    dataset.encode(add_generation_prompt=True)
    return dataset


def compute_rewards(trajectories: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    accuracy_rewards = GSM8KAccuracyReward()(trajectories)
    format_rewards = GSM8KFormatReward()(trajectories)
    total_rewards = [a + f for a, f in zip(accuracy_rewards, format_rewards, strict=True)]
    return total_rewards, format_rewards, accuracy_rewards


def main(max_steps: int, output_dir: str, writer: MetricWriter | None = None) -> list[dict[str, float]]:
    lora_config = LoraConfig(target_modules='all-linear', r=16, lora_alpha=32, lora_dropout=0.05)
    model = TransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model(ADAPTER_NAME, lora_config, gradient_accumulation_steps=1)
    model.set_optimizer('AdamW', lr=LEARNING_RATE)
    model.set_lr_scheduler('CosineAnnealingLR', T_max=max_steps, eta_min=0)
    model.set_loss('GRPOLoss', epsilon=0.2)
    model.set_processor(InputProcessor)
    model.set_template('Qwen3_5Template', model_id=MODEL_ID)
    model.add_metric('GRPOMetric')

    sampler = TorchSampler(model_id=MODEL_ID)
    sampler.set_template('Qwen3_5Template', model_id=MODEL_ID)
    ckpt_manager = CheckpointEngineManager(model=model, sampler=sampler)

    dataloader = DataLoader(dataset=create_gsm8k_dataset, batch_size=BATCH_SIZE, min_batch_size=BATCH_SIZE)
    advantage_fn = GRPOAdvantage()
    metrics = CompletionRewardMetric()
    sampling_params = SamplingParams(max_tokens=MAX_NEW_TOKENS, num_samples=NUM_GENERATIONS, logprobs=1)

    optim_step, log = 0, []
    for batch in dataloader:
        if optim_step >= max_steps:
            break
        metrics.reset()
        sync = ckpt_manager.sync_weights(merge_and_sync=True)
        sampler.reset_prefix_cache()
        sample_responses = sampler.sample(batch, sampling_params)

        all_input_data, all_old_logps, all_completion_lengths = [], [], []
        for sample_response in sample_responses:
            for sequence in sample_response.sequences:
                all_input_data.append(sequence.new_input_feature)
                all_old_logps.append(sequence.token_logprobs)
                all_completion_lengths.append(len(sequence.tokens))

        total_rewards, format_rewards, accuracy_rewards = compute_rewards(all_input_data)
        metrics.accumulate(
            completion_lengths=all_completion_lengths,
            rewards={'total': total_rewards, 'format': format_rewards, 'accuracy': accuracy_rewards},
            weight_sync_time=sync.seconds,
        )
        advantages = advantage_fn(total_rewards, num_generations=NUM_GENERATIONS, scale='group').tolist()

        for mb_start in range(0, len(all_input_data), MINI_BATCH_SIZE):
            mb_end = mb_start + MINI_BATCH_SIZE
            model.forward_backward(
                inputs=all_input_data[mb_start:mb_end],
                old_logps=all_old_logps[mb_start:mb_end],
                advantages=advantages[mb_start:mb_end],
                micro_batch_size=MICRO_BATCH_SIZE,
            )
            model.clip_grad_and_step()
            optim_step += 1
            log_dict = metrics.calculate()
            log_dict.update(model.calculate_metric(is_training=True))
            metrics.reset()
            log.append(log_dict)
            if writer is not None:
                writer.write(log_dict, step=optim_step)
            logger.info(f'[Step {optim_step}/{max_steps}] {log_dict}')
            if optim_step >= max_steps:
                break

    logger.info(f'Training completed. optim_steps={optim_step}')
    model.save('grpo-gsm8k-checkpoint', output_dir=output_dir)
    return log


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--max-steps', type=int, default=20)
    parser.add_argument('--output-dir', default='output')
    add_sink_arguments(parser, log_dir='output/grpo-gsm8k/logs')
    args = parser.parse_args()
    with MetricWriter(args.report_to, args.log_dir, config=vars(args)) as metric_writer:
        main(args.max_steps, args.output_dir, metric_writer)
