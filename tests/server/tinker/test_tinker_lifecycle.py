"""A Tinker model's and session's life on a real server on loopback: a create refused with a full
queue leaves nothing (its retry succeeds, a retry of one accepted gets its first answer),
``unload_model`` retires a model, and a LoRA rank of 128 trains.

The tenant's queue is filled by holding the worker with a ``Gate`` (``server_helpers``): a request
queued behind it waits, so the next one finds the queue full whatever the machine's speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import tinker
from server_helpers import Gate, background_server
from tinker import types

from twinkle.server.store import Store

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

#: One queued request fills a tenant's queue.
QUEUE = 1


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    limits = {'max_queued_per_tenant': QUEUE}
    with background_server(tmp_path_factory.mktemp('lifecycle'), tiny_model_dir, limits=limits) as running:
        yield running


def post(url: str, key: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f'{url}/api/v1/{route}', json=body, headers={'X-API-Key': key}, timeout=60)


def result(url: str, key: str, request_id: str) -> dict:
    """The future's answer once it is not ``try_again`` (the server long-polls each call); a
    protobuf one (a sample's) as ``{'protobuf': its size}``."""
    while True:
        reply = post(url, key, 'retrieve_future', {'request_id': request_id})
        if reply.headers['content-type'] == 'application/x-protobuf':
            return {'protobuf': len(reply.content)}
        answer = reply.json()
        if answer.get('type') != 'try_again':
            return answer


def new_session(url: str, key: str) -> str:
    body = types.CreateSessionRequest(tags=[], user_metadata=None, sdk_version='0.38.0')
    return post(url, key, 'create_session', body.model_dump(mode='json')).json()['session_id']


def create_model_body(session_id: str, model: str, seq: int = 0, rank: int = 4) -> dict:
    lora = types.LoraConfig(rank=rank, seed=0)
    request = types.CreateModelRequest(session_id=session_id, model_seq_id=seq, base_model=model, lora_config=lora)
    return request.model_dump(mode='json')


def sample_body(model: str, sampling_session_id: str | None = None) -> dict:
    prompt = types.ModelInput.from_ints([1, 2, 3])
    params = types.SamplingParams(max_tokens=2, seed=0)
    target = {'base_model': model} if sampling_session_id is None else {'sampling_session_id': sampling_session_id}
    request = types.SampleRequest(num_samples=1, prompt=prompt, sampling_params=params, **target)
    return request.model_dump(mode='json')


def run_ids(store: Store, tenant_id: str) -> list[str]:
    return [run.id for run in store.runs.page(tenant_id, limit=1000)[0]]


def test_a_create_model_refused_with_a_full_queue_leaves_nothing_and_its_retry_succeeds(server, tiny_model_dir):
    url, keys, background = server
    key, service = keys['alice'], background.app.state.service
    tenant = service.store.tenants.for_key(key)
    session_id = new_session(url, key)
    body = create_model_body(session_id, tiny_model_dir)
    gate = Gate(service.default.scheduler)
    try:
        queued = post(url, key, 'asample', sample_body(tiny_model_dir))  # alice's one queued request
        assert queued.status_code == 200, queued.text
        refused = post(url, key, 'create_model', body)
        assert refused.status_code == 429 and refused.json()['error'] == 'QueueFullError', refused.text
        assert f'{session_id}:train:0' not in run_ids(service.store, tenant.id)  # the refusal made no run
    finally:
        gate.open()
    result(url, key, queued.json()['request_id'])
    retry = post(url, key, 'create_model', body)  # what the SDK sends after the Retry-After
    assert retry.status_code == 200, retry.text
    model_id = retry.json()['model_id']
    assert model_id == f'{session_id}:train:0'
    assert result(url, key, retry.json()['request_id']) == {'model_id': model_id, 'type': 'create_model'}
    # A retry of the accepted request gets its answer, not a 400, from memory and from the store
    # (after a restart, or once the remembered ids moved past it).
    assert post(url, key, 'create_model', body).json()['request_id'] == retry.json()['request_id']
    background.app.state.tinker.state.requests.clear()
    again = post(url, key, 'create_model', body)
    assert again.status_code == 200 and again.json()['request_id'] == retry.json()['request_id'], again.text


def test_a_native_run_refused_with_a_full_queue_is_not_left_behind(server):
    url, keys, background = server
    key, service = keys['bob'], background.app.state.service
    tenant = service.store.tenants.for_key(key)
    headers = {'Authorization': f'Bearer {key}'}
    before = run_ids(service.store, tenant.id)
    gate = Gate(service.default.scheduler)
    with ThreadPoolExecutor(1) as pool:
        try:  # POST /runs answers once its job ran: it waits behind the gate, bob's one queued request
            queued = pool.submit(httpx.post, f'{url}/twinkle/v1/runs', json={'lora': {'r': 4}}, headers=headers)
            until(lambda: service.default.scheduler.queued(tenant.id) == QUEUE)
            refused = httpx.post(f'{url}/twinkle/v1/runs', json={'lora': {'r': 4}}, headers=headers, timeout=60)
            assert refused.status_code == 429, refused.text
        finally:
            gate.open()
        assert queued.result(timeout=60).status_code == 201
    assert len(run_ids(service.store, tenant.id)) == len(before) + 1  # the queued one's; the refused one left none


def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, 'the condition did not come true in time'
        time.sleep(0.01)


class Heartbeats:
    """Heartbeats every 0.1 s, on a thread of their own, for the sessions in ``beating``: a session
    taken out of it stops beating, as a killed client's does."""

    def __init__(self, url: str, key: str, *sessions: str):
        self.url, self.key, self.beating = url, key, set(sessions)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopped.wait(0.1):
            for session_id in list(self.beating):
                post(self.url, self.key, 'session_heartbeat', {'session_id': session_id, 'type': 'session_heartbeat'})

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def test_a_session_that_stops_heartbeating_loses_its_queue_and_another_keeps_its_own(tmp_path, tiny_model_dir):
    # 8 s without a heartbeat expires a session; the live one beats every 0.1 s. (At 2 s both expired beside a busy
    # core: the server on this process's thread answered no heartbeat for 2 s while it loaded the model.)
    with background_server(tmp_path, tiny_model_dir, tinker={'session_timeout_s': 8.0}) as (url, keys, background):
        key, service = keys['alice'], background.app.state.service
        gone, live = new_session(url, key), new_session(url, key)
        heartbeats = Heartbeats(url, key, gone, live)
        try:
            created = post(url, key, 'create_model', create_model_body(gone, tiny_model_dir)).json()
            model_id = created['model_id']
            assert result(url, key, created['request_id'])['type'] == 'create_model'
            samplers = {
                session: post(url, key, 'create_sampling_session', sampling_session_body(session, tiny_model_dir))
                for session in (gone, live)
            }
            sampler_ids = {session: reply.json()['sampling_session_id'] for session, reply in samplers.items()}
            gate = Gate(service.default.scheduler)
            try:
                # The gone session's queue: two samples and a step on the worker, a step waiting for seq 2.
                queued = [post(url, key, 'asample', sample_body(tiny_model_dir, sampler_ids[gone])) for _ in range(2)]
                queued += [post(url, key, 'optim_step', optim_step_body(model_id, seq)) for seq in (1, 3)]
                kept = post(url, key, 'asample', sample_body(tiny_model_dir, sampler_ids[live]))
                assert all(reply.status_code == 200 for reply in [*queued, kept])
                heartbeats.beating.discard(gone)  # its client is killed
                until(lambda: expired_requests(service) == 4)
                for reply in queued:  # failed as the tenant's doing, naming why
                    answer = result(url, key, reply.json()['request_id'])
                    assert answer['category'] == 'user' and answer['error'].startswith('SessionExpiredError: ')
                    assert 'tinker.session_timeout_s' in answer['error']
                assert service.default.scheduler.queued(service.store.tenants.for_key(key).id) == 1  # the live one's
                refused = post(url, key, 'asample', sample_body(tiny_model_dir, sampler_ids[gone]))
                beat = post(url, key, 'session_heartbeat', {'session_id': gone, 'type': 'session_heartbeat'})
                for reply in (refused, beat):  # a 410: the SDK does not retry it, and stops its heartbeat loop
                    assert reply.status_code == 410 and reply.json()['error'] == 'SessionExpiredError', reply.text
            finally:
                gate.open()
            assert result(url, key, kept.json()['request_id'])['protobuf'] > 0  # the live session's sample ran
            assert expired_requests(service) == 4
        finally:
            heartbeats.stop()


def sampling_session_body(session_id: str, model: str) -> dict:
    request = types.CreateSamplingSessionRequest(session_id=session_id, sampling_session_seq_id=0, base_model=model)
    return request.model_dump(mode='json')


def optim_step_body(model_id: str, seq_id: int) -> dict:
    return types.OptimStepRequest(model_id=model_id, seq_id=seq_id, adam_params=types.AdamParams()).model_dump(
        mode='json'
    )


def expired_requests(service) -> float:
    return service.registry.get_sample_value('twinkle_expired_requests_total') or 0.0


@pytest.fixture(scope='module')
def sdk_server(tmp_path_factory, tiny_model_dir):
    """A server with the default limits (max_lora_rank among them), for the SDK's own calls."""
    with background_server(tmp_path_factory.mktemp('sdk'), tiny_model_dir) as running:
        yield running


@pytest.fixture(scope='module')
def carol(sdk_server, module_sdk_clients) -> tinker.ServiceClient:
    url, keys, _ = sdk_server
    return module_sdk_clients(url, keys['alice'])


def sft_datum(length: int = 9) -> types.Datum:
    tokens = [(7 * j) % 400 + 10 for j in range(length)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={'target_tokens': tokens[1:], 'weights': [1.0] * (length - 1)},
    )


def test_a_rank_128_adapter_trains_under_the_default_limit(carol, tiny_model_dir):
    # tinker-cookbook's distillation recipes train rank 128; so do Tinker and SkyRL.
    client = carol.create_lora_training_client(base_model=tiny_model_dir, rank=128, seed=0)
    assert client.get_info().lora_rank == 128
    data = [sft_datum()]
    before = client.forward_backward(data, 'cross_entropy').result().metrics['loss:sum']
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = client.forward(data, 'cross_entropy').result().metrics['loss:sum']
    assert after < before  # one step at lr 1e-2 on the datum it was taken on lowers its loss


def test_a_rank_over_the_limit_names_the_limit_and_where_it_is_set(sdk_server, tiny_model_dir):
    url, keys, _ = sdk_server
    key = keys['alice']
    refused = post(url, key, 'create_model', create_model_body(new_session(url, key), tiny_model_dir, rank=129))
    assert refused.status_code == 400, refused.text
    assert 'r=129' in refused.json()['detail'] and 'limits.max_lora_rank' in refused.json()['detail']
    assert '[1, 128]' in refused.json()['detail']


def test_unload_model_retires_the_model_and_keeps_its_checkpoints(sdk_server, carol, tiny_model_dir):
    url, keys, _ = sdk_server
    client = carol.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0)
    client.forward_backward([sft_datum()], 'cross_entropy').result()
    saved = client.save_weights_for_sampler('before-unload').result().path
    accepted = post(url, keys['alice'], 'unload_model', types.UnloadModelRequest(model_id=client.model_id).model_dump())
    assert accepted.status_code == 200 and accepted.json()['model_id'] == client.model_id, accepted.text
    answer = result(url, keys['alice'], accepted.json()['request_id'])
    assert types.UnloadModelResponse.model_validate(answer) == types.UnloadModelResponse(
        model_id=client.model_id, type='unload_model'
    )
    with pytest.raises(tinker.NotFoundError):  # the model is gone: its requests are a 404
        client.forward_backward([sft_datum()], 'cross_entropy').result()
    again = post(url, keys['alice'], 'unload_model', {'model_id': client.model_id, 'type': 'unload_model'})
    assert again.status_code == 404
    # Its sampler weights sample on, and the sampler has no prefix cache to report hits from.
    sampled = carol.create_sampling_client(model_path=saved).sample(
        types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2, seed=0)
    )
    reply = sampled.result()
    assert len(reply.sequences[0].tokens) == 2 and reply.prompt_cache_hit_tokens == 0
