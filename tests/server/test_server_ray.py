"""The service with its model in a Ray actor (``ray:`` in the config): the same API, the same
numbers as a model in the server's process, and a dead worker is an error, not a hang."""

from __future__ import annotations

import os
import time

import pytest
import tinker
from tinker import types

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ray = pytest.importorskip('ray')

from twinkle.infra.ray.cluster import LOCAL_SYSTEM_CONFIG  # noqa: E402
from twinkle.server.cli import BackgroundServer  # noqa: E402
from twinkle.server.config import ServerConfig  # noqa: E402
from twinkle.server.execution.hosts.remote_host import RemoteHost  # noqa: E402
from twinkle.server.store import Store  # noqa: E402


@pytest.fixture(scope='module')
def local_ray():
    ray.init(
        address='local', num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG
    )
    yield
    ray.shutdown()


def serve(tmp_path, model_dir: str, **options):
    config = ServerConfig.build(base_model=model_dir, port=0, data_dir=str(tmp_path), device='cpu', **options)
    store = Store(config.db_path)
    _, key = store.tenants.add('alice')
    store.close()
    return BackgroundServer(config), key


def losses(url: str, key: str, model_dir: str) -> list[float]:
    with tinker.ServiceClient(base_url=url, api_key=key) as client:
        training = client.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
        rows = [[(3 * i + 7 * j) % 300 + 20 for j in range(12)] for i in range(3)]
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(r[:-1]),
                loss_fn_inputs={'target_tokens': r[1:], 'weights': [1.0] * 11},
            )
            for r in rows
        ]
        out = []
        for _ in range(3):
            out.append(training.forward_backward(data, 'cross_entropy').result().metrics['loss:sum'])
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return out


def test_a_model_in_a_ray_actor_trains_exactly_like_one_in_process(local_ray, tmp_path, tiny_model_dir):
    remote, key = serve(tmp_path / 'remote', tiny_model_dir, ray={'address': None})
    with remote as url:
        host = remote.app.state.service.default.host
        assert isinstance(host, RemoteHost) and host.pid != os.getpid()
        through_ray = losses(url, key, tiny_model_dir)
    local, key = serve(tmp_path / 'local', tiny_model_dir)
    with local as url:
        in_process = losses(url, key, tiny_model_dir)
    # The actor runs on 1 thread, this process on more: fp32 matmuls sum in another order.
    assert through_ray == pytest.approx(in_process, rel=1e-5)
    assert through_ray[-1] < through_ray[0]


def test_user_errors_stay_user_errors_and_a_dead_worker_is_named(local_ray, tmp_path, tiny_model_dir):
    server, key = serve(tmp_path, tiny_model_dir, ray={'address': None})
    with server as url, tinker.ServiceClient(base_url=url, api_key=key) as client:
        training = client.create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
        bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={'target_tokens': [2, 10**7]})
        with pytest.raises(tinker.RequestFailedError, match='outside the vocabulary') as caught:
            training.forward_backward([bad], 'cross_entropy').result()
        assert 'user' in str(caught.value.category).lower()
        actor = server.app.state.service.default.host._actor
        ray.kill(actor)
        with pytest.raises((ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
            for _ in range(300):  # ray.kill returns before the actor is gone
                ray.get(actor.__ray_ready__.remote(), timeout=5)
                time.sleep(0.1)
        with pytest.raises(tinker.RequestFailedError, match=r'model worker .*died'):
            training.optim_step(types.AdamParams()).result()


def test_tenants_share_a_pass_in_the_ray_actor_and_get_their_numbers_alone(local_ray, tmp_path, tiny_model_dir):
    import threading

    from peft import LoraConfig

    from twinkle_client import init_twinkle_client
    from twinkle_client.client import PREFIX
    from twinkle_client.model import MultiLoraTransformersModel

    config = ServerConfig.build(
        base_model=tiny_model_dir, port=0, data_dir=str(tmp_path), device='cpu', ray={'address': None}
    )
    with Store(config.db_path) as store:
        keys = {tenant: store.tenants.add(tenant)[1] for tenant in ('alice', 'bob')}
    rows = {
        'alice': [{'input_ids': [5, 9, 31, 7, 2], 'labels': [-100, 9, 31, 7, 2]}],
        'bob': [{'input_ids': [40, 8, 17], 'labels': [-100, 8, 17]}, {'input_ids': [3, 3], 'labels': [-100, 3]}],
    }
    server = BackgroundServer(config)
    with server as url:
        service = server.app.state.service
        assert isinstance(service.default.host, RemoteHost)
        models = {}
        for tenant, rank in (('alice', 4), ('bob', 8)):
            model = MultiLoraTransformersModel(client=init_twinkle_client(base_url=url, api_key=keys[tenant]))
            lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules='all-linear', init_lora_weights=False)
            for name in ('mixed', 'alone'):
                model.add_adapter_to_model(name, lora, seed=rank)
            models[tenant] = model
        entered, opened = threading.Event(), threading.Event()
        service.default.scheduler.submit('gatekeeper', lambda: entered.set() or opened.wait(60))  # holds the worker
        assert entered.wait(60)
        futures = {
            tenant: model.client.submit(
                f'{PREFIX}/runs/{model.runs["mixed"]}/ops/forward_backward', {'inputs': rows[tenant]}
            )
            for tenant, model in models.items()
        }
        opened.set()
        shared = {tenant: models[tenant].client.result(future) for tenant, future in futures.items()}
        jobs = [service.default.scheduler.get(future) for future in futures.values()]
        assert jobs[0].pass_id == jobs[1].pass_id and jobs[0].pass_size == 2  # one pass, in the actor
        for tenant, model in models.items():
            alone = model.forward_backward(inputs=rows[tenant], adapter_name='alone')
            assert shared[tenant]['loss'] == pytest.approx(alone.loss, abs=1e-5)
            norms = [model.clip_grad_norm(1.0, adapter_name=name) for name in ('mixed', 'alone')]
            assert norms[0] == pytest.approx(norms[1], rel=1e-5)
