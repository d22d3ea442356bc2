"""The quick tier's guard (tests/tiers.py): a test that starts a process or listens on a socket fails in
``--quick``, naming the mark it needs; marked ``integration`` it is not in the tier; outside it, it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # it runs pytest in a process of its own

TESTS = Path(__file__).resolve().parent
SAMPLE = """
import socket
import subprocess
import sys

import pytest


def test_pure():
    assert 1 + 1 == 2


def test_starts_a_process():
    subprocess.run([sys.executable, '-c', 'pass'], check=True)


def test_listens():
    with socket.socket() as server:
        server.bind(('127.0.0.1', 0))
        server.listen()


@pytest.mark.integration
def test_marked():
    subprocess.run([sys.executable, '-c', 'pass'], check=True)
"""


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (folder / 'test_sample.py').write_text(SAMPLE)
    (folder / 'pytest.ini').write_text('[pytest]\nmarkers =\n    integration: x\n    slow: y\n')
    env = {**os.environ, 'PYTHONPATH': str(TESTS)}
    command = [sys.executable, '-m', 'pytest', '-p', 'tiers', '-p', 'no:cacheprovider', '-rf', *args, str(folder)]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_the_quick_tier_fails_a_test_that_starts_something(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, '--quick')
    assert '2 failed, 1 passed, 1 deselected' in result.stdout, result.stdout
    assert 'starts a process (subprocess), in the quick tier: mark it `integration`' in result.stdout
    assert 'listens on a socket (a server), in the quick tier' in result.stdout
    assert 'quick tier: 3 tests in' in result.stdout  # the gate's line


def test_outside_the_quick_tier_the_same_tests_run(tmp_path: Path) -> None:
    result = run_pytest(tmp_path)
    assert '4 passed' in result.stdout, result.stdout


def test_quick_takes_no_other_marks(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, '--quick', '-m', 'slow')
    assert result.returncode != 0 and '--quick selects' in result.stderr, result.stderr


def test_the_gate_names_the_tests_its_durations_file_does_not_hold(tmp_path: Path) -> None:
    known = tmp_path / 'known.json'
    known.write_text('{"test_sample.py::test_pure": 0.01}')
    result = run_pytest(tmp_path, '--durations-file', str(known))
    assert '3 tests not in known.json' in result.stdout, result.stdout
    listed = result.stdout.split('3 tests not in known.json', 1)[1]
    assert 'test_sample.py::test_marked' in listed and 'test_sample.py::test_pure' not in listed
    result = run_pytest(tmp_path, '--durations-file', str(known), '--write-durations')
    assert 'wrote 4 durations' in result.stdout
    result = run_pytest(tmp_path, '--durations-file', str(known))
    assert 'not in known.json' not in result.stdout, result.stdout
