"""The suite's tiers, and the gate that keeps them (a pytest plugin: pyproject's ``addopts`` loads it).

- **quick** (``make test-quick``, ``pytest --quick``): every test marked neither ``integration`` nor ``slow``,
  with every docstring example under ``src/`` (``tests/test_doctests.py``). It starts nothing: in this tier a
  test that starts a process (``subprocess``, ``multiprocessing``, ``os.fork``), listens on a socket (a server),
  or joins a ``torch.distributed`` group fails, with the mark it needs.
- **integration**: a test that starts a server, a process or a cluster.
- **slow**: a test that trains for more than a few seconds.
- ``make test`` runs them all: the quick tier, then ``-m 'integration or slow'`` on two workers (pytest-xdist).

The gate: each run prints its tier's wall time, and the slowest tests that ``tests/durations.json`` does not
hold (the new ones, whose cost no one has looked at yet). ``pytest --write-durations`` writes that file from the
run (every test's setup, call and teardown, in seconds).
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

QUICK = 'not integration and not slow'
BASELINE = Path(__file__).with_name('durations.json')
#: The quick tier's budget on an idle 2-core machine, in seconds (issue 50).
QUICK_BUDGET_S = 180
#: How many new tests the summary names.
NEW_SHOWN = 10


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup('twinkle tiers')
    group.addoption('--quick', action='store_true', help=f'the quick tier ({QUICK!r}), with nothing started')
    group.addoption('--write-durations', action='store_true', help="write every test's seconds to the durations file")
    group.addoption('--durations-file', default=str(BASELINE), help="the known tests' seconds (default: %(default)s)")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STARTED] = time.monotonic()
    if config.getoption('--quick'):
        if config.option.markexpr:
            given = config.option.markexpr
            raise pytest.UsageError(f'--quick selects {QUICK!r} itself; it takes no -m (got {given!r})')
        config.option.markexpr = QUICK
    if os.environ.get('PYTEST_XDIST_WORKER'):
        _one_thread_per_worker()


def _one_thread_per_worker() -> None:
    """On workers (``pytest -n 2``), torch takes one thread in the worker and in the processes its tests
    start (``OMP_NUM_THREADS``, unless set), not the machine's every core each. Two workers already keep two
    cores busy; a torch process with two threads beside another busy one waits on its slower thread at
    every op: the GRPO recipe's 20 steps took 22.8 s on two threads beside a busy-loop process, 15.5 s on
    one (12.1 and 14.4 s alone, 2026-12-03). A test that sets the threads itself keeps its own."""
    threads = int(os.environ.setdefault('OMP_NUM_THREADS', '1'))
    import torch

    torch.set_num_threads(threads)


def pytest_collection_finish(session: pytest.Session) -> None:
    """From here on (the tests, not their modules' imports: a module's skip conditions may probe with a
    process), a quick run starts nothing."""
    if session.config.getoption('--quick'):
        _forbid_starting_anything()


_STARTED = pytest.StashKey[float]()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Spread over workers (``pytest -n 2``, pytest-xdist's ``--dist loadfile``: a module's tests on one
    worker, so its module-scoped servers start once), the modules run longest first by their seconds in
    ``tests/durations.json``: the workers then end near together, where in file order the last long module
    ran alone. Each worker orders alike (the scheduler needs one order); a test's order in its module stays."""
    if not os.environ.get('PYTEST_XDIST_WORKER'):
        return
    known = _known(Path(config.getoption('--durations-file')))
    seconds: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split('::')[0]
        seconds[module] = seconds.get(module, 0.0) + known.get(item.nodeid, 0.0)
    items.sort(key=lambda item: -seconds[item.nodeid.split('::')[0]])


# ---- the quick tier starts nothing ----------------------------------------------------------------
def _guarded(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def guard(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(
            f'this test {what}, in the quick tier: mark it `integration` (it starts a server, a process or a '
            'cluster; `pytestmark = pytest.mark.integration` marks a whole module), or make it start nothing'
        )

    guard.__wrapped__ = original  # type: ignore[attr-defined]
    return guard


def _forbid_starting_anything() -> None:
    """For the rest of this process: every way a test could start a process, a server or a process
    group fails it. (A quick run is a process of its own: nothing is put back.)"""
    subprocess.Popen.__init__ = _guarded(subprocess.Popen.__init__, 'starts a process (subprocess)')  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = _guarded(  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start, 'starts a process (multiprocessing)'
    )
    for name in ('fork', 'forkpty', 'posix_spawn', 'posix_spawnp'):
        if hasattr(os, name):
            setattr(os, name, _guarded(getattr(os, name), f'starts a process (os.{name})'))
    socket.socket.listen = _guarded(socket.socket.listen, 'listens on a socket (a server)')  # type: ignore[method-assign]
    import torch.distributed

    if torch.distributed.is_available():
        torch.distributed.init_process_group = _guarded(
            torch.distributed.init_process_group, 'joins a torch.distributed process group'
        )


# ---- the gate: the tier's time, and the new tests' ------------------------------------------------
#: Each test's seconds in this run: its setup, call and teardown.
_SEEN: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SEEN[report.nodeid] = _SEEN.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not _SEEN:
        return
    wall = time.monotonic() - config.stash[_STARTED]
    marks = config.option.markexpr
    tier = 'quick tier' if config.getoption('--quick') else f'-m {marks!r}' if marks else 'run'
    write = terminalreporter.write_line
    terminalreporter.section('tiers and durations')
    budget = f' (budget {QUICK_BUDGET_S} s)' if config.getoption('--quick') else ''
    write(f'{tier}: {len(_SEEN)} tests in {wall:.0f} s{budget}')
    baseline = Path(config.getoption('--durations-file'))
    known = _known(baseline)
    new = sorted(((s, nodeid) for nodeid, s in _SEEN.items() if nodeid not in known), reverse=True)
    if known and new:
        write(f'{len(new)} tests not in {baseline.name}, {sum(s for s, _ in new):.0f} s in all; the slowest:')
        for seconds, nodeid in new[:NEW_SHOWN]:
            write(f'  {seconds:7.2f} s  {nodeid}')
    if config.getoption('--write-durations'):
        merged = {**known, **{nodeid: round(s, 2) for nodeid, s in _SEEN.items()}}
        baseline.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + '\n')
        write(f'wrote {len(merged)} durations to {baseline}')


def _known(baseline: Path) -> dict[str, float]:
    if not baseline.exists():
        return {}
    loaded: dict[str, float] = json.loads(baseline.read_text())
    return loaded
