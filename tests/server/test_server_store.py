"""The service's store and API keys, on both backends: real SQLite files under tmp_path, and databases of a real
PostgreSQL server (``tests/pg_helpers.py``). Tests that take ``db`` or ``store`` run on each."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psycopg
import pytest

from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.server.auth import hash_key, key_from_headers, new_api_key, read_keys_file
from twinkle.server.store import SCHEMA_VERSION, Store, check_name, parse_checkpoint_path, parse_twinkle_path

SRC = str(Path(__file__).resolve().parents[2] / 'src')


class FakeClock:
    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=['sqlite', 'postgresql'])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a store is: a SQLite file, or a new PostgreSQL database's URL."""
    if request.param == 'sqlite':
        return tmp_path / 'twinkle.db'
    return request.getfixturevalue('postgres_url')


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Path:
    return tmp_path / 'twinkle.db'


def schema_version(db: Path | str) -> int:
    if isinstance(db, Path):
        with contextlib.closing(sqlite3.connect(db)) as connection:
            return int(connection.execute('PRAGMA user_version').fetchone()[0])
    with psycopg.connect(db) as connection:
        return int(connection.execute('SELECT version FROM twinkle_schema').fetchone()[0])


def set_schema_version(db: Path | str, version: int) -> None:
    if isinstance(db, Path):
        with contextlib.closing(sqlite3.connect(db)) as connection:
            connection.execute(f'PRAGMA user_version = {version}')
        return
    with psycopg.connect(db, autocommit=True) as connection:
        connection.execute('UPDATE twinkle_schema SET version = %s', (version,))


@pytest.fixture
def store(db: Path):
    with Store(db) as opened:
        yield opened


# -- auth ---------------------------------------------------------------------------------------------


def test_new_keys_are_long_random_and_prefixed():
    keys = {new_api_key() for _ in range(100)}
    assert len(keys) == 100
    # 32 random bytes in URL-safe base64 are 43 characters, after the 3-character prefix.
    assert all(key.startswith('tml-') and len(key) == 47 for key in keys)


def test_hash_key_is_hex_sha256():
    # sha256('abc') is the FIPS 180-2 test vector.
    assert hash_key('abc') == 'ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad'


@pytest.mark.parametrize(
    ('headers', 'expected'),
    [
        ({'authorization': 'Bearer tk-1'}, 'tk-1'),
        ({'Authorization': 'bearer  tk-1 '}, 'tk-1'),
        ({'x-api-key': 'tk-2'}, 'tk-2'),
        ({'X-Api-Key': 'tk-2'}, 'tk-2'),
        ({'authorization': 'Bearer tk-1', 'x-api-key': 'tk-2'}, 'tk-1'),
        ({'authorization': 'Basic dXNlcjpwdw==', 'x-api-key': 'tk-2'}, 'tk-2'),
        ({'authorization': 'Basic dXNlcjpwdw=='}, None),
        ({'authorization': 'Bearer '}, None),
        ({'x-api-key': ''}, None),
        ({}, None),
    ],
)
def test_key_from_headers(headers, expected):
    assert key_from_headers(headers) == expected


# -- names and paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize('name', ['a', 'default', 'step-10', 'v1.2_final', 'A' * 64])
def test_check_name_accepts_safe_names(name):
    assert check_name('adapter', name) == name


@pytest.mark.parametrize('name', ['', '.hidden', '..', '../x', 'a/b', 'a\\b', '-x', 'a b', 'a\n', 'A' * 65, 3, None])
def test_check_name_rejects_names_that_could_escape_a_directory(name):
    with pytest.raises(DataError, match=r'Invalid checkpoint name .*starting with a letter or digit'):
        check_name('checkpoint', name)


@pytest.mark.integration
def test_twinkle_path_round_trip(store):
    tenant, _ = store.tenants.add('alice')
    run = store.runs.create(tenant.id, 'base', 'default', {})
    checkpoint, _ = store.checkpoints.add(tenant.id, run.id, 'step-10', '/disk/x', 'training', 12)
    assert checkpoint.twinkle_path == f'twinkle://{run.id}/checkpoints/step-10'
    assert parse_twinkle_path(checkpoint.twinkle_path) == (run.id, 'step-10')


@pytest.mark.parametrize(
    'path',
    [
        'twinkle://a/b',
        'twinkle://r/checkpoints/../x',
        'twinkle://r/checkpoints/..',
        'twinkle://r/checkpoints/a..b',
        'twinkle://r/checkpoints/.hidden',
        'twinkle://r/checkpoints/x/',
        'twinkle://r/weights/x',
        'twinkle://../checkpoints/x',
        'twinkle:///checkpoints/x',
        'http://example.com/r/checkpoints/x',
        '/r/checkpoints/x',
        '',
    ],
)
def test_parse_twinkle_path_rejects_anything_else(path):
    with pytest.raises(DataError) as info:
        parse_twinkle_path(path)
    assert repr(path) in str(info.value)
    assert 'twinkle://<run_id>/checkpoints/<name>' in str(info.value)


# -- tenants ------------------------------------------------------------------------------------------


def test_keys_are_stored_only_hashed(sqlite_db):
    db = sqlite_db
    with Store(db) as store:
        tenant, key = store.tenants.add('alice')
        assert store.tenants.for_key(key) == tenant
    stored = b''.join(path.read_bytes() for path in db.parent.iterdir() if path.name.startswith(db.name))
    assert key.encode() not in stored
    assert hash_key(key).encode() in stored


@pytest.mark.integration
def test_tenant_lookup_by_key(store):
    alice, alice_key = store.tenants.add('alice')
    bob, bob_key = store.tenants.add('bob', key='tk-' + 'b' * 40)
    assert bob_key == 'tk-' + 'b' * 40
    assert store.tenants.for_key(alice_key) == alice
    assert store.tenants.for_key(bob_key) == bob
    assert store.tenants.for_key(alice_key + 'x') is None
    assert store.tenants.for_key('') is None
    assert store.tenants.all() == [alice, bob]


@pytest.mark.integration
def test_duplicate_tenant_name_or_key_and_weak_keys_are_refused(store):
    store.tenants.add('alice', key='k' * 40)
    with pytest.raises(ConfigurationError, match="a tenant named 'alice'"):
        store.tenants.add('alice')
    with pytest.raises(ConfigurationError, match='that API key'):
        store.tenants.add('bob', key='k' * 40)
    with pytest.raises(ConfigurationError, match='at least 32'):
        store.tenants.add('carol', key='short')
    with pytest.raises(DataError, match='tenant name'):
        store.tenants.add('../etc')
    assert [tenant.name for tenant in store.tenants.all()] == ['alice']


@pytest.mark.integration
def test_remove_tenant_removes_their_rows_only(store):
    alice, alice_key = store.tenants.add('alice')
    bob, _ = store.tenants.add('bob')
    alice_run = store.runs.create(alice.id, 'base', 'a', {})
    store.checkpoints.add(alice.id, alice_run.id, 'c', '/p', 'sampler', 1)
    store.futures.create(alice.id, alice_run.id, 'forward_backward')
    bob_run = store.runs.create(bob.id, 'base', 'b', {})
    assert store.tenants.remove('alice') is True
    assert store.tenants.remove('alice') is False
    assert store.tenants.for_key(alice_key) is None
    assert store.runs.page(alice.id) == ([], 0)
    assert store.checkpoints.of_run(alice.id, alice_run.id) == []
    assert store.runs.get(bob.id, bob_run.id) == bob_run


# -- tenant isolation ---------------------------------------------------------------------------------


@pytest.mark.integration
def test_another_tenants_rows_do_not_exist(store):
    alice, _ = store.tenants.add('alice')
    bob, _ = store.tenants.add('bob')
    run = store.runs.create(alice.id, 'base', 'default', {'r': 8})
    checkpoint, _ = store.checkpoints.add(alice.id, run.id, 'step-1', '/disk/1', 'training', 10)
    future = store.futures.create(alice.id, run.id, 'optim_step')

    assert store.runs.get(alice.id, run.id) == run
    assert store.checkpoints.get(alice.id, run.id, 'step-1') == checkpoint
    assert store.futures.get(alice.id, future.id) == future

    assert store.runs.get(bob.id, run.id) is None
    assert store.runs.page(bob.id) == ([], 0)
    assert store.checkpoints.get(bob.id, run.id, 'step-1') is None
    assert store.checkpoints.of_run(bob.id, run.id) == []
    assert store.checkpoints.delete(bob.id, run.id, 'step-1') is False
    assert store.futures.get(bob.id, future.id) is None
    # Bob cannot attach rows to Alice's run either.
    with pytest.raises(StateError, match=f'no run {run.id!r}'):
        store.checkpoints.add(bob.id, run.id, 'mine', '/disk/2', 'training', 1)
    with pytest.raises(StateError, match=f'no run {run.id!r}'):
        store.futures.create(bob.id, run.id, 'sample')
    assert store.checkpoints.of_run(alice.id, run.id) == [checkpoint]


# -- runs ---------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_runs_list_newest_first_with_paging_and_without_deleted(db):
    clock = FakeClock()
    with Store(db, clock=clock) as store:
        tenant, _ = store.tenants.add('alice')
        runs = []
        for i in range(5):
            clock.now = 1_000.0 + i
            runs.append(store.runs.create(tenant.id, 'base', f'adapter-{i}', {'i': i}))
        store.runs.set_status(runs[4].id, 'deleted')
        # Four live runs, newest first: adapter-3, adapter-2 | adapter-1, adapter-0.
        page, total = store.runs.page(tenant.id, limit=2, offset=0)
        assert total == 4 and [run.adapter_name for run in page] == ['adapter-3', 'adapter-2']
        page, total = store.runs.page(tenant.id, limit=2, offset=2)
        assert total == 4 and [run.adapter_name for run in page] == ['adapter-1', 'adapter-0']
        assert page[1].config == {'i': 0}
        assert store.runs.get(tenant.id, runs[4].id).status == 'deleted'


@pytest.mark.integration
def test_run_status_and_names_are_validated(store):
    tenant, _ = store.tenants.add('alice')
    run = store.runs.create(tenant.id, 'base', 'default', {})
    with pytest.raises(ConfigurationError, match=r"'gone'.*\['active', 'deleted', 'released'\]"):
        store.runs.set_status(run.id, 'gone')
    with pytest.raises(DataError, match='adapter name'):
        store.runs.create(tenant.id, 'base', '../other-tenant', {})
    with pytest.raises(StateError, match="No tenant 'tn-missing'"):
        store.runs.create('tn-missing', 'base', 'default', {})


@pytest.mark.integration
def test_idle_runs(db):
    clock = FakeClock(1_000.0)
    with Store(db, clock=clock) as store:
        tenant, _ = store.tenants.add('alice')
        busy = store.runs.create(tenant.id, 'base', 'busy', {})
        idle = store.runs.create(tenant.id, 'base', 'idle', {})
        released = store.runs.create(tenant.id, 'base', 'released', {})
        store.runs.set_status(released.id, 'released')
        clock.now = 1_500.0
        store.runs.touch(busy.id)
        clock.now = 1_700.0
        # 600 s before now is 1100: idle (last request 1000) is older, busy (1500) is not, released is not active.
        assert [run.id for run in store.runs.idle(600)] == [idle.id]
        assert store.runs.get(tenant.id, busy.id).last_request_at == 1_500.0
        # 100 s before now is 1600: both active runs are idle, the longest idle first.
        assert [run.id for run in store.runs.idle(100)] == [idle.id, busy.id]


# -- checkpoints --------------------------------------------------------------------------------------


@pytest.mark.integration
def test_checkpoint_replace_and_delete(db):
    clock = FakeClock()
    with Store(db, clock=clock) as store:
        tenant, _ = store.tenants.add('alice')
        run = store.runs.create(tenant.id, 'base', 'default', {})
        first, _ = store.checkpoints.add(tenant.id, run.id, 'latest', '/disk/v1', 'training', 100)
        other, _ = store.checkpoints.add(tenant.id, run.id, 'step-1', '/disk/s1', 'sampler', 50)
        clock.now += 10
        second, _ = store.checkpoints.add(tenant.id, run.id, 'latest', '/disk/v2', 'training', 200)
        assert second.id != first.id
        assert store.checkpoints.get(tenant.id, run.id, 'latest') == second
        assert store.checkpoints.of_run(tenant.id, run.id) == [other, second]

        assert store.checkpoints.delete(tenant.id, run.id, 'latest') is True
        assert store.checkpoints.delete(tenant.id, run.id, 'latest') is False
        assert store.checkpoints.get(tenant.id, run.id, 'latest') is None
        assert store.checkpoints.of_run(tenant.id, run.id) == [other]
        with pytest.raises(ConfigurationError, match="'weights'"):
            store.checkpoints.add(tenant.id, run.id, 'x', '/disk/x', 'weights', 1)


@pytest.mark.integration
def test_a_checkpoint_row_and_its_saves_future_commit_together_or_not_at_all(store):
    tenant, _ = store.tenants.add('alice')
    run = store.runs.create(tenant.id, 'base', 'default', {})
    first, _ = store.checkpoints.add(tenant.id, run.id, 'ck', '/disk/v1', 'training', 1)
    future = store.futures.create(tenant.id, run.id, 'save')
    with pytest.raises(RuntimeError, match='crash'), store.transaction():  # a failure before the commit
        store.checkpoints.add(tenant.id, run.id, 'ck', '/disk/v2', 'training', 2)
        store.futures.finish(future.id, 'twinkle://v2')
        raise RuntimeError('crash')
    assert store.checkpoints.get(tenant.id, run.id, 'ck') == first  # neither the row...
    assert store.futures.get(tenant.id, future.id).status == 'pending'  # ...nor the future changed
    with store.transaction():
        second, replaced = store.checkpoints.add(tenant.id, run.id, 'ck', '/disk/v2', 'training', 2)
        assert store.futures.finish(future.id, second.twinkle_path)
    assert replaced == first and store.checkpoints.get(tenant.id, run.id, 'ck') == second
    assert store.futures.get(tenant.id, future.id).result == second.twinkle_path
    assert store.checkpoints.paths() == {'/disk/v2'}


@pytest.mark.integration
def test_a_run_brought_back_with_less_than_it_had_says_so_and_forgets_the_steps_it_lost(db):
    clock = FakeClock()
    with Store(db, clock=clock) as store:
        tenant, _ = store.tenants.add('alice')
        run = store.runs.create(tenant.id, 'base', 'default', {})
        store.history.add_steps(run.id, [{'step': float(step), 'loss': 1.0 / step} for step in range(1, 7)])
        assert store.history.record_restore(run.id, 6, None, fresh_optimizer=False) is None  # as it was
        assert store.history.restores(run.id) == [] and store.history.last_restore(run.id) is None
        clock.now += 5
        lost = store.history.record_restore(run.id, 4, None, fresh_optimizer=False)
        expected = {'time': 1005.0, 'step': 4, 'checkpoint': None, 'fresh_optimizer': False, 'lost_steps': 2}
        assert lost == expected
        assert [entry['step'] for entry in store.history.steps(run.id)] == [1, 2, 3, 4]
        fresh = store.history.record_restore(run.id, 4, 'twinkle://run/checkpoints/four', fresh_optimizer=True)
        assert fresh is not None and (fresh['lost_steps'], fresh['fresh_optimizer']) == (0, True)
        assert store.history.restores(run.id) == [lost, fresh] and store.history.last_restore(run.id) == fresh


# -- futures ------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_future_lifecycle(store):
    tenant, _ = store.tenants.add('alice')
    future = store.futures.create(tenant.id, None, 'create_run')
    assert (future.status, future.run_id, future.finished) == ('pending', None, False)
    assert store.futures.set_running(future.id) is True
    assert store.futures.set_running(future.id) is False
    assert store.futures.finish(future.id, {'loss': 1.5, 'ids': [1, 2]}) is True
    done = store.futures.get(tenant.id, future.id)
    assert (done.status, done.result, done.finished) == ('done', {'loss': 1.5, 'ids': [1, 2]}, True)
    # A finished future never changes again.
    assert store.futures.fail(future.id, 'late', 'server') is False
    assert store.futures.get(tenant.id, future.id) == done

    failed = store.futures.create(tenant.id, None, 'sample')
    assert store.futures.fail(failed.id, 'prompt too long', 'user') is True
    failed = store.futures.get(tenant.id, failed.id)
    assert (failed.status, failed.error, failed.category, failed.result) == ('failed', 'prompt too long', 'user', None)
    with pytest.raises(ConfigurationError, match="'client'"):
        store.futures.fail(failed.id, 'x', 'client')
    with pytest.raises(DataError, match='JSON-serializable'):
        store.futures.finish(store.futures.create(tenant.id, None, 'op').id, object())


@pytest.mark.integration
def test_fail_unfinished_futures(store):
    tenant, _ = store.tenants.add('alice')
    pending = store.futures.create(tenant.id, None, 'a')
    running = store.futures.create(tenant.id, None, 'b')
    store.futures.set_running(running.id)
    done = store.futures.create(tenant.id, None, 'c')
    store.futures.finish(done.id, 1)
    assert store.futures.fail_unfinished('server restarted') == 2
    for future_id in (pending.id, running.id):
        future = store.futures.get(tenant.id, future_id)
        assert (future.status, future.error, future.category) == ('failed', 'server restarted', 'server')
        assert future.finished_at is not None
    assert store.futures.get(tenant.id, done.id).result == 1
    assert store.futures.fail_unfinished('again') == 0


# -- durability and concurrency -----------------------------------------------------------------------


@pytest.mark.integration
def test_rows_persist_across_reopen(db):
    with Store(db) as store:
        tenant, key = store.tenants.add('alice')
        run = store.runs.create(tenant.id, 'base', 'default', {'lora': {'r': 8}})
        store.checkpoints.add(tenant.id, run.id, 'step-1', '/disk/1', 'training', 10)
        future = store.futures.create(tenant.id, run.id, 'save')
        store.futures.finish(future.id, {'path': 'twinkle://x'})
    store.close()  # closing twice is harmless
    with pytest.raises(StateError, match='closed'):
        store.tenants.all()

    with Store(db) as reopened:
        assert reopened.tenants.for_key(key) == tenant
        assert reopened.runs.get(tenant.id, run.id) == run
        assert reopened.checkpoints.get(tenant.id, run.id, 'step-1').size_bytes == 10
        assert reopened.futures.get(tenant.id, future.id).result == {'path': 'twinkle://x'}
    assert schema_version(db) == SCHEMA_VERSION
    if isinstance(db, Path):
        with contextlib.closing(sqlite3.connect(db)) as connection:
            assert connection.execute('PRAGMA journal_mode').fetchone()[0] == 'wal'


def test_a_version_1_database_is_migrated_and_keeps_its_rows(sqlite_db):
    db = sqlite_db
    connection = sqlite3.connect(db)
    connection.executescript((Path(__file__).parent / 'data' / 'store_schema_v1.sql').read_text())
    connection.execute("INSERT INTO tenants VALUES ('tn-1', 'alice', ?, 1.0)", (hash_key('k' * 40),))
    connection.execute("INSERT INTO runs VALUES ('run-1', 'tn-1', 'base', 'default', '{}', 1.0, 1.0, 'active')")
    connection.execute(
        "INSERT INTO checkpoints VALUES ('ckpt-1', 'run-1', 'tn-1', 'step-1', '/disk/1', 'training', 10, 2.0)"
    )
    connection.commit()
    connection.close()
    with Store(db) as store:
        alice = store.tenants.for_key('k' * 40)
        assert alice.name == 'alice' and store.runs.get(alice.id, 'run-1').session_id is None
        checkpoint = store.checkpoints.get(alice.id, 'run-1', 'step-1')
        assert (checkpoint.path, checkpoint.size_bytes, checkpoint.public, checkpoint.expires_at) == (
            '/disk/1',
            10,
            False,
            None,
        )
        # a sampler checkpoint of the same name now fits beside the training one
        store.checkpoints.add(alice.id, 'run-1', 'step-1', '/disk/2', 'sampler', 5)
        # and an exported one (version 5 widened the kinds by rebuilding the table)
        store.checkpoints.add(alice.id, 'run-1', 'step-1', '/disk/3', 'external', 3)
        assert [c.checkpoint_id for c in store.checkpoints.of_run(alice.id, 'run-1')] == [
            'weights/step-1',
            'sampler_weights/step-1',
            'external_weights/step-1',
        ]
        store.tenants.sync_keys_file({'bob': hash_key('b' * 40)})
        assert store.tenants.for_key('b' * 40).name == 'bob'
    connection = sqlite3.connect(db)
    assert connection.execute('PRAGMA user_version').fetchone()[0] == SCHEMA_VERSION
    indexes = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'checkpoints'")}
    assert {'checkpoints_by_tenant', 'checkpoints_by_expiry'} <= indexes
    connection.close()


@pytest.mark.integration
def test_the_keys_file_decides_its_own_tenants_only(store, tmp_path):
    carol, carol_key = store.tenants.add('carol')  # added by hand: the file never touches her
    keys = tmp_path / 'keys.yaml'
    keys.write_text(f'alice: {"a" * 40}\nbob: sha256:{hash_key("b" * 40)}\n')
    store.tenants.sync_keys_file(read_keys_file(keys))
    alice = store.tenants.for_key('a' * 40)
    assert alice.name == 'alice' and store.tenants.for_key('b' * 40).name == 'bob'
    keys.write_text(f'alice: {"z" * 40}\n')  # alice's key rotated, bob removed
    store.tenants.sync_keys_file(read_keys_file(keys))
    assert store.tenants.for_key('a' * 40) is None and store.tenants.for_key('b' * 40) is None
    assert store.tenants.for_key('z' * 40) == alice  # the same tenant, so her runs stay hers
    assert store.tenants.for_key(carol_key) == carol
    with pytest.raises(ConfigurationError, match="tenant 'carol' a key another tenant has"):
        store.tenants.sync_keys_file({'alice': hash_key('z' * 40), 'carol': hash_key('z' * 40)})


@pytest.mark.parametrize(
    ('text', 'match'),
    [
        ('alice: short', "key of tenant 'alice' must be a string of at least 32"),
        ('alice: sha256:abc', "key of tenant 'alice'"),
        ('- just\n- a list', 'must map tenant names to keys'),
    ],
)
def test_bad_keys_files_are_refused(tmp_path, text, match):
    keys = tmp_path / 'keys.yaml'
    keys.write_text(text)
    with pytest.raises(ConfigurationError, match=match):
        read_keys_file(keys)
    with pytest.raises(ConfigurationError, match='does not exist'):
        read_keys_file(tmp_path / 'missing.yaml')


@pytest.mark.integration
def test_newer_schema_is_refused(db):
    Store(db).close()
    set_schema_version(db, 99)
    with pytest.raises(StateError, match='schema version 99'):
        Store(db)


@pytest.mark.integration
def test_concurrent_writes_from_8_threads(store):
    tenant, _ = store.tenants.add('alice')
    per_thread = 40
    ids: list[list[str]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            for i in range(per_thread):
                run = store.runs.create(tenant.id, 'base', f't{slot}-{i}', {'slot': slot})
                store.runs.touch(run.id)
                store.checkpoints.add(tenant.id, run.id, 'c', f'/disk/{run.id}', 'training', i)
                future = store.futures.create(tenant.id, run.id, 'op')
                store.futures.finish(future.id, i)
                ids[slot].append(run.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    runs, total = store.runs.page(tenant.id, limit=1_000)
    assert total == 8 * per_thread
    assert {run.id for run in runs} == {run_id for slot in ids for run_id in slot}
    assert all(len(store.checkpoints.of_run(tenant.id, run.id)) == 1 for run in runs)


_WRITER = textwrap.dedent(
    """
    import sys
    from twinkle.server.store import Store

    store = Store(sys.argv[1])
    tenant, _ = store.tenants.add('alice')
    print(tenant.id, flush=True)
    i = 0
    while True:
        run = store.runs.create(tenant.id, 'base', 'a', {'i': i})
        store.checkpoints.add(tenant.id, run.id, 'c', '/disk/' + run.id, 'training', i)
        print(run.id, flush=True)
        i += 1
    """
)


@pytest.mark.integration
def test_acknowledged_rows_survive_kill_9(db):
    env = {**os.environ, 'PYTHONPATH': SRC + os.pathsep + os.environ.get('PYTHONPATH', '')}
    writer = subprocess.Popen(
        [sys.executable, '-c', _WRITER, str(db)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    lines = []
    try:
        while len(lines) < 60:
            line = writer.stdout.readline()
            assert line, f'writer exited early: {writer.stderr.read()}'
            lines.append(line)
    finally:
        writer.send_signal(signal.SIGKILL)
    out, _ = writer.communicate(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    # A line is an acknowledgement only once its newline is out; a torn last line acknowledges nothing.
    lines += out.splitlines(keepends=True)
    acknowledged = [line.strip() for line in lines if line.endswith('\n')]
    tenant_id, run_ids = acknowledged[0], acknowledged[1:]
    assert len(run_ids) >= 59

    with Store(db) as reopened:
        runs, total = reopened.runs.page(tenant_id, limit=100_000)
        present = {run.id for run in runs}
        assert set(run_ids) <= present
        assert total >= len(run_ids)
        assert all(reopened.checkpoints.get(tenant_id, run_id, 'c') is not None for run_id in run_ids)
    if isinstance(db, Path):
        with contextlib.closing(sqlite3.connect(db)) as connection:
            assert connection.execute('PRAGMA integrity_check').fetchall() == [('ok',)]
            assert connection.execute('PRAGMA foreign_key_check').fetchall() == []


@pytest.mark.integration
def test_tinker_sessions_sampling_sessions_and_their_runs(store):
    alice, _ = store.tenants.add('alice')
    bob, _ = store.tenants.add('bob')
    session = store.sessions.create(alice.id, {'tags': ['x'], 'sdk_version': '0.38.0'})
    run = store.runs.create(alice.id, 'base', 'default', {}, run_id=f'{session.id}:train:0', session_id=session.id)
    with pytest.raises(StateError, match='already a run'):
        store.runs.create(alice.id, 'base', 'default', {}, run_id=run.id)
    sampler = store.sessions.create_sampler(alice.id, f'{session.id}:sample:0', session.id, 'base', None)
    assert store.sessions.create_sampler(alice.id, sampler.id, session.id, 'other', 'x') == sampler  # idempotent
    assert store.sessions.runs(alice.id, session.id) == [run.id]
    assert store.sessions.samplers(alice.id, session.id) == [sampler.id]
    assert store.sessions.get(bob.id, session.id) is None and store.sessions.runs(bob.id, session.id) == []
    assert store.sessions.sampler(bob.id, sampler.id) is None
    store.sessions.finish(session.id)
    assert store.sessions.get(alice.id, session.id).status == 'finished'
    assert [s.id for s in store.sessions.page(alice.id)] == [session.id] and store.sessions.page(bob.id) == []


@pytest.mark.integration
def test_sessions_without_a_heartbeat_since_a_time_expire_once(db):
    clock = FakeClock(1_000.0)
    with Store(db, clock=clock) as store:
        alice, _ = store.tenants.add('alice')
        quiet, beating, finished = (store.sessions.create(alice.id, {}) for _ in range(3))
        store.sessions.finish(finished.id)  # a finished session does not expire: its client said goodbye
        clock.now = 1_100.0
        store.sessions.heartbeat(beating.id)
        expired = store.sessions.expire(beaten_before=1_050.0)  # quiet's last beat: 1,000; beating's: 1,100
        assert [(s.id, s.expired_at) for s in expired] == [(quiet.id, 1_100.0)]
        assert store.sessions.get(alice.id, quiet.id).expired_at == 1_100.0
        assert store.sessions.get(alice.id, beating.id).expired_at is None
        assert store.sessions.expire(beaten_before=1_050.0) == []  # marked once
        assert store.sessions.expired([quiet.id, beating.id, finished.id, 'sess-unknown']) == {quiet.id}
        assert store.sessions.expired([]) == set()


@pytest.mark.integration
def test_published_checkpoints_are_readable_by_others_and_expired_ones_go(db):
    clock = FakeClock()
    with Store(db, clock=clock) as store:
        alice, _ = store.tenants.add('alice')
        bob, _ = store.tenants.add('bob')
        run = store.runs.create(alice.id, 'base', 'default', {})
        kept, _ = store.checkpoints.add(alice.id, run.id, 'kept', '/disk/k', 'sampler', 1)
        brief, _ = store.checkpoints.add(alice.id, run.id, 'brief', '/disk/b', 'training', 1, expires_at=clock.now + 60)
        assert store.checkpoints.readable(bob.id, run.id, 'kept', 'sampler') is None
        store.checkpoints.set_public(kept.id, True)
        assert store.checkpoints.readable(bob.id, run.id, 'kept', 'sampler').path == '/disk/k'
        assert store.checkpoints.readable(bob.id, run.id, 'kept', 'training') is None  # kind matters
        assert store.checkpoints.get(bob.id, run.id, 'kept', 'sampler') is None  # still alice's alone
        assert store.checkpoints.pop_expired() == []
        clock.now += 61
        assert [c.id for c in store.checkpoints.pop_expired()] == [brief.id]
        checkpoints, total = store.checkpoints.page(alice.id)
        assert [c.tinker_path for c in checkpoints] == [f'tinker://{run.id}/sampler_weights/kept'] and total == 1


@pytest.mark.parametrize(
    ('path', 'parsed'),
    [
        ('twinkle://run-1/checkpoints/a', ('run-1', 'training', 'a')),
        ('tinker://s-1:train:0/weights/a', ('s-1:train:0', 'training', 'a')),
        ('tinker://s-1:train:0/sampler_weights/a.b', ('s-1:train:0', 'sampler', 'a.b')),
        ('tinker://s-1:train:0/external_weights/final', ('s-1:train:0', 'external', 'final')),
    ],
)
def test_checkpoint_paths_of_both_apis(path, parsed):
    assert parse_checkpoint_path(path) == parsed


@pytest.mark.parametrize(
    'path', ['tinker://r/exported/a', 'tinker://r/weights/a/b', 'http://r/weights/a', 'tinker://../weights/a']
)
def test_bad_checkpoint_paths_name_the_accepted_forms(path):
    with pytest.raises(DataError, match='tinker://<run_id>/sampler_weights/<name>'):
        parse_checkpoint_path(path)


def test_marking_a_future_running_is_not_synced_alone_and_leaves_later_writes_synced(tmp_path):
    store = Store(tmp_path / 'twinkle.db')
    tenant, _ = store.tenants.add('alice')
    record = store.futures.create(tenant.id, None, 'forward_backward')
    assert store.futures.set_running(record.id)
    assert store.futures.get(tenant.id, record.id).status == 'running'
    assert store.futures.fail_unfinished('restarted') == 1  # what a restart does with it, as with a pending one
    synced, unsynced = store.db._conn, store.db._fast
    assert synced.execute('PRAGMA synchronous').fetchone()[0] == 2  # FULL: fsynced at every commit
    assert unsynced.execute('PRAGMA synchronous').fetchone()[0] == 1  # NORMAL: in the WAL, synced by the next FULL
    statements: dict[str, list[str]] = {'synced': [], 'unsynced': []}
    synced.set_trace_callback(statements['synced'].append)
    unsynced.set_trace_callback(statements['unsynced'].append)
    done = store.futures.create(tenant.id, None, 'forward_backward')  # created and finished unsynced too
    assert store.futures.finish(done.id, {'loss': 1.5})
    store.tenants.add('bob')  # a durable write
    with store.transaction():  # an unsynced write inside a durable transaction commits with it
        store.futures.fail(done.id, 'late', 'server')
    synced.set_trace_callback(None)
    unsynced.set_trace_callback(None)
    writes = {
        name: [' '.join(s.split(' ', 2)[:2]) for s in said if s.startswith(('PRAGMA', 'INSERT', 'UPDATE'))]
        for name, said in statements.items()
    }
    assert writes['unsynced'] == ['INSERT INTO', 'UPDATE futures']  # no setting switched per write
    assert writes['synced'] == ['INSERT INTO', 'UPDATE futures']
    assert store.futures.get(tenant.id, done.id).result == {'loss': 1.5}  # read on the other connection
    store.close()


@pytest.mark.integration
def test_usage_sums_per_hour_steps_replace_and_sampled_sequences_round_trip(db):
    clock = FakeClock(7_200.0)
    with Store(db, clock=clock) as store:
        alice, _ = store.tenants.add('alice')
        run = store.runs.create(alice.id, 'base', 'default', {})
        store.usage.add(alice.id, run.id, None, 'base', {'training': 10, 'compute_seconds': 0.5})
        store.usage.add(alice.id, run.id, None, 'base', {'training': 5, 'checkpoint': 0})  # upserted, zero skipped
        clock.now += 3_600
        store.usage.add(alice.id, None, None, 'base', {'sampling_sample': 7})
        rows = [(row.hour, row.run_id, row.kind, row.quantity) for row in store.usage.hours(None, 0, 1e9)]
        assert rows == [
            (7_200.0, run.id, 'compute_seconds', 0.5),
            (7_200.0, run.id, 'training', 15.0),
            (10_800.0, None, 'sampling_sample', 7.0),
        ]
        assert store.usage.total(alice.id, ('training', 'sampling_sample'), 0) == 22

        store.history.add_steps(run.id, [{'step': 1, 'loss': 2.0}, {'step': 2, 'loss': 1.5}])
        store.history.add_steps(run.id, [{'step': 2, 'loss': 1.25}])  # a step recorded again replaces it
        assert [(s['step'], s['loss']) for s in store.history.steps(run.id)] == [(1, 2.0), (2, 1.25)]

        session = store.sessions.create(alice.id, {})
        sequences = [('seq-a', [5, 6, 2**40], [-0.5, -1.25, -2.0]), ('seq-b', [7], [-0.125])]
        store.sequences.record(alice.id, session.id, [1, 2, 3], sequences)
        store.sequences.record(alice.id, session.id, [1, 2], [('seq-b', [8, 9], [-0.25, -0.5])])  # replaced
        got = store.sequences.get(alice.id, ['seq-a', 'seq-b'])
        assert (got['seq-a'].prompt, got['seq-a'].tokens, got['seq-a'].logprobs) == (
            [1, 2, 3],
            [5, 6, 2**40],
            [-0.5, -1.25, -2.0],
        )
        assert (got['seq-b'].prompt, got['seq-b'].tokens, got['seq-b'].logprobs) == ([1, 2], [8, 9], [-0.25, -0.5])
