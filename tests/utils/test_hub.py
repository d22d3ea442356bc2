"""twinkle.hub: ids to local files, through the real huggingface_hub and modelscope caches.

Every test runs offline: the offline variables are set, each library's cache points into
tmp_path, and sockets refuse to connect, so a stray network attempt fails at once.
The caches are built by hand in the exact layout each library writes (see the helpers), then
read back through the libraries' own ``snapshot_download(local_files_only=True)``.
"""

from __future__ import annotations

import doctest
import hashlib
import importlib
import os
import socket
from pathlib import Path

import pytest

import twinkle.hub
from twinkle.errors import AssetNotFoundError, ConfigurationError
from twinkle.hub import HubId, hub_cache_dir, is_offline, parse_hub_id, resolve_dataset, resolve_model

COMMIT = 'a' * 40  # a Hugging Face commit hash is 40 hex digits
OFFLINE_VARS = ('TWINKLE_OFFLINE', 'HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE', 'MODELSCOPE_OFFLINE')


def _no_network(*args: object, **kwargs: object) -> None:
    raise OSError('network access is disabled in tests/utils/test_hub.py')


@pytest.fixture(autouse=True)
def offline_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Offline variables on, caches and HOME under tmp_path, sockets dead."""
    for name in ('connect', 'connect_ex'):
        monkeypatch.setattr(socket.socket, name, _no_network)
    monkeypatch.setattr(socket, 'getaddrinfo', _no_network)
    monkeypatch.setattr(socket, 'create_connection', _no_network)
    for name in ('HUGGINGFACE_HUB_CACHE', 'MS_CACHE_HOME', 'XDG_CACHE_HOME'):
        monkeypatch.delenv(name, raising=False)
    for name in OFFLINE_VARS:
        monkeypatch.setenv(name, '1')
    monkeypatch.setenv('HOME', str(tmp_path / 'home'))
    monkeypatch.setenv('HF_HOME', str(tmp_path / 'hf_home'))
    monkeypatch.setenv('HF_HUB_CACHE', str(tmp_path / 'hf'))
    monkeypatch.setenv('MODELSCOPE_CACHE', str(tmp_path / 'ms'))
    monkeypatch.setenv('MODELSCOPE_HOME', str(tmp_path / 'ms_home'))
    # Both libraries freeze some settings at first use; keep this module's values out of others.
    import huggingface_hub.constants
    import modelscope_hub.config

    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
    monkeypatch.setattr(modelscope_hub.config, '_default_config', None)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------------------------------------
# Cache builders, in each library's on-disk layout


def make_hf_repo(cache: Path, repo_id: str, repo_type: str, files: dict[str, str]) -> Path:
    """huggingface_hub's layout: ``{repo_type}s--org--name/{blobs,refs,snapshots}``.

    Contents live once in ``blobs/<etag>``; ``snapshots/<commit>/<file>`` is a relative symlink
    to the blob, and ``refs/main`` holds the commit hash (no newline).
    """
    repo = cache / f'{repo_type}s--{repo_id.replace("/", "--")}'
    snapshot = repo / 'snapshots' / COMMIT
    for rel, text in files.items():
        etag = hashlib.sha256(text.encode()).hexdigest()
        blob = repo / 'blobs' / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_text(text)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / 'refs').mkdir(parents=True, exist_ok=True)
    (repo / 'refs' / 'main').write_text(COMMIT)
    return snapshot


def make_ms_repo(cache: Path, repo_id: str, repo_type: str, files: dict[str, str], revision: str) -> Path:
    """modelscope 1.38+ layout: ``{repo_type}s/org--name/snapshots/<revision>/<file>``, plain files.

    With no revision asked, modelscope reads ``snapshots/master`` (its default branch), then
    ``snapshots/main``, then a lone other snapshot.
    """
    snapshot = cache / f'{repo_type}s' / repo_id.replace('/', '--') / 'snapshots' / revision
    for rel, text in files.items():
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / rel).write_text(text)
    return snapshot


def test_the_hf_cache_built_here_is_one_huggingface_hub_recognises(offline_env: Path) -> None:
    import huggingface_hub

    make_hf_repo(offline_env / 'hf', 'org/tiny', 'model', {'config.json': '{}'})
    make_hf_repo(offline_env / 'hf', 'org/data', 'dataset', {'train.jsonl': '{"a": 1}\n'})
    info = huggingface_hub.scan_cache_dir(offline_env / 'hf')
    assert not info.warnings
    found = {(r.repo_id, r.repo_type, rev.commit_hash, tuple(rev.refs)) for r in info.repos for rev in r.revisions}
    assert found == {('org/tiny', 'model', COMMIT, ('main',)), ('org/data', 'dataset', COMMIT, ('main',))}


# ---------------------------------------------------------------------------------------------
# parse_hub_id


@pytest.mark.parametrize(
    ('raw', 'expected'),
    [
        ('ms://Qwen/Qwen3-0.6B', HubId('ms', 'Qwen/Qwen3-0.6B')),
        ('hf://Qwen/Qwen3-0.6B', HubId('hf', 'Qwen/Qwen3-0.6B')),
        ('hf://gpt2', HubId('hf', 'gpt2')),
        ('Qwen/Qwen3-0.6B', HubId('ms', 'Qwen/Qwen3-0.6B')),  # bare, not on disk: ModelScope
    ],
)
def test_parse_hub_ids(raw: str, expected: HubId) -> None:
    assert parse_hub_id(raw) == expected


def test_an_existing_local_path_wins_over_a_bare_repo_id(offline_env: Path) -> None:
    (offline_env / 'Qwen' / 'Qwen3-0.6B').mkdir(parents=True)  # cwd is offline_env
    assert parse_hub_id('Qwen/Qwen3-0.6B') == HubId('local', str(offline_env / 'Qwen' / 'Qwen3-0.6B'))


def test_home_is_expanded_in_local_paths(offline_env: Path) -> None:
    model = offline_env / 'home' / 'models' / 'tiny'
    model.mkdir(parents=True)
    assert parse_hub_id('~/models/tiny') == HubId('local', str(model))
    assert resolve_model('~/models/tiny') == str(model)


@pytest.mark.parametrize(
    ('raw', 'reason'),
    [
        ('', 'it is empty'),
        ('ms://', "got ''"),
        ('hf://', "got ''"),
        ('xx://a/b', "unknown scheme 'xx://'"),
        ('ms://justname', 'org/name'),  # a ModelScope repo always has an owner
        ('ms://a/b/c', 'org/name'),
        ('hf://a//b', 'org/name or name'),
        ('hf://../etc', 'org/name or name'),
    ],
)
def test_bad_ids_list_the_accepted_forms(raw: str, reason: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_hub_id(raw)
    message = str(info.value)
    assert reason in message
    assert 'ms://org/name' in message and 'hf://org/name' in message and 'local' in message
    assert isinstance(info.value, ValueError)


def test_doctests() -> None:
    assert doctest.testmod(twinkle.hub, raise_on_error=False).failed == 0


# ---------------------------------------------------------------------------------------------
# Hugging Face, through huggingface_hub.snapshot_download(local_files_only=True)


def test_hf_model_and_dataset_resolve_from_the_cache(offline_env: Path) -> None:
    model = make_hf_repo(offline_env / 'hf', 'org/tiny', 'model', {'config.json': '{}'})
    data = make_hf_repo(offline_env / 'hf', 'org/data', 'dataset', {'data/train.jsonl': '{"a": 1}\n'})

    assert resolve_model('hf://org/tiny') == str(model)
    assert resolve_model('hf://org/tiny', revision=COMMIT) == str(model)
    assert resolve_dataset('hf://org/data') == str(data)
    assert (Path(resolve_dataset('hf://org/data')) / 'data' / 'train.jsonl').read_text() == '{"a": 1}\n'


def test_hf_cache_follows_hf_home_when_hf_hub_cache_is_unset(
    offline_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv('HF_HUB_CACHE')
    assert hub_cache_dir('hf') == offline_env / 'hf_home' / 'hub'
    model = make_hf_repo(offline_env / 'hf_home' / 'hub', 'org/tiny', 'model', {'config.json': '{}'})
    assert resolve_model('hf://org/tiny') == str(model)


def test_missing_hf_repo_names_the_id_hub_and_folder(offline_env: Path) -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    with pytest.raises(AssetNotFoundError) as info:
        resolve_model('hf://org/missing')
    message = str(info.value)
    assert "'hf://org/missing'" in message and 'Hugging Face' in message
    assert str(offline_env / 'hf' / 'models--org--missing') in message
    assert 'hf download org/missing' in message and 'local path' in message and 'unset' in message
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value.__cause__, LocalEntryNotFoundError)


def test_unknown_hf_revision_is_not_found(offline_env: Path) -> None:
    make_hf_repo(offline_env / 'hf', 'org/tiny', 'model', {'config.json': '{}'})
    with pytest.raises(AssetNotFoundError, match="revision 'v2'"):
        resolve_model('hf://org/tiny', revision='v2')  # no refs/v2 in the cache


def test_hf_model_is_not_a_hf_dataset(offline_env: Path) -> None:
    make_hf_repo(offline_env / 'hf', 'org/tiny', 'model', {'config.json': '{}'})
    with pytest.raises(AssetNotFoundError, match='datasets--org--tiny'):
        resolve_dataset('hf://org/tiny')


# ---------------------------------------------------------------------------------------------
# ModelScope, through modelscope.hub.snapshot_download(local_files_only=True)


@pytest.mark.integration
def test_ms_model_and_dataset_resolve_from_the_cache(offline_env: Path) -> None:
    model = make_ms_repo(offline_env / 'ms', 'org/tiny', 'model', {'config.json': '{}'}, 'master')
    data = make_ms_repo(offline_env / 'ms', 'org/data', 'dataset', {'train.jsonl': '{"a": 1}\n'}, 'master')

    assert resolve_model('ms://org/tiny') == str(model)
    assert resolve_model('org/tiny') == str(model)  # a bare id means ModelScope
    assert resolve_dataset('ms://org/data') == str(data)
    assert resolve_dataset('org/data') == str(data)


@pytest.mark.integration
def test_ms_revision_picks_that_snapshot(offline_env: Path) -> None:
    make_ms_repo(offline_env / 'ms', 'org/tiny', 'model', {'config.json': '{}'}, 'master')
    tagged = make_ms_repo(offline_env / 'ms', 'org/tiny', 'model', {'config.json': '{"v": 1}'}, 'v1.0')
    assert resolve_model('ms://org/tiny', revision='v1.0') == str(tagged)
    with pytest.raises(AssetNotFoundError, match="revision 'v9'"):
        resolve_model('ms://org/tiny', revision='v9')


@pytest.mark.integration
def test_ms_reads_the_pre_1_38_cache_layout(offline_env: Path) -> None:
    # Older modelscope wrote {cache}/hub/models/org/name with '.' in the name spelled '___'.
    legacy = offline_env / 'ms' / 'hub' / 'models' / 'Qwen' / 'Qwen3___5-0___8B'
    legacy.mkdir(parents=True)
    (legacy / 'config.json').write_text('{}')
    assert resolve_model('ms://Qwen/Qwen3.5-0.8B') == str(legacy)


@pytest.mark.integration
def test_missing_ms_repo_names_the_id_hub_and_folder(offline_env: Path) -> None:
    from modelscope_hub.errors import CacheNotFound

    with pytest.raises(AssetNotFoundError) as info:
        resolve_dataset('org/missing')
    message = str(info.value)
    assert "'org/missing'" in message and 'ModelScope' in message
    assert str(offline_env / 'ms' / 'datasets' / 'org--missing') in message
    assert 'modelscope download org/missing --repo-type dataset' in message
    assert 'MODELSCOPE_OFFLINE' in message
    assert isinstance(info.value.__cause__, CacheNotFound)


# ---------------------------------------------------------------------------------------------
# Local paths


def test_local_directory_and_file(offline_env: Path) -> None:
    model = offline_env / 'my-model'
    model.mkdir()
    data = offline_env / 'train.jsonl'
    data.write_text('{"a": 1}\n')

    assert resolve_model(str(model)) == str(model)
    assert resolve_model('./my-model') == str(model)
    assert resolve_dataset('train.jsonl') == str(data)
    assert resolve_dataset(str(model)) == str(model)


def test_a_model_must_be_a_directory(offline_env: Path) -> None:
    (offline_env / 'weights.bin').write_bytes(b'')
    with pytest.raises(ConfigurationError, match='is a file'):
        resolve_model('weights.bin')


def test_missing_local_path_names_where_it_looked(offline_env: Path) -> None:
    with pytest.raises(AssetNotFoundError) as info:
        resolve_dataset('./nowhere/data.jsonl')
    assert str(offline_env / 'nowhere' / 'data.jsonl') in str(info.value)
    assert 'ms://org/name' in str(info.value)


def test_a_revision_on_a_local_path_is_refused(offline_env: Path) -> None:
    (offline_env / 'my-model').mkdir()
    with pytest.raises(ConfigurationError, match='revision'):
        resolve_model('my-model', revision='main')


# ---------------------------------------------------------------------------------------------
# Offline policy: which flag the libraries get


def test_offline_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OFFLINE_VARS:
        monkeypatch.delenv(name)
    assert not is_offline('hf') and not is_offline('ms')
    monkeypatch.setenv('HF_HUB_OFFLINE', 'true')
    assert is_offline('hf') and not is_offline('ms')
    monkeypatch.setenv('MODELSCOPE_OFFLINE', '0')
    assert not is_offline('ms')
    monkeypatch.setenv('TWINKLE_OFFLINE', 'YES')
    assert is_offline('ms')


@pytest.mark.parametrize('hub', ['hf', 'ms'])
def test_online_calls_download_and_offline_keyword_overrides(
    hub: str, offline_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for the library call, to see its arguments without any network.
    calls: list[dict[str, object]] = []

    def fake_snapshot_download(*args: object, **kwargs: object) -> str:
        calls.append(kwargs)
        return str(offline_env / 'downloaded')

    if hub == 'hf':
        import huggingface_hub

        monkeypatch.setattr(huggingface_hub, 'snapshot_download', fake_snapshot_download)
    else:
        module = importlib.import_module('modelscope.hub.snapshot_download')
        monkeypatch.setattr(module, 'snapshot_download', fake_snapshot_download)
    for name in OFFLINE_VARS:
        monkeypatch.delenv(name)

    assert resolve_dataset(f'{hub}://org/data', revision='v1') == str(offline_env / 'downloaded')
    resolve_model(f'{hub}://org/tiny', offline=True)

    expected_cache = offline_env / hub
    assert [c['local_files_only'] for c in calls] == [False, True]
    assert [c['repo_type'] for c in calls] == ['dataset', 'model']
    assert calls[0]['revision'] == 'v1'
    assert Path(str(calls[0]['cache_dir'])) == expected_cache


def test_network_guard_is_active() -> None:
    with pytest.raises(OSError, match='disabled in tests'):
        socket.create_connection(('127.0.0.1', 9), timeout=1)


@pytest.mark.integration
def test_ms_falls_back_to_the_cache_when_the_hub_is_unreachable(
    offline_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Online, modelscope would retry for ~20 s and then fail even with a cached copy; the stand-in
    # fails the online call at once and passes the cache-only call to the real library.
    from modelscope_hub.errors import NetworkError

    module = importlib.import_module('modelscope.hub.snapshot_download')
    real = module.snapshot_download

    def unreachable_online(**kwargs: object) -> str:
        if not kwargs['local_files_only']:
            raise NetworkError('Connection failed')
        return real(**kwargs)

    monkeypatch.setattr(module, 'snapshot_download', unreachable_online)
    for name in OFFLINE_VARS:
        monkeypatch.delenv(name)
    model = make_ms_repo(offline_env / 'ms', 'org/tiny', 'model', {'config.json': '{}'}, 'master')

    assert resolve_model('ms://org/tiny') == str(model)
    with pytest.raises(AssetNotFoundError, match='the download failed') as info:
        resolve_model('ms://org/missing')
    assert isinstance(info.value.__cause__, NetworkError)
