"""The metrics, and what a server answers without a key.

``/metrics`` on the API's port answers the admin key only (a tenant's key is a 401, as no key is);
``metrics.port`` serves them alone without a key, and closes with the server; ``metrics.tenant_label``
names tenants by id (the default, ``tests/server/test_server_gateways.py``), by name
(``tests/server/test_server_usage.py``) or not at all (here). The routes that answer without a key are the health
checks, the API's schema and its pages, the dashboard's page and files, and the signed links' files (whose
signature is the credential: ``tests/server/tinker/test_tinker_export.py``); none names a tenant or a server path.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from peft import LoraConfig
from server_helpers import background_server, free_port

from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ROWS = [{'input_ids': [5, 6, 7, 8, 9, 10], 'labels': [-100, 6, 7, 8, 9, 10]}]
ADMIN_KEY = 'admin-' + 'k' * 40
#: What answers without a key, and why: health checks, the API's own schema and pages (the package's, the
#: same on every server), the dashboard's page and files (it signs in with a key after it loads).
PUBLIC_PAGES = [
    '/healthz',
    '/api/v1/healthz',
    '/openapi.json',
    '/docs',
    '/redoc',
    '/dashboard',
    '/dashboard/static/dashboard.js',
]


@pytest.fixture(scope='module')
def served(tmp_path_factory, tiny_model_dir) -> Iterator[dict[str, Any]]:
    data_dir = tmp_path_factory.mktemp('metrics')
    port = free_port()
    options = {'admin_api_key': ADMIN_KEY, 'metrics': {'port': port, 'tenant_label': 'none'}}
    with background_server(data_dir, tiny_model_dir, tenants=('alice', 'bob'), **options) as (url, keys, _):
        for name in ('alice', 'bob'):  # one forward_backward of ROWS each: 6 tokens trained each
            model = MultiLoraTransformersModel(client=TwinkleClient(url, keys[name]))
            model.add_adapter_to_model(f'{name}-run', LoraConfig(r=4, target_modules='all-linear'))
            model.forward_backward(inputs=ROWS)
        yield {'url': url, 'keys': keys, 'scrape': f'http://127.0.0.1:{port}', 'data_dir': str(data_dir)}


def test_the_metrics_port_serves_them_without_a_key_and_without_tenants(served):
    scraped = httpx.get(served['scrape'], timeout=30)
    assert scraped.status_code == 200
    # tenant_label: none: one series per kind, every tenant's usage summed (6 + 6 tokens trained)
    assert re.search(r'^twinkle_usage_total\{kind="training"\} 12\.0$', scraped.text, re.M), scraped.text
    assert 'tenant=' not in scraped.text and 'alice' not in scraped.text
    # The API's port: the admin key only, the same metrics.
    url, alice = served['url'], served['keys']['alice']
    for refused in ({}, {'Authorization': f'Bearer {alice}'}, {'X-API-Key': 'tml-' + 'x' * 40}):
        answer = httpx.get(f'{url}/metrics', headers=refused)
        assert answer.status_code == 401 and answer.json()['error'] == 'UnauthorizedError', answer.text
        assert 'metrics.port' in answer.json()['detail'] and 'twinkle_' not in answer.text
    admin = httpx.get(f'{url}/metrics', headers={'X-API-Key': ADMIN_KEY}).text
    assert 'twinkle_usage_total{kind="training"} 12.0' in admin
    # The metrics' socket serves nothing but them: the API is not there.
    assert 'twinkle_usage_total' in httpx.get(f'{served["scrape"]}/twinkle/v1/runs', headers={'X-API-Key': alice}).text


def test_what_answers_without_a_key_names_no_tenant_and_no_server_path(served):
    url = served['url']
    for path in PUBLIC_PAGES:
        answer = httpx.get(f'{url}{path}')
        assert answer.status_code == 200, (path, answer.status_code)
        for private in ('alice', 'bob', served['data_dir'], *served['keys'].values()):
            assert private not in answer.text, (path, private)
    # Everything else needs a key: a tenant's run list, the dashboard's session, the metrics.
    for path in ('/twinkle/v1/runs', '/dashboard/api/session', '/metrics', '/api/v1/training_runs'):
        assert httpx.get(f'{url}{path}').status_code == 401, path


def test_the_metrics_port_closes_with_its_server(tmp_path, tiny_model_dir):
    with background_server(tmp_path, tiny_model_dir, tenants=(), metrics={'port': 0}) as (_, _, background):
        port = background.app.state.metrics.port
        assert port and httpx.get(f'http://127.0.0.1:{port}/').status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f'http://127.0.0.1:{port}/', timeout=5)
