"""Idempotency keys: a compute request sent again with its ``Idempotency-Key`` runs once.

The store keeps one future per tenant and key, written with the future (SQLite and PostgreSQL); a request
refused before it ran (its tenant's queue full) frees its key, so the client's retry with it after the
``Retry-After`` runs. (Through gateways, one killed during a wait: ``tests/server/test_server_gateways.py``.)
"""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from peft import LoraConfig
from server_helpers import Gate, background_server

from twinkle.errors import StateError
from twinkle.server.store import KnownRequest, RequestKey, Store
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ROWS = [{'input_ids': [5, 6, 7, 8, 9, 10], 'labels': [-100, 6, 7, 8, 9, 10]}]


@pytest.fixture(params=['sqlite', 'postgresql'])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a store is: a SQLite file, or a new PostgreSQL database's URL."""
    if request.param == 'sqlite':
        return tmp_path / 'twinkle.db'
    return request.getfixturevalue('postgres_url')


@pytest.fixture
def store(db: Path | str) -> Iterator[Store]:
    with Store(db) as opened:
        yield opened


def test_a_key_names_one_future_per_tenant(store):
    alice, _ = store.tenants.add('alice')
    bob, _ = store.tenants.add('bob')
    run = store.runs.create(alice.id, 'm', 'a', {})
    key = RequestKey('call-1', 'hash-of-the-request')
    first = store.futures.create(alice.id, run.id, 'forward_backward', request_key=key)
    assert store.futures.by_key(alice.id, 'call-1') == first
    with pytest.raises(KnownRequest) as known:  # the same key again: nothing recorded, the first one named
        store.futures.create(alice.id, run.id, 'forward_backward', request_key=key)
    assert known.value.record.id == first.id and known.value.record.request_hash == 'hash-of-the-request'
    assert store.futures.by_key(bob.id, 'call-1') is None  # another tenant's key is its own
    bobs = store.futures.create(bob.id, None, 'sample', request_key=key)
    assert bobs.id != first.id and store.futures.by_key(bob.id, 'call-1') == bobs
    # Futures without a key are as many as made; another run's missing row is still the StateError it was.
    assert len({store.futures.create(alice.id, run.id, 'forward_backward').id for _ in range(3)}) == 3
    with pytest.raises(StateError, match='has no run'):
        store.futures.create(alice.id, 'run-missing', 'forward_backward', request_key=RequestKey('call-2', 'h'))


def test_a_released_key_names_nothing(store):
    alice, _ = store.tenants.add('alice')
    refused = store.futures.create(alice.id, None, 'sample', request_key=RequestKey('call-1', 'h'))
    store.futures.release_key(refused.id)
    store.futures.fail(refused.id, 'QueueFullError: full', 'user')
    assert store.futures.by_key(alice.id, 'call-1') is None
    again = store.futures.create(alice.id, None, 'sample', request_key=RequestKey('call-1', 'h'))
    assert store.futures.by_key(alice.id, 'call-1') == again != refused
    assert store.futures.get(alice.id, refused.id).status == 'failed'  # the refusal's record stays


def _downgraded_to_8(db: Path | str) -> None:
    """The store at db as version 8 had it: its futures without the key columns (version 9's), its
    sessions without expired_at (version 11's)."""
    statements = [
        'DROP INDEX futures_by_idempotency_key',
        'ALTER TABLE futures DROP COLUMN idempotency_key',
        'ALTER TABLE futures DROP COLUMN request_hash',
        'ALTER TABLE sessions DROP COLUMN expired_at',
    ]
    if isinstance(db, Path):
        with contextlib.closing(sqlite3.connect(db)) as connection:
            for statement in statements:
                connection.execute(statement)
            connection.execute('PRAGMA user_version = 8')
            connection.commit()
        return
    with psycopg.connect(db, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)
        connection.execute('UPDATE twinkle_schema SET version = 8')


def test_a_version_8_store_is_migrated_and_keeps_its_futures(db):
    with Store(db) as store:
        alice, _ = store.tenants.add('alice')
        old = store.futures.create(alice.id, None, 'sample')
    _downgraded_to_8(db)
    with Store(db) as store:
        assert store.futures.get(alice.id, old.id).idempotency_key is None
        keyed = store.futures.create(alice.id, None, 'sample', request_key=RequestKey('call-1', 'h'))
        assert store.futures.by_key(alice.id, 'call-1') == keyed
        with pytest.raises(KnownRequest):  # the migration made the index that keeps a key to one future
            store.futures.create(alice.id, None, 'sample', request_key=RequestKey('call-1', 'h'))


def test_a_request_refused_with_a_full_queue_runs_when_its_key_is_sent_again(tmp_path, tiny_model_dir):
    with background_server(tmp_path, tiny_model_dir, tenants=('alice',), limits={'max_queued_per_tenant': 1}) as (
        url,
        keys,
        background,
    ):
        client = TwinkleClient(url, keys['alice'])
        run_id = MultiLoraTransformersModel(client=client).add_adapter_to_model('full', LoraConfig(r=4))
        path = f'{url}/twinkle/v1/runs/{run_id}/ops/forward_backward'
        headers = {'Authorization': f'Bearer {keys["alice"]}', 'Idempotency-Key': str(uuid.uuid4())}
        gate = Gate(background.app.state.service.default.scheduler)
        try:
            queued = httpx.post(path, json={'inputs': ROWS}, headers={'Authorization': headers['Authorization']})
            assert queued.status_code == 202  # alice's one queued request
            refused = httpx.post(path, json={'inputs': ROWS}, headers=headers)
            assert refused.status_code == 429, refused.text
        finally:
            gate.open()
        client.result(queued.json()['future_id'])
        again = httpx.post(path, json={'inputs': ROWS}, headers=headers, params={'wait': 30}, timeout=60)
        assert again.status_code == 202 and again.json()['future']['status'] == 'done', again.text
        store = background.app.state.service.store
        assert store.futures.by_key(store.tenants.for_key(keys['alice']).id, headers['Idempotency-Key']).op == (
            'forward_backward'
        )
