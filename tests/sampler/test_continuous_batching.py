"""Continuous batching on the torch sampler: calls made while another generates join its batch at the
next step, each with its own adapter, seed, parameters and stop conditions, and get what they get
alone; rows leave as they end, and rows past ``max_batch_size`` wait for room. Then the scheduler's
sharing jobs (a paused one waits behind its tenant's next ones), and a real server: concurrent Tinker
SDK requests of two tenants decode in one batch, each with the tokens it gets alone.

Alone and batched differ only in the shapes the numbers are computed on (padding, batch size): the
tokens are compared exactly, the logprobs within 1e-4 (float32 rounding of a batched matmul)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from peft import LoraConfig
from server_helpers import Gate, background_server
from tinker import types

from twinkle import assets
from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.sampler import TorchSampler
from twinkle.server.execution.scheduling.scheduler import Continue, Scheduler

TIMEOUT = 120.0
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)  # B != 0: not the base


@pytest.fixture(scope='module', params=['tiny-qwen3', 'tiny-qwen3.5'])
def sampler(request: pytest.FixtureRequest) -> TorchSampler:
    """A sampler with two adapters of random weights; tiny-qwen3.5's linear-attention layers keep
    conv and recurrent states per row, which a join concatenates."""
    made = TorchSampler(assets.tiny_model(request.param), device='cpu')
    torch.manual_seed(0)
    made.add_adapter('a', LORA)
    made.add_adapter('b', LORA)
    return made


def calls(sampler: TorchSampler) -> list[tuple[list[dict[str, Any]], SamplingParams, str | None]]:
    """Calls unlike one another: adapters, temperatures, top-k and top-p, penalties, stop strings, prompt
    logprobs, lengths (``max_tokens`` 3 to 14) and two samples of one prompt."""
    penalised = SamplingParams(max_tokens=12, seed=1, repetition_penalty=1.3, ignore_eos=True)
    text = alone(sampler, [FIRST[0][0]], penalised, 'a')[0].sequences[0].decoded
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # what its text holds halfway, as a stop string
    return [
        ([{'input_ids': [7, 8, 9, 10, 11, 12, 13]}], SamplingParams(max_tokens=14, temperature=0.7, top_k=20,
         seed=2, num_samples=2, logprobs=2, ignore_eos=True), 'a'),
        ([{'input_ids': [5, 6]}], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), 'b'),
        ([FIRST[0][0]], SamplingParams(max_tokens=12, seed=1, stop=[stop] if stop else None, repetition_penalty=1.3,
         ignore_eos=True), 'a'),
        ([{'input_ids': [3, 1, 4, 1, 5, 9, 2, 6]}], SamplingParams(max_tokens=3, top_p=0.8, seed=4,
         prompt_logprobs=True, topk_prompt_logprobs=2, ignore_eos=True), 'b'),
        ([{'input_ids': [21, 22, 23]}], SamplingParams(max_tokens=9, seed=5, ignore_eos=True), None),
    ]  # fmt: skip


#: The call every batch starts with: the others join it.
FIRST = ([{'input_ids': [11, 42, 7, 99, 5]}], SamplingParams(max_tokens=12, seed=1, ignore_eos=True), None)


def alone(sampler: TorchSampler, prompts: list[dict[str, Any]], params: SamplingParams, adapter: str | None):
    """The call made with nothing else in the batch."""
    assert sampler.batch.active == 0
    return sampler.sample(prompts, params, adapter_name=adapter)


class JoinAfter:
    """``turns`` of the first call: after its ``steps`` steps the other calls start, each on a thread of
    its own; once each has added its rows (they wait for the batch, which this call holds), the first
    steps on with them in the batch. Nothing ever gives way."""

    def __init__(self, sampler: TorchSampler, others: list[Any], steps: int):
        self.sampler, self.others, self.steps, self.count = sampler, others, steps, 0
        self.results: list[list[SampleResponse] | None] = [None] * len(others)
        self.threads: list[threading.Thread] = []

    def due(self) -> bool:
        self.count += 1  # asked before each step
        if self.count == self.steps + 1:
            rows = sum(len(prompts) * params.num_samples for prompts, params, _ in self.others)
            rows += self.sampler.batch.waiting  # before its first step, the first call's own row waits too
            for i in range(len(self.others)):
                self.threads.append(threading.Thread(target=self._call, args=(i,)))
                self.threads[-1].start()
            wait_for(lambda: self.sampler.batch.waiting == rows)
        return False

    def _call(self, i: int) -> None:
        prompts, params, adapter = self.others[i]
        self.results[i] = self.sampler.sample(prompts, params, adapter_name=adapter)

    def give_way(self) -> None:
        raise AssertionError('never due')

    def time_limit_s(self) -> float | None:
        return None

    def join(self) -> None:
        for thread in self.threads:
            thread.join(TIMEOUT)


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, 'timed out'
        time.sleep(0.001)


def assert_same(batched: list[SampleResponse], single: list[SampleResponse]) -> None:
    """The same tokens, stops and text; the logprobs within float32 rounding."""
    for got, want in zip(batched, single, strict=True):
        for seq, ref in zip(got.sequences, want.sequences, strict=True):
            assert (seq.tokens, seq.stop_reason, seq.decoded) == (ref.tokens, ref.stop_reason, ref.decoded)
            for entry, ref_entry in zip(seq.logprobs, ref.logprobs, strict=True):
                assert [t for t, _ in entry] == [t for t, _ in ref_entry]
                assert [v for _, v in entry] == pytest.approx([v for _, v in ref_entry], abs=1e-4)
        if want.prompt_logprobs is not None:
            assert got.prompt_logprobs == pytest.approx(want.prompt_logprobs, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('steps', [0, 4], ids=['at-once', 'mid-generation'])
def test_calls_made_while_one_generates_join_its_batch_and_get_what_they_get_alone(sampler, steps):
    others = calls(sampler)
    single = [alone(sampler, *FIRST), *(alone(sampler, *call) for call in others)]
    # Steps alone: each call's longest row (its max_tokens, or where its stop string ended it).
    steps_alone = sum(max(len(s.tokens) for r in responses for s in r.sequences) for responses in single)
    sampler.batch.step_sizes.clear()
    turns = JoinAfter(sampler, others, steps)
    sampler.turns = turns
    try:
        first = sampler.sample(*FIRST[:2], adapter_name=FIRST[2])
        turns.join()
    finally:
        sampler.turns = None
    assert_same(first, single[0])
    for got, want in zip(turns.results, single[1:], strict=True):
        assert got is not None
        assert_same(got, want)
    sizes = list(sampler.batch.step_sizes)
    # 1 row, then from its step `steps` on all 7 rows (5 calls: one of 2 samples) in one step.
    assert sizes[:steps] == [1] * steps and sizes[steps] == 7
    # Rows leave as they end: the greedy call's (5 tokens) is gone after its 5th step, and no row comes back.
    assert sizes[steps + 5] < 7 and sizes[steps:] == sorted(sizes[steps:], reverse=True)
    assert len(sizes) < steps_alone  # shared steps: fewer than the calls take one after another


def test_rows_past_max_batch_size_wait_and_join_as_others_end(tiny_model_dir):
    prompts = [{'input_ids': [i + 1, i + 2, i + 3][: 1 + i % 3]} for i in range(5)]
    params = SamplingParams(max_tokens=6, seed=9, ignore_eos=True, stop=[17])
    capped = TorchSampler(tiny_model_dir, device='cpu', max_batch_size=2)
    whole = TorchSampler(tiny_model_dir, device='cpu')
    assert_same(capped.sample(prompts, params), whole.sample(prompts, params))
    assert max(capped.batch.step_sizes) == 2 and max(whole.batch.step_sizes) == 5
    assert capped.batch.active == 0 and capped.batch.waiting == 0


def test_a_call_that_fails_takes_its_rows_out_and_the_others_go_on(sampler):
    want = alone(sampler, *FIRST)

    class FailAfter:
        """``turns`` that unwinds the call from its third give-way, as a cancelled slice does."""

        count = 0

        def due(self) -> bool:
            return True

        def give_way(self) -> None:
            self.count += 1
            if self.count == 3:
                raise KeyboardInterrupt  # what a cancelled slice thread raises is a BaseException too

        def time_limit_s(self) -> float | None:
            return None

    sampler.turns = FailAfter()
    try:
        with pytest.raises(KeyboardInterrupt):
            sampler.sample([{'input_ids': [1, 2, 3]}], SamplingParams(max_tokens=20, seed=3, ignore_eos=True))
    finally:
        sampler.turns = None
    assert sampler.batch.active == 0 and sampler.batch.waiting == 0 and not sampler.busy
    assert_same(alone(sampler, *FIRST), want)


def test_a_calls_time_limit_ends_its_rows_alone(sampler):
    class Limited:
        def due(self) -> bool:
            return False

        def give_way(self) -> None:
            raise AssertionError('never due')

        def time_limit_s(self) -> float | None:
            return 0.0  # no step is shorter: every row ends after its first token

    sampler.turns = Limited()
    try:
        [response] = sampler.sample([{'input_ids': [1, 2, 3]}], SamplingParams(max_tokens=20, num_samples=2, seed=3))
    finally:
        sampler.turns = None
    assert [(len(s.tokens), s.stop_reason) for s in response.sequences] == [(1, 'length'), (1, 'length')]


# ---- the scheduler: sampling jobs of one tenant pass one another ----------------------------------------
@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    made = Scheduler(shares=lambda job: job.operation == 'sample')
    yield made
    made.stop()


def sharing(order: list[str], label: str, count: int, joining: Callable[[], bool] | None = None) -> Callable[[], Any]:
    """A job of ``count`` slices: each appends ``label<i>``; with ``joining`` the first records whether
    a sampling job that has not started waits."""

    def slice_at(index: int) -> Any:
        order.append(f'{label}{index}' + ('+' if index == 0 and joining is not None and joining() else ''))
        return f'{label} done' if index + 1 == count else Continue(lambda: slice_at(index + 1))

    return lambda: slice_at(0)


def test_a_paused_sampling_job_waits_behind_its_tenants_next_ones_not_its_training(scheduler):
    order: list[str] = []
    jobs = [
        scheduler.submit('alice', sharing(order, 'x', 3, scheduler.joiners_waiting), operation='sample'),
        scheduler.submit('alice', sharing(order, 'y', 2, scheduler.joiners_waiting), operation='sample'),
        scheduler.submit('alice', sharing(order, 'step', 1), operation='optim_step'),
        scheduler.submit('alice', sharing(order, 'z', 1), operation='sample'),
    ]
    scheduler.start()
    assert all(job.wait(TIMEOUT) for job in jobs)
    # x starts and sees y waiting to join (+); paused, it waits behind y, which starts (no job left to
    # join), then they take turns. The step waits for both; z, sent after it, runs after it.
    assert order == ['x0+', 'y0', 'x1', 'y1', 'x2', 'step0', 'z0']


# ---- a real server ---------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('batching'), tiny_model_dir) as (url, keys, running):
        yield url, keys, running.app.state.service


@pytest.mark.integration
def test_concurrent_tinker_requests_of_two_tenants_share_a_batch(server, tiny_model_dir, sdk_clients):
    url, keys, service = server
    clients = {name: sdk_clients(url, keys[name]).create_sampling_client(base_model=tiny_model_dir).result()
               for name in ('alice', 'bob')}  # fmt: skip
    requests = [  # (tenant, prompt, max_tokens, seed, temperature)
        ('alice', [11, 42, 7], 16, 1, 1.0),
        ('alice', [5, 6, 7, 8, 9], 8, 2, 0.7),
        ('alice', [3], 12, 3, 0.0),
        ('bob', [11, 42, 7], 16, 4, 1.0),
        ('bob', [1, 2], 10, 5, 1.2),
    ]

    def send(tenant: str, prompt: list[int], max_tokens: int, seed: int, temperature: float) -> Any:
        params = types.SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature)
        return clients[tenant].sample(types.ModelInput.from_ints(prompt), 1, params)

    single = [send(*request).result() for request in requests]
    batch = service.default.host.sampler().batch
    batch.step_sizes.clear()
    scheduler = service.default.scheduler
    gate = Gate(scheduler)  # holds the worker: the requests wait together, then run
    futures = [send(*request) for request in requests]
    wait_for(lambda: scheduler.queued() == len(requests))
    gate.open()
    results = [future.result() for future in futures]
    for got, want in zip(results, single, strict=True):
        assert got.sequences[0].tokens == want.sequences[0].tokens
        assert got.sequences[0].logprobs == pytest.approx(want.sequences[0].logprobs, abs=1e-4)
    sizes = list(batch.step_sizes)
    assert max(sizes) == len(requests)  # every request's row in one step
    assert len(sizes) < sum(max_tokens for _, _, max_tokens, _, _ in requests)
