"""Async GRPO on the letter-words task: sampling overlaps training, within a staleness bound.

The task, reward and settings of ``grpo_letter_words.py`` (``twinkle.reward.letter_words``). A
background thread samples one prompt's group at a time (``produce``) with the sampler's current
weights while the loop trains on groups already scored; after each step that changed the
weights the loop stages a copy of them and the rollout thread loads them into the sampler
between two generations (``--partial-chunk N``: between two chunks of N tokens, so a generation
spanning an update continues on the new weights). ``--max-staleness k`` bounds how many steps
behind the trainer a group may be; ``--max-staleness 0`` is the synchronous loop, step for step
and number for number (``--sync`` runs that loop without threads, for comparison). ``start``
(over ``twinkle.recipe``) is the only code that knows the mode.

Stale groups train with the decoupled loss (``loss_settings``) and prompts whose samples all
scored alike are left out (``trained_rows``): without the first a bound of 2 stalled four runs
of five, without the second a solved run could fall back to a near-uniform policy
(docs/async_rl.md, "Stale samples"). ``--fill-pipeline`` makes every batch exactly
``max_staleness`` steps old, the bound's worst case, the same at every run of a seed.

    python cookbook/grpo_async.py                                  # one process, about 40 s
    python cookbook/grpo_async.py --mode ray                       # sampler and trainer in two Ray actors
    python cookbook/grpo_async.py --mode server --sampler-group    # against a server started here
    python cookbook/grpo_async.py --max-staleness 2 --partial-chunk 4
    python cookbook/grpo_async.py --max-staleness 4 --fill-pipeline

Each log line shows the mean reward, the staleness of the step's groups, the share of tokens
whose clip bites, the range of the importance weights trainer / sampler, and how long the
trainer waited for the groups.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from twinkle import assets, get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.advantage.dynamic_sampling import filter_groups
from twinkle.data_format import SampledSequence, SamplingParams
from twinkle.recipe import RECIPE_MODES, ModeSettings, RecipeParts, add_config_arguments, start_parts
from twinkle.reward import LetterWordsReward
from twinkle.reward.letter_words import letter_words_prompts
from twinkle.rl import AsyncRollouts, Session, Stamped, generate_partial

logger = get_logger()
ADAPTER = 'default'


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
    # > 0: the decoupled loss (Hilton et al. 2022; AReaL's): clip against the trainer's own policy, weight each
    # token by the truncated importance ratio trainer / sampler (rollout_correction, token level, this cap).
    # 0: GRPO's clip against the sampler, which at staleness k lets a token's probability grow by about
    # 1.2 ** (1 / k) a step and stalls learning at k = 2 (see loss_settings and docs/async_rl.md).
    correction_cap: float = 2.0
    # The loop waits until the rollouts are max_staleness batches ahead before each step: every batch is exactly
    # that many steps old (the worst case, and the same at every run of a seed), as with a sampler much faster than
    # training; in versions, less the skipped steps between (they change no weights).
    fill_pipeline: bool = False
    # Leave out each prompt's samples that all scored alike (advantage 0); no step when none is left (trained_rows).
    skip_flat_groups: bool = True
    sync: bool = False  # the synchronous loop, without threads
    # Where it runs (twinkle.recipe.ModeSettings): 'local', 'ray' (sampler and trainer in two actors) or 'server'.
    mode: str = 'local'
    threads: int = 0  # torch threads in each process (0: torch's default)
    url: str = ''  # --mode server: a running server to train on (with --api-key); else one starts here
    api_key: str = ''
    sampler_group: bool = False  # --mode server: the server samples on a process of its own (synced weights)


@dataclass
class Group:
    """One prompt's scored samples."""

    sequences: list[SampledSequence]
    rewards: list[float]
    advantages: list[float]


@contextmanager
def start(config: Config) -> Iterator[RecipeParts]:
    """The model (set up for GRPO), the sampler and their weight sync in ``config.mode``."""
    mode = ModeSettings(
        config.mode, config.seed, device='cpu', threads=config.threads, url=config.url, api_key=config.api_key,
        sampler_group=config.sampler_group,
    )  # fmt: skip
    with start_parts(mode, assets.tiny_model(config.model)) as parts:
        lora = LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, target_modules='all-linear')
        parts.model.add_adapter_to_model(ADAPTER, lora)
        parts.model.set_optimizer('AdamW', lr=config.lr)
        parts.model.set_loss('GRPOLoss', **loss_settings(config))
        parts.model.add_metric('GRPOMetric')
        yield parts


def loss_settings(config: Config) -> dict[str, Any]:
    """GRPOLoss's settings: by default the decoupled objective of Hilton, Cobbe and Schulman 2022
    (arXiv:2110.00641), as AReaL's async GRPO trains (Fu et al. 2025, arXiv:2505.24298)::

        term = -min(w, cap) * min(r * A, clip(r, 1 - eps, 1 + eps) * A)
        r = pi / sg(pi_prox),   w = pi_prox / pi_sampler                    (per token)

    where the proximal policy ``pi_prox`` is the trainer's weights at the step (one update per
    batch, so ``r = 1``). GRPO's own clip (``correction_cap=0``) takes ``r = pi / pi_sampler``:
    at staleness ``k`` it clips the tokens the ``k`` updates since moved by ``eps`` and the reward
    stalls (docs/async_rl.md, "Stale samples"). On-policy both are the same loss."""
    correction = {'level': 'token', 'mode': 'truncate', 'threshold': config.correction_cap}
    return {
        'epsilon': 0.2,
        'beta': config.beta,
        'rollout_correction': correction if config.correction_cap else None,
    }


def make_produce(parts: RecipeParts, config: Config) -> Callable[[Session], Group]:
    """Sample and score rollout item ``session.index``: ``prompts_per_call`` prompts, whose
    prompts and seed depend on the index only, so any run of the same config draws the same
    groups from the same weights."""
    prompts = letter_words_prompts(config.letters, config.steps * config.prompts_per_step, config.seed)
    reward_fn, advantage_fn = LetterWordsReward(config.target_words), GRPOAdvantage()
    per_call = config.prompts_per_call

    def produce(session: Session) -> Group:
        first = session.index * per_call % len(prompts)
        step = first // config.prompts_per_step + 1
        params = SamplingParams(
            max_tokens=config.max_tokens,
            num_samples=config.num_generations,
            temperature=config.temperature,
            seed=config.seed * 100_003 + step,
        )
        rows = prompts[first : first + per_call]
        if config.partial_chunk:
            responses = generate_partial(parts.sampler, session, rows, params, config.partial_chunk)
        else:
            with session.sampling():
                responses = parts.sampler.sample(rows, params)
        sequences = [seq for response in responses for seq in response.sequences]
        rewards = reward_fn([seq.new_input_feature for seq in sequences])
        advantages = advantage_fn(rewards, num_generations=config.num_generations, scale='group').tolist()
        return Group(sequences, rewards, advantages)

    return produce


def train_step(parts: RecipeParts, batch: list[Stamped[Group]], config: Config) -> dict[str, float]:
    """One GRPO step on the batch's groups; a reweighted stale group's advantages are scaled. With
    ``skip_flat_groups`` no step is taken when every prompt's samples scored alike. ``skipped`` is
    1 when the weights did not change: no step, or one the optimizer skipped (a NaN or infinite
    gradient norm); the loop then stages no new weights for the sampler."""
    sequences, advantages = trained_rows(batch, config)
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
    staleness = [item.staleness for item in batch]
    figures = {'staleness_mean': sum(staleness) / len(staleness), 'staleness_max': float(max(staleness))}
    parts.model.log_step_figures(figures, adapter_name=ADAPTER)
    grad_norm = parts.model.clip_grad_and_step()
    record['loss'] = float(output.loss)
    record.update(parts.model.calculate_metric(is_training=True))
    if grad_norm is None or not math.isfinite(grad_norm):  # the model skips a step with such a norm
        record['skipped'] = 1.0
    return record


def trained_rows(batch: list[Stamped[Group]], config: Config) -> tuple[list[SampledSequence], list[float]]:
    """The batch's sequences and advantages (times each item's weight) to train on. With
    ``skip_flat_groups`` a prompt's samples that all scored alike are left out: DAPO's dynamic
    sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2) without the refill. Their advantages
    are 0, so they add only the KL term's pull towards the base model, which once the task is
    solved goes on unchecked and took stale runs back to a near-uniform policy (docs/async_rl.md)."""
    sequences: list[SampledSequence] = []
    advantages: list[float] = []
    for item in batch:
        group, rows = item.value, range(len(item.value.rewards))
        if config.skip_flat_groups:
            rows = filter_groups(group.rewards, config.num_generations).kept_rows
        sequences += [group.sequences[row] for row in rows]
        advantages += [group.advantages[row] * item.weight for row in rows]
    return sequences, advantages


def train(config: Config) -> dict[str, Any]:
    """The loop; returns the per-step history and the run's totals."""
    if config.prompts_per_call < 1 or config.prompts_per_step % config.prompts_per_call:
        raise ValueError(
            f'prompts_per_call ({config.prompts_per_call}) must divide prompts_per_step ({config.prompts_per_step})'
        )
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with start(config) as parts:
        produce = make_produce(parts, config)
        started = time.perf_counter()
        if config.sync:
            history = _sync_loop(parts, produce, config)
            stats: dict[str, float] = {}
        else:
            history, stats = _async_loop(parts, produce, config)
        seconds = time.perf_counter() - started
    samples = config.steps * config.prompts_per_step * config.num_generations
    return {'history': history, 'seconds': seconds, 'samples_per_s': samples / seconds, 'stats': stats}


def _sync_loop(parts: RecipeParts, produce: Callable[[Session], Group], config: Config) -> list[dict[str, float]]:
    history: list[dict[str, float]] = []
    for step in range(1, config.steps + 1):
        started = time.perf_counter()
        if not history or not history[-1].get('skipped'):  # after a skipped step the sampler has the weights
            version, apply = parts.stage_weights()
            if apply is not None:
                apply()
        synced = time.perf_counter()
        groups = []
        items = config.prompts_per_step // config.prompts_per_call
        for j in range(items):
            index = (step - 1) * items + j
            session = Session(index, lambda v=version: v, lambda: None)
            groups.append(Stamped(produce(session), version, index=index))
        sampled = time.perf_counter()
        record = {'step': step, **train_step(parts, groups, config), 'staleness_mean': 0.0}
        # Where a synchronous step's time goes: the async loop overlaps sampling with the rest.
        record.update(sync_s=synced - started, sample_s=sampled - synced, train_s=time.perf_counter() - sampled)
        history.append(record)
        _log(record)
    return history


def _async_loop(
    parts: RecipeParts, produce: Callable[[Session], Group], config: Config
) -> tuple[list[dict[str, float]], dict[str, float]]:
    rollouts = AsyncRollouts(
        produce,
        batch_size=config.prompts_per_step // config.prompts_per_call,
        max_staleness=config.max_staleness,
        stale=config.stale,  # type: ignore[arg-type]
        workers=config.workers,
    )
    history = []
    with rollouts.running(*parts.stage_weights()):
        for step in range(1, config.steps + 1):
            waited = time.perf_counter()
            if config.fill_pipeline:
                rollouts.fill()
            batch = rollouts.next_batch()
            waited = time.perf_counter() - waited
            record = {'step': step, **train_step(parts, batch, config), 'wait_s': waited, **staleness_figures(batch)}
            if record.get('skipped'):  # the weights are the last step's: no copy, no new version
                rollouts.publish_unchanged()
            else:
                rollouts.publish(*parts.stage_weights())
            history.append(record)
            _log(record)
    return history, rollouts.stats.metrics()


def staleness_figures(batch: list[Stamped[Group]]) -> dict[str, float]:
    """The step's staleness: mean, max, and the share of its groups at each staleness."""
    counts = Counter(item.staleness for item in batch)
    figures = {f'staleness/{s}': n / len(batch) for s, n in sorted(counts.items())}
    figures['staleness_mean'] = sum(s * n for s, n in counts.items()) / len(batch)
    figures['staleness_max'] = float(max(counts))
    return figures


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
    logger.info(
        f'mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}; '
        f'{result["samples_per_s"]:.1f} samples/s; {result["stats"]}'
    )
    if config.output:
        Path(config.output).write_text(json.dumps({'config': asdict(config), **result}, indent=1))


if __name__ == '__main__':
    main()
