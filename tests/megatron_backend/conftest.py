"""Shared set-up of the Megatron tests (``make test-megatron``, in .venv-megatron): torchrun launches.

Each test module starts with ``pytest.importorskip('megatron.core')``, so the main suite skips them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope='session')
def torchrun() -> Callable[..., str]:
    """``torchrun(script, nproc, *args)``: run ``script`` under ``torch.distributed.run`` (gloo, one thread per
    rank); fails the test with the output's tail if a rank fails. Returns the output."""

    def run(script: Path, nproc: int, *args: object, timeout_s: float = 500) -> str:
        command = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}']
        command += [f'--master_port={free_port()}', str(script), *map(str, args)]
        env = {**os.environ, 'OMP_NUM_THREADS': '1'}
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s)
        output = done.stdout.decode(errors='replace')
        assert done.returncode == 0, output[-6000:]
        return output

    return run
