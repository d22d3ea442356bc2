"""Gateways apart from the worker (issue 34, point 2): two ``twinkle-server gateway`` processes in front of one
worker (a server on a thread of this process), all three on one PostgreSQL database.

Two gateways serve one run in turn; a gateway killed with ``kill -9`` right after accepting requests leaves
them to the other, which answers their futures from the store; ``SIGTERM`` drains a gateway: the request it
was answering is answered, a new one is a 503 with ``Retry-After``, and it exits once the first is done.

What a client reaches through a gateway is what it reaches at the worker, and no more: the metrics need the
admin key, links and redirects name the gateway (never the worker's address), the worker's limits hold at the
gateway (a body is read only for a known key, capped and timed, and streamed), odd paths, queries, headers and
methods are answered as the worker answers them, and a compute request sent again with its ``Idempotency-Key``
(its gateway killed while it waited) runs once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pg_helpers
import pytest
from peft import LoraConfig
from server_helpers import Gate, background_server, free_port

from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

ROWS = [{'input_ids': [5, 6, 7, 8, 9, 10], 'labels': [-100, 6, 7, 8, 9, 10]}]
#: Tokens one forward_backward of ROWS trains (its input ids, as the usage counts them).
ROWS_TOKENS = 6
#: Seconds a gateway subprocess may take to answer /healthz (it imports the store, not the model).
START_TIMEOUT_S = 120.0
ADMIN_KEY = 'admin-' + 'k' * 40
#: The worker's cap on a body that carries tokens: larger than the default, for the streaming test's body.
WORKER_BODY_BYTES = 256 * 2**20


class GatewayProcess:
    """``twinkle-server gateway`` in a subprocess of its own, on a free port, its output in a file; ``config``:
    fields of its server config (``limits``), written to a file of its own."""

    def __init__(self, worker_url: str, store_url: str, drain_timeout_s: float = 60.0, config: dict | None = None):
        self.port = free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        self.folder = tempfile.TemporaryDirectory(prefix='twinkle-gateway-')
        command = [
            sys.executable, '-m', 'twinkle.server.cli', '--host', '127.0.0.1', '--port', str(self.port),
            *self._config_flag(config), 'gateway', '--worker', worker_url, '--drain-timeout-s', str(drain_timeout_s),
        ]  # fmt: skip
        env = {**os.environ, 'TWINKLE_STORE': store_url}
        # A file, not a pipe: a pipe nobody reads would fill and stop the gateway. Closed by stop().
        self.log = open(Path(self.folder.name) / 'log', 'w+b')  # noqa: SIM115
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.process.poll() is None, f'the gateway exited at start:\n{self.output()}'
            try:
                if httpx.get(f'{self.url}/healthz', timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, 'the gateway did not answer /healthz'
            time.sleep(0.1)

    def _config_flag(self, config: dict | None) -> list[str]:
        if config is None:
            return []
        path = Path(self.folder.name) / 'gateway.json'
        path.write_text(json.dumps({'base_model': '(no model here)', **config}))
        return ['--config', str(path)]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors='replace')[-4000:]

    def peak_rss_mib(self) -> float:
        """The most memory the gateway's process has held (VmHWM), in MiB."""
        status = Path(f'/proc/{self.process.pid}/status').read_text()
        return int(re.search(r'^VmHWM:\s+(\d+) kB', status, re.M)[1]) / 1024

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.log.close()
        self.folder.cleanup()


@pytest.fixture(scope='module')
def deployment(tmp_path_factory, tiny_model_dir, postgres) -> Iterator[dict[str, Any]]:
    limits = {'max_body_bytes': WORKER_BODY_BYTES}
    with (
        pg_helpers.fresh_database(postgres) as store_url,
        background_server(
            tmp_path_factory.mktemp('worker'), tiny_model_dir, store=store_url, admin_api_key=ADMIN_KEY, limits=limits
        ) as (worker_url, keys, background),
    ):
        gateways = [GatewayProcess(worker_url, store_url) for _ in range(2)]
        try:
            yield {'store': store_url, 'worker': worker_url, 'keys': keys, 'gateways': gateways, 'app': background.app}
        finally:
            for gateway in gateways:
                gateway.stop()


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


@pytest.mark.integration
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


# ---- what a client reaches through a gateway --------------------------------------------------------------
def exchange(url: str, request: bytes, timeout_s: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    """One request written as raw bytes (what httpx would refuse or mend: a NUL, a byte past ASCII, an odd
    method), sent with ``Connection: close``; the answer's status, headers (lower-case names) and body."""
    target = httpx.URL(url)
    with socket.create_connection((target.host, target.port), timeout=timeout_s) as conn:
        conn.sendall(request)
        received = b''
        while chunk := conn.recv(1 << 16):
            received += chunk
    head, _, body = received.partition(b'\r\n\r\n')
    lines = head.decode('latin-1').split('\r\n')
    headers = {name.lower(): value for name, _, value in (line.partition(': ') for line in lines[1:])}
    if headers.get('transfer-encoding') == 'chunked':
        body = _dechunked(body)
    return int(lines[0].split()[1]), headers, body


def _dechunked(data: bytes) -> bytes:
    body = b''
    while True:
        size_line, _, data = data.partition(b'\r\n')
        size = int(size_line.split(b';')[0], 16)
        if size == 0:
            return body
        body, data = body + data[:size], data[size + 2 :]


def head(method: str, target: bytes, key: str | None = None, *more: bytes) -> bytes:
    """A request head to send with ``exchange``: ``target`` as raw bytes, the key if any, ``more`` header lines."""
    lines = [method.encode() + b' ' + target + b' HTTP/1.1', b'Host: 127.0.0.1', b'Connection: close', *more]
    if key is not None:
        lines.append(b'Authorization: Bearer ' + key.encode())
    return b'\r\n'.join(lines) + b'\r\n\r\n'


@pytest.mark.integration
def test_metrics_need_the_admin_key_and_name_tenants_by_id(deployment):
    worker, gateway = deployment['worker'], deployment['gateways'][0].url
    alice = deployment['keys']['alice']
    model = MultiLoraTransformersModel(client=TwinkleClient(gateway, alice))
    model.add_adapter_to_model('metered', LoraConfig(r=4, target_modules='all-linear'))
    model.forward_backward(inputs=ROWS)
    for url in (worker, gateway):
        for refused in ({}, {'Authorization': f'Bearer {alice}'}):  # no key, and a tenant's key
            answer = httpx.get(f'{url}/metrics', headers=refused, timeout=30)
            assert answer.status_code == 401 and 'admin key' in answer.json()['detail'], answer.text
            assert 'twinkle_usage' not in answer.text
        metrics = httpx.get(f'{url}/metrics', headers={'Authorization': f'Bearer {ADMIN_KEY}'}, timeout=30).text
        # metrics.tenant_label's default: the tenant's id, never its name.
        alice_id = deployment['app'].state.service.store.tenants.for_key(alice).id
        trained = re.search(rf'twinkle_usage_total{{kind="training",tenant="{alice_id}"}} (\S+)', metrics)
        assert trained is not None and float(trained[1]) >= ROWS_TOKENS, metrics
        assert 'alice' not in metrics and 'bob' not in metrics


@pytest.mark.integration
def test_links_and_redirects_through_a_gateway_name_it_and_never_the_worker(deployment):
    gateway, key = deployment['gateways'][0].url, deployment['keys']['bob']
    worker = httpx.URL(deployment['worker'])
    worker_address = f'{worker.host}:{worker.port}'
    answers: list[httpx.Response] = []

    def keep(response: httpx.Response) -> None:
        response.read()
        answers.append(response)

    client = TwinkleClient(gateway, key)
    client.http.event_hooks['response'] = [keep]
    model = MultiLoraTransformersModel(client=client)
    run_id = model.add_adapter_to_model('linked', LoraConfig(r=4, target_modules='all-linear'))
    model.forward_backward(inputs=ROWS)
    model.save('linked')
    links = client.request('POST', f'/twinkle/v1/runs/{run_id}/checkpoints/linked/links')
    auth = {'Authorization': f'Bearer {key}'}
    with httpx.Client(base_url=gateway, event_hooks={'response': [keep]}, timeout=60) as http:
        dashboard = http.post(f'/dashboard/api/runs/{run_id}/checkpoints/training/linked/links', headers=auth).json()
        session = {'tags': [], 'user_metadata': None, 'sdk_version': '0.38.0', 'type': 'create_session'}
        session_id = http.post('/api/v1/create_session', json=session, headers=auth).json()['session_id']
        trace = http.get(f'/api/v1/sessions/{session_id}/trace_export', headers=auth).json()['url']
        urls = [*links['urls'].values(), *dashboard['urls'].values(), trace]
        assert urls and all(url.startswith(f'{gateway}/api/v1/') for url in urls), urls
        for url in urls:  # each link works through the gateway, without a key
            assert http.get(url).status_code == 200, url
        # The framework's redirects (a trailing slash) name the gateway too.
        for path in ('/twinkle/v1/runs/', '/dashboard/static'):
            moved = http.get(path, headers=auth)
            assert moved.status_code == 307 and moved.headers['location'].startswith(gateway), moved.headers
        # Behind a TLS load balancer that serves the API under /svc (on loopback, which the gateway trusts):
        # the links name the balancer's address, scheme and prefix.
        balanced = {**auth, 'Host': 'lb.example', 'X-Forwarded-Proto': 'https', 'X-Forwarded-Prefix': '/svc'}
        behind = http.post(f'/twinkle/v1/runs/{run_id}/checkpoints/linked/links', headers=balanced).json()['urls']
        assert all(url.startswith('https://lb.example/svc/api/v1/external_weights_files/') for url in behind.values())
    assert len(answers) > 10
    for answer in answers:  # nothing the client got through the gateway names the worker's address
        seen = answer.content.decode('latin-1') + str(answer.headers.raw)
        assert worker_address not in seen, (answer.request.url, seen[:2000])


@pytest.mark.integration
def test_tinker_s_exported_weights_through_a_gateway_are_links_to_it(deployment, sdk_clients, tiny_model_dir):
    gateway, key = deployment['gateways'][1].url, deployment['keys']['alice']
    sdk = sdk_clients(gateway, key)
    client = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
    path = client.save_weights_external('exported').result().path
    urls = sdk.create_rest_client().get_external_weights_urls(path).result().urls
    assert urls and all(url.startswith(f'{gateway}/api/v1/external_weights_files/') for url in urls.values()), urls
    assert all(httpx.get(url, timeout=60).status_code == 200 for url in urls.values())  # no key: the link is it


@pytest.mark.integration
def test_a_gateway_holds_the_worker_s_limits_and_streams_a_body(deployment):
    limits = {'body_read_timeout_s': 1.0, 'idle_connection_timeout_s': 1.0, 'max_body_bytes': WORKER_BODY_BYTES}
    gateway = GatewayProcess(deployment['worker'], deployment['store'], config={'limits': limits})
    try:
        # Half a request head, then nothing: the gateway hangs up after idle_connection_timeout_s.
        with socket.create_connection(('127.0.0.1', gateway.port), timeout=10) as idle:
            idle.sendall(b'POST /twinkle/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n')
            started = time.monotonic()
            assert idle.recv(1024) == b'' and time.monotonic() - started < 8
        ops = b'/twinkle/v1/runs/run-none/ops/forward_backward'
        json_type = b'Content-Type: application/json'
        # No key, a 300 MB body announced and 1 KB of it sent: the worker's own 401, the body left unread.
        announced = head('POST', ops, None, json_type, b'Content-Length: 300000000') + b' ' * 1024
        status, headers, body = exchange(gateway.url, announced)
        assert (status, headers.get('connection')) == (401, 'close'), body
        assert json.loads(body)['error'] == 'UnauthorizedError'
        key = deployment['keys']['alice']
        # A known key, a body over the cap: a 413 before a byte of it is read.
        status, _, body = exchange(gateway.url, head('POST', ops, key, json_type, b'Content-Length: 1000000000'))
        assert status == 413 and b'max_body_bytes' in body, body
        # A body that stops arriving: a 408 after body_read_timeout_s.
        started = time.monotonic()
        status, _, body = exchange(gateway.url, head('POST', ops, key, json_type, b'Content-Length: 1000') + b'{"in')
        assert status == 408 and b'body_read_timeout_s' in body and time.monotonic() - started < 10, body
        # 128 MiB to the worker: streamed through, the gateway's peak memory grows by a small part of it.
        before = gateway.peak_rss_mib()
        chunk, chunks = b' ' * (1 << 20), 128
        content = (part for part in [b'{"inputs":', *[chunk] * chunks, b'[]}'])
        answer = httpx.post(
            f'{gateway.url}{ops.decode()}', content=content, headers={'Authorization': f'Bearer {key}'}, timeout=120
        )
        assert answer.status_code in (404, 422), answer.text  # the worker read it all, and answered it
        assert gateway.peak_rss_mib() - before < chunks / 4, (before, gateway.peak_rss_mib())
    finally:
        gateway.stop()


#: Requests whose path, query, headers or method httpx would refuse or change: (method, raw target, more header lines).
ODD_REQUESTS = [
    ('GET', b'/twinkle/v1/runs/x%00', ()),
    ('GET', b'/twinkle/v1/futures/x%00', ()),
    ('GET', b'/twinkle/v1/runs?limit=%00', ()),
    ('GET', b'/twinkle/v1/runs?limit=1&x=%zz&y=%ff', ()),
    ('GET', b'/twinkle/v1/runs/../server', ()),
    ('GET', b'/twinkle/v1/runs/a%2F..%2Fb', ()),
    ('GET', b'/twinkle/v1/runs/%ff%fe', ()),
    ('GET', b'/twinkle/v1/runs/a%3Fb%23c', ()),
    ('GET', b'/twinkle/v1/runs', (b'X-Odd: caf\xe9 \xff',)),
    ('GET', b'/twinkle/v1/runs', (b'X-Forwarded-Host: elsewhere.example', b'Forwarded: host=elsewhere.example')),
    ('PROPFIND', b'/twinkle/v1/runs', ()),
    ('OPTIONS', b'/twinkle/v1/runs', ()),
    ('HEAD', b'/healthz', ()),
    ('POST', b'/healthz', ()),
    ('GET', b'/docs%00', ()),
    ('GET', b'//twinkle/v1/runs', ()),
    ('POST', b'/api/v1/session_heartbeat', (b'Content-Type: application/json',)),
]
#: The body of each POST above: a NUL in a JSON string, which PostgreSQL's text cannot hold.
ODD_BODY = b'{"session_id": "x\\u0000", "type": "session_heartbeat"}'


@pytest.mark.integration
@pytest.mark.parametrize('with_key', [False, True], ids=['no key', 'key'])
def test_odd_requests_are_answered_through_a_gateway_as_at_the_worker(deployment, with_key):
    key = deployment['keys']['alice'] if with_key else None
    worker, gateway = deployment['worker'], deployment['gateways'][1].url
    for method, target, more in ODD_REQUESTS:
        body = ODD_BODY if method == 'POST' else b''
        request = head(method, target, key, *more, b'Content-Length: %d' % len(body)) + body
        there, here = exchange(worker, request), exchange(gateway, request)
        assert there[0] < 500 and here[0] == there[0], (method, target, there, here)
        assert here[2] == there[2], (method, target, there[2], here[2])
        assert here[1].get('allow') == there[1].get('allow'), (method, target)


# ---- a compute request sent again: it runs once -------------------------------------------------------
def count_futures(deployment: dict[str, Any], run_id: str, op: str = 'forward_backward') -> int:
    db = deployment['app'].state.service.store.db
    return db.count('SELECT COUNT(*) FROM futures WHERE run_id = ? AND op = ?', (run_id, op))


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, 'timed out'
        time.sleep(0.05)


@pytest.mark.integration
def test_a_waited_call_sent_again_after_its_gateway_was_killed_runs_once(deployment):
    key = deployment['keys']['alice']
    doomed, survivor = GatewayProcess(deployment['worker'], deployment['store']), deployment['gateways'][1]
    try:
        client = TwinkleClient(survivor.url, key)
        run_id = MultiLoraTransformersModel(client=client).add_adapter_to_model(
            'once', LoraConfig(r=4, target_modules='all-linear')
        )
        path, once = f'/twinkle/v1/runs/{run_id}/ops/forward_backward', {'Idempotency-Key': str(uuid.uuid4())}
        headers = {'Authorization': f'Bearer {key}', **once}
        gate = Gate(deployment['app'].state.service.default.scheduler)  # the request waits at the worker
        cut: list[BaseException] = []

        def send_at_the_doomed() -> None:
            try:
                httpx.post(
                    f'{doomed.url}{path}', json={'inputs': ROWS}, params={'wait': 30}, headers=headers, timeout=60
                )
            except httpx.HTTPError as error:  # the gateway died under it
                cut.append(error)

        first = threading.Thread(target=send_at_the_doomed)
        first.start()
        wait_until(lambda: count_futures(deployment, run_id) == 1)  # the worker has it
        doomed.stop()  # kill -9 during the wait
        first.join(timeout=30)
        assert cut and doomed.process.returncode == -signal.SIGKILL
        answers: list[httpx.Response] = []
        again = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f'{survivor.url}{path}', json={'inputs': ROWS}, params={'wait': 30}, headers=headers, timeout=60
                )
            )
        )
        again.start()
        time.sleep(0.5)  # at the worker, waiting for the first one's future
        gate.open()
        again.join(timeout=60)
        assert answers and answers[0].status_code == 202, answers
        future = answers[0].json()['future']
        assert future['status'] == 'done' and future['result']['loss'] > 0, future
        assert count_futures(deployment, run_id) == 1  # one forward_backward ran, and its future answered both
        usage = client.usage(since=time.time() - 7200)
        assert [r.tokens_trained for r in usage.tenants[0].runs if r.run_id == run_id] == [ROWS_TOKENS]
        # Sent again once settled: the same future at once, still nothing run.
        replay = httpx.post(
            f'{survivor.url}{path}', json={'inputs': ROWS}, params={'wait': 30}, headers=headers, timeout=60
        )
        assert replay.status_code == 202 and replay.json()['future_id'] == answers[0].json()['future_id']
        assert count_futures(deployment, run_id) == 1
    finally:
        doomed.stop()


@pytest.mark.integration
def test_a_key_sent_again_with_another_request_is_a_422_that_says_so(deployment):
    key = deployment['keys']['bob']
    gateway = deployment['gateways'][0].url
    client = TwinkleClient(gateway, key)
    run_id = MultiLoraTransformersModel(client=client).add_adapter_to_model(
        'keyed', LoraConfig(r=4, target_modules='all-linear')
    )
    other_run = MultiLoraTransformersModel(client=client).add_adapter_to_model(
        'other', LoraConfig(r=4, target_modules='all-linear')
    )
    headers = {'Authorization': f'Bearer {key}', 'Idempotency-Key': str(uuid.uuid4())}
    first = httpx.post(
        f'{gateway}/twinkle/v1/runs/{run_id}/ops/forward_backward',
        json={'inputs': ROWS},
        headers=headers,
        params={'wait': 30},
        timeout=60,
    )
    assert first.status_code == 202, first.text
    longer = [{'input_ids': [5, 6, 7, 8, 9, 10, 11], 'labels': [-100, 6, 7, 8, 9, 10, 11]}]
    for run, op, inputs in (
        (run_id, 'forward_backward', longer),
        (run_id, 'forward_only', ROWS),
        (other_run, 'forward_backward', ROWS),
    ):
        refused = httpx.post(
            f'{gateway}/twinkle/v1/runs/{run}/ops/{op}', json={'inputs': inputs}, headers=headers, timeout=60
        )
        assert refused.status_code == 422, refused.text
        [problem] = refused.json()['detail']
        assert problem['loc'] == ['header', 'Idempotency-Key'] and 'another request' in problem['msg'], problem
        assert f'forward_backward on run {run_id!r}' in problem['msg']
    assert count_futures(deployment, run_id) == 1 and count_futures(deployment, other_run) == 0
    assert count_futures(deployment, run_id, 'forward_only') == 0


class Balancer:
    """A load balancer's worth of TCP on a port of its own: each new connection goes to the first of
    ``backends`` that takes it, so a request sent again after its gateway died reaches the next one."""

    def __init__(self, backends: list[str]):
        self.backends = [(httpx.URL(url).host, httpx.URL(url).port) for url in backends]
        self.listener = socket.create_server(('127.0.0.1', 0))
        self.url = f'http://127.0.0.1:{self.listener.getsockname()[1]}'
        self.sockets: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = self._connect()
            if upstream is None:
                client.close()
                continue
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                pipe = threading.Thread(target=self._pipe, args=(source, sink))
                self.threads.append(pipe)
                pipe.start()

    def _connect(self) -> socket.socket | None:
        for backend in self.backends:
            try:
                return socket.create_connection(backend, timeout=5)
            except OSError:
                continue
        return None

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):  # one side gone: the other is told (a broken connection, as a balancer's)
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for end in self.sockets:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
        for thread in self.threads:
            thread.join(timeout=30)
        for end in self.sockets:
            end.close()


@pytest.mark.integration
def test_the_client_sends_a_call_again_with_its_key_when_its_gateway_dies_under_it(deployment):
    key = deployment['keys']['alice']
    doomed, survivor = GatewayProcess(deployment['worker'], deployment['store']), deployment['gateways'][0]
    balancer = Balancer([doomed.url, survivor.url])
    try:
        model = MultiLoraTransformersModel(client=TwinkleClient(balancer.url, key))
        run_id = model.add_adapter_to_model('failover', LoraConfig(r=4, target_modules='all-linear'))
        gate = Gate(deployment['app'].state.service.default.scheduler)
        losses: list[float] = []
        call = threading.Thread(target=lambda: losses.append(model.forward_backward(inputs=ROWS).loss))
        call.start()
        wait_until(lambda: count_futures(deployment, run_id) == 1)  # at the worker, through the doomed gateway
        doomed.stop()  # kill -9 under the client's waiting call: it sends the call again, through the survivor
        time.sleep(1.0)
        gate.open()
        call.join(timeout=120)
        assert losses and losses[0] > 0
        assert count_futures(deployment, run_id) == 1
    finally:
        balancer.close()
        doomed.stop()


def test_the_client_keeps_one_key_per_call_over_its_tries():
    """No server: a transport whose first try of each request breaks its connection and whose second is a
    503 (a gateway stopping), so each answered request took three tries."""
    seen: list[tuple[str, str | None]] = []
    done = {'id': 'fut-1', 'tenant_id': 't', 'run_id': 'r', 'op': 'forward_backward', 'status': 'done'}
    answers = {'POST': {'future_id': 'fut-1', 'future': {**done, 'result': {'loss': 1.5}, 'created_at': 0.0}}}
    answers['GET'] = {'runs': [], 'total': 0}

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.headers.get('Idempotency-Key')))
        if len(seen) % 3 == 1:
            raise httpx.RemoteProtocolError('server disconnected without sending a response', request=request)
        if len(seen) % 3 == 2:
            return httpx.Response(
                503, headers={'Retry-After': '0'}, json={'detail': 'stop', 'error': 'UnavailableError'}
            )
        return httpx.Response(202 if request.method == 'POST' else 200, json=answers[request.method])

    client = TwinkleClient('http://balancer.invalid', 'tml-key', binary=False)
    transport = httpx.MockTransport(answer)
    client.http = httpx.Client(base_url=client.base_url, headers=client.http.headers, transport=transport)
    ops = '/twinkle/v1/runs/r/ops/forward_backward'
    assert client.call(ops, {'inputs': ROWS}) == {'loss': 1.5}
    first = {key for _, key in seen}
    assert len(seen) == 3 and len(first) == 1 and uuid.UUID(first.pop()).version == 4  # one key, on each try
    assert client.call(ops, {'inputs': ROWS}) == {'loss': 1.5}
    assert len(seen) == 6 and seen[3][1] == seen[5][1] != seen[0][1]  # a new call: a key of its own
    assert client.list_training_runs() == [] and len(seen) == 9  # a GET runs nothing: tried again too
    seen.clear()
    with pytest.raises(httpx.RemoteProtocolError):  # a POST without a key is not sent again: it may have run
        client.request('POST', '/twinkle/v1/runs', json={})
    assert seen == [('POST', None)]


@pytest.mark.integration
def test_a_gateway_imports_no_model_code():
    """A gateway starts in seconds: it imports the store and the HTTP layer, never torch or transformers."""
    probe = 'import sys, twinkle.server.gateway; print(sorted({"torch", "transformers"} & {*sys.modules}))'
    assert subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, check=True).stdout == '[]\n'
