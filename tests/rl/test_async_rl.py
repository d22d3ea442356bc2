"""Async RL: rollouts that overlap training, bounded staleness, partial rollouts, and the
async GRPO recipe in one process, on Ray and against the service (two tenants at once)."""

from __future__ import annotations

import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError, StateError
from twinkle.rl import AsyncRollouts, Session, Stamped, generate_partial, trained_rows

COOKBOOK = Path(__file__).resolve().parents[2] / 'cookbook'


@pytest.fixture(scope='module')
def recipe() -> Any:
    sys.path.insert(0, str(COOKBOOK))
    try:
        import grpo_async

        yield grpo_async
    finally:
        sys.path.remove(str(COOKBOOK))


# ---- the bound, without a model ----------------------------------------------------------------
def _versioned(session: Session) -> int:
    with session.sampling() as version:
        return version


def test_max_staleness_0_plans_one_batch_at_a_time() -> None:
    """k=0: the items of batch b start only after the trainer published step b's weights."""
    seen: list[tuple[int, int]] = []
    rollouts = AsyncRollouts(lambda s: seen.append((s.index, _versioned(s))) or s.index, batch_size=2, max_staleness=0)
    with rollouts.running(5):
        for step in range(3):
            batch = rollouts.next_batch(timeout=30)
            assert [item.staleness for item in batch] == [0, 0]
            assert sorted(item.index for item in batch) == [2 * step, 2 * step + 1]
            rollouts.publish(6 + step)
    # Each item drew from the weights its batch trains on.
    assert sorted(seen)[:6] == [(0, 5), (1, 5), (2, 6), (3, 6), (4, 7), (5, 7)]


def _late_first_item(release: threading.Event) -> Any:
    def produce(session: Session) -> int:
        _versioned(session)
        if session.index == 0:  # sampled at once, but arrives only when the test lets it
            assert release.wait(30)
        return session.index

    return produce


def _train_until_item_0_is_handled(rollouts: AsyncRollouts[int], release: threading.Event) -> list[Any]:
    """Steps until item 0 (released after the second update) was dropped or trained: when it
    arrives depends on the threads, so the number of steps does too (a step every 10 ms, 30 s at most)."""
    items: list[Any] = []
    deadline = time.monotonic() + 30
    with rollouts.running(0):
        step = 0
        while not (rollouts.stats.dropped or any(item.index == 0 for item in items)):
            assert time.monotonic() < deadline, 'item 0 never arrived'
            items += rollouts.next_batch(timeout=30)
            step += 1
            rollouts.publish(step)
            if step == 2:
                release.set()
            time.sleep(0.01)
    return items


def test_a_sample_older_than_the_bound_never_trains() -> None:
    """Item 0 is sampled at version 0 but arrives after two updates or more: staler than 1, dropped."""
    release = threading.Event()
    rollouts = AsyncRollouts(_late_first_item(release), batch_size=1, max_staleness=1, workers=2)
    items = _train_until_item_0_is_handled(rollouts, release)
    assert all(item.staleness <= 1 for item in items)
    assert 0 not in [item.index for item in items]
    assert rollouts.stats.dropped == 1
    assert rollouts.stats.metrics()['dropped_stale'] == 1.0


def test_reweight_keeps_a_stale_sample_at_a_decayed_weight() -> None:
    release = threading.Event()
    rollouts = AsyncRollouts(
        _late_first_item(release), batch_size=1, max_staleness=1, workers=2, stale='reweight', decay=0.5
    )
    items = _train_until_item_0_is_handled(rollouts, release)
    late = next(item for item in items if item.index == 0)
    assert late.version == 0 and late.staleness >= 2
    assert late.weight == 0.5 ** (late.staleness - 1)
    assert all(item.weight == 1.0 and item.staleness <= 1 for item in items if item.index != 0)
    assert rollouts.stats.reweighted == 1 and rollouts.stats.dropped == 0


def test_weights_are_applied_between_generations_never_during_one() -> None:
    """A publish while a generation runs waits for it; the trainer does not."""
    inside = threading.Event()
    finish = threading.Event()
    applied: list[bool] = []

    def produce(session: Session) -> int:
        with session.sampling() as version:
            if session.index == 0:
                inside.set()
                assert finish.wait(30)
            return version

    rollouts = AsyncRollouts(produce, batch_size=1, max_staleness=1)
    with rollouts.running(0):
        assert inside.wait(30)
        rollouts.publish(1, apply=lambda: applied.append(finish.is_set()))  # returns at once
        assert applied == []
        finish.set()
        first = rollouts.next_batch(timeout=30)
        second = rollouts.next_batch(timeout=30)
    assert applied == [True]
    assert (first[0].value, second[0].value) == (0, 1)


def test_fill_trains_every_batch_exactly_max_staleness_old() -> None:
    """k=2, batches of 2: the bound plans 3 batches at version 0 (staleness 0, 1, 2 at steps 0-2); each
    publish(v) then lets one batch start, on v, which the trainer takes two publishes later: 2 old."""
    rollouts = AsyncRollouts(_versioned, batch_size=2, max_staleness=2)
    seen = []
    with rollouts.running(0):
        for step in range(6):
            rollouts.fill(timeout=30)
            assert rollouts.stats.produced - rollouts.stats.trained == 2 * 3  # the whole plan is ready: 3 batches
            batch = rollouts.next_batch(timeout=30)
            seen.append([(item.version, item.staleness) for item in batch])
            rollouts.publish(step + 1)
    assert seen == [[(0, 0)] * 2, [(0, 1)] * 2, [(0, 2)] * 2, [(1, 2)] * 2, [(2, 2)] * 2, [(3, 2)] * 2]


def test_a_step_that_left_the_weights_unchanged_moves_the_plan_but_not_the_version() -> None:
    """k=0, batches of 1: publish_unchanged() after step 0 lets item 1 start on version 0 (without it
    the plan would stay at one batch and next_batch wait forever); it trains 0 versions old."""
    rollouts = AsyncRollouts(_versioned, batch_size=1, max_staleness=0)
    seen = []
    with rollouts.running(0):
        for publish in (rollouts.publish_unchanged, lambda: rollouts.publish(1), rollouts.publish_unchanged):
            batch = rollouts.next_batch(timeout=30)
            seen.append([(item.version, item.staleness) for item in batch])
            publish()
        seen.append([(item.version, item.staleness) for item in rollouts.next_batch(timeout=30)])
    assert seen == [[(0, 0)], [(0, 0)], [(1, 0)], [(1, 0)]]
    assert rollouts.trainer_version == 1


def test_fill_raises_a_failed_produce_and_refuses_stopped_rollouts() -> None:
    def produce(session: Session) -> int:
        raise ValueError('sampler gone')

    rollouts = AsyncRollouts(produce, batch_size=1)
    with rollouts.running(0), pytest.raises(StateError, match='sampler gone'):
        rollouts.fill(timeout=30)
    with pytest.raises(StateError, match='not running'):
        rollouts.fill(timeout=1)


def test_a_failing_produce_is_raised_in_the_trainer_thread() -> None:
    def produce(session: Session) -> int:
        raise ValueError('reward server down')

    rollouts = AsyncRollouts(produce, batch_size=1)
    with rollouts.running(0), pytest.raises(StateError, match='reward server down'):
        rollouts.next_batch(timeout=30)


@pytest.mark.parametrize(
    ('kwargs', 'message'),
    [
        ({'max_staleness': -1}, 'max_staleness must be an integer >= 0'),
        ({'batch_size': 0}, 'batch_size must be an integer >= 1'),
        ({'stale': 'ignore'}, "stale 'ignore'"),
        ({'decay': 0.0}, r'decay must be in \(0, 1\]'),
        ({'workers': 1.5}, 'workers must be an integer'),
    ],
)
def test_bad_settings_are_refused_before_any_work(kwargs: dict[str, Any], message: str) -> None:
    settings = {'batch_size': 2, **kwargs}
    with pytest.raises(ConfigurationError, match=message):
        AsyncRollouts(_versioned, **settings)


# ---- partial rollouts on a real sampler ----------------------------------------------------------
class _PausingSampler:
    """Passes calls to a sampler; after the first, waits until the test has published weights."""

    def __init__(self, sampler: Any, first_done: threading.Event, go_on: threading.Event):
        self.sampler, self.first_done, self.go_on, self.calls = sampler, first_done, go_on, 0

    def sample(self, inputs: Any, sampling_params: Any = None) -> Any:
        responses = self.sampler.sample(inputs, sampling_params)
        self.calls += 1
        if self.calls == 1:
            self.first_done.set()
            assert self.go_on.wait(60)
        return responses


def test_a_partial_rollout_continues_on_the_new_weights(tiny_model_dir: str) -> None:
    from peft import LoraConfig

    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    torch.manual_seed(0)
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('default', LoraConfig(r=4, lora_alpha=8, target_modules='all-linear'))
    sampler = TorchSampler(tiny_model_dir, device='cpu')
    manager = CheckpointEngineManager(model, sampler)
    first_done, go_on = threading.Event(), threading.Event()
    pausing = _PausingSampler(sampler, first_done, go_on)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, num_samples=2, ignore_eos=True)
    prompt = {'input_ids': [5, 17, 42, 9]}

    def produce(session: Session) -> Any:
        return generate_partial(pausing, session, [prompt], params, chunk_tokens=2)

    rollouts = AsyncRollouts(produce, batch_size=1, max_staleness=2)
    staged = manager.stage_weights(merge_and_sync=False)
    with rollouts.running(staged.version, apply=lambda: manager.apply_staged(staged)):
        assert first_done.wait(60)
        with torch.no_grad():  # new weights, far from the old ones
            for name, param in model.model.named_parameters():
                if 'lora_B' in name:
                    param.normal_(0.0, 0.3)
        new = manager.stage_weights(merge_and_sync=False)
        rollouts.publish(new.version, apply=lambda: manager.apply_staged(new))
        go_on.set()
        [item] = rollouts.next_batch(timeout=60)
    responses = item.value
    old_version, new_version = staged.version, new.version
    assert item.version == old_version and item.staleness == new_version - old_version
    for seq in responses[0].sequences:
        assert seq.token_versions == [old_version] * 2 + [new_version] * 4
        assert seq.weight_version == old_version
        assert seq.new_input_feature['input_ids'] == prompt['input_ids'] + seq.tokens
        # Score the whole sequence with the new weights (now in the sampler): the continued tokens'
        # logprobs are the new weights', the first chunk's are not.
        scored = sampler.sample(
            [{'input_ids': prompt['input_ids'] + seq.tokens}],
            SamplingParams(max_tokens=1, prompt_logprobs=True, temperature=1.0),
        )[0].prompt_logprobs
        new_logps = torch.tensor(scored[len(prompt['input_ids']) :])
        drawn = torch.tensor(seq.token_logprobs)
        torch.testing.assert_close(drawn[2:], new_logps[2:], atol=1e-4, rtol=0)
        assert (drawn[:2] - new_logps[:2]).abs().max() > 1e-2


# ---- the recipe's loss on stale samples --------------------------------------------------------
def test_the_recipe_s_loss_still_trains_a_stale_token_the_updates_since_already_raised(recipe: Any) -> None:
    """One trained token, A = +1, sampled at p = 0.1 by weights two steps old; the trainer now gives
    it 1/4 (a vocabulary of 4, equal logits). GRPO's clip against the sampler sees r = 0.25 / 0.1 = 2.5
    > 1.2 and gives it no gradient: the stall measured at k = 2 (docs/async_rl.md). The recipe's
    decoupled loss has r = pi / sg(pi) = 1 and the weight min(w, 2) with w = 2.5, so its term is
    -2 * A * logp and d/dlogits = -2 * (onehot - 1/4). (The KL term's gradient is 0 at ref = logp.)"""
    from twinkle.loss import GRPOLoss

    def gradient(loss: GRPOLoss) -> torch.Tensor:
        logits = torch.zeros(1, 2, 4, requires_grad=True)
        out = loss(
            {'labels': torch.tensor([[-100, 0]])},
            {'logits': logits},
            advantages=[1.0],
            old_logps=[[math.log(0.1)]],
            ref_logps=[[-math.log(4)]],
        )
        out.loss.backward()
        assert logits.grad is not None
        return logits.grad[0, 1]

    stale = recipe.Config(max_staleness=2)
    expected = -2.0 * (torch.tensor([1.0, 0.0, 0.0, 0.0]) - 0.25)
    torch.testing.assert_close(gradient(GRPOLoss(**recipe.loss_settings(stale))), expected)
    coupled = recipe.loss_settings(recipe.Config(max_staleness=2, correction_cap=0.0))
    assert gradient(GRPOLoss(**coupled)).abs().max() == 0.0


# ---- the recipe: sync equals k=0, and the three runtimes ---------------------------------------
def _run(recipe: Any, **overrides: Any) -> dict[str, Any]:
    config = recipe.Config(**{'steps': 3, 'prompts_per_step': 2, 'num_generations': 4, **overrides})
    return recipe.train(config)


def test_max_staleness_0_gives_the_synchronous_loop_s_numbers(recipe: Any) -> None:
    sync = _run(recipe, sync=True)['history']
    zero = _run(recipe, max_staleness=0)['history']
    for a, b in zip(sync, zero, strict=True):
        for key in ('loss', 'total_reward', 'kl', 'entropy', 'skipped'):  # a skipped step has no loss
            assert a.get(key) == pytest.approx(b.get(key), abs=1e-6), key
        assert b['staleness_max'] == 0


def test_prompts_whose_samples_all_scored_alike_are_left_out(recipe: Any) -> None:
    """Item 0 holds two prompts of 2 samples, rewards (1, 1) and (0, 1), at weight 0.5; item 1 one
    prompt, (0, 0). Only the (0, 1) pair trains, its advantages (-1, 1) scaled to (-0.5, 0.5); a
    batch of flat prompts alone trains nothing, and its step is skipped."""
    config = recipe.Config(num_generations=2)
    batch = [
        Stamped(recipe.Group(['a', 'b', 'c', 'd'], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, -1.0, 1.0]), 0, weight=0.5),
        Stamped(recipe.Group(['e', 'f'], [0.0, 0.0], [0.0, 0.0]), 0),
    ]
    assert trained_rows(batch, 2) == (['c', 'd'], [-0.5, 0.5])
    assert trained_rows(batch[1:], 2) == ([], [])
    assert recipe.train_step(None, batch[1:], config) == {'total_reward': 0.0, 'signal_prompts': 0.0, 'skipped': 1.0}
    assert trained_rows(batch, 2, skip_flat=False)[0] == ['a', 'b', 'c', 'd', 'e', 'f']


class _NoSignalModel:
    """A model for the loop alone: each ``clip_grad_and_step`` returns the next of ``norms`` (a
    NaN norm is an optimizer step the model skipped); ``versions``: the weights each
    ``forward_backward``'s samples came from."""

    def __init__(self, norms: list[float]):
        self.norms, self.steps, self.versions = norms, 0, []

    def forward_backward(self, *, inputs: list[dict[str, list[int]]], **_: Any) -> Any:
        self.versions.append(inputs[0]['input_ids'][0])
        return SimpleNamespace(loss=0.5)

    def log_step_figures(self, figures: dict[str, float], *, adapter_name: str) -> None:
        pass

    def clip_grad_and_step(self) -> float:
        self.steps += 1
        return self.norms[self.steps - 1]

    def calculate_metric(self, is_training: bool) -> dict[str, float]:
        return {}


@pytest.mark.parametrize('loop', ['sync', 'async_k0', 'async_k1'])
def test_a_skipped_step_stages_no_weights_and_keeps_the_version(recipe: Any, loop: str) -> None:
    """4 steps of one prompt, 2 samples: step 2's samples score alike (no prompt left to train on),
    step 3's optimizer skips (a NaN gradient norm). Only steps 1 and 4 change the weights, so each
    loop stages 1 + 2 copies (versions 0, 1, 2) and steps 2-4 sample version 1, not 2 and 3. Before
    the fix every step staged: 5 copies."""
    staged: list[int] = []

    def stage() -> tuple[int, Any]:
        staged.append(len(staged))
        return staged[-1], None

    def produce(session: Session) -> Any:
        with session.sampling() as version:
            rewards = [1.0, 1.0] if session.index == 1 else [0.0, 1.0]
            sequence = SimpleNamespace(new_input_feature={'input_ids': [version]}, token_logprobs=[0.0])
            return recipe.Group([sequence, sequence], rewards, [r - 0.5 for r in rewards])

    model = _NoSignalModel([1.0, math.nan, 1.0])
    parts = SimpleNamespace(model=model, stage_weights=stage)  # what the loops use of a RecipeParts
    k = {'sync': 0, 'async_k0': 0, 'async_k1': 1}[loop]
    config = recipe.Config(steps=4, prompts_per_step=1, num_generations=2, max_staleness=k, sync=loop == 'sync')
    history = recipe._loop(parts, produce, config)[0]
    assert [record.get('skipped', 0.0) for record in history] == [0.0, 1.0, 1.0, 0.0]
    assert model.steps == 3 and staged == [0, 1, 2]
    # Steps 1, 3, 4 trained: step 1 on the first weights, 3 and 4 on step 1's (at k=1 too: item 2 is
    # planned only once step 1 published, item 3 once step 2 finished).
    assert model.versions == [0, 1, 1]


def test_a_filled_pipeline_trains_every_step_after_the_first_k_at_exactly_k(recipe: Any) -> None:
    """Every step trains (no prompt left out), so each changes the weights: a batch k steps old is
    k versions old. (With prompts left out a step may change none; the staleness is then lower.)"""
    result = _run(recipe, steps=4, max_staleness=2, fill_pipeline=True, skip_flat_groups=False)
    assert [record['staleness_max'] for record in result['history']] == [0, 1, 2, 2]
    assert [record['staleness/2'] for record in result['history'][2:]] == [1.0, 1.0]  # every group


def test_async_recipe_stays_within_its_bound_in_one_process(recipe: Any) -> None:
    result = _run(recipe, max_staleness=1, partial_chunk=3)
    assert all(record['staleness_max'] <= 1 for record in result['history'])
    assert result['stats']['staleness/1'] > 0  # it did run ahead


@pytest.mark.integration
def test_async_recipe_on_ray_sampler_and_model_groups(recipe: Any) -> None:
    result = _run(recipe, max_staleness=1, mode='ray')
    assert all(record['staleness_max'] <= 1 for record in result['history'])
    assert len(result['history']) == 3


def test_a_cpu_sampler_group_and_its_model_split_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each taking every core had two sets of torch threads contend for them (the recipe in server
    mode sampled 0.43 of one process's samples/s, 1.03 split: docs/async_rl.md): on 2 cores the model
    (in the server's process) and one sampler rank get 1 each; on 16 with 3 sampler ranks, 16 // 4 = 4
    a rank and the 4 left to the model. A model on a GPU, or on ranks of its own, keeps the old way."""
    from twinkle.server.config import ServerConfig
    from twinkle.server.execution.groups import sampler_group
    from twinkle.server.execution.hosts import multi_rank

    config = ServerConfig(base_model='m', device='cpu')
    monkeypatch.setattr(sampler_group, '_cores', lambda: 2)
    assert sampler_group.cpu_split(config, 1, 'cpu') == (1, 1)
    monkeypatch.setattr(sampler_group, '_cores', lambda: 16)
    assert sampler_group.cpu_split(config, 3, 'cpu') == (4, 4)
    assert sampler_group.cpu_split(config, 1, 'cuda:1') is None
    assert sampler_group.cpu_split(config.model_copy(update={'device': 'cuda:0'}), 1, 'cpu') is None
    assert sampler_group.cpu_split(config.model_copy(update={'ranks': 2}), 1, 'cpu') is None
    # The worker takes what ProcessRanks gives it, else its share of the machine among its ranks.
    monkeypatch.setenv(multi_rank.THREADS_ENV, '3')
    assert multi_rank.rank_threads(world=1) == 3
    monkeypatch.delenv(multi_rank.THREADS_ENV)
    assert multi_rank.rank_threads(world=2) == max(1, (os.cpu_count() or 1) // 2)


@pytest.mark.integration
def test_two_tenants_async_loops_share_one_service_each_within_its_budget(recipe: Any, tiny_model_dir: str) -> None:
    from twinkle.server.cli import BackgroundServer
    from twinkle.server.config import ServerConfig
    from twinkle.server.store import Store

    with tempfile.TemporaryDirectory() as data_dir:
        # A sampler group of its own: one tenant's sampling runs while the other's step trains.
        sampler = {'ranks': 1, 'device': 'cpu'}
        server_config = ServerConfig.build(base_model=tiny_model_dir, port=0, data_dir=data_dir, sampler=sampler)
        with Store(server_config.db_path) as store:
            keys = [store.tenants.add(name)[1] for name in ('alice', 'bob')]
        results: dict[int, dict[str, Any]] = {}
        errors: list[BaseException] = []
        with BackgroundServer(server_config) as url:

            def tenant(budget: int, key: str) -> None:
                try:
                    results[budget] = _run(
                        recipe, max_staleness=budget, mode='server', url=url, api_key=key, sampler_group=True
                    )
                except BaseException as error:
                    errors.append(error)

            threads = [
                threading.Thread(target=tenant, args=(budget, key)) for budget, key in zip((0, 2), keys, strict=True)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=300)
        assert not errors, errors
    assert all(record['staleness_max'] == 0 for record in results[0]['history'])
    assert all(record['staleness_max'] <= 2 for record in results[2]['history'])
    assert max(record['staleness_max'] for record in results[2]['history']) >= 1  # it used its budget
