"""Async GRPO on the letter-words task: sampling overlaps training, within a staleness bound.

The task and settings of ``grpo_letter_words.py``. Rollout threads (``AsyncRollouts``) sample one
prompt's group at a time (``produce``) while the loop trains on groups already scored; each step
that changed the weights publishes a copy, which the rollouts load between two generations (or
two chunks of ``--partial-chunk N`` tokens). ``--max-staleness k`` bounds how many steps behind a
group may be; ``0`` gives the synchronous loop's numbers, and ``--sync`` is that loop without
threads (``SyncRollouts``). Stale groups train with the decoupled loss (``loss_settings``), and
prompts whose samples all scored alike are left out (``twinkle.rl.groups.trained_rows``): docs/async_rl.md says why.

    python cookbook/grpo_async.py                                  # one process, about 40 s
    python cookbook/grpo_async.py --mode ray                       # sampler and trainer in two Ray actors
    python cookbook/grpo_async.py --mode server --sampler-group    # against a server started here
    python cookbook/grpo_async.py --max-staleness 4 --fill-pipeline --partial-chunk 4

A log line: the mean reward, the step's staleness, the share of tokens whose clip bites, the range
of the importance weights trainer / sampler, and how long the trainer waited for its groups.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from twinkle import assets, get_logger
from twinkle.data_format import SampledSequence, SamplingParams
from twinkle.recipe import RECIPE_MODES, ModeSettings, RecipeParts, add_config_arguments, start_parts
from twinkle.reward import LetterWordsReward
from twinkle.reward.letter_words import letter_words_prompts
from twinkle.rl import AsyncRollouts, ScoredGroup, Session, Stamped, SyncRollouts, batch_staleness, generate_partial
from twinkle.rl.groups import score_group, trained_rows

logger = get_logger()
ADAPTER = 'default'
Group = ScoredGroup[SampledSequence]  # one prompt's scored samples


@dataclass
class Config:
    # The task, the model and the optimizer: grpo_letter_words.py's settings (there 80 steps).
    steps: int = 60
    prompts_per_step: int = 6
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
    prompts_per_call: int = 1  # prompts per sampler call (one rollout item); divides prompts_per_step
    max_staleness: int = 1
    stale: str = 'drop'  # 'drop' or 'reweight' for a group staler than the bound
    partial_chunk: int = 0  # > 0: generate in chunks of this many tokens, weights may change between them
    workers: int = 1
    correction_cap: float = 2.0  # > 0: the decoupled loss's importance-weight cap; 0: GRPO's clip (loss_settings)
    fill_pipeline: bool = False  # every batch exactly max_staleness steps old (AsyncRollouts.fill)
    skip_flat_groups: bool = True  # leave out prompts whose samples all scored alike (trained_rows)
    sync: bool = False  # the synchronous loop, without threads
    # Where it runs (twinkle.recipe.ModeSettings' fields): 'local', 'ray' (sampler and trainer in two actors) or
    # 'server' (the url's, with api_key; else one started here, sampling in a group of its own with sampler_group).
    mode: str = 'local'
    threads: int = 0  # torch threads in each process (0: torch's default)
    url: str = ''
    api_key: str = ''
    sampler_group: bool = False


@contextmanager
def start(config: Config) -> Iterator[RecipeParts]:
    """The model (set up for GRPO), the sampler and their weight sync in ``config.mode``."""
    mode = ModeSettings.of(config, device='cpu')
    with start_parts(mode, assets.tiny_model(config.model)) as parts:
        lora = LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, target_modules='all-linear')
        parts.model.add_adapter_to_model(ADAPTER, lora)
        parts.model.set_optimizer('AdamW', lr=config.lr)
        parts.model.set_loss('GRPOLoss', **loss_settings(config))
        parts.model.add_metric('GRPOMetric')
        yield parts


def loss_settings(config: Config) -> dict[str, Any]:
    """GRPOLoss's settings: by default the decoupled objective (Hilton, Cobbe and Schulman 2022,
    arXiv:2110.00641; AReaL's async GRPO): the clip against the trainer's own policy, each token
    weighted by ``min(pi_trainer / pi_sampler, cap)``. ``correction_cap=0``: GRPO's clip against the
    sampler, which at staleness 2 stalls the reward (docs/async_rl.md, "Stale samples")."""
    correction = {'level': 'token', 'mode': 'truncate', 'threshold': config.correction_cap}
    return {'epsilon': 0.2, 'beta': config.beta, 'rollout_correction': correction if config.correction_cap else None}


def make_produce(parts: RecipeParts, config: Config) -> Callable[[Session], Group]:
    """Sample and score rollout item ``session.index``: ``prompts_per_call`` prompts, whose prompts and seed
    depend on the index only, so any run of the same config draws the same groups from the same weights."""
    prompts = letter_words_prompts(config.letters, config.steps * config.prompts_per_step, config.seed)
    reward_fn, per_call = LetterWordsReward(config.target_words), config.prompts_per_call

    def produce(session: Session) -> Group:
        first = session.index * per_call % len(prompts)
        seed, n = config.seed * 100_003 + first // config.prompts_per_step + 1, config.num_generations
        params = SamplingParams(max_tokens=config.max_tokens, num_samples=n, temperature=config.temperature, seed=seed)
        rows = prompts[first : first + per_call]
        if config.partial_chunk:
            responses = generate_partial(parts.sampler, session, rows, params, config.partial_chunk)
        else:
            with session.sampling():
                responses = parts.sampler.sample(rows, params)
        return score_group(responses, reward_fn, n)

    return produce


def train_step(parts: RecipeParts, batch: list[Stamped[Group]], config: Config) -> dict[str, float]:
    """One GRPO step on the batch's ``trained_rows``. ``skipped`` is 1 when the weights did not change (no row to
    train on, or a NaN or infinite gradient norm, which the model skips): the loop then publishes none."""
    sequences, advantages = trained_rows(batch, config.num_generations, skip_flat=config.skip_flat_groups)
    rewards = [r for item in batch for r in item.value.rewards]
    # signal_prompts: the share of the step's prompts whose samples scored differently (those it trains on).
    record = {'total_reward': sum(rewards) / len(rewards), 'signal_prompts': len(sequences) / len(rewards)}
    if not sequences:
        return {**record, 'skipped': 1.0}
    output = parts.model.forward_backward(
        inputs=[seq.new_input_feature for seq in sequences],
        old_logps=[seq.token_logprobs for seq in sequences],
        advantages=advantages,
    )
    # The step's staleness joins its log (a server's run history and dashboard) beside the loss's figures.
    parts.model.log_step_figures(batch_staleness(batch), adapter_name=ADAPTER)
    grad_norm = parts.model.clip_grad_and_step()
    record['loss'] = float(output.loss)
    record.update(parts.model.calculate_metric(is_training=True))
    if grad_norm is None or not math.isfinite(grad_norm):  # the model skips a step with such a norm
        record['skipped'] = 1.0
    return record


def train(config: Config) -> dict[str, Any]:
    """The loop (``AsyncRollouts``, or ``SyncRollouts`` with ``--sync``); returns the per-step history and totals."""
    if config.prompts_per_call < 1 or config.prompts_per_step % config.prompts_per_call:
        raise ValueError(
            f'prompts_per_call ({config.prompts_per_call}) must divide prompts_per_step ({config.prompts_per_step})'
        )
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with start(config) as parts:
        started = time.perf_counter()
        history, stats = _loop(parts, make_produce(parts, config), config)
        seconds = time.perf_counter() - started
    samples = config.steps * config.prompts_per_step * config.num_generations
    return {'history': history, 'seconds': seconds, 'samples_per_s': samples / seconds, 'stats': stats}


def _loop(
    parts: RecipeParts, produce: Callable[[Session], Group], config: Config
) -> tuple[list[dict[str, float]], dict[str, float]]:
    batch_size = config.prompts_per_step // config.prompts_per_call
    rollouts: AsyncRollouts[Group] | SyncRollouts[Group] = (
        SyncRollouts(produce, batch_size=batch_size)
        if config.sync
        else AsyncRollouts(
            produce, batch_size=batch_size, max_staleness=config.max_staleness, stale=config.stale,  # type: ignore[arg-type]
            workers=config.workers,
        )
    )  # fmt: skip
    history = []
    with rollouts.running(*parts.stage_weights()):
        for step in range(1, config.steps + 1):
            waited = time.perf_counter()
            if config.fill_pipeline:
                rollouts.fill()
            batch = rollouts.next_batch()
            trained = time.perf_counter()
            record = {'step': step, **train_step(parts, batch, config), **batch_staleness(batch)}
            if record.get('skipped'):  # the weights are the last step's: no copy, no new version
                rollouts.publish_unchanged()
            else:
                rollouts.publish(*parts.stage_weights())
            # wait_s: waiting for the batch (with --sync: loading the weights and sampling it); train_s: the rest.
            record.update(wait_s=trained - waited, train_s=time.perf_counter() - trained)
            history.append(record)
            _log(record)
    return history, rollouts.stats.metrics()


def _log(record: dict[str, float]) -> None:
    # clip: tokens whose clip bites; w: the importance weights trainer / sampler (their range, before the cap).
    logger.info(
        f'step {int(record["step"]):4d}  reward {record["total_reward"]:.3f}  '
        f'staleness {record.get("staleness_mean", 0.0):.2f}  clip {record.get("clip_frac", 0.0):.2f}  '
        f'w {record.get("is_weight_min", 1.0):.2f}-{record.get("is_weight_max", 1.0):.2f}  '
        f'waited {record.get("wait_s", 0.0):.2f}s'
    )


def parse_args(argv: list[str] | None = None) -> Config:
    """The config from the command line (or ``argv``): each field a ``--flag``, booleans also ``--no-flag``."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_config_arguments(parser, Config(), choices={'mode': RECIPE_MODES})
    return Config(**vars(parser.parse_args(argv)))


def main() -> None:
    config = parse_args()
    result = train(config)
    history = result['history']
    first = sum(r['total_reward'] for r in history[:10]) / min(10, len(history))
    last = sum(r['total_reward'] for r in history[-10:]) / min(10, len(history))
    speed = f'{result["samples_per_s"]:.1f} samples/s'
    logger.info(f'mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}; {speed}; {result["stats"]}')
    if config.output:
        Path(config.output).write_text(json.dumps({'config': asdict(config), **result}, indent=1))


if __name__ == '__main__':
    main()
