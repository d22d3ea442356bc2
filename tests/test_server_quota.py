"""One tenant cannot fill the server: each tenant holds at most ``max_adapters_per_tenant``
adapters on the model (native runs and Tinker models alike), a full pool releases its least
recently used idle adapter to make room at once, and idle adapters are released by default."""

from __future__ import annotations

import time

import httpx
import pytest
from server_helpers import background_server

from twinkle.server.config import Limits, ServerConfig

LORA = {'r': 4, 'target_modules': ['q_proj']}


def create_run(url: str, key: str) -> httpx.Response:
    """A raw POST: the client would retry a 429 after its Retry-After."""
    return httpx.post(f'{url}/twinkle/v1/runs', json={'lora': LORA}, headers={'Authorization': f'Bearer {key}'})


def status_of(url: str, key: str, run_id: str) -> str:
    headers = {'Authorization': f'Bearer {key}'}
    return httpx.get(f'{url}/twinkle/v1/runs/{run_id}', headers=headers).json()['status']


def test_idle_adapters_are_released_by_default_and_tenants_have_a_quota():
    config = ServerConfig.build(base_model='tiny-qwen3')
    assert config.idle_release_s is not None and config.idle_release_s <= 600  # before: None, never released
    assert Limits().max_adapters_per_tenant < Limits().max_adapters


def test_a_tenant_at_its_quota_gets_a_429_that_says_how_to_free_one_and_others_still_create(tmp_path, tiny_model_dir):
    limits = {'max_adapters': 3, 'max_adapters_per_tenant': 2}
    with background_server(tmp_path, tiny_model_dir, limits=limits, idle_release_s=3600.0) as (url, keys, _):
        assert [create_run(url, keys['alice']).status_code for _ in range(2)] == [201, 201]
        refused = create_run(url, keys['alice'])
        assert refused.status_code == 429, refused.text  # before: 201, the third of the pool's three
        detail = refused.json()['detail']
        assert 'max_adapters_per_tenant' in detail and '2' in detail and 'idle' in detail, detail
        # Its oldest adapter is released after an hour idle: that is when a place frees up.
        assert 3500 <= int(refused.headers['Retry-After']) <= 3600
        assert create_run(url, keys['bob']).status_code == 201  # bob's quota is his own


def test_a_full_pool_releases_its_least_recently_used_idle_adapter_at_once(tmp_path, tiny_model_dir):
    limits = {'max_adapters': 2, 'max_adapters_per_tenant': 2}
    with background_server(tmp_path, tiny_model_dir, limits=limits, idle_release_s=3600.0) as (url, keys, server):
        first, second = (create_run(url, keys['alice']).json()['id'] for _ in range(2))
        created = create_run(url, keys['bob'])
        assert created.status_code == 201, created.text  # before: 429 Retry-After 5 until a restart
        assert status_of(url, keys['alice'], first) == 'released'  # the least recently used
        assert status_of(url, keys['alice'], second) == 'active'
        # The released run comes back on its next request, making room the same way.
        headers = {'Authorization': f'Bearer {keys["alice"]}'}
        future = httpx.post(f'{url}/twinkle/v1/runs/{first}/ops/get_train_configs', json={}, headers=headers)
        assert future.status_code == 202, future.text
        record = httpx.get(f'{url}/twinkle/v1/futures/{future.json()["future_id"]}?wait=30', headers=headers).json()
        assert record['status'] == 'done', record
        assert status_of(url, keys['alice'], first) == 'active'
        assert len(server.app.state.service.adapters) == 2


def test_the_retry_after_of_a_full_quota_is_kept(tmp_path, tiny_model_dir):
    limits = {'max_adapters_per_tenant': 1}
    with background_server(tmp_path, tiny_model_dir, limits=limits, idle_release_s=2.0) as (url, keys, _):
        assert create_run(url, keys['alice']).status_code == 201
        refused = create_run(url, keys['alice'])
        assert refused.status_code == 429, refused.text
        wait = int(refused.headers['Retry-After'])
        assert 1 <= wait <= 2
        time.sleep(wait + 0.1)  # the adapter has now been idle for idle_release_s: its place is free
        assert create_run(url, keys['alice']).status_code == 201


def tinker_create_model(url: str, key: str, session_id: str, base_model: str) -> httpx.Response:
    body = {'session_id': session_id, 'model_seq_id': 0, 'base_model': base_model, 'lora_config': {'rank': 4}}
    return httpx.post(f'{url}/api/v1/create_model', json=body, headers={'X-API-Key': key})


def tinker_result(url: str, key: str, request_id: str) -> dict:
    while True:
        body = {'request_id': request_id}
        result = httpx.post(f'{url}/api/v1/retrieve_future', json=body, headers={'X-API-Key': key}, timeout=60).json()
        if result.get('type') != 'try_again':
            return result


@pytest.mark.parametrize('first', ['native', 'tinker'])
def test_tinker_models_and_native_runs_share_the_quota(tmp_path, tiny_model_dir, first):
    limits = {'max_adapters_per_tenant': 1}
    with background_server(tmp_path, tiny_model_dir, limits=limits, idle_release_s=3600.0) as (url, keys, _):
        key = keys['alice']
        session = httpx.post(
            f'{url}/api/v1/create_session',
            json={'tags': [], 'user_metadata': {}, 'sdk_version': '0'},
            headers={'X-API-Key': key},
        )
        session_id = session.json()['session_id']
        if first == 'native':
            assert create_run(url, key).status_code == 201
            refused = tinker_create_model(url, key, session_id, tiny_model_dir)
        else:
            created = tinker_create_model(url, key, session_id, tiny_model_dir)
            assert created.status_code == 200, created.text
            assert tinker_result(url, key, created.json()['request_id'])['type'] == 'create_model'
            refused = create_run(url, key)
        assert refused.status_code == 429, refused.text
        assert 'max_adapters_per_tenant' in refused.text
