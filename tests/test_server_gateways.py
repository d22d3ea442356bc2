"""Gateways apart from the worker (issue 34, point 2): two ``twinkle-server gateway`` processes in front of one
worker (a server on a thread of this process), all three on one PostgreSQL database.

Two gateways serve one run in turn; a gateway killed with ``kill -9`` right after accepting requests leaves
them to the other, which answers their futures from the store; ``SIGTERM`` drains a gateway: the request it
was answering is answered, a new one is a 503 with ``Retry-After``, and it exits once the first is done.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pg_helpers
import pytest
from peft import LoraConfig
from server_helpers import Gate, background_server, free_port

from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

ROWS = [{'input_ids': [5, 6, 7, 8, 9, 10], 'labels': [-100, 6, 7, 8, 9, 10]}]
#: Seconds a gateway subprocess may take to answer /healthz (it imports the store, not the model).
START_TIMEOUT_S = 120.0


class GatewayProcess:
    """``twinkle-server gateway`` in a subprocess of its own, on a free port."""

    def __init__(self, worker_url: str, store_url: str, drain_timeout_s: float = 60.0):
        self.port = free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        command = [
            sys.executable, '-m', 'twinkle.server.cli', '--host', '127.0.0.1', '--port', str(self.port),
            'gateway', '--worker', worker_url, '--drain-timeout-s', str(drain_timeout_s),
        ]  # fmt: skip
        env = {**os.environ, 'TWINKLE_STORE': store_url}
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process.poll() is None, f'the gateway exited at start:\n{self.process.stdout.read()}'
            try:
                if httpx.get(f'{self.url}/healthz', timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, 'the gateway did not answer /healthz'
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@pytest.fixture(scope='module')
def deployment(tmp_path_factory, tiny_model_dir, postgres) -> Iterator[dict[str, Any]]:
    with (
        pg_helpers.fresh_database(postgres) as store_url,
        background_server(
            tmp_path_factory.mktemp('worker'), tiny_model_dir, tenants=('alice', 'bob'), store=store_url
        ) as (worker_url, keys, background),
    ):
        gateways = [GatewayProcess(worker_url, store_url) for _ in range(2)]
        try:
            yield {'store': store_url, 'worker': worker_url, 'keys': keys, 'gateways': gateways, 'app': background.app}
        finally:
            for gateway in gateways:
                gateway.stop()


def test_two_gateways_serve_one_run_in_turn(deployment):
    one, two = (g.url for g in deployment['gateways'])
    key = deployment['keys']['alice']
    model = MultiLoraTransformersModel(client=TwinkleClient(one, key))
    run_id = model.add_adapter_to_model('turns', LoraConfig(r=4, target_modules='all-linear'), seed=1)
    model.set_optimizer('AdamW', lr=1e-2)
    other = TwinkleClient(two, key)
    ops = f'/twinkle/v1/runs/{run_id}/ops'
    losses = []
    for step in range(4):  # the steps alternate between the gateways
        client = model.client if step % 2 == 0 else other
        losses.append(client.call(f'{ops}/forward_backward', {'inputs': ROWS})['loss'])
        client.call(f'{ops}/clip_grad_and_step', {})
    assert losses[-1] < losses[0], losses
    history = other.request('GET', f'/twinkle/v1/runs/{run_id}/history')
    assert [step['step'] for step in history['steps']] == [1, 2, 3, 4]
    assert other.get_training_run(run_id).id == run_id
    assert model.save('after-turns') == f'twinkle://{run_id}/checkpoints/after-turns'
    assert [c.name for c in other.list_checkpoints(run_id)] == ['after-turns']


def test_a_gateway_killed_leaves_its_accepted_requests_to_the_other(deployment):
    key = deployment['keys']['bob']
    doomed = GatewayProcess(deployment['worker'], deployment['store'])
    try:
        model = MultiLoraTransformersModel(client=TwinkleClient(doomed.url, key))
        run_id = model.add_adapter_to_model('doomed', LoraConfig(r=4, target_modules='all-linear'))
        ops = f'/twinkle/v1/runs/{run_id}/ops'
        accepted = [model.client.submit(f'{ops}/forward_backward', {'inputs': ROWS}) for _ in range(4)]
    finally:
        doomed.stop()  # kill -9, right after the 202s
    assert doomed.process.returncode == -signal.SIGKILL
    survivor = TwinkleClient(deployment['gateways'][1].url, key)
    results = [survivor.result(future_id) for future_id in accepted]
    assert all(result['loss'] > 0 for result in results), results
    record = survivor.request('GET', f'/twinkle/v1/futures/{accepted[0]}')
    assert record['status'] == 'done' and record['run_id'] == run_id


def test_sigterm_drains_a_gateway(deployment):
    key = deployment['keys']['alice']
    draining = GatewayProcess(deployment['worker'], deployment['store'])
    try:
        model = MultiLoraTransformersModel(client=TwinkleClient(draining.url, key))
        run_id = model.add_adapter_to_model('drained', LoraConfig(r=4, target_modules='all-linear'))
        headers = {'Authorization': f'Bearer {key}'}
        gate = Gate(deployment['app'].state.service.default.scheduler)  # the worker holds the next request
        answers: list[httpx.Response] = []
        path = f'{draining.url}/twinkle/v1/runs/{run_id}/ops/forward_backward'
        in_flight = threading.Thread(
            target=lambda: answers.append(
                httpx.post(path, json={'inputs': ROWS}, params={'wait': 60}, headers=headers, timeout=120)
            )
        )
        in_flight.start()
        time.sleep(1.0)  # the request is at the worker, behind the gate
        draining.process.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(50):  # the signal is handled on the gateway's loop: the next request sees it
            refused = httpx.get(f'{draining.url}/twinkle/v1/runs/{run_id}', headers=headers, timeout=30)
            if refused.status_code == 503:
                break
            time.sleep(0.1)
        assert refused is not None and refused.status_code == 503, refused.text
        assert refused.json()['error'] == 'UnavailableError' and 'stopping' in refused.json()['detail']
        assert int(refused.headers['Retry-After']) >= 1
        assert draining.process.poll() is None  # still answering the request in flight
        gate.open()
        in_flight.join(timeout=120)
        assert answers and answers[0].status_code == 202, answers
        assert answers[0].json()['future']['status'] == 'done'
        # It exits once the last request is answered, by the signal it was sent (uvicorn raises it again at the end).
        assert draining.process.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        draining.stop()


def test_two_gateways_racing_to_delete_one_run_one_wins_and_the_other_is_told(deployment):
    key = deployment['keys']['bob']
    one, two = (g.url for g in deployment['gateways'])
    model = MultiLoraTransformersModel(client=TwinkleClient(one, key))
    run_id = model.add_adapter_to_model('raced', LoraConfig(r=4, target_modules='all-linear'))
    headers = {'Authorization': f'Bearer {key}'}
    start, answers = threading.Barrier(2), {}

    def delete(url: str) -> None:
        start.wait()
        answers[url] = httpx.delete(f'{url}/twinkle/v1/runs/{run_id}', headers=headers, timeout=120)

    threads = [threading.Thread(target=delete, args=(url,)) for url in (one, two)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    statuses = sorted(answer.status_code for answer in answers.values())
    assert statuses == [200, 404], {url: (a.status_code, a.text) for url, a in answers.items()}
    told = next(answer for answer in answers.values() if answer.status_code == 404)
    assert told.json()['detail'] == f'training run {run_id!r} not found'


def test_a_tenant_hammering_one_gateway_is_refused_while_another_is_served_at_the_other(
    tmp_path, tiny_model_dir, postgres
):
    limits = {'max_requests_per_minute': 30}
    with (
        pg_helpers.fresh_database(postgres) as store_url,
        background_server(tmp_path, tiny_model_dir, tenants=('alice', 'bob'), store=store_url, limits=limits) as (
            worker_url,
            keys,
            _,
        ),
    ):
        one, two = GatewayProcess(worker_url, store_url), GatewayProcess(worker_url, store_url)
        try:
            flood: list[int] = []

            def hammer() -> None:
                with httpx.Client(headers={'Authorization': f'Bearer {keys["alice"]}'}, timeout=60) as http:
                    flood.extend(http.get(f'{one.url}/twinkle/v1/runs').status_code for _ in range(20))

            hammers = [threading.Thread(target=hammer) for _ in range(3)]
            for thread in hammers:
                thread.start()
            bob = MultiLoraTransformersModel(client=TwinkleClient(two.url, keys['bob'], max_retries=1))
            bob.add_adapter_to_model('calm', LoraConfig(r=4, target_modules='all-linear'))
            assert bob.forward_backward(inputs=ROWS).loss > 0  # served while alice's flood is refused
            for thread in hammers:
                thread.join()
            # 60 requests against 30 a minute: about half refused (at least 10, were the flood slowed to 40 s)
            assert flood.count(429) >= 10 and set(flood) == {200, 429}, sorted(set(flood))
            assert all(run.adapter_name == 'calm' for run in bob.client.list_training_runs())
        finally:
            one.stop()
            two.stop()
