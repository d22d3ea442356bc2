"""The training service on loopback: a real uvicorn server, a real SQLite file, the real client."""

from __future__ import annotations

import doctest
import json
import threading

import httpx
import pytest
import torch
from peft import LoraConfig
from server_helpers import background_server

import twinkle.server.api.errors
from twinkle.dataset import DatasetMeta
from twinkle.model import TransformersModel
from twinkle_client import RemoteError, TwinkleClient, init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset
from twinkle_client.model import MultiLoraTransformersModel


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('server'), tiny_model_dir, limits={'max_lora_rank': 32}) as running:
        yield running


@pytest.fixture(scope='module')
def batches(tiny_model_dir, self_cognition_path) -> list[list[dict]]:
    dataset = Dataset(dataset_meta=DatasetMeta(self_cognition_path, data_slice=range(16)))
    dataset.set_template('Qwen3_5Template', model_id=tiny_model_dir, max_length=128)
    dataset.map('SelfCognitionProcessor', init_args={'model_name': 'twinkle model', 'model_author': 'ModelScope'})
    dataset.encode(batched=True)
    return list(DataLoader(dataset=dataset, batch_size=4))


def lora(r: int) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules='all-linear', init_lora_weights=False)


@pytest.mark.integration
def test_the_seed_client_loop_trains_and_its_loss_falls(server, batches, tiny_model_dir):
    url, keys, _ = server
    client = init_twinkle_client(base_url=url, api_key=keys['alice'])
    model = MultiLoraTransformersModel(model_id=tiny_model_dir)  # the seed's 'ms://Qwen/Qwen3.5-4B', served here
    model.add_adapter_to_model('default', LoraConfig(target_modules='all-linear'), gradient_accumulation_steps=2)
    model.set_template('Qwen3_5Template')
    model.set_processor('InputProcessor', padding_side='right')
    model.set_loss('CrossEntropyLoss')
    model.set_optimizer('AdamW', lr=5e-3)
    model.set_lr_scheduler('LinearLR')
    assert 'adapter' in model.get_train_configs()
    losses = []
    for epoch in range(3):
        for batch in batches:
            losses.append(model.forward_backward(inputs=batch).loss)
            model.clip_grad_norm(1.0)
            model.step()
            model.zero_grad()
            model.lr_step()
        path = model.save(name=f'twinkle-epoch-{epoch}', save_optimizer=True)
        assert path.startswith('twinkle://') and path.endswith(f'/checkpoints/twinkle-epoch-{epoch}')
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.0, losses
    runs = client.list_training_runs()
    assert [run.training_run_id for run in runs] == list(model.runs.values())
    checkpoints = client.list_checkpoints(runs[0].training_run_id)
    assert sorted(c.twinkle_path for c in checkpoints) == sorted(
        f'twinkle://{runs[0].training_run_id}/checkpoints/twinkle-epoch-{e}' for e in range(3)
    )
    metrics = model.calculate_metric(is_training=True)
    assert {'loss', 'lr', 'grad_norm'} <= set(metrics)


def train_steps(model, batches: list, steps: int, **kwargs) -> list[float]:
    losses = []
    for batch in batches[:steps]:
        losses.append(model.forward_backward(inputs=batch, **kwargs).loss)
        model.clip_grad_and_step(**kwargs)
    return losses


@pytest.mark.integration
def test_two_tenants_at_once_get_the_losses_each_gets_alone(server, batches, tiny_model_dir):
    url, keys, background = server
    base = background.app.state.service.default.host.model.model
    before = {n: p.detach().clone() for n, p in base.named_parameters() if 'lora_' not in n}
    # Different ranks, losses (token mean vs token sum) and learning rates.
    setups = {'alice': (4, 'mean', 1e-2), 'bob': (16, 'sum', 3e-4)}
    remote: dict[str, list[float]] = {}

    def tenant(name: str) -> None:
        rank, reduction, lr = setups[name]
        model = MultiLoraTransformersModel(client=TwinkleClient(url, keys[name]))
        model.add_adapter_to_model(f'{name}-adapter', lora(rank), seed=7)
        model.set_loss('CrossEntropyLoss', reduction=reduction)
        model.set_optimizer('AdamW', lr=lr)
        remote[name] = train_steps(model, batches, 4)

    threads = [threading.Thread(target=tenant, args=(name,)) for name in setups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, (rank, reduction, lr) in setups.items():
        local = TransformersModel(tiny_model_dir, device='cpu')
        torch.manual_seed(7)
        local.add_adapter_to_model(f'{name}-adapter', lora(rank))
        local.set_loss('CrossEntropyLoss', reduction=reduction)
        local.set_optimizer('AdamW', lr=lr)
        alone = train_steps(local, batches, 4)
        assert remote[name] == pytest.approx(alone, abs=1e-6, rel=1e-6), (name, remote[name], alone)
        assert remote[name][-1] < remote[name][0]
    after = dict((n, p) for n, p in base.named_parameters() if 'lora_' not in n)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.integration
def test_another_tenants_things_do_not_exist(server, batches):
    url, keys, _ = server
    alice = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
    run_id = alice.add_adapter_to_model('private', lora(4))
    path = alice.save('mine')
    future = alice.client.submit(f'/twinkle/v1/runs/{run_id}/ops/calculate_metric', {})
    bob = TwinkleClient(url, keys['bob'])
    for method, route, body in [
        ('GET', f'/twinkle/v1/runs/{run_id}', None),
        ('GET', f'/twinkle/v1/runs/{run_id}/checkpoints', None),
        ('POST', f'/twinkle/v1/runs/{run_id}/ops/step', {}),
        ('POST', f'/twinkle/v1/runs/{run_id}/save', {'name': 'stolen'}),
        ('DELETE', f'/twinkle/v1/runs/{run_id}/checkpoints/mine', None),
        ('GET', f'/twinkle/v1/futures/{future}', None),
    ]:
        with pytest.raises(RemoteError) as error:
            bob.request(method, route, json=body)
        assert error.value.status == 404, (route, str(error.value))
    assert run_id not in [r.training_run_id for r in bob.list_training_runs()]
    thief = MultiLoraTransformersModel(client=bob)
    thief.add_adapter_to_model('mine-now', lora(4))
    with pytest.raises(RemoteError, match='not found') as error:
        thief.load(path)
    assert error.value.status == 404


@pytest.mark.integration
def test_missing_or_bad_keys_are_refused(server):
    url, _, _ = server
    assert httpx.get(f'{url}/healthz').json() == {'status': 'ok'}
    assert httpx.get(f'{url}/twinkle/v1/runs').status_code == 401
    response = httpx.get(f'{url}/twinkle/v1/runs', headers={'Authorization': 'Bearer tk-wrong'})
    assert response.status_code == 401 and 'unknown API key' in response.text


@pytest.mark.integration
def test_an_error_names_its_class_and_a_422_does_not_echo_the_request(server):
    url, keys, _ = server
    headers = {'Authorization': f'Bearer {keys["bob"]}'}
    missing = httpx.get(f'{url}/twinkle/v1/runs/run-nope', headers=headers)
    assert missing.status_code == 404
    assert missing.json() == {'detail': "training run 'run-nope' not found", 'error': 'NotFoundError'}
    unknown_key = httpx.get(f'{url}/twinkle/v1/runs', headers={'Authorization': 'Bearer tk-wrong'})
    assert unknown_key.json() == {'detail': 'unknown API key', 'error': 'UnauthorizedError'}
    # 100 kB in a field the model does not take, and a 1000-character field name: the answer says
    # where (the name cut to 64 characters) and what, and holds none of the value.
    body = {'lora': {'r': 4}, 'surprise': 'x' * 100_000, 'k' * 1000: 1}
    refused = httpx.post(f'{url}/twinkle/v1/runs', json=body, headers=headers)
    assert refused.status_code == 422
    extra = {'msg': 'Extra inputs are not permitted', 'type': 'extra_forbidden'}
    problems = [{'loc': ['body', 'surprise'], **extra}, {'loc': ['body', 'k' * 64], **extra}]
    assert refused.json() == {'detail': problems, 'problems': 2}
    tried = doctest.testmod(twinkle.server.api.errors)
    assert tried.attempted > 0 and tried.failed == 0


@pytest.mark.integration
def test_bad_requests_get_a_4xx_that_names_the_problem_and_the_server_keeps_serving(server, batches):
    url, keys, _ = server
    client = TwinkleClient(url, keys['bob'])
    model = MultiLoraTransformersModel(client=client)
    run_id = model.add_adapter_to_model('checked', lora(4))
    ops = f'/twinkle/v1/runs/{run_id}/ops'
    bad_row = {**batches[0][0], 'input_ids': [5000, *batches[0][0]['input_ids'][1:]]}
    cases = [
        ('POST', f'{ops}/set_loss', {'loss_cls': 'NoSuchLoss'}, 400, "Unknown loss 'NoSuchLoss'"),
        ('POST', f'{ops}/set_optimizer', {'optimizer_cls': 'AdamW', 'options': {'lr': float('nan')}}, 422, 'finite'),
        ('POST', f'{ops}/set_optimizer', {'optimizer_cls': 'AdamW', 'lr': 1e-3}, 422, 'extra_forbidden'),
        ('POST', f'{ops}/forward_backward', {'inputs': [bad_row]}, 400, 'token id 5000, outside the vocabulary'),
        ('POST', f'{ops}/forward_backward', {'inputs': []}, 422, 'at least 1 item'),
        ('POST', f'{ops}/step', {'surprise': 1}, 422, 'surprise'),
        ('POST', f'{ops}/no_such_op', {}, 400, "Unknown operation 'no_such_op'"),
        ('POST', '/twinkle/v1/runs', {'lora': {'r': 999}}, 400, 'rank r=999'),
        ('POST', '/twinkle/v1/runs', {'lora': {'r': 4}, 'surprise': 1}, 422, 'surprise'),
        ('POST', '/twinkle/v1/runs', {'adapter_name': '../etc'}, 400, "'../etc'"),
        ('POST', f'/twinkle/v1/runs/{run_id}/load', {'path': 'twinkle://x/../y'}, 400, 'twinkle://'),
        ('GET', '/twinkle/v1/runs/run-nope', None, 404, 'not found'),
    ]
    for method, route, body, status, message in cases:
        content = None if body is None else json.dumps(body).encode()
        response = client.http.request(method, route, content=content, headers={'Content-Type': 'application/json'})
        assert response.status_code == status, (route, body, response.text)
        assert message in response.text, (route, response.text)
    # A body that is not JSON at all is a 400, in the one error shape.
    malformed = client.http.post(f'{ops}/step', content=b'{not json', headers={'Content-Type': 'application/json'})
    assert malformed.status_code == 400, malformed.text
    assert malformed.json()['error'] == 'DataError' and 'not valid JSON' in malformed.json()['detail']
    # So are the framework's own refusals: an unknown path, a method a route does not take.
    for method, route, status, error in (
        ('GET', '/twinkle/v1/nowhere', 404, 'NotFoundError'),
        ('PUT', '/twinkle/v1/runs', 405, ''),
    ):
        answer = client.http.request(method, route)
        assert answer.status_code == status and answer.json()['error'] == (error or 'TwinkleError'), answer.text
    # A failure while running fails that request alone.
    with pytest.raises(RemoteError, match='CrossEntropyLoss takes no loss arguments') as error:
        model.forward_backward(inputs=batches[0], surprise=[1.0] * len(batches[0]))
    assert error.value.category == 'user'
    assert model.forward_backward(inputs=batches[0]).loss > 0
    assert httpx.get(f'{url}/healthz').status_code == 200


@pytest.mark.integration
def test_a_compute_request_sent_with_wait_is_answered_with_its_result_in_one_round_trip(server, batches):
    url, keys, _ = server
    client = TwinkleClient(url, keys['bob'], binary=False)  # JSON answers to read by hand
    model = MultiLoraTransformersModel(client=client)
    run_id = model.add_adapter_to_model('waited', lora(4))
    ops = f'/twinkle/v1/runs/{run_id}/ops'
    sent: list[str] = []
    client.http.event_hooks['request'].append(lambda request: sent.append(f'{request.method} {request.url.path}'))
    configs = model.get_train_configs()
    assert run_id in configs and sent == [f'POST {ops}/get_train_configs']  # no poll of the future followed
    answer = client.http.post(f'{ops}/forward_backward', params={'wait': 30}, json={'inputs': batches[0]})
    assert answer.status_code == 202
    future = answer.json()['future']
    assert future['id'] == answer.json()['future_id'] and future['status'] == 'done'
    assert future['result']['loss'] > 0
    # A request that fails as it runs is answered with its error; without wait, with the id alone.
    failed = client.http.post(f'{ops}/calculate_loss', params={'wait': 30}, json={})  # no forward_only to score
    assert failed.json()['future']['status'] == 'failed' and failed.json()['future']['category'] == 'user'
    assert failed.json()['future']['error'].startswith('StateError: calculate_loss() needs a forward_only() first')
    assert client.http.post(f'{ops}/get_train_configs', json={}).json()['future'] is None
    for wait in ('-1', 'nan', 'soon'):  # on the compute request and on its future alike
        refused = client.http.post(f'{ops}/get_train_configs', params={'wait': wait}, json={})
        assert refused.status_code == 422 and 'wait' in refused.text, (wait, refused.text)
        refused = client.http.get(f'/twinkle/v1/futures/{future["id"]}', params={'wait': wait})
        assert refused.status_code == 422 and 'wait' in refused.text, (wait, refused.text)


def test_the_data_directory_is_the_servers_user_alone(tmp_path):
    """The store and every tenant's weights live in ``data_dir``: made 0700 (a sandbox's code runs as
    another user, ``twinkle.agent.sandbox``), and an existing one of the server's user is made so too."""
    from twinkle.server.service import private_folder

    new, old = tmp_path / 'new' / 'data', tmp_path / 'old'
    old.mkdir(mode=0o755)
    old.chmod(0o755)
    for folder in (new, old):
        private_folder(folder)
        assert folder.stat().st_mode & 0o777 == 0o700, oct(folder.stat().st_mode)
