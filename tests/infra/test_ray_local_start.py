"""A Ray instance twinkle starts itself (no cluster running, no ``RAY_ADDRESS``) runs its workers
at the driver's priority: Ray's default niceness of 15 would starve the training actors on a host
busy with other work."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import os, ray
    from twinkle.infra.ray.cluster import start_local

    start_local()  # what connect() does when no cluster is running and RAY_ADDRESS is not set

    @ray.remote
    class Probe:
        def niceness(self) -> int:
            return os.nice(0)

    print('niceness', ray.get(Probe.remote().niceness.remote()), 'driver', os.nice(0))
    ray.shutdown()
    """
)


def test_workers_of_a_local_ray_run_at_the_drivers_priority():
    # A Ray directory of its own, beside any other instance on this machine.
    ray_dir = tempfile.mkdtemp(prefix='ray', dir='/tmp')  # short: Ray's socket paths must fit 107 bytes
    env = {**{k: v for k, v in os.environ.items() if k != 'RAY_ADDRESS'}, 'RAY_TMPDIR': ray_dir}
    try:
        done = subprocess.run([sys.executable, '-c', SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith('niceness'))
    _, worker, _, driver = line.split()
    assert worker == driver, line  # Ray's default: the driver's niceness + 15
