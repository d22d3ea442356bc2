"""The code sandbox: real child processes, each limit hit on purpose and seen in the result.

Wall limits are generous wherever wall time is not the point: the CI machine may be busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import doctest
import os
import socket
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from twinkle.agent import sandbox as sandbox_module
from twinkle.agent.sandbox import Sandbox, SandboxLimits, SandboxResult, namespaces_available, python_tool
from twinkle.agent.tools import ToolBox, ToolCall
from twinkle.errors import ConfigurationError

NO_NAMESPACES = 'unshare cannot make user, network and PID namespaces on this machine'
needs_namespaces = pytest.mark.skipif(not namespaces_available(), reason=NO_NAMESPACES)
# Both modes where they exist; 'rlimits' cannot block the network, so it must be asked to keep it.
MODES = [pytest.param('namespace', marks=needs_namespaces), 'rlimits']


def make(mode: str = 'auto', **limits: object) -> Sandbox:
    limits.setdefault('wall_seconds', 30.0)
    if mode == 'rlimits':
        limits['network'] = True
    return Sandbox(SandboxLimits(**limits), mode=mode)  # type: ignore[arg-type]


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker`` (zombies have an empty one)."""
    found = []
    for entry in Path('/proc').iterdir():
        with contextlib.suppress(OSError):  # a process may exit between listing and reading
            if entry.name.isdigit() and marker.encode() in (entry / 'cmdline').read_bytes():
                found.append(int(entry.name))
    return found


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that accepts connections (the kernel completes the handshake)."""
    with socket.socket() as server:
        server.bind(('127.0.0.1', 0))
        server.listen(8)
        yield server.getsockname()[1]


def test_doctests() -> None:
    result = doctest.testmod(sandbox_module)
    assert result.attempted >= 2 and result.failed == 0


@pytest.mark.parametrize('mode', MODES)
def test_a_normal_program_gives_its_stdout_stdin_and_exit_code(mode: str) -> None:
    result = make(mode).run_python('import sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(3)', '4 5')
    assert (result.stdout, result.stderr, result.exit_code, result.error) == ('9\n', '', 3, None)
    assert (result.mode, result.timed_out, result.truncated) == (mode, False, False)
    assert result.as_tool_output() == '9\n[exit code 3]'


@pytest.mark.parametrize(
    ('code', 'last_line'),
    [('def f(:\n', 'SyntaxError: invalid syntax'), ('raise ValueError("boom")', 'ValueError: boom')],
)
def test_bad_code_is_a_result_with_its_traceback(code: str, last_line: str) -> None:
    result = make().run_python(code)
    assert result.exit_code == 1 and result.error is None and result.stdout == ''
    assert result.stderr.rstrip().splitlines()[-1] == last_line
    assert result.as_tool_output().endswith(f'{last_line}\n[exit code 1]')


def test_an_endless_loop_is_stopped_by_the_cpu_limit() -> None:
    result = make(cpu_seconds=1).run_python('while True:\n    pass')
    # SIGXCPU at the 1 s soft limit; the loop would otherwise run until the 30 s wall limit.
    assert result.exit_code == -24 and result.error == 'CPU time limit of 1s' and not result.timed_out
    assert result.as_tool_output() == '[exit code -24 (CPU time limit of 1s)]'


def test_a_loop_that_ignores_sigxcpu_is_killed_at_the_hard_cpu_limit() -> None:
    code = 'import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass'
    result = make(cpu_seconds=1).run_python(code)
    assert result.exit_code == -9 and result.error == 'CPU time limit of 1s'


@pytest.mark.parametrize('mode', MODES)
def test_wall_time_kills_the_code_and_every_process_it_started(mode: str) -> None:
    marker = uuid.uuid4().hex
    # The child prints once it runs, so the test knows it existed before the kill; ``setsid``
    # puts it outside the process group, which only the PID namespace still catches.
    child = f'import time; print("child up", flush=True); time.sleep(60)  # {marker}'
    setsid = 'True' if mode == 'namespace' else 'False'
    code = (
        'import subprocess, sys, time\n'
        f'subprocess.Popen([sys.executable, "-c", {child!r}], start_new_session={setsid})\n'
        'time.sleep(60)\n'
    )
    result = make(mode, wall_seconds=3).run_python(code)
    assert result.as_tool_output() == 'child up\n[killed (wall time limit of 3s)]'  # output before the kill stays
    assert result.timed_out and result.exit_code is None and result.error == 'wall time limit of 3s'
    assert 3 <= result.wall_s < 20
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_allocating_past_the_memory_limit_fails_and_is_flagged() -> None:
    code = 'block = bytearray(1 << 30)\nprint(len(block))'
    result = make(memory_mb=256).run_python(code)
    assert result.stderr.rstrip().endswith('MemoryError') and result.error == 'memory limit of 256 MB'
    assert result.exit_code == 1 and result.stdout == ''
    # The same gigabyte fits under 2 GiB (bytearray zeroes it lazily), so the limit did it.
    assert make(memory_mb=2048).run_python(code).stdout == f'{1 << 30}\n'


def test_output_past_the_limit_is_cut_flagged_and_never_held_in_full() -> None:
    tracemalloc.start()
    try:
        result = make(output_bytes=1000).run_python('import sys\nsys.stdout.write("x" * 50_000_000)')
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.stdout == 'x' * 1000 and result.truncated and result.error == 'output limit of 1000 bytes'
    assert peak < 2_000_000  # 50 MB of output went through; reads are 64 KiB, and 1000 bytes kept


def test_writing_past_the_file_size_limit_fails() -> None:
    code = 'with open("big.bin", "wb") as f:\n    f.write(b"0" * (10 << 20))'
    result = make(file_bytes=1 << 20).run_python(code)
    assert 'OSError: [Errno 27] File too large' in result.stderr
    assert result.exit_code == 1 and result.error == 'file size limit of 1048576 bytes'


def test_opening_past_the_file_descriptor_limit_fails() -> None:
    result = make(max_files=32).run_python('files = [open("main.py") for _ in range(64)]')
    assert '[Errno 24] Too many open files' in result.stderr and result.error == 'open files limit of 32'


def test_each_run_has_a_fresh_directory_that_is_removed() -> None:
    sandbox = make()
    first = sandbox.run_python('import os\nopen("note.txt", "w").write("hi")\nprint(os.getcwd())')
    second = sandbox.run_python('import os\nprint(os.path.exists("note.txt"), os.listdir("."))')
    assert first.exit_code == 0 and second.stdout == "False ['main.py']\n"
    assert not os.path.exists(first.stdout.strip())


def test_the_parent_environment_is_not_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('TWINKLE_SECRET', 'hunter2')
    result = make().run_python('import os\nprint(sorted(os.environ), os.environ["HOME"] == os.getcwd())')
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR'] True\n"


CONNECT = """import socket, sys
try:
    socket.create_connection(('127.0.0.1', int(sys.stdin.read())), timeout=5).close()
    print('connected')
except OSError as error:
    print(type(error).__name__, error.errno)
"""


@needs_namespaces
def test_namespace_mode_has_no_network(listening_port: int) -> None:
    result = make('namespace').run_python(CONNECT, str(listening_port))
    # A new network namespace has only a loopback that is down: ENETUNREACH (101).
    assert result.stdout == 'OSError 101\n'


def test_rlimits_mode_keeps_the_network_so_the_check_above_can_fail(listening_port: int) -> None:
    assert make('rlimits').run_python(CONNECT, str(listening_port)).stdout == 'connected\n'


@needs_namespaces
def test_namespace_mode_with_network_keeps_it(listening_port: int) -> None:
    result = make('namespace', network=True).run_python(CONNECT, str(listening_port))
    assert result.stdout == 'connected\n'


@needs_namespaces
def test_namespace_code_cannot_raise_its_limits_or_see_the_trainer() -> None:
    code = (
        'import os, resource\n'
        'try:\n'
        '    resource.setrlimit(resource.RLIMIT_CPU, (100, 100))\n'
        'except ValueError:\n'
        '    print("limit held")\n'
        'print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))\n'
    )
    # The launcher is PID 1 of the namespace and the code PID 2; the trainer is not there.
    assert make('namespace').run_python(code).stdout == 'limit held\n[1, 2]\n'


def test_many_concurrent_runs_each_get_their_own_answer() -> None:
    sandbox = make()

    async def run_all() -> list[SandboxResult]:
        runs = [sandbox.run_python_async('print(int(input()) ** 2)', str(i)) for i in range(8)]
        return await asyncio.gather(*runs)

    results = asyncio.run(run_all())
    assert [result.stdout for result in results] == [f'{i * i}\n' for i in range(8)]


def test_a_result_that_was_killed_reads_as_killed() -> None:
    result = SandboxResult('', 'oops\n', None, True, False, 'wall time limit of 1s', 'rlimits', 1.0)
    assert result.as_tool_output() == 'oops\n[killed (wall time limit of 1s)]'


@pytest.mark.parametrize('field', ['cpu_seconds', 'memory_mb', 'wall_seconds', 'output_bytes', 'max_processes'])
def test_limits_must_be_positive(field: str) -> None:
    with pytest.raises(ConfigurationError, match=f'SandboxLimits.{field} must be positive, got 0'):
        SandboxLimits(**{field: 0})  # type: ignore[arg-type]


def test_an_unknown_mode_names_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"Unknown sandbox mode 'docker'. Valid modes are: \['auto'"):
        Sandbox(mode='docker')


def test_rlimits_mode_refuses_to_pretend_it_blocks_the_network() -> None:
    with pytest.raises(ConfigurationError, match="'rlimits' cannot block the network"):
        Sandbox(SandboxLimits(network=False), mode='rlimits')


def test_python_tool_answers_the_model_with_what_the_program_did() -> None:
    # Through a ToolBox, as a rollout calls it: a program's output, and a broken program's error as text.
    box = ToolBox([python_tool(Sandbox(SandboxLimits(wall_seconds=30)))])
    good, bad = asyncio.run(
        box.run([ToolCall('run_python', {'code': 'print(6 * 7)'}), ToolCall('run_python', {'code': 'print(1/0)'})])
    )
    assert (good.content, good.failed) == ('42\n[exit code 0]', False)
    assert not bad.failed and 'ZeroDivisionError: division by zero' in bad.content
    assert bad.content.endswith('[exit code 1]')
