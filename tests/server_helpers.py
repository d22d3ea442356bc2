"""What the server tests share: a free loopback port, and waiting for a server process to answer."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
from twinkle.server.store import Store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def token_rows(seed: int, lengths: list[int]) -> list[dict[str, list[int]]]:
    """Rows of random token ids below 4,000 (every embedded model's vocabulary holds them), one per length,
    trained on all but their first token; the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        ids = torch.randint(0, 4000, (length,), generator=gen).tolist()
        rows.append({'input_ids': ids, 'labels': [-100, *ids[1:]]})
    return rows


def here_and_under_torchrun(script: Path, main: Any, one: Path, two: Path, timeout_s: float = 400) -> list[dict]:
    """Run ``script`` under torchrun (2 ranks, gloo, 1 thread each) writing to ``two`` while
    ``main(one)``, the same script, runs in this process; both results.json, one process's first."""
    import json
    import os

    command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2']
    command += [f'--master_port={free_port()}', str(script), str(two)]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'HF_DATASETS_DISABLE_PROGRESS_BARS': '1'}
    torchrun = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        main(one)
        output, _ = torchrun.communicate(timeout=timeout_s)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
    assert torchrun.returncode == 0, output.decode()[-4000:]
    return [json.loads((folder / 'results.json').read_text()) for folder in (one, two)]


def wait_until_healthy(process: subprocess.Popen, port: int, timeout_s: float = 60.0) -> None:
    """Return once ``/healthz`` answers 200; fail with the process's stderr if it died first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f'http://127.0.0.1:{port}/healthz', timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
        if process.poll() is not None:
            raise AssertionError(process.stderr.read().decode()[-3000:])
    process.kill()
    raise AssertionError(f'the server did not come up in {timeout_s:.0f} s')


def server_command(model_dir: str, data_dir: Path, port: int, *args: str) -> list[str]:
    return [
        sys.executable, '-m', 'twinkle.server.cli', '--base-model', model_dir, '--port', str(port),
        '--data-dir', str(data_dir), *args,
    ]  # fmt: skip


def start_server(model_dir: str, data_dir: Path, port: int) -> subprocess.Popen:
    """``twinkle-server serve`` in a process of its own, once it answers."""
    process = subprocess.Popen(
        server_command(model_dir, data_dir, port, 'serve'), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    wait_until_healthy(process, port)
    return process


def add_key(model_dir: str, data_dir: Path, tenant: str) -> str:
    command = server_command(model_dir, data_dir, 0, 'keys', 'add', tenant)
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


@contextmanager
def background_server(
    data_dir: Path, model_dir: str, tenants: tuple[str, ...] = ('alice', 'bob'), **options: Any
) -> Iterator[tuple[str, dict[str, str], BackgroundServer]]:
    """A server on a thread of this process (CPU, a free port) with a key per tenant:
    ``(url, {tenant: key}, server)``; ``options`` are more ``ServerConfig`` fields."""
    config = ServerConfig.build(base_model=model_dir, port=0, data_dir=str(data_dir), device='cpu', **options)
    with Store(config.store_location) as store:
        keys = {name: store.tenants.add(name)[1] for name in tenants}
    background = BackgroundServer(config)
    with background as url:
        yield url, keys, background


class Gate:
    """A job that holds the worker until ``open``; requests submitted meanwhile wait together."""

    def __init__(self, scheduler: Any, wait_s: float = 120):
        self.entered, self.opened, self.wait_s = threading.Event(), threading.Event(), wait_s
        scheduler.submit('gatekeeper', self._hold)
        assert self.entered.wait(wait_s)

    def _hold(self) -> None:
        self.entered.set()
        self.opened.wait(self.wait_s)

    def open(self) -> None:
        self.opened.set()
