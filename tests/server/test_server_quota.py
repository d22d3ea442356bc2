"""One tenant cannot fill the server: each tenant holds at most ``max_adapters_per_tenant``
adapters on the model (native runs and Tinker models alike) and a full pool holds at most
``max_adapters``; adding one past either first releases the least recently used adapter that
can go (it comes back on its next request), and idle adapters are released by default."""

from __future__ import annotations

import httpx
import pytest
from peft import LoraConfig
from server_helpers import background_server

from twinkle.server.config import Limits, ServerConfig
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

LORA = {'r': 4, 'target_modules': ['q_proj']}
ROW = {'input_ids': [1, 2, 3, 4], 'labels': [1, 2, 3, 4]}


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


@pytest.mark.integration
def test_a_tenant_past_its_quota_gives_up_its_least_recently_used_adapter(tmp_path, tiny_model_dir):
    limits = {'max_adapters': 3, 'max_adapters_per_tenant': 2}
    with background_server(tmp_path, tiny_model_dir, limits=limits, idle_release_s=3600.0) as (url, keys, server):
        runs = []
        for _ in range(4):  # before: the third filled the pool, the fourth was a 429 for everyone
            created = create_run(url, keys['alice'])
            assert created.status_code == 201, created.text
            runs.append(created.json()['id'])
        assert [status_of(url, keys['alice'], run) for run in runs] == ['released', 'released', 'active', 'active']
        assert create_run(url, keys['bob']).status_code == 201  # alice never holds more than her two
        assert len(server.app.state.service.default.adapters) == 3


@pytest.mark.integration
def test_a_tenant_whose_adapters_all_wait_for_a_step_still_gets_a_new_run(tmp_path, tiny_model_dir):
    """Both of alice's adapters hold gradients waiting for a step: a third run releases the least
    recently used one with its gradients (before: a 429 until one of them stepped), and each then
    steps on its own gradient, as the other does (the same weights and row: the same norm)."""
    with background_server(tmp_path, tiny_model_dir, limits={'max_adapters_per_tenant': 2}) as (url, keys, _):
        model = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
        for name in ('a', 'b'):
            model.add_adapter_to_model(name, LoraConfig(r=4, target_modules=['q_proj']), seed=1)
            model.forward_backward(inputs=[ROW], adapter_name=name)  # gradients wait for a step
        created = create_run(url, keys['alice'])
        assert created.status_code == 201, created.text
        assert status_of(url, keys['alice'], model.runs['a']) == 'released'  # the least recently used
        norms = [model.clip_grad_and_step(adapter_name=name) for name in ('a', 'b')]  # each comes back for it
        assert norms[0] is not None and norms[0] > 0 and norms[0] == pytest.approx(norms[1], rel=1e-6), norms


@pytest.mark.integration
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
        assert len(server.app.state.service.default.adapters) == 2


def tinker_create_model(url: str, key: str, session_id: str, base_model: str) -> httpx.Response:
    body = {'session_id': session_id, 'model_seq_id': 0, 'base_model': base_model, 'lora_config': {'rank': 4}}
    return httpx.post(f'{url}/api/v1/create_model', json=body, headers={'X-API-Key': key})


def tinker_result(url: str, key: str, request_id: str) -> dict:
    while True:
        body = {'request_id': request_id}
        result = httpx.post(f'{url}/api/v1/retrieve_future', json=body, headers={'X-API-Key': key}, timeout=60).json()
        if result.get('type') != 'try_again':
            return result


@pytest.mark.integration
@pytest.mark.parametrize('first', ['native', 'tinker'])
def test_tinker_models_and_native_runs_share_the_quota(tmp_path, tiny_model_dir, first):
    limits = {'max_adapters_per_tenant': 1}
    with background_server(tmp_path, tiny_model_dir, limits=limits, idle_release_s=3600.0) as (url, keys, server):
        key = keys['alice']
        body = {'tags': [], 'user_metadata': {}, 'sdk_version': '0'}
        session_id = httpx.post(f'{url}/api/v1/create_session', json=body, headers={'X-API-Key': key}).json()[
            'session_id'
        ]
        native = tinker = None
        for kind in (first, 'tinker' if first == 'native' else 'native'):
            if kind == 'native':
                native = create_run(url, key).json()['id']
            else:
                created = tinker_create_model(url, key, session_id, tiny_model_dir).json()
                assert tinker_result(url, key, created['request_id'])['type'] == 'create_model'
                tinker = created['model_id']
        newest = tinker if first == 'native' else native
        assert list(server.app.state.service.default.adapters) == [newest]  # the other one was released for it
