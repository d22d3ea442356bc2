"""Metering (issue 34, point 3): each tenant's usage is what it sent, priced by the config.

Two tenants train, sample and save on one server; ``GET /twinkle/v1/usage`` gives each its own
tokens trained (forward and forward_backward), prompt and sampled tokens, worker seconds,
checkpoints saved and stored, and their cost; the admin key sees both, Prometheus counts them, and
the Tinker SDK's billing routes (``tinker billing usage`` and ``checkpoint-storage``) answer from them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig
from server_helpers import background_server

from twinkle.data_format import SamplingParams
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

ADMIN_KEY = 'admin-' + 'k' * 40
PRICING = {
    'training_per_million_tokens': 2.0,
    'sampling_prefill_per_million_tokens': 0.5,
    'sampling_sample_per_million_tokens': 1.5,
    'compute_per_hour': 3.6,
    'per_checkpoint': 0.01,
    'storage_per_gigabyte_month': 0.25,
}
PROMPTS = [{'messages': [{'role': 'user', 'content': 'What is your name?'}]}, {'input_ids': [5, 6, 7, 8, 9]}]


def rows(seed: int, lengths: list[int]) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(0, 4000, (length,), generator=gen).tolist()
        out.append({'input_ids': ids, 'labels': [-100, *ids[1:]]})
    return out


@pytest.fixture(scope='module')
def served(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, dict[str, str], Any]]:
    data_dir = tmp_path_factory.mktemp('usage')
    options = {'pricing': PRICING, 'admin_api_key': ADMIN_KEY}
    with background_server(data_dir, tiny_model_dir, tenants=('alice', 'bob'), **options) as running:
        yield running


@pytest.fixture(scope='module')
def used(served) -> dict[str, Any]:
    """Alice trains 19 + 12 tokens, samples two prompts, saves a checkpoint; Bob trains 25 tokens."""
    url, keys, _ = served
    alice = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
    alice.add_adapter_to_model('a', LoraConfig(r=4, target_modules='all-linear'))
    alice.forward_backward(inputs=rows(1, [12, 7]), adapter_name='a')
    alice.forward_only(inputs=rows(2, [12]), adapter_name='a')
    responses = vLLMSampler(client=alice.client).sample(PROMPTS, SamplingParams(max_tokens=3, num_samples=2))
    path = alice.save('first', adapter_name='a')
    bob = MultiLoraTransformersModel(client=TwinkleClient(url, keys['bob']))
    bob.add_adapter_to_model('b', LoraConfig(r=4, target_modules='all-linear'))
    bob.forward_backward(inputs=rows(3, [25]), adapter_name='b')
    return {'alice': alice, 'bob': bob, 'responses': responses, 'path': path}


def test_a_tenant_sees_what_it_sent_and_no_one_else(served, used):
    background = served[2]
    report = used['alice'].client.usage()
    (tenant,) = report.tenants
    assert tenant.tenant == 'alice'
    run_id = used['alice'].runs['a']
    (run,) = [r for r in tenant.runs if r.run_id == run_id]
    assert run.tokens_trained == 12 + 7 + 12 and run.base_model is not None
    assert run.checkpoints_saved == 1 and run.checkpoints_stored == 1
    stored = background.app.state.service.store.checkpoints.stored()
    assert run.bytes_stored == stored[report_tenant_id(background, 'alice')][run_id][1] > 0
    (sampled,) = [r for r in tenant.runs if r.run_id is None]  # sampling without a run
    prompts = [
        len(r.sequences[0].new_input_feature['input_ids']) - len(r.sequences[0].tokens) for r in used['responses']
    ]
    assert prompts[1] == 5 and sampled.prompt_tokens_sampled == sum(prompts)
    assert sampled.tokens_sampled == sum(len(s.tokens) for r in used['responses'] for s in r.sequences) > 0
    assert run.compute_seconds > 0 and sampled.compute_seconds > 0
    assert tenant.total.tokens_trained == run.tokens_trained
    assert [t.tenant for t in used['bob'].client.usage().tenants] == ['bob']
    assert used['bob'].client.usage().tenants[0].total.tokens_trained == 25


def test_the_cost_is_the_config_prices_times_the_usage(used):
    tenant = used['alice'].client.usage().tenants[0]
    total = tenant.total
    want = (
        total.tokens_trained * 2.0 / 1e6
        + total.prompt_tokens_sampled * 0.5 / 1e6
        + total.tokens_sampled * 1.5 / 1e6
        + total.compute_seconds * 3.6 / 3600
        + total.checkpoints_saved * 0.01
    )
    assert total.cost_usd == pytest.approx(want, rel=1e-6)
    assert total.storage_usd_per_month == pytest.approx(total.bytes_stored * 0.25 / 1e9)


def test_the_admin_sees_every_tenant_and_a_window_without_usage_is_empty(served, used):
    url = served[0]
    admin = TwinkleClient(url, ADMIN_KEY)
    assert {t.tenant for t in admin.usage().tenants} == {'alice', 'bob'}
    later = used['alice'].client.usage(since=time.time() + 7200).tenants[0].total
    assert later.tokens_trained == 0 and later.compute_seconds == 0 and later.checkpoints_stored == 1
    with pytest.raises(RemoteError, match='unknown API key') as error:
        TwinkleClient(url, 'tml-' + 'x' * 40).usage()
    assert error.value.status == 401
    with pytest.raises(RemoteError) as error:
        used['alice'].client.request('GET', '/twinkle/v1/usage', params={'since': -1})
    assert error.value.status == 422


def test_prometheus_counts_the_usage_by_tenant(served, used):
    url, _, _ = served
    metrics = httpx.get(f'{url}/metrics').text
    assert 'twinkle_usage_total{kind="training",tenant="alice"} 31.0' in metrics
    assert 'twinkle_usage_total{kind="training",tenant="bob"} 25.0' in metrics


def report_tenant_id(background: Any, name: str) -> str:
    store = background.app.state.service.store
    return next(t.id for t in store.tenants.all() if t.name == name)
