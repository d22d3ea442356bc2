"""What the server tests share: a free loopback port, and waiting for a server process to answer."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


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
