"""Shared test set-up: everything offline, assets built once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pg_helpers
import pytest
from pg_helpers import PostgresServer
from sdk_clients import ServiceClients, open_sdk_sessions

# Set before anything imports huggingface_hub / datasets, which read these once.
for _name in ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE', 'TRANSFORMERS_OFFLINE', 'TWINKLE_OFFLINE', 'MODELSCOPE_OFFLINE'):
    os.environ[_name] = '1'
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
# W&B runs stay offline files (its sink's default too), with no console chatter.
os.environ['WANDB_MODE'] = 'offline'
os.environ.setdefault('WANDB_SILENT', 'true')
# One asset cache for the whole run (CI sets TWINKLE_HOME to reuse it across runs).
os.environ.setdefault('TWINKLE_HOME', str(Path(__file__).resolve().parent.parent / '.twinkle_home'))
# Arrow caches of the datasets the tests load stay beside the assets, not in the user's cache.
os.environ.setdefault('HF_DATASETS_CACHE', str(Path(os.environ['TWINKLE_HOME']) / 'hf-datasets'))


@pytest.fixture(scope='session')
def tiny_model_dir() -> str:
    from twinkle import assets

    return assets.tiny_model()


@pytest.fixture(scope='session')
def self_cognition_path() -> str:
    from twinkle import assets

    return assets.dataset('self-cognition')


@pytest.fixture
def sdk_clients() -> Iterator[ServiceClients]:
    """``sdk_clients(url, key)``: a ``tinker.ServiceClient`` closed when the test ends. Request it
    after the server's fixture, so that the clients close before the server stops."""
    with ServiceClients() as clients:
        yield clients


@pytest.fixture(scope='module')
def module_sdk_clients() -> Iterator[ServiceClients]:
    """``sdk_clients`` for module-scoped fixtures: the clients close when the module ends."""
    with ServiceClients() as clients:
        yield clients


@pytest.fixture(scope='module', autouse=True)
def no_sdk_session_outlives_its_module() -> Iterator[None]:
    """Fail the module's last test when a Tinker SDK session it opened still beats: its server is
    gone, and the heartbeat would log failures until the process ends (see sdk_clients.py)."""
    before = set(open_sdk_sessions())
    yield
    left = sorted(set(open_sdk_sessions()) - before)
    assert not left, f'Tinker SDK sessions left open (close their ServiceClient, or make it with sdk_clients): {left}'


@pytest.fixture(scope='session')
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the session's own (Debian's package, ``tests/pg_helpers.py``). Skipped where
    PostgreSQL is not installed, except in CI (``CI`` set), which installs it (``make postgres``)."""
    if pg_helpers.binaries() is None:
        if os.environ.get('CI'):
            pytest.fail('PostgreSQL is not installed: CI installs it with `make postgres` (as root)')
        pytest.skip('PostgreSQL is not installed: `make postgres` installs it with apt-get as root')
    with pg_helpers.postgres_server() as server:
        yield server


@pytest.fixture
def postgres_url(postgres: PostgresServer) -> Iterator[str]:
    """A new, empty PostgreSQL database for one test, dropped after it."""
    with pg_helpers.fresh_database(postgres) as url:
        yield url
