"""The service's SQLite store and API keys, on real database files under tmp_path."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.server.auth import hash_key, key_from_headers, new_api_key, read_keys_file
from twinkle.server.store import SCHEMA_VERSION, Store, check_name, parse_checkpoint_path, parse_twinkle_path

SRC = str(Path(__file__).resolve().parent.parent / 'src')


class FakeClock:
    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / 'twinkle.db'


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


def test_twinkle_path_round_trip(store):
    tenant, _ = store.add_tenant('alice')
    run = store.create_run(tenant.id, 'base', 'default', {})
    checkpoint = store.add_checkpoint(tenant.id, run.id, 'step-10', '/disk/x', 'training', 12)
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


def test_keys_are_stored_only_hashed(db):
    with Store(db) as store:
        tenant, key = store.add_tenant('alice')
        assert store.tenant_for_key(key) == tenant
    stored = b''.join(path.read_bytes() for path in db.parent.iterdir() if path.name.startswith(db.name))
    assert key.encode() not in stored
    assert hash_key(key).encode() in stored


def test_tenant_lookup_by_key(store):
    alice, alice_key = store.add_tenant('alice')
    bob, bob_key = store.add_tenant('bob', key='tk-' + 'b' * 40)
    assert bob_key == 'tk-' + 'b' * 40
    assert store.tenant_for_key(alice_key) == alice
    assert store.tenant_for_key(bob_key) == bob
    assert store.tenant_for_key(alice_key + 'x') is None
    assert store.tenant_for_key('') is None
    assert store.list_tenants() == [alice, bob]


def test_duplicate_tenant_name_or_key_and_weak_keys_are_refused(store):
    store.add_tenant('alice', key='k' * 40)
    with pytest.raises(ConfigurationError, match="a tenant named 'alice'"):
        store.add_tenant('alice')
    with pytest.raises(ConfigurationError, match='that API key'):
        store.add_tenant('bob', key='k' * 40)
    with pytest.raises(ConfigurationError, match='at least 32'):
        store.add_tenant('carol', key='short')
    with pytest.raises(DataError, match='tenant name'):
        store.add_tenant('../etc')
    assert [tenant.name for tenant in store.list_tenants()] == ['alice']


def test_remove_tenant_removes_their_rows_only(store):
    alice, alice_key = store.add_tenant('alice')
    bob, _ = store.add_tenant('bob')
    alice_run = store.create_run(alice.id, 'base', 'a', {})
    store.add_checkpoint(alice.id, alice_run.id, 'c', '/p', 'sampler', 1)
    store.create_future(alice.id, alice_run.id, 'forward_backward')
    bob_run = store.create_run(bob.id, 'base', 'b', {})
    assert store.remove_tenant('alice') is True
    assert store.remove_tenant('alice') is False
    assert store.tenant_for_key(alice_key) is None
    assert store.list_runs(alice.id) == ([], 0)
    assert store.list_checkpoints(alice.id, alice_run.id) == []
    assert store.get_run(bob.id, bob_run.id) == bob_run


# -- tenant isolation ---------------------------------------------------------------------------------


def test_another_tenants_rows_do_not_exist(store):
    alice, _ = store.add_tenant('alice')
    bob, _ = store.add_tenant('bob')
    run = store.create_run(alice.id, 'base', 'default', {'r': 8})
    checkpoint = store.add_checkpoint(alice.id, run.id, 'step-1', '/disk/1', 'training', 10)
    future = store.create_future(alice.id, run.id, 'optim_step')

    assert store.get_run(alice.id, run.id) == run
    assert store.get_checkpoint(alice.id, run.id, 'step-1') == checkpoint
    assert store.get_future(alice.id, future.id) == future

    assert store.get_run(bob.id, run.id) is None
    assert store.list_runs(bob.id) == ([], 0)
    assert store.get_checkpoint(bob.id, run.id, 'step-1') is None
    assert store.list_checkpoints(bob.id, run.id) == []
    assert store.delete_checkpoint(bob.id, run.id, 'step-1') is False
    assert store.get_future(bob.id, future.id) is None
    # Bob cannot attach rows to Alice's run either.
    with pytest.raises(StateError, match=f'no run {run.id!r}'):
        store.add_checkpoint(bob.id, run.id, 'mine', '/disk/2', 'training', 1)
    with pytest.raises(StateError, match=f'no run {run.id!r}'):
        store.create_future(bob.id, run.id, 'sample')
    assert store.list_checkpoints(alice.id, run.id) == [checkpoint]


# -- runs ---------------------------------------------------------------------------------------------


def test_runs_list_newest_first_with_paging_and_without_deleted(tmp_path):
    clock = FakeClock()
    with Store(tmp_path / 'db', clock=clock) as store:
        tenant, _ = store.add_tenant('alice')
        runs = []
        for i in range(5):
            clock.now = 1_000.0 + i
            runs.append(store.create_run(tenant.id, 'base', f'adapter-{i}', {'i': i}))
        store.set_run_status(runs[4].id, 'deleted')
        # Four live runs, newest first: adapter-3, adapter-2 | adapter-1, adapter-0.
        page, total = store.list_runs(tenant.id, limit=2, offset=0)
        assert total == 4 and [run.adapter_name for run in page] == ['adapter-3', 'adapter-2']
        page, total = store.list_runs(tenant.id, limit=2, offset=2)
        assert total == 4 and [run.adapter_name for run in page] == ['adapter-1', 'adapter-0']
        assert page[1].config == {'i': 0}
        assert store.get_run(tenant.id, runs[4].id).status == 'deleted'


def test_run_status_and_names_are_validated(store):
    tenant, _ = store.add_tenant('alice')
    run = store.create_run(tenant.id, 'base', 'default', {})
    with pytest.raises(ConfigurationError, match=r"'gone'.*\['active', 'deleted', 'released'\]"):
        store.set_run_status(run.id, 'gone')
    with pytest.raises(DataError, match='adapter name'):
        store.create_run(tenant.id, 'base', '../other-tenant', {})
    with pytest.raises(StateError, match="No tenant 'tn-missing'"):
        store.create_run('tn-missing', 'base', 'default', {})


def test_idle_runs(tmp_path):
    clock = FakeClock(1_000.0)
    with Store(tmp_path / 'db', clock=clock) as store:
        tenant, _ = store.add_tenant('alice')
        busy = store.create_run(tenant.id, 'base', 'busy', {})
        idle = store.create_run(tenant.id, 'base', 'idle', {})
        released = store.create_run(tenant.id, 'base', 'released', {})
        store.set_run_status(released.id, 'released')
        clock.now = 1_500.0
        store.touch_run(busy.id)
        clock.now = 1_700.0
        # 600 s before now is 1100: idle (last request 1000) is older, busy (1500) is not, released is not active.
        assert [run.id for run in store.idle_runs(600)] == [idle.id]
        assert store.get_run(tenant.id, busy.id).last_request_at == 1_500.0
        # 100 s before now is 1600: both active runs are idle, the longest idle first.
        assert [run.id for run in store.idle_runs(100)] == [idle.id, busy.id]


# -- checkpoints --------------------------------------------------------------------------------------


def test_checkpoint_replace_and_delete(tmp_path):
    clock = FakeClock()
    with Store(tmp_path / 'db', clock=clock) as store:
        tenant, _ = store.add_tenant('alice')
        run = store.create_run(tenant.id, 'base', 'default', {})
        first = store.add_checkpoint(tenant.id, run.id, 'latest', '/disk/v1', 'training', 100)
        other = store.add_checkpoint(tenant.id, run.id, 'step-1', '/disk/s1', 'sampler', 50)
        clock.now += 10
        second = store.add_checkpoint(tenant.id, run.id, 'latest', '/disk/v2', 'training', 200)
        assert second.id != first.id
        assert store.get_checkpoint(tenant.id, run.id, 'latest') == second
        assert store.list_checkpoints(tenant.id, run.id) == [other, second]

        assert store.delete_checkpoint(tenant.id, run.id, 'latest') is True
        assert store.delete_checkpoint(tenant.id, run.id, 'latest') is False
        assert store.get_checkpoint(tenant.id, run.id, 'latest') is None
        assert store.list_checkpoints(tenant.id, run.id) == [other]
        with pytest.raises(ConfigurationError, match="'weights'"):
            store.add_checkpoint(tenant.id, run.id, 'x', '/disk/x', 'weights', 1)


# -- futures ------------------------------------------------------------------------------------------


def test_future_lifecycle(store):
    tenant, _ = store.add_tenant('alice')
    future = store.create_future(tenant.id, None, 'create_run')
    assert (future.status, future.run_id, future.finished) == ('pending', None, False)
    assert store.set_future_running(future.id) is True
    assert store.set_future_running(future.id) is False
    assert store.finish_future(future.id, {'loss': 1.5, 'ids': [1, 2]}) is True
    done = store.get_future(tenant.id, future.id)
    assert (done.status, done.result, done.finished) == ('done', {'loss': 1.5, 'ids': [1, 2]}, True)
    # A finished future never changes again.
    assert store.fail_future(future.id, 'late', 'server') is False
    assert store.get_future(tenant.id, future.id) == done

    failed = store.create_future(tenant.id, None, 'sample')
    assert store.fail_future(failed.id, 'prompt too long', 'user') is True
    failed = store.get_future(tenant.id, failed.id)
    assert (failed.status, failed.error, failed.category, failed.result) == ('failed', 'prompt too long', 'user', None)
    with pytest.raises(ConfigurationError, match="'client'"):
        store.fail_future(failed.id, 'x', 'client')
    with pytest.raises(DataError, match='JSON-serializable'):
        store.finish_future(store.create_future(tenant.id, None, 'op').id, object())


def test_fail_unfinished_futures(store):
    tenant, _ = store.add_tenant('alice')
    pending = store.create_future(tenant.id, None, 'a')
    running = store.create_future(tenant.id, None, 'b')
    store.set_future_running(running.id)
    done = store.create_future(tenant.id, None, 'c')
    store.finish_future(done.id, 1)
    assert store.fail_unfinished_futures('server restarted') == 2
    for future_id in (pending.id, running.id):
        future = store.get_future(tenant.id, future_id)
        assert (future.status, future.error, future.category) == ('failed', 'server restarted', 'server')
        assert future.finished_at is not None
    assert store.get_future(tenant.id, done.id).result == 1
    assert store.fail_unfinished_futures('again') == 0


# -- durability and concurrency -----------------------------------------------------------------------


def test_rows_persist_across_reopen(db):
    with Store(db) as store:
        tenant, key = store.add_tenant('alice')
        run = store.create_run(tenant.id, 'base', 'default', {'lora': {'r': 8}})
        store.add_checkpoint(tenant.id, run.id, 'step-1', '/disk/1', 'training', 10)
        future = store.create_future(tenant.id, run.id, 'save')
        store.finish_future(future.id, {'path': 'twinkle://x'})
    store.close()  # closing twice is harmless
    with pytest.raises(StateError, match='closed'):
        store.list_tenants()

    with Store(db) as reopened:
        assert reopened.tenant_for_key(key) == tenant
        assert reopened.get_run(tenant.id, run.id) == run
        assert reopened.get_checkpoint(tenant.id, run.id, 'step-1').size_bytes == 10
        assert reopened.get_future(tenant.id, future.id).result == {'path': 'twinkle://x'}
    connection = sqlite3.connect(db)
    assert connection.execute('PRAGMA user_version').fetchone()[0] == SCHEMA_VERSION
    assert connection.execute('PRAGMA journal_mode').fetchone()[0] == 'wal'
    connection.close()


def test_a_version_1_database_is_migrated_and_keeps_its_rows(db):
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
        alice = store.tenant_for_key('k' * 40)
        assert alice.name == 'alice' and store.get_run(alice.id, 'run-1').session_id is None
        checkpoint = store.get_checkpoint(alice.id, 'run-1', 'step-1')
        assert (checkpoint.path, checkpoint.size_bytes, checkpoint.public, checkpoint.expires_at) == (
            '/disk/1',
            10,
            False,
            None,
        )
        # a sampler checkpoint of the same name now fits beside the training one
        store.add_checkpoint(alice.id, 'run-1', 'step-1', '/disk/2', 'sampler', 5)
        # and an exported one (version 5 widened the kinds by rebuilding the table)
        store.add_checkpoint(alice.id, 'run-1', 'step-1', '/disk/3', 'external', 3)
        assert [c.checkpoint_id for c in store.list_checkpoints(alice.id, 'run-1')] == [
            'weights/step-1',
            'sampler_weights/step-1',
            'external_weights/step-1',
        ]
        store.sync_keys_file({'bob': hash_key('b' * 40)})
        assert store.tenant_for_key('b' * 40).name == 'bob'
    connection = sqlite3.connect(db)
    assert connection.execute('PRAGMA user_version').fetchone()[0] == SCHEMA_VERSION
    indexes = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'checkpoints'")}
    assert {'checkpoints_by_tenant', 'checkpoints_by_expiry'} <= indexes
    connection.close()


def test_the_keys_file_decides_its_own_tenants_only(store, tmp_path):
    carol, carol_key = store.add_tenant('carol')  # added by hand: the file never touches her
    keys = tmp_path / 'keys.yaml'
    keys.write_text(f'alice: {"a" * 40}\nbob: sha256:{hash_key("b" * 40)}\n')
    store.sync_keys_file(read_keys_file(keys))
    alice = store.tenant_for_key('a' * 40)
    assert alice.name == 'alice' and store.tenant_for_key('b' * 40).name == 'bob'
    keys.write_text(f'alice: {"z" * 40}\n')  # alice's key rotated, bob removed
    store.sync_keys_file(read_keys_file(keys))
    assert store.tenant_for_key('a' * 40) is None and store.tenant_for_key('b' * 40) is None
    assert store.tenant_for_key('z' * 40) == alice  # the same tenant, so her runs stay hers
    assert store.tenant_for_key(carol_key) == carol
    with pytest.raises(ConfigurationError, match="tenant 'carol' a key another tenant has"):
        store.sync_keys_file({'alice': hash_key('z' * 40), 'carol': hash_key('z' * 40)})


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


def test_newer_schema_is_refused(db):
    Store(db).close()
    connection = sqlite3.connect(db)
    connection.execute('PRAGMA user_version = 99')
    connection.close()
    with pytest.raises(StateError, match='schema version 99'):
        Store(db)


def test_concurrent_writes_from_8_threads(store):
    tenant, _ = store.add_tenant('alice')
    per_thread = 40
    ids: list[list[str]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        try:
            for i in range(per_thread):
                run = store.create_run(tenant.id, 'base', f't{slot}-{i}', {'slot': slot})
                store.touch_run(run.id)
                store.add_checkpoint(tenant.id, run.id, 'c', f'/disk/{run.id}', 'training', i)
                future = store.create_future(tenant.id, run.id, 'op')
                store.finish_future(future.id, i)
                ids[slot].append(run.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    runs, total = store.list_runs(tenant.id, limit=1_000)
    assert total == 8 * per_thread
    assert {run.id for run in runs} == {run_id for slot in ids for run_id in slot}
    assert all(len(store.list_checkpoints(tenant.id, run.id)) == 1 for run in runs)


_WRITER = textwrap.dedent(
    """
    import sys
    from twinkle.server.store import Store

    store = Store(sys.argv[1])
    tenant, _ = store.add_tenant('alice')
    print(tenant.id, flush=True)
    i = 0
    while True:
        run = store.create_run(tenant.id, 'base', 'a', {'i': i})
        store.add_checkpoint(tenant.id, run.id, 'c', '/disk/' + run.id, 'training', i)
        print(run.id, flush=True)
        i += 1
    """
)


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
        runs, total = reopened.list_runs(tenant_id, limit=100_000)
        present = {run.id for run in runs}
        assert set(run_ids) <= present
        assert total >= len(run_ids)
        assert all(reopened.get_checkpoint(tenant_id, run_id, 'c') is not None for run_id in run_ids)
    connection = sqlite3.connect(db)
    assert connection.execute('PRAGMA integrity_check').fetchall() == [('ok',)]
    assert connection.execute('PRAGMA foreign_key_check').fetchall() == []
    connection.close()


def test_tinker_sessions_sampling_sessions_and_their_runs(store):
    alice, _ = store.add_tenant('alice')
    bob, _ = store.add_tenant('bob')
    session = store.create_session(alice.id, {'tags': ['x'], 'sdk_version': '0.38.0'})
    run = store.create_run(alice.id, 'base', 'default', {}, run_id=f'{session.id}:train:0', session_id=session.id)
    with pytest.raises(StateError, match='already a run'):
        store.create_run(alice.id, 'base', 'default', {}, run_id=run.id)
    sampler = store.create_sampling_session(alice.id, f'{session.id}:sample:0', session.id, 'base', None)
    assert store.create_sampling_session(alice.id, sampler.id, session.id, 'other', 'x') == sampler  # idempotent
    assert store.session_runs(alice.id, session.id) == [run.id]
    assert store.session_samplers(alice.id, session.id) == [sampler.id]
    assert store.get_session(bob.id, session.id) is None and store.session_runs(bob.id, session.id) == []
    assert store.get_sampling_session(bob.id, sampler.id) is None
    store.finish_session(session.id)
    assert store.get_session(alice.id, session.id).status == 'finished'
    assert [s.id for s in store.list_sessions(alice.id)] == [session.id] and store.list_sessions(bob.id) == []


def test_published_checkpoints_are_readable_by_others_and_expired_ones_go(db):
    clock = FakeClock()
    with Store(db, clock=clock) as store:
        alice, _ = store.add_tenant('alice')
        bob, _ = store.add_tenant('bob')
        run = store.create_run(alice.id, 'base', 'default', {})
        kept = store.add_checkpoint(alice.id, run.id, 'kept', '/disk/k', 'sampler', 1)
        brief = store.add_checkpoint(alice.id, run.id, 'brief', '/disk/b', 'training', 1, expires_at=clock.now + 60)
        assert store.get_readable_checkpoint(bob.id, run.id, 'kept', 'sampler') is None
        store.set_checkpoint_public(kept.id, True)
        assert store.get_readable_checkpoint(bob.id, run.id, 'kept', 'sampler').path == '/disk/k'
        assert store.get_readable_checkpoint(bob.id, run.id, 'kept', 'training') is None  # kind matters
        assert store.get_checkpoint(bob.id, run.id, 'kept', 'sampler') is None  # still alice's alone
        assert store.pop_expired_checkpoints() == []
        clock.now += 61
        assert [c.id for c in store.pop_expired_checkpoints()] == [brief.id]
        checkpoints, total = store.list_tenant_checkpoints(alice.id)
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
    tenant, _ = store.add_tenant('alice')
    record = store.create_future(tenant.id, None, 'forward_backward')
    assert store.set_future_running(record.id)
    assert store.get_future(tenant.id, record.id).status == 'running'
    assert store._query('PRAGMA synchronous')[0][0] == 2  # FULL again for every later write
    assert store.fail_unfinished_futures('restarted') == 1  # what a restart does with it, as with a pending one
    store.close()
