"""Run untrusted Python (a model's "run code" tool call) in a separate process with limits.

Bad code gives the model an error, never the trainer: a crash, a kill, a time-out or too much
output all come back as a :class:`SandboxResult`; only a bad configuration raises.

Every run gets a fresh temporary working directory (``HOME`` and ``TMPDIR`` point there too),
removed afterwards; an environment of only ``PATH``, ``LANG``, ``HOME`` and ``TMPDIR``;
``python -I -S`` (no user site, no ``PYTHON*`` variables, standard library only); its own
process group, killed whole on time-out; and these rlimits, set by a small launcher that then
runs the code: ``RLIMIT_CPU`` (SIGXCPU), ``RLIMIT_AS`` (``MemoryError``), ``RLIMIT_FSIZE``
(``OSError: File too large``), ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0`` and, if asked,
``RLIMIT_NPROC``. Wall time and output size are enforced by the parent, which reads at most
``output_bytes`` per stream and kills the group past that.

What each mode isolates (``mode='auto'`` takes ``'namespace'`` where ``unshare`` works):

- ``'namespace'``: ``unshare --user --map-root-user --net --pid --fork --mount-proc``. A new
  network namespace with only a loopback that is down, so no network at all (unless
  ``network=True``); a PID namespace, so the code sees and signals only its own processes, and
  every process it starts dies with it, even one that left the process group; a user
  namespace, so even when the trainer is root the code holds no capability outside it: it
  cannot raise its rlimits back, nor enter the host's network namespace.
- ``'rlimits'``: a plain child process with the rlimits. It does **not** block the network,
  a child that calls ``setsid`` escapes the time-out kill, and code running as root can raise
  its own rlimits. Use it only where ``unshare`` is refused (some containers).

Neither mode filters system calls (no seccomp) nor hides the filesystem: the code can read
what the trainer's user can read and write what that user owns (as root: files owned by root),
outside its working directory too. Nor do they cap the number of processes for root (Linux
does not apply ``RLIMIT_NPROC`` to root), disk use beyond ``file_bytes`` per file, or CPU time
summed over the code's processes (``RLIMIT_CPU`` is per process; wall time bounds the rest).
Run the trainer as its own user, or in a container, where that matters.

>>> result = Sandbox().run_python('print(6 * 7)')
>>> result.stdout, result.exit_code, result.error
('42\\n', 0, None)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from twinkle.agent.tools import Tool
from twinkle.errors import ConfigurationError
from twinkle.utils.logger import get_logger

logger = get_logger()

MODES = ('auto', 'namespace', 'rlimits')
_UNSHARE = ('unshare', '--user', '--map-root-user', '--net', '--pid', '--fork', '--mount-proc')
_CHUNK = 65536

# Runs inside the sandbox: set the rlimits, run the code as a child (under a PID namespace the
# launcher is PID 1, which ignores SIGXCPU and hides how the code died), and write the code's
# exit code and CPU seconds to the status pipe.
_LAUNCHER = """
import os, resource, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the code may not stop its launcher
status_fd = int(sys.argv[1])
os.set_inheritable(status_fd, False)
for item in sys.argv[2:]:
    name, soft, hard = item.split(':')
    which = getattr(resource, name)
    old_hard = resource.getrlimit(which)[1]
    hard = int(hard) if old_hard == resource.RLIM_INFINITY else min(int(hard), old_hard)
    resource.setrlimit(which, (min(int(soft), hard), hard))
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execv(sys.executable, [sys.executable, '-I', '-S', '-u', 'main.py'])
_, status, usage = os.wait4(pid, 0)
os.write(status_fd, f'{os.waitstatus_to_exitcode(status)} {usage.ru_utime + usage.ru_stime}'.encode())
"""

# The last line of stderr that tells which limit an exception came from.
_LAST_LINE_REASONS = (
    ('MemoryError', 'memory limit of {memory_mb} MB'),
    ('[Errno 27]', 'file size limit of {file_bytes} bytes'),
    ('[Errno 24]', 'open files limit of {max_files}'),
)


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. Every value must be positive."""

    # CPU seconds of each process (RLIMIT_CPU): SIGXCPU at this, SIGKILL one second later.
    cpu_seconds: int = 5
    # Address space of each process in MiB (RLIMIT_AS); numpy-style imports need a few hundred.
    memory_mb: int = 512
    # Seconds from start to kill, for the whole process group.
    wall_seconds: float = 10.0
    # Bytes kept of stdout and of stderr each; more kills the run and sets ``truncated``.
    output_bytes: int = 16_384
    # Largest file the code may write (RLIMIT_FSIZE).
    file_bytes: int = 1 << 20
    # Open file descriptors per process (RLIMIT_NOFILE).
    max_files: int = 64
    # RLIMIT_NPROC, or None to leave it. Linux counts it over all processes and threads of the
    # user (the trainer's included), and ignores it for root: set it only for a sandbox user.
    max_processes: int | None = None
    # Keep the network. Only ``'namespace'`` mode can take it away.
    network: bool = False

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != 'network' and value is not None and not value > 0:
                raise ConfigurationError(f'SandboxLimits.{field.name} must be positive, got {value!r}')

    def rlimits(self) -> list[str]:
        """The launcher's arguments, ``NAME:soft:hard`` each."""
        limits = {
            'RLIMIT_CPU': (self.cpu_seconds, self.cpu_seconds + 1),
            'RLIMIT_AS': (self.memory_mb << 20,) * 2,
            'RLIMIT_FSIZE': (self.file_bytes,) * 2,
            'RLIMIT_NOFILE': (self.max_files,) * 2,
            'RLIMIT_CORE': (0, 0),
        }
        if self.max_processes is not None:
            limits['RLIMIT_NPROC'] = (self.max_processes,) * 2
        return [f'{name}:{soft}:{hard}' for name, (soft, hard) in limits.items()]


@dataclass
class SandboxResult:
    """What one run did. ``exit_code`` is negative for a signal and None when the run was killed
    before the code finished; ``error`` says which limit stopped it, or None."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    error: str | None
    mode: str
    wall_s: float

    def as_tool_output(self) -> str:
        """Stdout, stderr, then one bracketed status line: what a model reads back.

        >>> SandboxResult('4\\n', '', 0, False, False, None, 'namespace', 0.1).as_tool_output()
        '4\\n[exit code 0]'
        """
        status = 'killed' if self.exit_code is None else f'exit code {self.exit_code}'
        if self.error:
            status += f' ({self.error})'
        parts = [text if text.endswith('\n') else text + '\n' for text in (self.stdout, self.stderr) if text]
        return ''.join(parts) + f'[{status}]'


@functools.cache
def namespaces_available() -> bool:
    """Whether ``unshare`` can make the namespaces of ``'namespace'`` mode here (probed once)."""
    try:
        return subprocess.run([*_UNSHARE, 'true'], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Sandbox:
    """Runs Python source in a limited child process; see the module docstring for what each
    mode isolates. One instance serves any number of concurrent runs."""

    def __init__(self, limits: SandboxLimits | None = None, mode: str = 'auto'):
        self.limits = limits or SandboxLimits()
        self.mode = self._resolve(mode)

    def _resolve(self, mode: str) -> str:
        if mode not in MODES:
            raise ConfigurationError(f'Unknown sandbox mode {mode!r}. Valid modes are: {list(MODES)}')
        if mode == 'rlimits':
            if not self.limits.network:
                raise ConfigurationError("Sandbox mode 'rlimits' cannot block the network: pass network=True")
            return mode
        if namespaces_available():
            return 'namespace'
        if mode == 'namespace':
            raise ConfigurationError(f"Sandbox mode 'namespace' needs a working `{' '.join(_UNSHARE)} true` here")
        if not self.limits.network:
            logger.warning('unshare is not available: sandboxed code runs with rlimits only and keeps the network')
        return 'rlimits'

    async def run_python_async(self, code: str, stdin: str = '') -> SandboxResult:
        """:meth:`run_python` on a worker thread, so many episodes can run code at once."""
        return await asyncio.to_thread(self.run_python, code, stdin)

    def run_python(self, code: str, stdin: str = '') -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh directory with ``stdin`` as its input."""
        workdir = tempfile.mkdtemp(prefix='twinkle-sandbox-')
        try:
            Path(workdir, 'main.py').write_bytes(code.encode('utf-8', 'surrogatepass'))
            return self._run_in(workdir, stdin.encode('utf-8', 'surrogatepass'))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _command(self, status_fd: int) -> list[str]:
        prefix = [flag for flag in _UNSHARE if not (flag == '--net' and self.limits.network)]
        launcher = [sys.executable, '-I', '-S', '-c', _LAUNCHER, str(status_fd), *self.limits.rlimits()]
        return prefix + launcher if self.mode == 'namespace' else launcher

    def _run_in(self, workdir: str, stdin: bytes) -> SandboxResult:
        env = {'PATH': os.environ.get('PATH', os.defpath), 'LANG': 'C.UTF-8', 'HOME': workdir, 'TMPDIR': workdir}
        status_r, status_w = os.pipe()
        try:
            with tempfile.TemporaryFile() as stdin_file:
                stdin_file.write(stdin)
                stdin_file.seek(0)
                start = time.monotonic()
                try:
                    proc = subprocess.Popen(
                        self._command(status_w),
                        stdin=stdin_file,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=workdir,
                        env=env,
                        start_new_session=True,
                        pass_fds=(status_w,),
                    )
                finally:
                    os.close(status_w)  # the launcher holds the only write end: EOF means it is done
                with proc:
                    try:
                        output = _Output(proc, status_r, self.limits.output_bytes)
                        output.collect(start + self.limits.wall_seconds)
                    finally:
                        _kill_group(proc.pid)
        finally:
            os.close(status_r)
        return self._result(output, time.monotonic() - start)

    def _result(self, output: _Output, wall_s: float) -> SandboxResult:
        exit_code, cpu_s = output.status()
        stderr = output.text(output.stderr)
        return SandboxResult(
            stdout=output.text(output.stdout),
            stderr=stderr,
            exit_code=exit_code,
            timed_out=output.timed_out,
            truncated=output.truncated,
            error=self._reason(output, exit_code, cpu_s, stderr),
            mode=self.mode,
            wall_s=wall_s,
        )

    def _reason(self, output: _Output, exit_code: int | None, cpu_s: float, stderr: str) -> str | None:
        limits = self.limits
        if output.timed_out:
            return f'wall time limit of {limits.wall_seconds:g}s'
        if output.truncated:
            return f'output limit of {limits.output_bytes} bytes'
        if exit_code is None:
            return 'the sandbox stopped before the code did'
        if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_s >= limits.cpu_seconds):
            return f'CPU time limit of {limits.cpu_seconds}s'
        last_line = stderr.rstrip().rpartition('\n')[2]
        for marker, reason in _LAST_LINE_REASONS:
            if exit_code > 0 and marker in last_line:
                return reason.format(**dataclasses.asdict(limits))
        if exit_code < 0:
            return f'killed by signal {signal.Signals(-exit_code).name}'
        return None


class _Output:
    """Reads stdout, stderr and the launcher's status pipe of one run until all close, the wall
    deadline passes or a stream overflows, keeping at most ``limit`` bytes of each stream."""

    def __init__(self, proc: subprocess.Popen[bytes], status_fd: int, limit: int):
        assert proc.stdout is not None and proc.stderr is not None  # both are PIPE
        self.pgid, self.limit = proc.pid, limit
        self.stdout, self.stderr, self.status_bytes = bytearray(), bytearray(), bytearray()
        self.buffers = {
            proc.stdout.fileno(): self.stdout,
            proc.stderr.fileno(): self.stderr,
            status_fd: self.status_bytes,
        }
        self.status_fd = status_fd
        self.timed_out = self.truncated = False

    def collect(self, deadline: float) -> None:
        with selectors.DefaultSelector() as selector:
            for fd in self.buffers:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map() and not self.truncated:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # Past the deadline only an unfinished code is a time-out, not a straggler.
                    self.timed_out = self.status_fd in selector.get_map()
                    return
                for key, _ in selector.select(remaining):
                    self._read(selector, key.fd)

    def _read(self, selector: selectors.BaseSelector, fd: int) -> None:
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            selector.unregister(fd)
            if fd == self.status_fd:  # the code is done: stop whatever it left running
                _kill_group(self.pgid)
            return
        buffer = self.buffers[fd]
        buffer += chunk
        if fd != self.status_fd and len(buffer) > self.limit:
            del buffer[self.limit :]
            self.truncated = True

    def status(self) -> tuple[int | None, float]:
        """The code's exit code and CPU seconds, or (None, 0.0) if it never finished."""
        if not self.status_bytes:
            return None, 0.0
        exit_code, cpu_s = self.status_bytes.decode().split()
        return int(exit_code), float(cpu_s)

    @staticmethod
    def text(buffer: bytearray) -> str:
        return buffer.decode('utf-8', errors='replace')


def _kill_group(pgid: int) -> None:
    """SIGKILL a run's process group (its leader is not reaped yet, so the id is still its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def python_tool(sandbox: Sandbox | None = None) -> Tool:
    """A ``run_python`` tool for a ``ToolBox``: the model's program runs in ``sandbox`` (a new
    default one when not given) and the model reads what it printed and how it ended."""
    box = sandbox if sandbox is not None else Sandbox()

    async def run_python(code: str) -> str:
        """Run a Python program (standard library only, no network) and read what it prints.

        Args:
            code: the program; print what you want to see
        """
        result = await box.run_python_async(code)
        return result.as_tool_output()

    return Tool(run_python)
