"""Server-wide settings on a real server: tenants from an API keys file, and the per-tenant
request rate limit (429 with Retry-After, other tenants unaffected)."""

from __future__ import annotations

import doctest

import httpx
import pytest

from twinkle.server import auth, rate_limit
from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
from twinkle.server.rate_limit import RateLimitedError, RateLimiter

ALICE, BOB = 'tml-' + 'a' * 40, 'tml-' + 'b' * 40


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    directory = tmp_path_factory.mktemp('limits')
    (directory / 'keys.yaml').write_text(f'alice: {ALICE}\nbob: sha256:{auth.hash_key(BOB)}\n')
    (directory / 'server.yaml').write_text(
        f'base_model: {tiny_model_dir}\nport: 0\ndevice: cpu\ndata_dir: {directory / "data"}\n'
        'api_keys_file: keys.yaml\nlimits: {max_requests_per_minute: 30}\n'
    )
    config = ServerConfig.load(directory / 'server.yaml')
    assert config.api_keys_file == str(directory / 'keys.yaml')  # relative to the config file
    with BackgroundServer(config) as url:
        yield url


def get_runs(url: str, key: str) -> httpx.Response:
    return httpx.get(f'{url}/twinkle/v1/runs', headers={'Authorization': f'Bearer {key}'})


@pytest.mark.integration
def test_a_tenant_over_its_rate_gets_429_and_others_are_served(server):
    statuses = [get_runs(server, ALICE).status_code for _ in range(4)]  # bursts of 30 / 10 = 3
    assert statuses[:3] == [200, 200, 200] and statuses[3] == 429, statuses
    refused = get_runs(server, ALICE)
    assert refused.status_code == 429
    assert 'max_requests_per_minute' in refused.json()['detail']
    assert 1 <= int(refused.headers['Retry-After']) <= 3  # a request every 2 s refills the bucket
    assert get_runs(server, BOB).status_code == 200  # bob's bucket is his own
    assert httpx.get(f'{server}/healthz').status_code == 200


@pytest.mark.integration
def test_tenants_of_the_keys_file_are_known_and_others_are_not(server):
    assert get_runs(server, BOB).status_code == 200
    assert get_runs(server, 'tml-' + 'c' * 40).status_code == 401


def test_the_bucket_refills_at_the_configured_rate():
    now = [0.0]
    limiter = RateLimiter(per_minute=120, clock=lambda: now[0])  # 2 a second, bursts of 12
    for _ in range(12):
        limiter.acquire('alice')
    with pytest.raises(RateLimitedError, match=r'retry in 0\.5 s'):
        limiter.acquire('alice')
    now[0] = 0.5
    limiter.acquire('alice')
    with pytest.raises(RateLimitedError):
        limiter.acquire('alice')
    limiter.acquire('bob')


def test_doctests():
    assert doctest.testmod(rate_limit).failed == 0
    assert doctest.testmod(auth).failed == 0
