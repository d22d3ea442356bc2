"""The code sandbox: real child processes, each limit hit on purpose and seen in the result.

Wall limits are generous wherever wall time is not the point: the CI machine may be busy. The
isolation matrix at the end runs a trainer in a child process (as root, and dropped to uid 65534)
and measures what the code can reach in each mode: the rows of docs/agents.md's table.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from twinkle.agent import sandbox as sandbox_module
from twinkle.agent.sandbox import RUN_UIDS, Sandbox, SandboxLimits, SandboxResult, namespaces_available, python_tool
from twinkle.agent.tools import ToolBox, ToolCall
from twinkle.errors import ConfigurationError

NO_NAMESPACES = 'unshare cannot make the user, mount, network and PID namespaces and the new root here'
needs_namespaces = pytest.mark.skipif(not namespaces_available(), reason=NO_NAMESPACES)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason='the tests run as a non-root user')
# Both modes where they exist; 'rlimits' cannot block the network, so it must be asked to keep it.
MODES = [pytest.param('namespace', marks=needs_namespaces), 'rlimits']


@functools.cache
def rlimits_python() -> str | None:
    """The interpreter rlimits mode can run: as root the code's own uid must be able to run it,
    which the trainer's (under /root here) may not be."""
    for python in (sys.executable, '/usr/bin/python3'):
        with contextlib.suppress(ConfigurationError):
            Sandbox(SandboxLimits(network=True), mode='rlimits', python=python)
            return python
    return None


def make(mode: str = 'auto', **limits: object) -> Sandbox:
    limits.setdefault('wall_seconds', 30.0)
    python = None
    if mode == 'rlimits':
        limits['network'] = True
        python = rlimits_python()
        if python is None:
            pytest.skip("no interpreter here that rlimits mode's own uid may run")
    return Sandbox(SandboxLimits(**limits), mode=mode, python=python)  # type: ignore[arg-type]


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


@pytest.mark.integration
@pytest.mark.parametrize('mode', MODES)
def test_a_normal_program_gives_its_stdout_stdin_and_exit_code(mode: str) -> None:
    result = make(mode).run_python('import sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(3)', '4 5')
    assert (result.stdout, result.stderr, result.exit_code, result.error) == ('9\n', '', 3, None)
    assert (result.mode, result.timed_out, result.truncated) == (mode, False, False)
    assert result.as_tool_output() == '9\n[exit code 3]'


@pytest.mark.integration
@pytest.mark.parametrize(
    ('code', 'last_line'),
    [('def f(:\n', 'SyntaxError: invalid syntax'), ('raise ValueError("boom")', 'ValueError: boom')],
)
def test_bad_code_is_a_result_with_its_traceback(code: str, last_line: str) -> None:
    result = make().run_python(code)
    assert result.exit_code == 1 and result.error is None and result.stdout == ''
    assert result.stderr.rstrip().splitlines()[-1] == last_line
    assert result.as_tool_output().endswith(f'{last_line}\n[exit code 1]')


@pytest.mark.integration
def test_an_endless_loop_is_stopped_by_the_cpu_limit() -> None:
    result = make(cpu_seconds=1).run_python('while True:\n    pass')
    # SIGXCPU at the 1 s soft limit; the loop would otherwise run until the 30 s wall limit.
    assert result.exit_code == -24 and result.error == 'CPU time limit of 1s' and not result.timed_out
    assert result.as_tool_output() == '[exit code -24 (CPU time limit of 1s)]'


@pytest.mark.integration
def test_a_loop_that_ignores_sigxcpu_is_killed_at_the_hard_cpu_limit() -> None:
    code = 'import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass'
    result = make(cpu_seconds=1).run_python(code)
    assert result.exit_code == -9 and result.error == 'CPU time limit of 1s'


@pytest.mark.integration
@pytest.mark.parametrize('mode', MODES)
def test_wall_time_kills_the_code_and_every_process_it_started(mode: str) -> None:
    marker = uuid.uuid4().hex
    # The child prints once it runs, so the test knows it existed before the kill; ``setsid``
    # puts it outside the process group, which the PID namespace still catches, and so does
    # rlimits mode as root (every process of the run's own uid is killed); as another user it escapes.
    child = f'import time; print("child up", flush=True); time.sleep(60)  # {marker}'
    setsid = str(mode == 'namespace' or os.geteuid() == 0)
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


@pytest.mark.integration
@pytest.mark.parametrize('mode', MODES)
def test_a_process_the_code_leaves_behind_dies_with_the_run(mode: str) -> None:
    if mode == 'rlimits' and os.geteuid() != 0:
        pytest.skip('rlimits mode as a non-root user: a child that calls setsid outlives the run (docs/agents.md)')
    marker = uuid.uuid4().hex
    # The code ends at once; its child left the process group: the PID namespace's end kills it,
    # and in rlimits mode as root the launcher's kill(-1) as the run's own uid.
    child = f'import time; time.sleep(60)  # {marker}'
    code = f'import subprocess, sys\nsubprocess.Popen([sys.executable, "-c", {child!r}], start_new_session=True)'
    assert make(mode).run_python(code).exit_code == 0
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []


@pytest.mark.integration
def test_allocating_past_the_memory_limit_fails_and_is_flagged() -> None:
    code = 'block = bytearray(1 << 30)\nprint(len(block))'
    result = make(memory_mb=256).run_python(code)
    assert result.stderr.rstrip().endswith('MemoryError') and result.error == 'memory limit of 256 MB'
    assert result.exit_code == 1 and result.stdout == ''
    # The same gigabyte fits under 2 GiB (bytearray zeroes it lazily), so the limit did it.
    assert make(memory_mb=2048).run_python(code).stdout == f'{1 << 30}\n'


@pytest.mark.integration
def test_output_past_the_limit_is_cut_flagged_and_never_held_in_full() -> None:
    tracemalloc.start()
    try:
        result = make(output_bytes=1000).run_python('import sys\nsys.stdout.write("x" * 50_000_000)')
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.stdout == 'x' * 1000 and result.truncated and result.error == 'output limit of 1000 bytes'
    assert peak < 2_000_000  # 50 MB of output went through; reads are 64 KiB, and 1000 bytes kept


@pytest.mark.integration
def test_writing_past_the_file_size_limit_fails() -> None:
    code = 'with open("big.bin", "wb") as f:\n    f.write(b"0" * (10 << 20))'
    result = make(file_bytes=1 << 20).run_python(code)
    assert 'OSError: [Errno 27] File too large' in result.stderr
    assert result.exit_code == 1 and result.error == 'file size limit of 1048576 bytes'


@pytest.mark.integration
def test_opening_past_the_file_descriptor_limit_fails() -> None:
    result = make(max_files=32).run_python('files = [open("main.py") for _ in range(64)]')
    assert '[Errno 24] Too many open files' in result.stderr and result.error == 'open files limit of 32'


@pytest.mark.integration
def test_each_run_has_a_fresh_directory_that_is_removed() -> None:
    sandbox = make()
    first = sandbox.run_python('import os\nopen("note.txt", "w").write("hi")\nprint(os.getcwd())')
    second = sandbox.run_python('import os\nprint(os.path.exists("note.txt"), os.listdir("."))')
    assert first.exit_code == 0 and second.stdout == "False ['main.py']\n"
    assert not os.path.exists(first.stdout.strip())


@pytest.mark.integration
@pytest.mark.parametrize('mode', MODES)
def test_the_parent_environment_is_not_visible(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('TWINKLE_SECRET', 'hunter2')
    monkeypatch.setenv('PATH', '/twinkle-trainer-only:' + os.environ['PATH'])
    sandbox = make(mode)
    result = sandbox.run_python('import os\nprint(dict(os.environ))')
    # Exactly four variables, none of them the trainer's: PATH starts at the interpreter's directory.
    workdir = result.stdout.split("'HOME': '")[1].split("'")[0]
    python_dir = os.path.dirname(sandbox.interpreter.path)
    path = f'{python_dir}:/usr/local/bin:/usr/bin:/bin'
    assert result.stdout == f"{{'PATH': '{path}', 'LANG': 'C.UTF-8', 'HOME': '{workdir}', 'TMPDIR': '{workdir}'}}\n"
    assert workdir.startswith('/') and workdir.endswith('/work')


CONNECT = """import socket, sys
try:
    socket.create_connection(('127.0.0.1', int(sys.stdin.read())), timeout=5).close()
    print('connected')
except OSError as error:
    print(type(error).__name__, error.errno)
"""


@pytest.mark.integration
@needs_namespaces
def test_namespace_mode_has_no_network(listening_port: int) -> None:
    result = make('namespace').run_python(CONNECT, str(listening_port))
    # A new network namespace has only a loopback that is down: ENETUNREACH (101).
    assert result.stdout == 'OSError 101\n'


@pytest.mark.integration
def test_rlimits_mode_keeps_the_network_so_the_check_above_can_fail(listening_port: int) -> None:
    assert make('rlimits').run_python(CONNECT, str(listening_port)).stdout == 'connected\n'


@pytest.mark.integration
@needs_namespaces
def test_namespace_mode_with_network_keeps_it(listening_port: int) -> None:
    result = make('namespace', network=True).run_python(CONNECT, str(listening_port))
    assert result.stdout == 'connected\n'


@pytest.mark.integration
@pytest.mark.parametrize('mode', MODES)
def test_the_code_cannot_raise_its_limits(mode: str) -> None:
    # As root the old rlimits mode's code could: now it is a uid of its own (or the trainer's
    # non-root user), or holds no capability in its user namespace.
    code = 'import resource\ntry:\n    resource.setrlimit(resource.RLIMIT_CPU, (100, 100))\n'
    code += 'except ValueError:\n    print("held")'
    assert make(mode, cpu_seconds=2).run_python(code).stdout == 'held\n'


def test_an_interpreter_installed_in_root_would_show_everything() -> None:
    with pytest.raises(ConfigurationError, match='/python3 is installed in /: namespace mode would show the whole'):
        sandbox_module._read_only_paths(sandbox_module._Interpreter('/python3', ('/',)), network=False)


@pytest.mark.integration
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


@pytest.mark.integration
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


def test_auto_refuses_rather_than_fall_back_to_rlimits(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where namespaces fail, 'auto' used to warn and run with rlimits only (the network and the
    # host's sockets and files in reach): now it says so and names the opt-in.
    monkeypatch.setattr(sandbox_module, '_namespace_problem', lambda interpreter, network: 'no unshare here')
    refusal = r"needs namespace mode, which does not work here: no unshare here\. mode='rlimits' \(with network=True\)"
    with pytest.raises(ConfigurationError, match=refusal):
        Sandbox()
    with pytest.raises(ConfigurationError, match="Sandbox mode 'namespace' needs namespace mode"):
        Sandbox(mode='namespace')


@pytest.mark.integration
@needs_root
def test_rlimits_mode_as_root_refuses_an_interpreter_its_uid_cannot_run(tmp_path: Path) -> None:
    hidden = tmp_path / 'private'  # 0700 of root: the run's own uid cannot pass through it
    hidden.mkdir(mode=0o700)
    (hidden / 'python3').symlink_to(sandbox_module._interpreter(sys.executable).path)
    with pytest.raises(ConfigurationError, match=f'its own \\(such as {RUN_UIDS.start}\\), which cannot run'):
        Sandbox(SandboxLimits(network=True), mode='rlimits', python=str(hidden / 'python3'))


@needs_root
def test_uid_leases_are_exclusive_and_know_a_run_whose_trainer_died(tmp_path: Path) -> None:
    locks = tmp_path / 'locks'
    with sandbox_module._UidLease(locks) as first, sandbox_module._UidLease(locks) as second:
        assert (first.uid, second.uid) == (RUN_UIDS[0], RUN_UIDS[1])  # the first free one each: 0 is held
        first.done()  # its run ended and killed its processes; the second's did not
    with sandbox_module._UidLease(locks) as again, sandbox_module._UidLease(locks) as after_second:
        assert (again.uid, again.left_over) == (RUN_UIDS[0], False)
        assert (after_second.uid, after_second.left_over) == (RUN_UIDS[1], True)


@needs_root
def test_the_uid_lock_directory_must_be_roots_alone(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    with pytest.raises(ConfigurationError, match='must be a directory of root with mode 0700, got 40755'):
        sandbox_module._UidLease(tmp_path).__enter__()


@pytest.mark.integration
def test_python_tool_answers_the_model_with_what_the_program_did() -> None:
    # Through a ToolBox, as a rollout calls it: a program's output, and a broken program's error as text.
    box = ToolBox([python_tool(Sandbox(SandboxLimits(wall_seconds=30)))])
    good, bad = asyncio.run(
        box.run([ToolCall('run_python', {'code': 'print(6 * 7)'}), ToolCall('run_python', {'code': 'print(1/0)'})])
    )
    assert (good.content, good.failed) == ('42\n[exit code 0]', False)
    assert not bad.failed and 'ZeroDivisionError: division by zero' in bad.content
    assert bad.content.endswith('[exit code 1]')


# The isolation matrix. A trainer (TRAINER, in a child process so that its secret is in its
# /proc/<pid>/environ as a real one is: a variable set after exec is not there) holds what the
# code should not reach: a secret in its environment, a Unix socket on a path (0777, as
# PostgreSQL's /var/run/postgresql/.s.PGSQL.5432) and an abstract one, a data directory made as
# twinkle.server.service makes data_dir (``private_folder``: 0700, its file 0644 inside), and a
# concurrent run's working directory. PROBE, run in the sandbox, tries each; the trainer reports
# 'reachable' or 'blocked' per row, and the error it met.

PROBE = """import errno, json, os, socket, sys
task = json.loads(sys.stdin.read())

def attempt(action):
    try:
        return action()
    except OSError as error:
        return f'{type(error).__name__} {errno.errorcode.get(error.errno)}'

def connect(address):
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(address)
    return 'reachable'

def create(path):
    open(path, 'x').close()
    return 'reachable'

pids = dict.fromkeys([task['trainer_pid'], os.getppid(), 1])
print(json.dumps({
    'environment': dict(os.environ),
    'cwd': os.getcwd(),
    'unix_path': attempt(lambda: connect(task['unix_path'])),
    'unix_abstract': attempt(lambda: connect(task['unix_abstract'])),
    'environ_files': [attempt(lambda pid=pid: open(f'/proc/{pid}/environ').read()) for pid in pids],
    'data_read': attempt(lambda: open(task['data_file']).read()),
    'data_write': attempt(lambda: create(task['data_dir'] + '/planted')),
    'system_write': attempt(lambda: create(task['system_file'])),
    'root_write': attempt(lambda: create(task['root_file'])),
    'proc_sys_write': attempt(lambda: open('/proc/sys/kernel/hostname', 'r+').close() or 'reachable'),
    'capabilities': open('/proc/self/status').read().split('CapEff:')[1].split()[0],
}))
"""

TRAINER = """import ctypes, glob, json, os, socket, sys, tempfile, threading, time, uuid
from twinkle.agent.sandbox import Sandbox, SandboxLimits
from twinkle.errors import ConfigurationError

user, probe, configs = sys.argv[1], sys.argv[2], sys.argv[3:]
if user == 'unprivileged' and os.geteuid() == 0:
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, which the uid change cleared
secret = os.environ['TWINKLE_TEST_SECRET']

def sandbox(config):
    limits = SandboxLimits(wall_seconds=30, network=config != 'namespace')
    problems = []
    for python in (sys.executable, '/usr/bin/python3'):  # the first that this user's code may run
        try:
            return Sandbox(limits, mode=config.split('+')[0], python=python), None
        except ConfigurationError as error:
            problems.append(str(error))
    return None, problems

def verdict(answer, wanted='reachable'):
    return 'reachable' if answer == wanted else f'blocked ({answer})'

def secret_verdict(texts):
    if any(secret in text for text in texts):
        return 'reachable'
    return 'blocked (' + ', '.join(text if text.isidentifier() else 'read, no secret' for text in texts) + ')'

def concurrent_read(box):
    # Run A writes a note and waits; run B, started once the note is on disk, tries to read it.
    name = f'note-{uuid.uuid4().hex}'
    wait = f"open({name!r}, 'w').write('from A')\\nimport os, time\\n"
    wait += "for _ in range(2000):\\n    if os.path.exists('done'): break\\n    time.sleep(0.01)"
    first = threading.Thread(target=box.run_python, args=(wait,))
    first.start()
    pattern = os.path.join(tempfile.gettempdir(), 'twinkle-sandbox-*', '**', name)
    for _ in range(2000):
        if glob.glob(pattern, recursive=True):
            break
        time.sleep(0.01)
    note = glob.glob(pattern, recursive=True)[0]
    read = 'try:\\n    print(open(input()).read())\\nexcept OSError as error:\\n    print(type(error).__name__)'
    answer = box.run_python(read, note).stdout.strip()
    open(os.path.join(os.path.dirname(note), 'done'), 'w').close()
    first.join()
    return verdict(answer, 'from A')

def measure(config, task):
    box, problems = sandbox(config)
    if box is None:
        return {'skip': problems}
    system_file = os.path.join(box.interpreter.prefixes[0], f'twinkle-probe-{uuid.uuid4().hex}')
    root_file = f'/twinkle-probe-{uuid.uuid4().hex}'
    result = box.run_python(probe, json.dumps({**task, 'system_file': system_file, 'root_file': root_file}))
    for path in (system_file, root_file, os.path.join(task['data_dir'], 'planted')):
        if os.path.exists(path):
            os.remove(path)
    seen = json.loads(result.stdout or 'null') or {'failed': result.stderr}
    rows = ('unix_path', 'unix_abstract', 'data_write', 'system_write', 'root_write', 'proc_sys_write')
    return {
        **seen,
        **{row: verdict(seen[row]) for row in rows},
        'python': box.interpreter.path,
        'secret': secret_verdict(seen['environ_files']),
        'data_read': verdict(seen['data_read'], secret),
        'other_run': concurrent_read(box),
    }

base = tempfile.mkdtemp()
os.chmod(base, 0o755)  # as /var/lib or /var/run: anyone may pass through
data_dir = os.path.join(base, 'data')
os.makedirs(data_dir, mode=0o700, exist_ok=True)  # what twinkle.server.service.private_folder does with data_dir
os.chmod(data_dir, 0o700)
with open(os.path.join(data_dir, 'twinkle.db'), 'w') as db:
    db.write(secret)
listeners = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
unix_path, unix_abstract = os.path.join(base, '.s.PGSQL.5432'), '\\0twinkle-test-' + uuid.uuid4().hex
listeners[0].bind(unix_path)
os.chmod(unix_path, 0o777)
listeners[1].bind(unix_abstract)
for listener in listeners:
    listener.listen(8)
task = {
    'trainer_pid': os.getpid(), 'unix_path': unix_path, 'unix_abstract': unix_abstract,
    'data_dir': data_dir, 'data_file': os.path.join(data_dir, 'twinkle.db'),
}
print(json.dumps({config: measure(config, task) for config in configs}))
"""

# What the code reaches in each cell ('reachable'; the rest of ROWS is 'blocked (the error)'),
# as docs/agents.md's table says. Why: namespace mode's code sees a new root, so no host path
# (socket, data, another run's directory) exists for it, and its network namespace holds none of
# the host's abstract sockets. rlimits mode as root runs the code as a uid of its own, which the
# trainer's 0400 environ, the other run's 0700 directory and the 0700 data directory refuse, but
# not a 0777 socket or an abstract one (no permissions at all); as another user the code is the
# trainer's user.
REACHES: dict[tuple[str, str], set[str]] = {
    ('namespace', 'root'): set(),
    ('namespace', 'unprivileged'): set(),
    ('namespace+network', 'root'): {'unix_abstract'},  # the host's network namespace, and so its abstract sockets
    ('rlimits', 'root'): {'unix_path', 'unix_abstract'},
    ('rlimits', 'unprivileged'): {'unix_path', 'unix_abstract', 'data_read', 'data_write', 'secret', 'other_run'},
}
ROWS = (
    'unix_path',
    'unix_abstract',
    'secret',
    'other_run',
    'data_read',
    'data_write',
    'system_write',
    'root_write',
    'proc_sys_write',
)
CELLS = [
    pytest.param(config, user, marks=needs_namespaces if config.startswith('namespace') else (), id=f'{config}-{user}')
    for config, user in REACHES
]


@functools.cache
def trainer_run(user: str) -> dict[str, dict[str, object]]:
    """What PROBE reached from one trainer of ``user``, for each config of REACHES (one child)."""
    if user == 'root' and os.geteuid() != 0:
        pytest.skip('the tests run as a non-root user, so no trainer here is root')
    configs = [config for config, cell_user in REACHES if cell_user == user]
    env = {'PATH': os.environ['PATH'], 'TWINKLE_TEST_SECRET': uuid.uuid4().hex}
    if 'PYTHONPATH' in os.environ:  # the child imports the twinkle under test
        env['PYTHONPATH'] = os.environ['PYTHONPATH']
    argv = [sys.executable, '-c', TRAINER, user, PROBE, *configs]
    run = subprocess.run(argv, env=env, cwd='/', capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    seen: dict[str, dict[str, object]] = json.loads(run.stdout.splitlines()[-1])
    return seen


Verdicts = dict[str, str]


def rows_seen(config: str, user: str, rows: tuple[str, ...]) -> tuple[Verdicts, Verdicts, dict[str, object]]:
    """The measured and the expected verdict ('reachable' or 'blocked') of ``rows``, and all seen."""
    seen = trainer_run(user)[config]
    if 'skip' in seen:
        pytest.skip(f'no sandbox for {user} in {config} here: {seen["skip"]}')
    measured = {row: str(seen[row]).split(' ')[0] for row in rows}
    expected = {row: 'reachable' if row in REACHES[config, user] else 'blocked' for row in rows}
    return measured, expected, seen


@pytest.mark.integration
@pytest.mark.parametrize(('config', 'user'), CELLS)
def test_host_unix_sockets_on_a_path_and_abstract(config: str, user: str) -> None:
    measured, expected, seen = rows_seen(config, user, ('unix_path', 'unix_abstract'))
    assert measured == expected, seen


@pytest.mark.integration
@pytest.mark.parametrize(('config', 'user'), CELLS)
def test_the_environment_is_minimal_and_the_trainers_secret_out_of_reach(config: str, user: str) -> None:
    # /proc/<trainer>/environ, /proc/<parent>/environ and /proc/1/environ.
    measured, expected, seen = rows_seen(config, user, ('secret',))
    assert measured == expected, seen['secret']
    # Exactly the four, whatever the trainer's environment held (its secret and its PATH).
    cwd, python_dir = seen['cwd'], os.path.dirname(str(seen['python']))
    path = f'{python_dir}:/usr/local/bin:/usr/bin:/bin'
    assert seen['environment'] == {'PATH': path, 'LANG': 'C.UTF-8', 'HOME': cwd, 'TMPDIR': cwd}


@pytest.mark.integration
@pytest.mark.parametrize(('config', 'user'), CELLS)
def test_concurrent_runs_and_the_servers_data_directory(config: str, user: str) -> None:
    measured, expected, seen = rows_seen(config, user, ('other_run', 'data_read', 'data_write'))
    assert measured == expected, seen


@pytest.mark.integration
@pytest.mark.parametrize(('config', 'user'), CELLS)
def test_the_code_holds_no_capability_and_cannot_write_the_system(config: str, user: str) -> None:
    # The interpreter's prefix, / and /proc/sys/kernel/hostname (opened for writing, not written).
    rows = ('system_write', 'root_write', 'proc_sys_write')
    measured, expected, seen = rows_seen(config, user, rows)
    assert measured == expected == dict.fromkeys(rows, 'blocked'), seen
    assert seen['capabilities'] == '0000000000000000'  # CapEff: none, not even in its user namespace
