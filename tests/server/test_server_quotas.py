"""Quotas (issue 34, point 4): each limit refused with a status and a message that says which limit
and when it resets or what to delete; the others keep being served.

``dave`` may use 60 tokens a day and keep 1 byte of checkpoints (so one checkpoint at a time);
every tenant may hold 2 runs and queue 1 request. Weighted turns are ``tests/server/test_server_scheduler.py``'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import tinker
from peft import LoraConfig
from server_helpers import Gate, background_server

from twinkle.errors import TwinkleError
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

QUOTAS = {'default': {'runs': 2}, 'tenants': {'dave': {'tokens_per_day': 60, 'stored_bytes': 1, 'weight': 2}}}
ROW = {'input_ids': list(range(10, 35)), 'labels': list(range(10, 35))}  # 25 tokens


@pytest.fixture(scope='module')
def served(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, dict[str, str], Any]]:
    data_dir = tmp_path_factory.mktemp('quotas')
    tenants = ('dave', 'erin', 'frank')
    options = {'quotas': QUOTAS, 'limits': {'max_queued_per_tenant': 1}}
    with background_server(data_dir, tiny_model_dir, tenants=tenants, **options) as running:
        yield running


def model(url: str, key: str, name: str = 'a') -> MultiLoraTransformersModel:
    trained = MultiLoraTransformersModel(client=TwinkleClient(url, key))
    trained.add_adapter_to_model(name, LoraConfig(r=4, target_modules='all-linear'))
    return trained


def test_the_tokens_of_a_day_are_a_429_until_midnight_utc(served):
    url, keys, _ = served
    dave = model(url, keys['dave'])
    dave.forward_backward(inputs=[ROW, ROW])  # 50 of 60
    with pytest.raises(RemoteError, match=r"'dave' used 50 of its tokens_per_day quota of 60 tokens") as error:
        dave.forward_backward(inputs=[ROW])  # 25 more would pass it
    assert error.value.status == 429
    midnight = datetime.fromtimestamp((time.time() // 86400 + 1) * 86400, tz=timezone.utc).isoformat()
    assert f'it resets at {midnight}' in str(error.value)
    answer = dave.client.http.post(f'/twinkle/v1/runs/{dave.runs["a"]}/ops/forward_only', json={'inputs': [ROW]})
    assert answer.status_code == 429 and 0 < int(answer.headers['Retry-After']) <= 86400
    assert dave.client.usage().tenants[0].total.tokens_trained == 50  # the refused ones are not charged
    model(url, keys['erin']).forward_backward(inputs=[ROW, ROW, ROW])  # another tenant is not held to it


def test_a_save_past_the_stored_bytes_is_a_403_until_a_checkpoint_is_deleted(served):
    url, keys, _ = served
    dave = model(url, keys['dave'], 'saver')
    dave.save('first', adapter_name='saver')
    with pytest.raises(RemoteError, match=r'keeps [\d,]+ bytes of checkpoints, its stored_bytes quota of 1') as error:
        dave.save('second', adapter_name='saver')
    assert error.value.status == 403 and 'delete checkpoints' in str(error.value)
    dave.client.delete_checkpoint(dave.runs['saver'], 'first')
    dave.save('second', adapter_name='saver')


def test_runs_past_the_quota_are_a_403_until_one_is_deleted(served, sdk_clients, tiny_model_dir):
    url, keys, _ = served
    frank = model(url, keys['frank'], 'one')
    frank.add_adapter_to_model('two', LoraConfig(r=4, target_modules='all-linear'))
    with pytest.raises(RemoteError, match=r"'frank' holds 2 training runs, its runs quota of 2") as error:
        frank.add_adapter_to_model('three', LoraConfig(r=4, target_modules='all-linear'))
    assert error.value.status == 403
    service = sdk_clients(url, keys['frank'])
    with pytest.raises(tinker.PermissionDeniedError, match='runs quota of 2'):
        service.create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
    frank.client.delete_training_run(frank.runs['one'])
    with pytest.raises(RemoteError, match='not found') as error:
        frank.client.delete_training_run(frank.runs['one'])
    assert error.value.status == 404
    assert [run.adapter_name for run in frank.client.list_training_runs()] == ['two']
    frank.add_adapter_to_model('three', LoraConfig(r=4, target_modules='all-linear'))
    with pytest.raises(RemoteError, match='not found'):
        TwinkleClient(url, keys['erin']).delete_training_run(frank.runs['two'])  # another tenant's


def test_the_configured_weights_reach_the_schedulers(served):
    _, _, background = served
    scheduler = background.app.state.service.default.scheduler
    store = background.app.state.service.store
    ids = {t.name: t.id for t in store.tenants.all()}
    assert scheduler.weight_of is not None
    assert scheduler.weight_of(ids['dave']) == 2 and scheduler.weight_of(ids['erin']) == 1


def test_a_request_that_asks_to_queue_waits_for_room_instead_of_a_429(served):
    url, keys, background = served
    erin = model(url, keys['erin'], 'queued')
    path = f'/twinkle/v1/runs/{erin.runs["queued"]}/ops/forward_only'
    order: list[str] = []
    gate = Gate(background.app.state.service.default.scheduler)
    try:
        first = erin.client.submit(path, {'inputs': [ROW]})  # the one place in erin's queue
        with pytest.raises(RemoteError, match=r'max_queued_per_tenant=1') as error:
            TwinkleClient(url, keys['erin'], max_retries=1).submit(path, {'inputs': [ROW]})
        assert error.value.status == 429
        queued = TwinkleClient(url, keys['erin'], queue_s=60)

        def wait_in_line() -> None:
            order.append(queued.submit(path, {'inputs': [ROW]}))

        waiting = threading.Thread(target=wait_in_line)
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive() and not order  # held on the server, not refused
    finally:
        gate.open()
    waiting.join(60)
    assert not waiting.is_alive() and len(order) == 1
    second = order[0]
    assert erin.client.result(second)['num_tokens'] == erin.client.result(first)['num_tokens']
    jobs = [background.app.state.service.default.scheduler.get(future) for future in (first, second)]
    assert jobs[0].started_at <= jobs[1].started_at  # in the order they came
    with pytest.raises(TwinkleError, match='queue_s must be between 0 and 600'):
        TwinkleClient(url, keys['erin'], queue_s=601)
