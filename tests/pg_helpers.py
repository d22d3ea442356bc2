"""A real PostgreSQL server for the tests: Debian's ``postgresql`` package, a cluster made with ``initdb`` in a
temporary directory, listening on a free loopback port, stopped and removed at the end (``make postgres``
installs the package where it is missing, as root; CI does).

PostgreSQL refuses to run as root: as root the cluster belongs to the ``postgres`` user the package made, and
its commands run as that user (``runuser``). Each test gets a database of its own (``fresh_database``).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_names = itertools.count()


def binaries() -> Path | None:
    """The folder of ``initdb``, ``pg_ctl`` and ``postgres``, or None when PostgreSQL is not installed."""
    found = shutil.which('initdb')
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob('/usr/lib/postgresql/*/bin/initdb'), key=lambda p: int(p.split('/')[4]))
    return Path(versions[-1]).parent if versions else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


class PostgresServer:
    """A cluster of its own: ``url(name)`` of a database in it; ``create``/``drop`` databases."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix='twinkle-pg-'))
        self.data = self.root / 'data'
        self.port = free_port()
        self.as_root = os.geteuid() == 0

    def _run(self, *command: str) -> subprocess.CompletedProcess[str]:
        prefix = ['runuser', '-u', 'postgres', '--'] if self.as_root else []
        return subprocess.run([*prefix, *command], capture_output=True, text=True, check=True, timeout=120)

    def start(self) -> None:
        if self.as_root:
            shutil.chown(self.root, 'postgres', 'postgres')
        self._run(str(self.bin_dir / 'initdb'), '-D', str(self.data), '--auth=trust', '-U', 'postgres', '-E', 'UTF8')
        options = f'-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1 -c max_connections=200'
        self._run(
            str(self.bin_dir / 'pg_ctl'),
            '-D',
            str(self.data),
            '-o',
            options,
            '-l',
            str(self.root / 'log'),
            '-w',
            'start',
        )

    def url(self, database: str = 'postgres') -> str:
        return f'postgresql://postgres@127.0.0.1:{self.port}/{database}'

    def create(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f'twinkle_test_{os.getpid()}_{next(_names)}'
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE {name}')
        return self.url(name)

    def drop(self, url: str) -> None:
        import psycopg

        name = url.rsplit('/', 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS {name} WITH (FORCE)')

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # not running
            self._run(str(self.bin_dir / 'pg_ctl'), '-D', str(self.data), '-m', 'immediate', '-w', 'stop')
        shutil.rmtree(self.root, ignore_errors=True)

    def pause(self) -> None:
        """Stop the server (fast: connections are cut, as a crash or a network loss would)."""
        self._run(str(self.bin_dir / 'pg_ctl'), '-D', str(self.data), '-m', 'fast', '-w', 'stop')

    def resume(self) -> None:
        """Start it again on the same port, with its data."""
        options = f'-k {self.root} -p {self.port} -c listen_addresses=127.0.0.1 -c max_connections=200'
        log = str(self.root / 'log')
        self._run(str(self.bin_dir / 'pg_ctl'), '-D', str(self.data), '-o', options, '-l', log, '-w', 'start')

    def log_tail(self, lines: int = 30) -> str:
        log = self.root / 'log'
        return '\n'.join(log.read_text(errors='replace').splitlines()[-lines:]) if log.exists() else ''


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A started cluster, stopped (``-m immediate``) and removed when the block ends."""
    bin_dir = binaries()
    if bin_dir is None:
        raise FileNotFoundError('PostgreSQL is not installed (initdb not found): run `make postgres` as root')
    server = PostgresServer(bin_dir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextmanager
def fresh_database(server: PostgresServer) -> Iterator[str]:
    """The URL of a new database in ``server``, dropped when the block ends."""
    url = server.create()
    try:
        yield url
    finally:
        server.drop(url)
