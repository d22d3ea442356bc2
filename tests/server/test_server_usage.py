"""Metering (issue 34, point 3): each tenant's usage is what it sent, priced by the config.

Two tenants train, sample and save on one server; ``GET /twinkle/v1/usage`` gives each its own
tokens trained (forward and forward_backward), prompt and sampled tokens, worker seconds,
checkpoints saved and stored, and their cost; the admin key sees both, Prometheus counts them, and
the Tinker SDK's billing routes (``tinker billing usage`` and ``checkpoint-storage``) answer from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
from peft import LoraConfig
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent
from server_helpers import background_server, token_rows
from tinker import types

from twinkle.data_format import SamplingParams
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

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


@pytest.fixture(scope='module')
def served(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, dict[str, str], Any]]:
    data_dir = tmp_path_factory.mktemp('usage')
    options = {'pricing': PRICING, 'admin_api_key': ADMIN_KEY, 'metrics': {'tenant_label': 'name'}}
    with background_server(data_dir, tiny_model_dir, tenants=('alice', 'bob'), **options) as running:
        yield running


@pytest.fixture(scope='module')
def used(served) -> dict[str, Any]:
    """Alice trains 19 + 12 tokens, samples two prompts, saves a checkpoint; Bob trains 25 tokens."""
    url, keys, _ = served
    alice = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
    alice.add_adapter_to_model('a', LoraConfig(r=4, target_modules='all-linear'))
    alice.forward_backward(inputs=token_rows(1, [12, 7]), adapter_name='a')
    alice.forward_only(inputs=token_rows(2, [12]), adapter_name='a')
    responses = vLLMSampler(client=alice.client).sample(PROMPTS, SamplingParams(max_tokens=3, num_samples=2))
    path = alice.save('first', adapter_name='a')
    bob = MultiLoraTransformersModel(client=TwinkleClient(url, keys['bob']))
    bob.add_adapter_to_model('b', LoraConfig(r=4, target_modules='all-linear'))
    bob.forward_backward(inputs=token_rows(3, [25]), adapter_name='b')
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
    assert {'alice', 'bob'} <= {t.tenant for t in admin.usage().tenants}  # (and later tests' tenants)
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
    # The admin key's, with tenants named by name (metrics.tenant_label: name).
    metrics = httpx.get(f'{url}/metrics', headers={'Authorization': f'Bearer {ADMIN_KEY}'}).text
    assert 'twinkle_usage_total{kind="training",tenant="alice"} 31.0' in metrics
    assert 'twinkle_usage_total{kind="training",tenant="bob"} 25.0' in metrics


def report_tenant_id(background: Any, name: str) -> str:
    store = background.app.state.service.store
    return next(t.id for t in store.tenants.all() if t.name == name)


# ---- the Tinker SDK and its command line ------------------------------------------------------------
def tinker_cli(url: str, key: str, *args: str) -> Any:
    """``tinker --format json <args>`` against the server, as a user runs it; its JSON."""
    env = {**os.environ, 'TINKER_BASE_URL': url, 'TINKER_API_KEY': key}
    done = subprocess.run(
        [sys.executable, '-m', 'tinker.cli', '--format', 'json', *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={'target_tokens': tokens[1:], 'weights': [1.0] * (len(tokens) - 1)},
    )


@pytest.fixture(scope='module')
def tinker_session(served, module_sdk_clients, tiny_model_dir) -> dict[str, Any]:
    """Carol's Tinker session: a forward_backward of 4 + 2 tokens, a step, sampler weights, and
    two samples of a 4-token prompt."""
    url, _, background = served
    _, key = background.app.state.service.store.tenants.add('carol')
    service = module_sdk_clients(url, key, user_metadata={'team': 'rl'})
    client = service.create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
    client.forward_backward([datum([11, 42, 7, 99, 5]), datum([3, 4, 5])], 'cross_entropy').result()
    client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = client.save_weights_and_get_sampling_client('for-sampling').result()
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    sampled = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=3)).result()
    return {
        'url': url,
        'key': key,
        'sampled': sampled,
        'session': service.holder.get_session_id(),
        'run': client.model_id,
    }


def test_tinker_billing_usage_answers_what_a_session_used(tinker_session):
    url, key, sampled = tinker_session['url'], tinker_session['key'], tinker_session['sampled']
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    window = [(hour - timedelta(hours=1)).isoformat(), (hour + timedelta(hours=1)).isoformat()]
    answer = tinker_cli(url, key, 'billing', 'usage', *window)
    by_type: dict[str, float] = {}
    for event in answer['data']:
        info = event['event_info']
        by_type[info['type']] = by_type.get(info['type'], 0) + info.get('token_count', info.get('count', 0))
        assert event['user_name'] == 'carol' and event['base_model'] is not None
    assert by_type['training'] == 4 + 2  # the model inputs: each datum's tokens but its last
    assert by_type['sampling_prefill'] == 4
    assert by_type['sampling_sample'] == sum(len(s.tokens) for s in sampled.sequences)
    assert by_type['checkpoint'] == 1
    training = next(e for e in answer['data'] if e['event_info']['type'] == 'training')
    assert training['estimated_cost_usd'] == pytest.approx(6 * 2.0 / 1e6)
    assert answer['sessions'][training['session_id']]['user_metadata'] == {'team': 'rl'}
    storage = tinker_cli(url, key, 'billing', 'checkpoint-storage')
    (row,) = storage['data']
    assert row['checkpoint_count'] == 1 and row['size_bytes'] > 0
    assert row['estimated_monthly_cost_usd'] == pytest.approx(row['size_bytes'] * 0.25 / 1e9)


@pytest.mark.parametrize(
    ('starting_on', 'ending_before', 'message'),
    [
        ('2026-07-13T00:30:00Z', '2026-07-14T00:00:00Z', 'must be on a UTC hour boundary'),
        ('2026-07-13T00:00:00Z', '2026-07-30T00:00:00Z', 'at most 14 days later'),
        ('2099-01-01T00:00:00Z', '2099-01-02T00:00:00Z', 'is in the future'),
    ],
)
def test_a_bad_billing_window_is_a_400_that_says_why(served, starting_on, ending_before, message):
    url, keys, _ = served
    answer = httpx.get(
        f'{url}/api/v1/billing/usage/events',
        params={'starting_on': starting_on, 'ending_before': ending_before},
        headers={'X-Api-Key': keys['alice']},
    )
    assert answer.status_code == 400 and message in answer.text


def test_a_billing_window_that_is_no_time_is_a_422_naming_the_field(served):
    url, keys, _ = served
    params = {'starting_on': 'yesterday', 'ending_before': '2026-07-14T00:00:00'}  # no time zone
    answer = httpx.get(f'{url}/api/v1/billing/usage/events', params=params, headers={'X-Api-Key': keys['alice']})
    assert answer.status_code == 422 and 'starting_on' in answer.text and 'ending_before' in answer.text


def test_tinker_session_export_trace_writes_the_sessions_requests_as_a_perfetto_trace(tinker_session, tmp_path):
    url, key = tinker_session['url'], tinker_session['key']
    path = tmp_path / 'session.pftrace'
    answer = tinker_cli(url, key, 'session', 'export-trace', tinker_session['session'], '--output', str(path))
    assert answer['file_size_bytes'] == path.stat().st_size > 0
    trace = Trace.FromString(path.read_bytes())
    tracks = {p.track_descriptor.uuid: p.track_descriptor.name for p in trace.packet if p.HasField('track_descriptor')}
    assert f'session {tinker_session["session"]}' in tracks.values()
    assert tinker_session['run'] in tracks.values() and 'sampling' in tracks.values()
    open_slices: dict[int, list[str]] = {}
    names: list[str] = []
    last = 0
    for packet in trace.packet:
        if not packet.HasField('track_event'):
            continue
        event = packet.track_event
        assert packet.timestamp >= last  # one sequence, in time order
        last = packet.timestamp
        stack = open_slices.setdefault(event.track_uuid, [])
        if event.type == TrackEvent.TYPE_SLICE_BEGIN:
            assert stack or event.name != 'running'  # a running slice lies inside its request's
            stack.append(event.name)
            names.append(event.name)
        else:
            assert event.type == TrackEvent.TYPE_SLICE_END and stack
            stack.pop()
    assert all(not stack for stack in open_slices.values())  # every slice ended
    for operation in ('create_model', 'forward_backward', 'optim_step', 'save_weights_for_sampler', 'sample'):
        assert operation in names, (operation, names)
    assert names.count('running') == len(names) - names.count('running')  # each request ran
    link = tinker_cli(url, key, 'session', 'export-trace', tinker_session['session'], '--url-only')['url']
    assert httpx.get(link.replace('signature=', 'signature=0')).status_code == 401
    assert httpx.get(link).content == path.read_bytes()  # the same requests, all answered
