"""Hostile path parameters on every route of every API of the worker (native ``/twinkle/v1``, Tinker
``/api/v1``, OpenAI ``/v1``, the dashboard): a NUL (``%00``), an encoded slash, a byte that is not UTF-8
(``%ff``) and very long ids are answered with a 4xx, never a 5xx, on both stores. PostgreSQL's text
cannot hold a NUL at all (psycopg refuses the statement before it is sent), so there a NUL in a run id
was a 500 on 32 routes; SQLite looks it up and finds nothing. A NUL, or any control character, is now
refused before any route looks it up: a 404 whose message names the parameter and its value."""

from __future__ import annotations

import contextlib
import re

import httpx
import pg_helpers
import pytest
from server_helpers import background_server

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

#: Routes the OpenAPI document leaves out (``include_in_schema=False``) that take path parameters.
HIDDEN = [('POST', '/twinkle/v1/runs/{run_id}/ops/{operation}'), ('PUT', '/api/v1/sessions/{session_id}/project')]
#: Path parameter values, as sent (already percent-encoded).
CONTROL_VALUES = ['%00', 'run-1%00', '%1B']
#: A line break is a control character too, but a ``{name:path}`` parameter does not match it: the
#: framework's own 404 answers it there, before any route.
OTHER_VALUES = ['%2F', '%ff', '%0A', 'x' * 5000]


@pytest.fixture(scope='module', params=['sqlite', 'postgresql'])
def server(request, tmp_path_factory, tiny_model_dir):
    with contextlib.ExitStack() as stack:
        store = None
        if request.param == 'postgresql':
            store = stack.enter_context(pg_helpers.fresh_database(request.getfixturevalue('postgres')))
        data_dir = tmp_path_factory.mktemp(request.param)
        url, keys, running = stack.enter_context(background_server(data_dir, tiny_model_dir, ('alice',), store=store))
        spec = running.app.openapi()
        routes = [(method.upper(), path) for path, methods in spec['paths'].items() for method in methods]
        headers = {'Authorization': f'Bearer {keys["alice"]}', 'Content-Type': 'application/json'}
        http = stack.enter_context(httpx.Client(base_url=url, headers=headers, timeout=60))
        yield http, [(m, p) for m, p in routes + HIDDEN if '{' in p]


def test_every_path_parameter_with_a_nul_or_control_character_is_a_404_naming_it(server):
    http, routes = server
    assert len(routes) >= 40, routes  # every API's routes are here, the dashboard's too
    assert {'/v1/models/{model}', '/dashboard/api/runs/{run_id}/checkpoints/{kind}/{name}'} <= {p for _, p in routes}
    wrong = []
    for method, template in routes:
        for value in CONTROL_VALUES:
            response = http.request(method, re.sub(r'\{[^}]*\}', value, template), content=b'{}')
            detail = response.json().get('detail', '') if response.status_code < 500 else ''
            # The message names the value as Python writes it: '\x00', '\n', '\x1b'.
            control = next(c for c in httpx.URL('/' + value).path[1:] if ord(c) < 32)
            if response.status_code != 404 or repr(control)[1:-1] not in detail:
                wrong.append(f'{method} {template} {value}: {response.status_code} {response.text[:160]}')
    assert not wrong, '\n'.join(wrong)


def test_every_path_parameter_slashed_long_or_not_utf8_is_refused_or_redirected(server):
    http, routes = server
    wrong = []
    for method, template in routes:
        for value in OTHER_VALUES:
            response = http.request(method, re.sub(r'\{[^}]*\}', value, template), content=b'{}')
            # 3xx: an encoded slash may leave a trailing slash the framework redirects away.
            if not 300 <= response.status_code < 500:
                wrong.append(f'{method} {template} {value[:20]}: {response.status_code} {response.text[:160]}')
    assert not wrong, '\n'.join(wrong)


def test_the_openai_model_route_names_the_id_in_its_error_shape(server):
    http, _ = server
    response = http.get('/v1/models/Qwen%00')
    assert response.status_code == 404, response.text
    error = response.json()['error']
    assert error['code'] == 'model_not_found' and error['param'] == 'model', error
    assert "'Qwen\\x00'" in error['message'], error
