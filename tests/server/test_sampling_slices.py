"""Sampling in slices: a long sampling request gives the worker up every ``sampling_slice_ms`` and
goes on at its tenant's next turn, so another tenant's training step waits for one slice, not the
whole reply; the reply is the one an unsliced run gives for the same seed, whatever ran between
its slices; and a request is bounded in tokens (``max_sampled_tokens_per_request``) and in worker
time (``max_sampling_s``).

Three layers: the scheduler's ``Continue`` (a job that yields goes back to the head of its tenant's
queue, behind the other tenants' turns), ``slicing.sliced`` (a job function run on a thread of its
own, handed the worker turn by turn) with the torch sampler that gives way between decode steps,
and a real server on loopback. Order is asserted by events, never by wall-clock thresholds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
import torch
from peft import LoraConfig
from server_helpers import background_server, token_rows
from tinker import types

from twinkle.data_format import SamplingParams
from twinkle.errors import StateError
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler
from twinkle.server.api.openai_api import ChatCompletionRequest
from twinkle.server.execution.sampling import slicing
from twinkle.server.execution.sampling.chat import ChatRequest
from twinkle.server.execution.scheduling.scheduler import Continue, Job, Scheduler
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import TorchSampler as RunSampler

TIMEOUT = 60.0
MESSAGES = [{'role': 'user', 'content': 'Tell me a long story.'}]


# ---- the scheduler: a job that continues ------------------------------------------------------------
@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    events: list[str] = []
    made = Scheduler(
        on_start=lambda job: events.append(f'start {job.id}'),
        on_pause=lambda job: events.append(f'pause {job.id}'),
        on_finish=lambda job: events.append(f'finish {job.id}'),
    )
    made.events = events  # type: ignore[attr-defined]  # what the callbacks saw, for the test
    yield made
    made.stop()


def slices(order: list[str], label: str, count: int) -> Callable[[], Any]:
    """A job of ``count`` slices: each appends ``label<i>`` to ``order``, all but the last continue."""

    def slice_at(index: int) -> Any:
        order.append(f'{label}{index}')
        if index + 1 == count:
            return f'{label} done'
        return Continue(lambda: slice_at(index + 1))

    return lambda: slice_at(0)


def test_a_job_that_continues_lets_the_other_tenants_run_between_its_slices(scheduler):
    order: list[str] = []
    long = scheduler.submit('alice', slices(order, 'a', 4), job_id='long')
    later = scheduler.submit('alice', slices(order, 'later', 1), job_id='later')  # alice's next request
    short = scheduler.submit('bob', slices(order, 'b', 1), job_id='short')
    scheduler.start()
    assert all(job.wait(TIMEOUT) for job in (long, later, short))
    # Round robin over alice and bob: bob's one job runs after alice's first slice, not after all
    # four; alice's own next request runs only once her long one has ended (her order holds).
    assert order == ['a0', 'b0', 'a1', 'a2', 'a3', 'later0']
    assert (long.status, long.result, long.slices) == ('done', 'a done', 4)
    # on_start before each slice, on_pause after each but the last, on_finish once at the end
    events = [event for event in scheduler.events if event.endswith(' long')]
    assert events == ['start long', 'pause long'] * 3 + ['start long', 'finish long']


def test_a_continued_jobs_duration_is_the_time_its_slices_ran(scheduler):
    gate = threading.Event()

    def first() -> Continue:
        time.sleep(0.05)
        return Continue(lambda: 'done')

    scheduler.start()
    job = scheduler.submit('alice', first)
    blocker = scheduler.submit('bob', lambda: gate.wait(TIMEOUT))  # holds the worker between alice's slices
    while blocker.status == 'pending':
        time.sleep(0.001)
    time.sleep(0.2)  # bob's job runs 0.2 s at least while alice's is paused
    gate.set()
    assert job.wait(TIMEOUT) and job.status == 'done'
    assert job.duration_s is not None and job.finished_at is not None and job.started_at is not None
    # It ran 0.05 s and then a moment; the 0.2 s bob held the worker between its slices are not its.
    assert 0.05 <= job.duration_s < (job.finished_at - job.started_at) - 0.15


def test_stopping_fails_a_paused_job_and_cancels_its_continuation(scheduler):
    cancelled, gate, submitted = threading.Event(), threading.Event(), threading.Event()

    def first_slice() -> Continue:
        # Alice's slice ends only once bob's job is queued: on a busy machine the worker could otherwise
        # take her continuation before bob was submitted, run it to the end, and never show her paused.
        submitted.wait(TIMEOUT)
        return Continue(lambda: 'never', cancel=cancelled.set)

    scheduler.start()
    job = scheduler.submit('alice', first_slice)
    blocker = scheduler.submit('bob', lambda: gate.wait(TIMEOUT))
    submitted.set()
    while job.status != 'paused' or blocker.status != 'running':
        time.sleep(0.001)
    left = scheduler.stop(wait=False)  # bob's job holds the worker until the gate opens: alice's is queued, paused
    gate.set()
    assert scheduler.stop() == []  # the worker ended after bob's job, and ran nothing more
    assert left == [job] and job.status == 'paused'
    job.fail(StateError('the server stopped before this request ran'))
    assert cancelled.is_set() and job.status == 'failed' and job.done.is_set()


def test_a_job_that_pauses_as_the_scheduler_stops_is_returned_with_the_queued_ones(scheduler):
    entered, release = threading.Event(), threading.Event()

    def first_slice() -> Continue:
        entered.set()
        release.wait(TIMEOUT)
        return Continue(lambda: 'never')

    scheduler.start()
    job = scheduler.submit('alice', first_slice)
    assert entered.wait(TIMEOUT)

    def release_once_stopping() -> None:  # the slice ends while stop waits for it, however slow the machine
        while not scheduler._stopping:
            time.sleep(0.001)
        release.set()

    releaser = threading.Thread(target=release_once_stopping)
    releaser.start()
    assert scheduler.stop() == [job] and job.status == 'paused'
    releaser.join(TIMEOUT)


# ---- slicing.sliced and the torch sampler ------------------------------------------------------------
def test_a_sliced_function_runs_on_its_own_thread_and_gives_way_when_its_slice_is_spent():
    steps: list[str] = []

    def generate() -> str:
        for _ in range(3):
            steps.append(threading.current_thread().name)
            if slicing.TURNS.due():
                slicing.TURNS.give_way()
        return 'finished'

    job_fn = slicing.sliced(generate, slice_s=0.0, limit_s=None)  # every step spends its slice
    results = [job_fn()]
    while isinstance(results[-1], Continue):
        results.append(results[-1].then())
    assert results[-1] == 'finished' and len(results) == 4  # three give-ways, then the end
    assert len(set(steps)) == 1 and steps[0] != threading.current_thread().name
    assert not any(thread.name == steps[0] for thread in threading.enumerate())  # the thread ended


def test_an_error_in_a_sliced_function_is_raised_on_the_worker_and_a_cancel_ends_its_thread():
    def fails() -> None:
        slicing.TURNS.give_way()
        raise ValueError('bad prompt')

    paused = slicing.sliced(fails, slice_s=0.0, limit_s=None)()
    assert isinstance(paused, Continue)
    with pytest.raises(ValueError, match='bad prompt'):
        paused.then()

    def forever() -> None:
        while True:
            slicing.TURNS.give_way()

    paused = slicing.sliced(forever, slice_s=0.0, limit_s=None)()
    assert isinstance(paused, Continue) and paused.cancel is not None
    paused.cancel()  # the thread wakes, unwinds and ends
    assert not any(thread.name.startswith('twinkle-slice') for thread in threading.enumerate())


def test_outside_a_sliced_job_nothing_is_ever_due():
    assert not slicing.TURNS.due() and slicing.TURNS.time_limit_s() is None
    slicing.TURNS.give_way()  # returns at once


@pytest.fixture(scope='module')
def trainer(tiny_model_dir) -> TransformersModel:
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('other', LoraConfig(r=4, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=1e-2, adapter_name='other')
    return model


def test_a_sliced_generation_with_training_between_its_slices_gives_the_unsliced_tokens(trainer):
    sampler = TorchSampler.from_model(trainer.model)
    sampler.turns = slicing.TURNS
    prompts = [{'input_ids': [11, 42, 7, 99, 5]}, {'input_ids': [3, 8]}]
    params = SamplingParams(max_tokens=24, temperature=1.0, num_samples=3, seed=7, logprobs=2, ignore_eos=True)
    whole = sampler.sample(prompts, params)  # no slice thread: nothing is ever due

    rows = token_rows(0, [12, 9])
    job_fn = slicing.sliced(lambda: sampler.sample(prompts, params), slice_s=0.0, limit_s=None)
    result, modes = job_fn(), []
    while isinstance(result, Continue):
        # Between two slices another tenant trains: its forward and backward in train mode, then a step.
        modes.append(trainer.model.training)
        trainer.model.train(True)
        trainer.forward_backward(inputs=rows, adapter_name='other')
        trainer.clip_grad_and_step(adapter_name='other')
        result = result.then()
    assert len(modes) >= params.max_tokens - 1  # it gave way after every decode step
    # Stepping out, the sampler put the model back as the trainer had left it (train mode), each time.
    assert all(modes[1:])
    for sliced_response, whole_response in zip(result, whole, strict=True):
        for sliced_seq, whole_seq in zip(sliced_response.sequences, whole_response.sequences, strict=True):
            assert sliced_seq.tokens == whole_seq.tokens and len(sliced_seq.tokens) == params.max_tokens
            assert sliced_seq.logprobs == whole_seq.logprobs  # bitwise: the same kernels on the same shapes


def test_a_generation_out_of_worker_time_ends_as_at_max_tokens(trainer):
    sampler = TorchSampler.from_model(trainer.model)
    sampler.turns = slicing.TURNS
    params = SamplingParams(max_tokens=2000, temperature=1.0, seed=1, ignore_eos=True)  # seconds of decode steps
    job_fn = slicing.sliced(lambda: sampler.sample([{'input_ids': [1, 2, 3]}], params), slice_s=None, limit_s=0.2)
    result = job_fn()
    [sequence] = result[0].sequences
    assert sequence.stop_reason == 'length' and 1 <= len(sequence.tokens) < params.max_tokens


# ---- a real server -----------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    options = {'sampling_slice_ms': 1.0, 'limits': {'max_tokens_per_request': 16_384}}
    with background_server(tmp_path_factory.mktemp('slices'), tiny_model_dir, **options) as (url, keys, running):
        yield url, keys, running.app.state.service


def chat(server, tenant: str = 'alice', **body: Any) -> httpx.Response:
    url, keys, _ = server
    headers = {'Authorization': f'Bearer {keys[tenant]}'}
    return httpx.post(f'{url}/v1/chat/completions', json=body, headers=headers, timeout=TIMEOUT * 4)


@contextmanager
def another_tenant_waiting(service: Any) -> Iterator[None]:
    """Another tenant with a job waiting for the worker at every moment (each, done, queues the
    next), so that a sampling request gives way after every slice (alone it would go on)."""
    scheduler, stop = service.default.scheduler, threading.Event()

    def again(_: Job) -> None:
        if not stop.is_set():
            scheduler.submit('carol', lambda: None, operation='noise').add_done_callback(again)

    again(None)  # type: ignore[arg-type]  # the first of the chain follows no job
    try:
        yield
    finally:
        stop.set()


def running_job(service: Any, operation: str) -> Job:
    """The job of ``operation`` once it has started its first slice."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for scheduler in service.default.schedulers:
            for job in scheduler.unsettled():
                if job.operation == operation and job.slices >= 1:
                    return job
        time.sleep(0.005)
    raise AssertionError(f'no {operation} job started')


@pytest.mark.integration
def test_another_tenants_step_during_a_long_chat_finishes_while_the_chat_still_samples(server, tiny_model_dir):
    url, keys, service = server
    bob = MultiLoraTransformersModel(client=TwinkleClient(url, keys['bob']))
    bob.add_adapter_to_model('bob', LoraConfig(r=4, target_modules='all-linear'))
    bob.set_optimizer('AdamW', lr=1e-3)
    body = {'model': tiny_model_dir, 'messages': MESSAGES, 'n': 4, 'max_tokens': 400, 'seed': 3, 'logprobs': True}
    steps_while_sampling, requests = 0, 0
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(chat, server, **body)
        chat_job = running_job(service, 'chat_completion')
        while not chat_job.done.is_set():  # bob trains, each request sent while the chat samples
            output = bob.forward_backward(inputs=token_rows(1, [16, 16]))
            assert output.num_tokens == 30  # two rows of 16 tokens, the first label of each ignored
            assert bob.clip_grad_and_step() > 0
            steps_while_sampling += not chat_job.done.is_set()
            requests += 2
        response = reply.result(TIMEOUT * 4)
    # Before slicing, bob's first forward_backward waited for all 1,600 tokens: no step during the chat.
    assert steps_while_sampling >= 2, (steps_while_sampling, chat_job.slices)
    assert response.status_code == 200, response.text
    assert response.json()['usage']['completion_tokens'] > 100
    # It gave way to each of bob's requests (alone, a slice goes on), and its reply is the one it
    # gets run whole: bob's steps between its slices changed nothing of it.
    assert steps_while_sampling <= chat_job.slices - 1 <= requests + 1
    assert_the_unsliced_reply(service, keys['alice'], body, response.json())


def assert_the_unsliced_reply(service: Any, tenant_key: str, body: dict[str, Any], sliced: dict[str, Any]) -> None:
    """``sliced`` (a chat's JSON) is what the same request gives run whole: a job of an operation
    that is not sliced, on the same worker; text and every token's logprob, bitwise."""
    params = ChatCompletionRequest.model_validate(body).sampling_params(body['max_tokens'], None)
    request = ChatRequest(params=params, token_limit=16_384, messages=body['messages'])
    run_whole = lambda: service.default.sample_chat(request)  # noqa: E731
    tenant = service.store.tenants.for_key(tenant_key)
    job = service.submit(tenant, service.default, None, 'test_whole', run_whole)
    assert job.wait(TIMEOUT) and job.error is None and job.slices == 1
    for choice, whole in zip(sliced['choices'], job.result['choices'], strict=True):
        assert choice['message']['content'] == whole['text']
        assert [entry['logprob'] for entry in choice['logprobs']['content']] == [t['logprob'] for t in whole['tokens']]


@pytest.mark.integration
def test_a_sliced_chat_reply_is_the_unsliced_one_for_the_same_seed(server, tiny_model_dir):
    _, keys, service = server
    body = {'model': tiny_model_dir, 'messages': MESSAGES, 'n': 3, 'max_tokens': 40, 'seed': 11, 'logprobs': True}
    with another_tenant_waiting(service):
        response = chat(server, **body)
    assert response.status_code == 200, response.text
    job = service.job(response.json()['id'].removeprefix('chatcmpl-'))
    assert job is not None and job.slices > 3
    assert_the_unsliced_reply(service, keys['alice'], body, response.json())


def slices_of(service: Any, operation: str) -> tuple[float, float]:
    """The slices the server's requests of ``operation`` ran in so far, and how many requests."""
    sample = service.registry.get_sample_value
    labels = {'operation': operation}
    return sample('twinkle_request_slices_sum', labels) or 0.0, sample('twinkle_request_slices_count', labels) or 0.0


def sliced_once(service: Any, operation: str, send: Callable[[], Any]) -> float:
    """The slices of the one request of ``operation`` that ``send`` makes while another tenant waits."""
    slices, count = slices_of(service, operation)
    with another_tenant_waiting(service):
        result = send()
    after, count_after = slices_of(service, operation)
    assert count_after == count + 1, result
    return after - slices


@pytest.mark.integration
def test_every_sampling_path_of_the_worker_is_sliced(server, tiny_model_dir, sdk_clients):
    url, keys, service = server
    headers = {'Authorization': f'Bearer {keys["alice"]}'}
    body = {'model': tiny_model_dir, 'prompt': 'Once', 'max_tokens': 30, 'seed': 1}
    completion = lambda: httpx.post(f'{url}/v1/completions', json=body, headers=headers, timeout=TIMEOUT)  # noqa: E731
    assert sliced_once(service, 'completion', completion) > 3
    model = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
    model.add_adapter_to_model('sampled', LoraConfig(r=4, target_modules='all-linear'))
    sampler = RunSampler(model=model)
    params = {'max_tokens': 30, 'seed': 2, 'ignore_eos': True}
    native = sampler.sample([{'input_ids': [5, 6, 7]}], params)
    assert len(native[0].sequences[0].tokens) == 30
    assert sliced_once(service, 'sample', lambda: sampler.sample([{'input_ids': [5, 6, 7]}], params)) > 3
    sampling = sdk_clients(url, keys['alice']).create_sampling_client(base_model=tiny_model_dir).result()
    prompt, seeded = types.ModelInput.from_ints([11, 42, 7]), types.SamplingParams(max_tokens=30, seed=5)
    first = sampling.sample(prompt, 1, seeded).result()
    assert sliced_once(service, 'sample', lambda: sampling.sample(prompt, 1, seeded).result()) > 3
    assert sampling.sample(prompt, 1, seeded).result().sequences[0].tokens == first.sequences[0].tokens


@pytest.mark.integration
def test_a_request_over_the_sampled_token_limit_is_a_400_naming_it(tmp_path, tiny_model_dir):
    limits = {'max_sampled_tokens_per_request': 1024}
    with background_server(tmp_path, tiny_model_dir, tenants=('alice',), limits=limits) as (url, keys, _):
        client = openai.OpenAI(base_url=f'{url}/v1', api_key=keys['alice'], max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=tiny_model_dir, messages=MESSAGES, n=8, max_tokens=2000)
        # 8 choices of up to 2,000 tokens: 16,000 tokens to sample, over the 1,024 allowed
        assert refused.value.body['param'] == 'max_tokens'
        assert '16000' in refused.value.body['message']
        assert 'max_sampled_tokens_per_request=1024' in refused.value.body['message']
        # No max_tokens: each of the 8 choices gets an equal share of the limit, 1024 // 8 = 128 tokens.
        fitted = client.chat.completions.create(model=tiny_model_dir, messages=MESSAGES, n=8, logprobs=True)
        assert max(len(choice.logprobs.content) for choice in fitted.choices) == 1024 // 8
        model = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
        model.add_adapter_to_model('capped', LoraConfig(r=4, target_modules='all-linear'))
        with pytest.raises(RemoteError, match='max_sampled_tokens_per_request=1024') as native:
            RunSampler(model=model).sample([{'input_ids': [5, 6, 7]}] * 3, {'max_tokens': 400})  # 1,200 tokens
        assert native.value.status == 400


@pytest.mark.integration
def test_a_chat_past_its_worker_time_ends_with_finish_reason_length(tmp_path, tiny_model_dir):
    options = {'limits': {'max_sampling_s': 0.3, 'max_tokens_per_request': 65_536}}
    with background_server(tmp_path, tiny_model_dir, tenants=('alice',), **options) as (url, keys, running):
        body = {'model': tiny_model_dir, 'messages': MESSAGES, 'max_tokens': 2000, 'temperature': 1.0, 'seed': 4}
        response = chat((url, keys, None), **body)
        # Alone on the worker it never gave way: one slice, however long.
        assert slices_of(running.app.state.service, 'chat_completion') == (1.0, 1.0)
    assert response.status_code == 200, response.text
    [choice] = response.json()['choices']
    assert choice['finish_reason'] == 'length'
    assert 0 < response.json()['usage']['completion_tokens'] < 2000


def test_sampling_in_slices_keeps_torch_state_of_the_worker_thread(trainer):
    # Grad mode is per thread: the sampler's no_grad on its slice thread leaves the worker's on.
    sampler = TorchSampler.from_model(trainer.model)
    sampler.turns = slicing.TURNS
    params = SamplingParams(max_tokens=4, seed=1)
    result = slicing.sliced(lambda: sampler.sample([{'input_ids': [1, 2]}], params), slice_s=0.0, limit_s=None)()
    while isinstance(result, Continue):
        assert torch.is_grad_enabled()
        result = result.then()
    assert len(result[0].sequences[0].tokens) <= 4
