"""What a connection may send before the server spends anything on it, over real HTTP on loopback.

Raw sockets send a request head and part of a body, then wait: an answer that comes while most of
the body is still unsent shows the server did not read it. The server runs with small limits
(4 KiB bodies for tokens, 1 KiB for the rest, half a second of silence) so that each case is quick;
the sockets wait far longer than that (``PATIENCE_S``), so a busy machine does not fail them, and a
server that never answers or never closes fails them with a timeout.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import httpx
import pytest
from server_helpers import background_server

from twinkle.server.api.request_limits import TOKEN_ROUTES
from twinkle.server.config import Limits
from twinkle.server.store import Store

#: Seconds a test socket waits for an answer or a close; the server's own timeouts are 0.5 s.
PATIENCE_S = 30.0
TOKENS_BODY_BYTES = 4096
OTHER_BODY_BYTES = 1024
LIMITS = {
    'max_body_bytes': TOKENS_BODY_BYTES,
    'max_other_body_bytes': OTHER_BODY_BYTES,
    'idle_connection_timeout_s': 0.5,
    'body_read_timeout_s': 0.5,
}
OPS_PATH = '/twinkle/v1/runs/run-x/ops/forward_backward'


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('limits'), tiny_model_dir, limits=LIMITS) as running:
        yield running


def connect(url: str) -> socket.socket:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=PATIENCE_S)
    return sock


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f'{method} {path} HTTP/1.1', 'Host: test', *(f'{name}: {value}' for name, value in headers.items())]
    return ('\r\n'.join(lines) + '\r\n\r\n').encode()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout if it never does)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b''.join(chunks)


def parse(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head_bytes, _, body = response.partition(b'\r\n\r\n')
    status_line, *header_lines = head_bytes.decode('latin-1').split('\r\n')
    headers = dict(line.lower().split(': ', 1) for line in header_lines)
    return int(status_line.split()[1]), headers, body


@pytest.mark.integration
@pytest.mark.parametrize('path', [OPS_PATH, '/api/v1/create_session', '/api/v1/create_model', '/api/v1/asample'])
@pytest.mark.parametrize('auth', [{}, {'Authorization': 'Bearer tml-not-a-key-of-anyone-here-0123456789'}])
def test_a_body_without_a_known_key_is_not_read(server, auth, path):
    # 50 MB announced, 2 bytes sent: the 401 must come now, and the connection close, without the rest.
    # The native and Tinker routes answer it in their shared error shape, under the tree's class.
    url, _, _ = server
    with connect(url) as sock:
        sock.sendall(
            head('POST', path, {**auth, 'Content-Type': 'application/json', 'Content-Length': '50000000'}) + b'{"'
        )
        status, headers, body = parse(read_until_closed(sock))
    assert status == 401, body
    answer = json.loads(body)
    assert 'API key' in answer['detail'] and answer['error'] == 'UnauthorizedError'
    assert headers['connection'] == 'close'


@pytest.mark.integration
def test_the_openai_api_refuses_a_keyless_body_in_its_own_shape(server):
    url, _, _ = server
    with connect(url) as sock:
        headers = {'Content-Type': 'application/json', 'Content-Length': '9999'}
        sock.sendall(head('POST', '/v1/chat/completions', headers))
        status, _, body = parse(read_until_closed(sock))
    assert status == 401
    assert 'API key' in json.loads(body)['error']['message']


@pytest.mark.integration
def test_a_body_sent_after_its_refusal_is_read_and_dropped_not_reset(server):
    # What a streaming client does (a gateway, httpx): the head, then the body in sends of its own. The
    # 401 comes after the head; the server then reads the body on and drops it until the client closes,
    # where closing at once would make its kernel answer the body's bytes with a reset (RFC 9112 9.6).
    url, _, _ = server
    with connect(url) as sock:
        sock.sendall(head('POST', OPS_PATH, {'Content-Type': 'application/json', 'Content-Length': '65536'}))
        status, headers, _ = parse(read_until_closed(sock))  # the answer, then the server's half-close
        for _ in range(4):
            sock.sendall(b' ' * 16384)  # a reset by now fails these sends or the read below
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b''
    assert status == 401 and headers['connection'] == 'close'


@pytest.mark.integration
def test_an_announced_body_over_the_cap_is_413_before_it_is_read(server):
    url, keys, _ = server
    with connect(url) as sock:
        announced = TOKENS_BODY_BYTES + 1
        sock.sendall(head('POST', OPS_PATH, {'X-API-Key': keys['alice'], 'Content-Length': str(announced)}))
        status, headers, body = parse(read_until_closed(sock))
    assert status == 413
    detail = json.loads(body)['detail']
    assert str(announced) in detail and str(TOKENS_BODY_BYTES) in detail and 'max_body_bytes' in detail
    assert headers['connection'] == 'close'


@pytest.mark.integration
def test_a_chunked_body_is_cut_off_at_the_cap(server):
    # No length announced: the server counts the bytes as they come and answers once they pass 4 KiB.
    url, keys, _ = server
    with connect(url) as sock:
        sock.sendall(head('POST', OPS_PATH, {'X-API-Key': keys['alice'], 'Transfer-Encoding': 'chunked'}))
        sock.sendall((b'3e8\r\n' + b' ' * 1000 + b'\r\n') * 5)  # 5 x 1000 bytes > 4096; no final empty chunk
        status, _, body = parse(read_until_closed(sock))
    assert status == 413
    assert str(TOKENS_BODY_BYTES) in json.loads(body)['detail']


@pytest.mark.integration
def test_routes_without_tokens_have_the_smaller_cap(server):
    url, keys, _ = server
    auth = {'X-API-Key': keys['alice']}
    padding = {'adapter_name': 'a', 'lora': {'target_modules': ['q_proj' + ' ' * 1500]}}  # 1.5 KB: over 1 KiB
    small = httpx.post(f'{url}/twinkle/v1/runs', json=padding, headers=auth, timeout=PATIENCE_S)
    assert small.status_code == 413, small.text
    assert 'max_other_body_bytes' in small.json()['detail']
    # The same 1.5 KB to a route that carries tokens is read, and refused for what it says, not its size.
    ops = httpx.post(f'{url}{OPS_PATH}', json={'inputs': [], 'pad': ' ' * 1500}, headers=auth, timeout=PATIENCE_S)
    assert 400 <= ops.status_code < 500 and ops.status_code != 413, ops.text


@pytest.mark.integration
def test_requests_within_the_caps_are_served(server):
    url, keys, _ = server
    auth = {'X-API-Key': keys['alice']}
    created = httpx.post(f'{url}/twinkle/v1/runs', json={'lora': {'r': 4}}, headers=auth, timeout=PATIENCE_S)
    assert created.status_code == 201, created.text
    assert httpx.get(f'{url}/healthz', timeout=PATIENCE_S).status_code == 200


@pytest.mark.integration
def test_a_connection_that_sends_nothing_is_closed(server):
    url, _, _ = server
    with connect(url) as sock:
        assert read_until_closed(sock) == b''


@pytest.mark.integration
def test_a_request_head_cut_short_is_closed(server):
    url, _, _ = server
    with connect(url) as sock:
        sock.sendall(b'POST /twinkle/v1/runs HTTP/1.1\r\nHost: te')
        assert read_until_closed(sock) == b''


@pytest.mark.integration
def test_a_body_that_stops_arriving_is_408_and_closed(server):
    url, keys, _ = server
    with connect(url) as sock:
        sock.sendall(head('POST', OPS_PATH, {'X-API-Key': keys['alice'], 'Content-Length': '100'}))
        sock.sendall(b'{"inputs": ')  # 11 of 100 bytes, then silence
        status, headers, body = parse(read_until_closed(sock))
    assert status == 408
    assert 'body_read_timeout_s' in json.loads(body)['detail']
    assert headers['connection'] == 'close'


@pytest.mark.integration
def test_a_connection_idle_after_a_response_is_closed(server):
    url, _, _ = server
    with connect(url) as sock:
        sock.sendall(head('GET', '/healthz', {}))
        status, _, _ = parse(read_until_closed(sock))  # kept alive, then closed for idling
    assert status == 200


def test_the_default_cap_fits_a_forward_backward_of_the_token_limit():
    # The largest native forward_backward the token limit allows, as the client sends it: one row of
    # max_tokens_per_request tokens, each of its five int fields at its widest (a 6-digit token id,
    # a 5-digit position), and per-token advantages and old log-probs as full-precision floats.
    limits = Limits()
    n = limits.max_tokens_per_request
    row = {
        'input_ids': [151_643] * n,
        'attention_mask': [1] * n,
        'position_ids': [n - 1] * n,
        'labels': [151_643] * n,
        'completion_mask': [1] * n,
    }
    body = {'inputs': [row], 'advantages': [-0.12345678901234567] * n, 'old_logps': [-12.345678901234567] * n}
    size = len(json.dumps(body).encode())
    assert size < limits.max_body_bytes


@pytest.mark.integration
def test_the_token_routes_are_routes_of_the_app(server):
    # Each route the larger cap is for exists, and no other published route gets it: a renamed route
    # would otherwise fall silently under the smaller cap. The native operations are published one by one.
    url, _, _ = server
    published = set(httpx.get(f'{url}/openapi.json', timeout=PATIENCE_S).json()['paths'])
    tokens = {path for path in published if TOKEN_ROUTES.fullmatch(path)}
    native_ops = {path for path in tokens if path.startswith('/twinkle/v1/runs/{run_id}/ops/')}
    assert '/twinkle/v1/runs/{run_id}/ops/forward_backward' in native_ops
    others = {'/api/v1/forward_backward', '/api/v1/asample', '/v1/chat/completions', '/v1/completions'}
    assert tokens - native_ops == others


@pytest.mark.integration
@pytest.mark.parametrize(
    ('method', 'path', 'body'),
    [
        ('POST', OPS_PATH, {}),  # the middleware's check before the body, then the route's
        ('POST', '/api/v1/forward_backward', {}),  # and Tinker's check before it parses the body
        ('GET', '/twinkle/v1/runs', None),  # no body: the route's check alone
    ],
)
def test_a_request_looks_its_key_up_once(server, monkeypatch, method, path, body):
    url, keys, background = server
    db = background.app.state.service.store.db
    lookups, query = [], db.query

    def counted(sql, params=()):
        if 'FROM tenants WHERE key_hash' in sql:
            lookups.append(sql)
        return query(sql, params)

    monkeypatch.setattr(db, 'query', counted)
    answer = httpx.request(method, f'{url}{path}', json=body, headers={'X-API-Key': keys['alice']}, timeout=PATIENCE_S)
    assert answer.status_code in (200, 400, 404, 422), answer.text  # answered as alice: not a 401
    assert len(lookups) == 1


@pytest.mark.integration
def test_a_key_removed_while_the_server_runs_is_refused_from_the_next_request_on(server):
    # As `twinkle-server keys add/remove` does it: another connection to the server's database.
    url, _, background = server
    with Store(background.app.state.service.config.db_path) as store:
        _, key = store.tenants.add('carol')
        headers = {'X-API-Key': key}
        assert httpx.get(f'{url}/twinkle/v1/runs', headers=headers, timeout=PATIENCE_S).status_code == 200
        assert store.tenants.remove('carol')
    answer = httpx.get(f'{url}/twinkle/v1/runs', headers=headers, timeout=PATIENCE_S)
    assert answer.status_code == 401 and answer.json()['detail'] == 'unknown API key'
