"""Async GRPO on the letter-words task: sampling overlaps training, within a staleness bound.

The task, reward and hyper-parameters of ``grpo_letter_words.py`` (imported from there). A
background thread samples one prompt's group at a time (``produce``) with the sampler's current
weights while the loop trains on groups already scored; after each step that changed the
weights the loop stages a copy of them and the rollout thread loads them into the sampler
between two generations (``--partial-chunk N``: between two chunks of N tokens, so a generation
spanning an update continues on the new weights). ``--max-staleness k`` bounds how many steps behind the trainer a
group may be; ``--max-staleness 0`` is the synchronous loop, step for step and number for number
(``--sync`` runs that loop without threads, for comparison).

Stale groups train with the decoupled loss (``loss_settings``: the clip against the trainer's
own policy, the sampler only in a truncated importance weight), and prompts whose samples all
scored alike are left out (``trained_rows``): without the first a bound of 2 stalled four runs
of five, without the second a solved run could fall back to a near-uniform policy
(docs/async_rl.md, "Stale samples"). ``--fill-pipeline`` makes every batch exactly
``max_staleness`` steps old, the bound's worst case, the same at every run of a seed (as many
versions old, less the steps between that were skipped: they left the weights as they were).

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
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from grpo_letter_words import ADAPTER, LetterWordsReward, prompt
from grpo_letter_words import Config as LetterWordsConfig
from peft import LoraConfig

import twinkle
from twinkle import DeviceGroup, assets, get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.data_format import SampledSequence, SamplingParams
from twinkle.rl import AsyncRollouts, Session, Stamped, generate_partial

logger = get_logger()
MODES = ('local', 'ray', 'server')


@dataclass
class Config(LetterWordsConfig):
    """``grpo_letter_words``'s settings (the task, the model, the optimizer) and the async loop's."""

    steps: int = 60
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
    mode: str = 'local'
    sync: bool = False  # the synchronous loop, without threads
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


class Runtime:
    """The model, the sampler and the weight sync of one mode: the one runtime-aware part."""

    def __init__(self, model: Any, sampler: Any, stage: Callable[[], tuple[int, Callable[[], object] | None]]):
        self.model, self.sampler, self.stage = model, sampler, stage


@contextmanager
def start(config: Config) -> Iterator[Runtime]:
    model_dir = assets.tiny_model(config.model)
    lora = LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, target_modules='all-linear')
    if config.mode == 'server':
        with _server(model_dir, config) as (model, sampler):
            _configure(model, lora, config)
            yield Runtime(model, sampler, _server_stage(model, sampler, config))
        return
    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    if config.mode == 'ray':
        from twinkle.infra.ray.cluster import start_local

        start_local(2)
        groups = [DeviceGroup('model', 1, 'cpu'), DeviceGroup('sampler', 1, 'cpu')]
        twinkle.initialize(mode='ray', groups=groups, seed=config.seed)
    else:
        twinkle.initialize(mode='local', seed=config.seed)
    model = TransformersModel(model_dir, device='cpu', remote_group='model')
    _configure(model, lora, config)
    sampler = TorchSampler(model_dir, device='cpu', remote_group='sampler')
    if config.threads and config.mode == 'ray':
        sampler.remote_execute(_set_threads, config.threads, dispatch='all')
    manager = CheckpointEngineManager(model, sampler)

    def stage() -> tuple[int, Callable[[], object]]:
        staged = manager.stage_weights(merge_and_sync=False)
        return staged.version, lambda: manager.apply_staged(staged)

    try:
        yield Runtime(model, sampler, stage)
    finally:
        if config.mode == 'ray':
            import ray

            ray.shutdown()


@contextmanager
def _server(model_dir: str, config: Config) -> Iterator[tuple[Any, Any]]:
    """The client model and sampler of a run on the server at ``config.url``; without one, a
    server on the tiny model in this process (with a sampler group if asked), one tenant."""
    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.sampler import TorchSampler as ClientSampler

    if config.url:
        model = MultiLoraTransformersModel(client=init_twinkle_client(base_url=config.url, api_key=config.api_key))
        yield model, ClientSampler(model=model)
        return
    from twinkle.server.cli import BackgroundServer
    from twinkle.server.config import ServerConfig
    from twinkle.server.store import Store

    sampler = {'sampler': {'ranks': 1, 'device': 'cpu'}} if config.sampler_group else {}
    with tempfile.TemporaryDirectory() as data_dir:
        server_config = ServerConfig.build(base_model=model_dir, port=0, data_dir=data_dir, **sampler)
        with Store(server_config.db_path) as store:
            key = store.tenants.add('async')[1]
        with BackgroundServer(server_config) as url, _server(model_dir, replace(config, url=url, api_key=key)) as pair:
            yield pair


def _server_stage(model: Any, sampler: Any, config: Config) -> Callable[[], tuple[int, Callable[[], object] | None]]:
    """Versions are the run's optimizer steps (what the server records on each sequence): the loop
    stages after each step that changed the weights, none after a skipped one. With a sampler
    group, ``apply`` saves the run's weights for it; without one the server samples the trainer's
    current weights and there is nothing to apply."""
    from twinkle_client.checkpoint_engine import CheckpointEngineManager as ClientManager

    manager, steps = ClientManager(model, sampler), iter(range(1_000_000))
    if not config.sampler_group:
        return lambda: (next(steps), None)
    return lambda: (next(steps), lambda: manager.sync_weights())


def _configure(model: Any, lora: LoraConfig, config: Config) -> None:
    if config.threads and config.mode == 'ray':
        model.remote_execute(_set_threads, config.threads, dispatch='all')
    model.add_adapter_to_model(ADAPTER, lora)
    model.set_optimizer('AdamW', lr=config.lr)
    model.set_loss('GRPOLoss', **loss_settings(config))
    model.add_metric('GRPOMetric')


def loss_settings(config: Config) -> dict[str, Any]:
    """GRPOLoss's settings: by default the decoupled objective of Hilton, Cobbe and Schulman 2022
    ("Batch size-invariance for policy optimization", arXiv:2110.00641), which AReaL's async GRPO
    trains with (Fu et al. 2025, arXiv:2505.24298)::

        term = -min(w, cap) * min(r * A, clip(r, 1 - eps, 1 + eps) * A)
        r = pi / sg(pi_prox),   w = pi_prox / pi_sampler                    (per token)

    where the proximal policy ``pi_prox`` is the trainer's weights at the step (one update per
    batch, so ``r = 1``). GRPO's own clip (``correction_cap=0``) takes ``r = pi / pi_sampler``
    instead: a sample ``k`` steps old has its tokens clipped once the ``k`` updates since it was
    drawn moved them by ``eps`` (here 23 % of the tokens at ``k = 2``), so a rewarded token's
    probability grows by about ``(1 + eps) ** (1 / k)`` a step at most and the reward stalls.
    On-policy (``k = 0``) both are the same loss."""
    correction = {'level': 'token', 'mode': 'truncate', 'threshold': config.correction_cap}
    return {
        'epsilon': 0.2,
        'beta': config.beta,
        'rollout_correction': correction if config.correction_cap else None,
    }


def _set_threads(component: Any, threads: int) -> None:
    torch.set_num_threads(threads)


def prompts_of(config: Config) -> list[dict[str, Any]]:
    """Every group's prompt, drawn up front from the run's seed."""
    rng = random.Random(config.seed)
    return [prompt(rng.choice(config.letters)) for _ in range(config.steps * config.prompts_per_step)]


def make_produce(runtime: Runtime, config: Config) -> Callable[[Session], Group]:
    """Sample and score rollout item ``session.index``: ``prompts_per_call`` prompts, whose
    prompts and seed depend on the index only, so any run of the same config draws the same
    groups from the same weights."""
    prompts, reward_fn, advantage_fn = prompts_of(config), LetterWordsReward(config.target_words), GRPOAdvantage()
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
            responses = generate_partial(runtime.sampler, session, rows, params, config.partial_chunk)
        else:
            with session.sampling():
                responses = runtime.sampler.sample(rows, params)
        sequences = [seq for response in responses for seq in response.sequences]
        rewards = reward_fn([seq.new_input_feature for seq in sequences])
        advantages = advantage_fn(rewards, num_generations=config.num_generations, scale='group').tolist()
        return Group(sequences, rewards, advantages)

    return produce


def train_step(runtime: Runtime, batch: list[Stamped[Group]], config: Config) -> dict[str, float]:
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
    output = runtime.model.forward_backward(
        inputs=[seq.new_input_feature for seq in sequences],
        old_logps=[seq.token_logprobs for seq in sequences],
        advantages=advantages,
    )
    # The step's staleness joins its log (a server's run history and dashboard) beside the loss's figures.
    staleness = [item.staleness for item in batch]
    figures = {'staleness_mean': sum(staleness) / len(staleness), 'staleness_max': float(max(staleness))}
    runtime.model.log_step_figures(figures, adapter_name=ADAPTER)
    grad_norm = runtime.model.clip_grad_and_step()
    record['loss'] = float(output.loss)
    record.update(runtime.model.calculate_metric(is_training=True))
    if grad_norm is None or not math.isfinite(grad_norm):  # the model skips a step with such a norm
        record['skipped'] = 1.0
    return record


def trained_rows(batch: list[Stamped[Group]], config: Config) -> tuple[list[SampledSequence], list[float]]:
    """The batch's sequences and advantages to train on. With ``skip_flat_groups`` a prompt's
    samples that all scored alike are left out: DAPO's dynamic sampling (Yu et al. 2025,
    arXiv:2503.14476, section 3.2), without its sampling more to refill the batch. Their
    advantages are 0, so they add only the KL term's pull towards the base model; once the policy
    solves the task every prompt is such, and that pull alone goes on unchecked until a batch
    sampled after it shows the reward it costs: at the next step when synchronous, ``k`` steps
    later at staleness ``k``, by when it had taken a run back to a near-uniform policy
    (docs/async_rl.md, "Stale samples")."""
    n = config.num_generations
    sequences: list[SampledSequence] = []
    advantages: list[float] = []
    for item in batch:
        group = item.value
        for start in range(0, len(group.sequences), n):
            scores = group.rewards[start : start + n]
            if config.skip_flat_groups and max(scores) == min(scores):
                continue
            sequences += group.sequences[start : start + n]
            advantages += [a * item.weight for a in group.advantages[start : start + n]]
    return sequences, advantages


def train(config: Config) -> dict[str, Any]:
    """The loop; returns the per-step history and the run's totals."""
    if config.prompts_per_call < 1 or config.prompts_per_step % config.prompts_per_call:
        raise ValueError(
            f'prompts_per_call ({config.prompts_per_call}) must divide prompts_per_step ({config.prompts_per_step})'
        )
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    if config.threads:
        torch.set_num_threads(config.threads)
    with start(config) as runtime:
        produce = make_produce(runtime, config)
        started = time.perf_counter()
        if config.sync:
            history = _sync_loop(runtime, produce, config)
            stats: dict[str, float] = {}
        else:
            history, stats = _async_loop(runtime, produce, config)
        seconds = time.perf_counter() - started
    samples = config.steps * config.prompts_per_step * config.num_generations
    return {'history': history, 'seconds': seconds, 'samples_per_s': samples / seconds, 'stats': stats}


def _sync_loop(runtime: Runtime, produce: Callable[[Session], Group], config: Config) -> list[dict[str, float]]:
    history: list[dict[str, float]] = []
    for step in range(1, config.steps + 1):
        started = time.perf_counter()
        if not history or not history[-1].get('skipped'):  # after a skipped step the sampler has the weights
            version, apply = runtime.stage()
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
        record = {'step': step, **train_step(runtime, groups, config), 'staleness_mean': 0.0}
        # Where a synchronous step's time goes: the async loop overlaps sampling with the rest.
        record.update(sync_s=synced - started, sample_s=sampled - synced, train_s=time.perf_counter() - sampled)
        history.append(record)
        _log(record)
    return history


def _async_loop(
    runtime: Runtime, produce: Callable[[Session], Group], config: Config
) -> tuple[list[dict[str, float]], dict[str, float]]:
    rollouts = AsyncRollouts(
        produce,
        batch_size=config.prompts_per_step // config.prompts_per_call,
        max_staleness=config.max_staleness,
        stale=config.stale,  # type: ignore[arg-type]
        workers=config.workers,
    )
    history = []
    with rollouts.running(*runtime.stage()):
        for step in range(1, config.steps + 1):
            waited = time.perf_counter()
            if config.fill_pipeline:
                rollouts.fill()
            batch = rollouts.next_batch()
            waited = time.perf_counter() - waited
            record = {'step': step, **train_step(runtime, batch, config), 'wait_s': waited, **staleness_figures(batch)}
            if record.get('skipped'):  # the weights are the last step's: no copy, no new version
                rollouts.publish_unchanged()
            else:
                rollouts.publish(*runtime.stage())
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
    for name, default in asdict(Config()).items():
        flag = f'--{name.replace("_", "-")}'
        if isinstance(default, bool):  # --flag and --no-flag
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif name == 'mode':
            parser.add_argument(flag, choices=MODES, default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)
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
