"""Mixed-adapter passes through the real service: tenants' requests that wait at the same moment
run as one pass, and each tenant's numbers are what it gets alone.

The worker is held by a gate job while the tenants submit (over HTTP), so the three requests
are certainly waiting together when it frees; the scheduler's records of which pass ran each
request show they shared one. References are twin runs (same seed, rank and data) in the same
tenants, run one request at a time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig
from server_helpers import Gate, background_server, token_rows

from twinkle.errors import DataError
from twinkle.utils.memory import can_release_memory
from twinkle_client import init_twinkle_client
from twinkle_client.client import PREFIX
from twinkle_client.model import MultiLoraTransformersModel

TOL = 1e-5
TENANTS = {'alice': 4, 'bob': 8, 'carol': 16}  # tenant -> LoRA rank
WAIT_S = 120
#: The admin key the servers here are started with: /metrics answers it only.
ADMIN_KEY = 'admin-' + 'k' * 40
ADMIN = {'Authorization': f'Bearer {ADMIN_KEY}'}


# Each tenant's batch, of lengths that differ across tenants (the shared pass pads them).
ROWS = {'alice': token_rows(1, [12, 7]), 'bob': token_rows(2, [25]), 'carol': token_rows(3, [9, 16, 5])}


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, dict[str, str], Any]]:
    folder, tenants = tmp_path_factory.mktemp('mixed'), tuple(TENANTS)
    with background_server(folder, tiny_model_dir, tenants=tenants, admin_api_key=ADMIN_KEY) as running:
        yield running


def _models(url: str, keys: dict[str, str]) -> dict[str, MultiLoraTransformersModel]:
    models = {}
    for tenant, rank in TENANTS.items():
        model = MultiLoraTransformersModel(client=init_twinkle_client(base_url=url, api_key=keys[tenant]))
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules='all-linear', init_lora_weights=False)
        for name in ('mixed', 'alone'):
            model.add_adapter_to_model(name, config, seed=rank)
            model.set_optimizer('AdamW', lr=1e-2, adapter_name=name)
        models[tenant] = model
    return models


def _submit(model: MultiLoraTransformersModel, operation: str, body: dict[str, Any]) -> str:
    return model.client.submit(f'{PREFIX}/runs/{model.runs["mixed"]}/ops/{operation}', body)


def _together(
    service: Any, models: dict[str, MultiLoraTransformersModel], operation: str, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Each tenant's 'mixed' run sends ``operation`` (with ``body``, else its rows) while the
    worker is held; results by tenant."""
    gate = Gate(service.default.scheduler)
    futures = {
        tenant: _submit(model, operation, body if body is not None else {'inputs': ROWS[tenant]})
        for tenant, model in models.items()
    }
    gate.open()
    results = {tenant: models[tenant].client.result(future) for tenant, future in futures.items()}
    jobs = [service.default.scheduler.get(future) for future in futures.values()]
    assert {job.pass_id for job in jobs} == {jobs[0].pass_id} and jobs[0].pass_size == 3  # one shared pass
    return results


def _logps(result: dict[str, Any]) -> torch.Tensor:
    return torch.cat([torch.tensor(row) for row in result['logps']])


@pytest.mark.integration
def test_three_tenants_in_one_pass_get_their_numbers_alone(server):
    url, keys, background = server
    service = background.app.state.service
    models = _models(url, keys)
    _one_pass_against_alone(service, models)
    # Each request of the shared pass counts a pass of 3 (9), each twin's its pass of 1 (3 more).
    metrics = httpx.get(f'{url}/metrics', headers=ADMIN).text
    assert 'twinkle_pass_jobs_sum{operation="forward_backward"} 12.0' in metrics
    assert 'twinkle_pass_jobs_count{operation="forward_backward"} 6.0' in metrics


@pytest.mark.integration
def test_rows_packed_alone_give_the_numbers_of_the_padded_shared_pass(tmp_path, tiny_model_dir, monkeypatch):
    """With ``speed: {padding_free: true}`` a request alone runs its rows packed into one row,
    while the shared pass pads them: each tenant's numbers are the same (1e-5)."""
    speed = {'padding_free': True}
    with background_server(tmp_path, tiny_model_dir, tenants=tuple(TENANTS), speed=speed) as (url, keys, background):
        service = background.app.state.service
        runner = service.default.host.model._runner
        choose, packed = runner.processor, []

        def processor(group: Any, packs: bool = False) -> Any:
            chosen = choose(group, packs)
            packed.append(chosen.padding_free)
            return chosen

        monkeypatch.setattr(runner, 'processor', processor)
        _one_pass_against_alone(service, _models(url, keys))
        assert sum(packed) == len(TENANTS)  # each twin's forward_backward alone, packed


def _one_pass_against_alone(service: Any, models: dict[str, MultiLoraTransformersModel]) -> None:
    """Each tenant's 'mixed' run in one shared ``forward_backward`` pass, its twin 'alone' in a
    pass of its own: the same loss and gradients. After a step of each, a shared
    ``forward_only`` pass gives each 'mixed' run the logprobs it gets alone. (Not its twin's: the
    first AdamW step moves a weight by about ``lr`` whatever the size of its gradient, so two
    passes' float32 rounding in the smallest gradients becomes weight differences of ~3e-5.)"""
    mixed = _together(service, models, 'forward_backward')
    for tenant, model in models.items():
        passes = service.default.scheduler.stats()['passes']
        alone = model.forward_backward(inputs=ROWS[tenant], adapter_name='alone')
        assert service.default.scheduler.stats()['passes'] == passes + 1  # ran in a pass of its own
        assert abs(mixed[tenant]['loss'] - alone.loss) <= TOL, tenant
        assert mixed[tenant]['num_tokens'] == alone.num_tokens
        # The gradient norm before clipping: the gradients agree, not only the losses.
        norms = [model.clip_grad_norm(1.0, adapter_name=name) for name in ('mixed', 'alone')]
        assert abs(norms[0] - norms[1]) <= TOL * max(1.0, norms[1]), (tenant, norms)
        for name in ('mixed', 'alone'):
            model.step(adapter_name=name)
            model.zero_grad(adapter_name=name)
    mixed = _together(service, models, 'forward_only')
    for tenant, model in models.items():
        alone = model.forward_only(inputs=ROWS[tenant], adapter_name='mixed')
        worst = (_logps(mixed[tenant]) - torch.cat([torch.tensor(r) for r in alone.logps])).abs().max().item()
        assert worst <= TOL, (tenant, worst)


@pytest.mark.integration
def test_three_tenants_step_together_and_get_the_numbers_of_their_steps_alone(server):
    # Twin runs: 'mixed' steps in one update shared by the three tenants, 'alone' steps alone.
    # Round 1 makes the optimizers' state; round 2 steps the three in one multi-tensor update.
    url, keys, background = server
    service = background.app.state.service
    models = _models(url, keys)
    for _ in range(2):
        for tenant, model in models.items():
            for name in ('mixed', 'alone'):
                model.forward_backward(inputs=ROWS[tenant], adapter_name=name)
        norms = _together(service, models, 'clip_grad_and_step', {'max_grad_norm': 0.5})
        for tenant, model in models.items():
            assert norms[tenant] == model.clip_grad_and_step(0.5, adapter_name='alone'), tenant
    for tenant, model in models.items():
        twins = [model.forward_only(inputs=ROWS[tenant], adapter_name=name) for name in ('mixed', 'alone')]
        assert twins[0].loss == twins[1].loss and twins[0].logps == twins[1].logps, tenant


@pytest.mark.integration
def test_a_flood_delays_a_lone_request_by_at_most_one_pass(server):
    url, keys, background = server
    scheduler = background.app.state.service.default.scheduler
    models = {}
    for tenant, name in (('alice', 'flood'), ('bob', 'lone')):
        models[name] = MultiLoraTransformersModel(client=init_twinkle_client(base_url=url, api_key=keys[tenant]))
        models[name].add_adapter_to_model(name, LoraConfig(r=4, target_modules='all-linear'))

    def submit(name: str) -> str:
        model = models[name]
        return model.client.submit(f'{PREFIX}/runs/{model.runs[name]}/ops/forward_only', {'inputs': ROWS['bob']})

    gate = Gate(scheduler)  # the flood queues up behind a running pass
    flood = [submit('flood') for _ in range(12)]
    lone = scheduler.get(submit('lone'))
    gate.open()
    for future in flood:
        models['flood'].client.result(future)
    assert lone.wait(WAIT_S) and lone.status == 'done'
    # The lone request ran in the pass right after the one running when it arrived, long
    # before the flood that was queued ahead of it had drained.
    assert lone.pass_id <= lone.passes_before + 1, (lone.pass_id, lone.passes_before)
    assert scheduler.get(flood[-1]).pass_id > lone.pass_id + 5
    # On an idle server a lone request starts at once, alone: there is no cycle to wait for.
    job = scheduler.get(submit('lone'))
    assert job.wait(WAIT_S)
    assert (job.pass_id, job.pass_size) == (job.passes_before + 1, 1)


def test_a_tenant_whose_loss_is_not_finite_fails_alone_in_a_shared_tinker_pass(tiny_model_dir, tmp_path):
    # 'bad' sends advantages of 3e38 on tokens it claims to have sampled at logprob -1e30: the
    # importance ratio (clamped at e^20) times them overflows float32, so its loss is infinite,
    # an error known only after the shared backward. 'good' keeps its result, and its
    # gradient is that of one pass (the same as a twin's alone), not of a pass and a rerun.
    from twinkle.server.config import ServerConfig
    from twinkle.server.execution.hosts.model_host import ModelHost
    from twinkle.server.execution.tinker.codec import Datum, ForwardBackwardCall

    host = ModelHost(ServerConfig.build(base_model=tiny_model_dir, device='cpu', data_dir=str(tmp_path)))
    for name in ('good', 'bad', 'twin'):
        host.add_adapter(name, {'r': 4, 'target_modules': 'all-linear'}, seed=0)
    tokens = ROWS['alice'][0]['input_ids']

    def call(logprob: float, advantage: float = 1.0) -> ForwardBackwardCall:
        inputs = {
            'target_tokens': torch.tensor(tokens[1:] + tokens[:1]),
            'logprobs': torch.full((len(tokens),), logprob),
            'advantages': torch.full((len(tokens),), advantage),
        }
        return ForwardBackwardCall('m', 1, 'importance_sampling', {}, False, [Datum(tokens, inputs)])

    good, bad = host.tinker_forward_backward([('good', call(-1.0)), ('bad', call(-1e30, 3e38))])
    assert isinstance(good, bytes)
    assert isinstance(bad, DataError) and 'not finite' in str(bad)
    (twin,) = host.tinker_forward_backward([('twin', call(-1.0))])
    # A pass of 2 rows against one of 1 row: equal up to float rounding (CPU matmuls block by shape).
    from tinker.proto.response_conv import deserialize_forward_backward_output

    twin_out, good_out = deserialize_forward_backward_output(twin), deserialize_forward_backward_output(good)
    assert twin_out.metrics == pytest.approx(good_out.metrics, rel=TOL, abs=TOL)
    assert twin_out.loss_fn_outputs[0]['logprobs'].tolist() == pytest.approx(
        good_out.loss_fn_outputs[0]['logprobs'].tolist(), abs=TOL
    )
    groups = host.model.groups
    for p, q in zip(groups['good'].params, groups['twin'].params, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
@pytest.mark.skipif(not can_release_memory(), reason='malloc_trim is glibc only')
def test_an_idle_server_gives_freed_memory_back(tmp_path, tiny_model_dir):
    options = {'release_memory_after_idle_s': 0.05, 'admin_api_key': ADMIN_KEY}
    with background_server(tmp_path, tiny_model_dir, tenants=('alice',), **options) as running:
        url, keys, _ = running
        model = MultiLoraTransformersModel(client=init_twinkle_client(base_url=url, api_key=keys['alice']))
        model.add_adapter_to_model('a', LoraConfig(r=4, target_modules='all-linear'))
        model.forward_backward(inputs=ROWS['alice'], adapter_name='a')
        deadline = time.monotonic() + WAIT_S
        released = re.compile(r'^twinkle_memory_releases_total [1-9]', re.M)
        while not released.search(metrics := httpx.get(f'{url}/metrics', headers=ADMIN).text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.05)
