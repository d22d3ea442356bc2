"""Run untrusted Python (a model's "run code" tool call) in a separate process with limits.

Bad code gives the model an error, never the trainer: a crash, a kill, a time-out or too much
output all come back as a :class:`SandboxResult`; only a bad configuration raises.

Every run gets a fresh working directory (``HOME`` and ``TMPDIR`` point there too), mode 0700,
removed afterwards; an environment of exactly ``PATH``, ``LANG``, ``HOME`` and ``TMPDIR``; umask
077; ``python -I -S`` (no user site, no ``PYTHON*`` variables, standard library only); its own
process group, killed whole on time-out; and these rlimits, set by a small launcher that then
runs the code: ``RLIMIT_CPU`` (SIGXCPU), ``RLIMIT_AS`` (``MemoryError``), ``RLIMIT_FSIZE``
(``OSError: File too large``), ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0`` and, if asked,
``RLIMIT_NPROC``. Wall time and output size are enforced by the parent, which reads at most
``output_bytes`` per stream and kills the group past that.

What each mode isolates (docs/agents.md has the table, each cell measured by tests/agent/test_sandbox.py):

- ``'namespace'``, what ``mode='auto'`` takes (where it does not work, ``auto`` refuses rather than
  fall back): ``unshare --user --map-root-user --mount --net --pid --ipc --uts --fork``, then the
  launcher builds a new root and pivots into it (``pivot_root``), the old root detached: a tmpfs with
  only ``/usr`` (and ``/bin``, ``/lib``, ``/lib64``), the interpreter's prefix and two files of
  ``/etc``, all read-only; a private ``/tmp`` (``tmp_mb``); a ``/dev`` of five devices; a fresh
  ``/proc`` of its PID namespace (``sys``, ``sysrq-trigger``, ``irq`` and ``bus`` read-only, as
  bubblewrap does); and the working directory. So no host path is there to open: not the
  server's data, home directories, other runs' directories, nor ``/run`` and its Unix sockets.
  The network namespace has only a loopback that is down and none of the host's abstract Unix
  sockets (``network=True`` keeps the host's network, and so those); the PID namespace shows and
  lets it signal only its own processes, which all die with the launcher; and the code holds no
  capability (bounding set dropped, ``no_new_privs``), so it cannot remount, raise its rlimits
  or gain one through a setuid file.
- ``'rlimits'``, only when asked for (with ``network=True``): a plain child process with the
  rlimits, for where ``unshare`` is refused. It sees the host's filesystem, network and sockets.
  When the trainer is root, the code runs as a uid of its own (:data:`RUN_UIDS`, leased across
  processes by :class:`_UidLease`) that owns its working directory: it cannot read the
  trainer's ``/proc/<pid>/environ``, its 0600 or 0700 files or another run's directory, nor
  raise its rlimits, and every process of that uid is killed when the run ends. As any other
  user the code is the trainer's user and reaches what that user can: the trainer's files,
  environment and other runs' directories included.

Neither mode filters system calls (no seccomp), caps disk use beyond ``file_bytes`` per file
or CPU time summed over the code's processes (``RLIMIT_CPU`` is per process; wall time bounds
the rest).

>>> result = Sandbox().run_python('print(6 * 7)')
>>> result.stdout, result.exit_code, result.error
('42\\n', 0, None)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import inspect
import marshal
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from twinkle.agent.tools import Tool
from twinkle.errors import BusyError, ConfigurationError
from twinkle.utils.logger import get_logger

logger = get_logger()

MODES = ('auto', 'namespace', 'rlimits')
# unshare(1)'s namespaces: user (the launcher is root of it, the code nothing), mount (its new
# root), network (dropped with network=True), PID, IPC (no host SysV IPC) and hostname.
_UNSHARE = ('--user', '--map-root-user', '--mount', '--net', '--pid', '--ipc', '--uts', '--fork')
# What the new root holds read-only besides the interpreter's prefixes: Python, a shell and the
# dynamic loader's cache; a top-level symlink (``/bin -> usr/bin``) is copied as a link.
_SYSTEM_PATHS = ('/usr', '/bin', '/lib', '/lib64', '/etc/ld.so.cache', '/etc/localtime')
# Added with ``network=True``: name resolution and CA certificates (not /etc/ssl/private).
_NETWORK_PATHS = ('/etc/hosts', '/etc/resolv.conf', '/etc/nsswitch.conf', '/etc/ssl/certs')
# The code's PATH after the interpreter's own directory: never the trainer's.
_PATH = '/usr/local/bin:/usr/bin:/bin'
#: rlimits mode as root: the uids (and gids) runs' code gets, one run each at a time. systemd
#: leaves 1879048192-2147483647 unallocated (https://systemd.io/UIDS-GIDS/).
RUN_UIDS = range(1_879_048_192, 1_879_048_192 + 4096)
# One lock file per leased uid, held (flock) for the run, so trainers on one host never share one.
_UID_LOCKS = Path('/run/twinkle-sandbox-uids')
_CHUNK = 65536

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
    # user and ignores it for root: set it where the code has a uid of its own (rlimits mode as root).
    max_processes: int | None = None
    # Size in MiB of namespace mode's private /tmp (a tmpfs: its pages are not in memory_mb).
    tmp_mb: int = 64
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


@dataclass
class _Plan:
    """What the launcher does, sent to it marshalled (a builtin module: the launcher imports
    nothing to read it; version 4 reads on every Python 3)."""

    # The interpreter that runs main.py (a real path, the same inside the new root).
    python: str
    # The run's working directory (the same path inside the new root).
    workdir: str
    # ``NAME:soft:hard`` each.
    rlimits: list[str]
    # Namespace mode: an empty directory to build the new root on; None runs in place.
    jail: str | None = None
    # Paths bound read-only into the new root.
    read_only: list[str] = dataclasses.field(default_factory=list)
    # Size of the new root's /tmp in MiB.
    tmp_mb: int = 64
    # rlimits mode as root: the uid is the run's own, so once the code ends, kill all of its processes.
    kill_uid: bool = False


class _Launcher:
    """The sandbox's first process, in its own interpreter (this class's source goes in with
    ``-c``, so it uses the standard library only): in namespace mode it builds the new root and
    enters it; then it sets the rlimits, runs the code as its child (under a PID namespace the
    launcher is PID 1, which ignores SIGXCPU and would hide how the code died) and writes the
    code's exit code and CPU seconds to the status pipe."""

    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
    RDONLY, NOSUID, NODEV, NOEXEC = 1, 2, 4, 8  # MOUNT_ATTR_*
    # mount_setattr(2) (Linux 5.12) is 442 on every architecture but alpha; it sets a flag on a
    # whole mount tree, which a remount cannot.
    SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MNT_DETACH = 442, -100, 0x8000, 2
    PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38
    DEVICES = ('null', 'zero', 'full', 'random', 'urandom')
    DEV_LINKS = (
        ('fd', '/proc/self/fd'),
        ('stdin', '/proc/self/fd/0'),
        ('stdout', '/proc/self/fd/1'),
        ('stderr', '/proc/self/fd/2'),
        ('shm', '/tmp'),  # one tmpfs for /tmp and /dev/shm
    )
    # What of /proc root could write without a capability (bubblewrap covers the same four).
    PROC_READ_ONLY = ('sys', 'sysrq-trigger', 'irq', 'bus')

    def __init__(self, plan: _Plan, status_fd: int) -> None:
        self.plan, self.status_fd = plan, status_fd
        self.libc = ctypes.CDLL(None, use_errno=True)

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the code may not stop its launcher
        os.set_inheritable(self.status_fd, False)
        if self.plan.jail is not None:
            self.enter_jail(self.plan.jail)
        for item in self.plan.rlimits:
            name, soft, hard = item.split(':')
            which = getattr(resource, name)
            old_hard = resource.getrlimit(which)[1]
            limit = int(hard) if old_hard == resource.RLIM_INFINITY else min(int(hard), old_hard)
            resource.setrlimit(which, (min(int(soft), limit), limit))
        pid = os.fork()
        if pid == 0:
            try:
                self.exec_code()
            finally:
                os._exit(127)
        _, status, usage = os.wait4(pid, 0)
        if self.plan.kill_uid:  # kill(-1) reaches every process of this uid but the caller
            try:  # noqa: SIM105 (contextlib would be one more import to start)
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        report = f'{os.waitstatus_to_exitcode(status)} {usage.ru_utime + usage.ru_stime}'
        os.write(self.status_fd, report.encode())

    def exec_code(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        self.call('prctl', self.libc.prctl(self.PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), *[ctypes.c_ulong(0)] * 3))
        if self.plan.jail is not None:  # root of the user namespace execs with the bounding set: none
            with open('/proc/sys/kernel/cap_last_cap') as file:
                last_cap = int(file.read())
            for cap in range(last_cap + 1):
                self.call('prctl', self.libc.prctl(self.PR_CAPBSET_DROP, ctypes.c_ulong(cap), *[ctypes.c_ulong(0)] * 3))
        os.umask(0o077)
        os.chdir(self.plan.workdir)
        os.execv(self.plan.python, [self.plan.python, '-I', '-S', '-u', 'main.py'])

    def enter_jail(self, root: str) -> None:
        """Build the new root on ``root`` (in this process's own mount namespace) and pivot into
        it, the old root detached: no path, /proc entry or mount of the host's stays."""
        self.mount(None, '/', None, self.MS_REC | self.MS_PRIVATE)
        self.mount('tmpfs', root, 'tmpfs', self.MS_NOSUID | self.MS_NODEV, 'mode=0755,size=1m')
        flags = self.MS_NOSUID | self.MS_NODEV
        self.mount('tmpfs', self.mkdir(root + '/tmp'), 'tmpfs', flags, f'mode=1777,size={self.plan.tmp_mb}m')
        self.mount('tmpfs', self.mkdir(root + '/dev'), 'tmpfs', flags | self.MS_NOEXEC, 'mode=0755,size=64k')
        for name in self.DEVICES:
            self.bind('/dev/' + name, root + '/dev/' + name, self.NOSUID | self.NOEXEC)
        for name, target in self.DEV_LINKS:
            os.symlink(target, f'{root}/dev/{name}')
        for path in self.plan.read_only:
            self.bind(path, root + path, self.RDONLY | self.NOSUID | self.NODEV)
        self.bind(self.plan.workdir, root + self.plan.workdir, self.NOSUID | self.NODEV)
        self.mount('proc', self.mkdir(root + '/proc'), 'proc', flags | self.MS_NOEXEC)
        for name in self.PROC_READ_ONLY:
            path = f'{root}/proc/{name}'
            if os.path.exists(path):
                self.bind(path, path, self.RDONLY | self.NOSUID | self.NODEV | self.NOEXEC)
        for path in (root, root + '/dev'):
            self.set_attr(path, self.RDONLY, recursive=False)
        os.chdir(root)
        self.call('pivot_root', self.libc.pivot_root(b'.', b'.'))  # pivot_root(2): the new root over the old
        self.call('umount old root', self.libc.umount2(b'.', self.MNT_DETACH))
        os.chdir('/')

    def bind(self, source: str, target: str, attrs: int) -> None:
        """Bind ``source`` (with what is mounted under it) on ``target``, made first; ``attrs``
        (MOUNT_ATTR_*) on every mount of it. A symlink is copied as a link; a missing path skipped."""
        if os.path.islink(source) and source != target:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(source), target)
            return
        if not os.path.exists(source):
            return
        if source != target:
            if os.path.isdir(source):
                os.makedirs(target, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                open(target, 'x').close()
        self.mount(source, target, None, self.MS_BIND | self.MS_REC)
        self.set_attr(target, attrs, recursive=True)

    def set_attr(self, path: str, attrs: int, *, recursive: bool) -> None:
        attr = (ctypes.c_uint64 * 4)(attrs, 0, 0, 0)  # struct mount_attr: set, clear, propagation, userns
        flags = self.AT_RECURSIVE if recursive else 0
        number, size = ctypes.c_long(self.SYS_MOUNT_SETATTR), ctypes.c_size_t(32)
        args = (ctypes.c_long(self.AT_FDCWD), path.encode(), ctypes.c_uint(flags), ctypes.byref(attr), size)
        self.call(f'mount_setattr {path}', self.libc.syscall(number, *args))

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        encoded = [None if value is None else value.encode() for value in (source, target, fstype, data)]
        result = self.libc.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3])
        self.call(f'mount {fstype or source} on {target}', result)

    @staticmethod
    def mkdir(path: str) -> str:
        os.makedirs(path, exist_ok=True)
        return path

    @staticmethod
    def call(what: str, result: int) -> None:
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, f'sandbox launcher: {what}: {os.strerror(error)}')


# What the launcher runs: _Launcher's source, and a _Plan's fields as attributes. Its imports
# are the cheap ones (json, dataclasses and pathlib would double an interpreter's start).
_LAUNCHER = '\n'.join(
    [
        'from __future__ import annotations',
        'import ctypes, marshal, os, resource, signal, sys, types',
        inspect.getsource(_Launcher),
        '_Launcher(types.SimpleNamespace(**marshal.loads(bytes.fromhex(sys.argv[2]))), int(sys.argv[1])).run()',
    ]
)


@dataclass(frozen=True)
class _Interpreter:
    """The Python that runs the code: its real path and its installation prefixes."""

    path: str
    prefixes: tuple[str, ...]


@functools.cache
def _interpreter(python: str) -> _Interpreter:
    """Ask ``python`` where it is installed (a venv answers with the Python it was made from)."""
    code = 'import os, sys\nfor path in (sys.executable, sys.base_prefix, sys.base_exec_prefix): print(path)'
    try:
        answer = subprocess.run([python, '-I', '-S', '-c', code], capture_output=True, text=True, timeout=60, env={})
    except OSError as error:
        raise ConfigurationError(f'Sandbox python {python!r} cannot be run: {error}') from error
    if answer.returncode != 0:
        raise ConfigurationError(f'Sandbox python {python!r} failed: {answer.stderr.strip()[-300:]}')
    executable, *prefixes = (os.path.realpath(line) for line in answer.stdout.splitlines())
    return _Interpreter(executable, tuple(dict.fromkeys(prefixes)))


def _read_only_paths(interpreter: _Interpreter, network: bool) -> list[str]:
    """What namespace mode binds read-only, each path once (a prefix under /usr is in /usr).

    >>> _read_only_paths(_Interpreter('/opt/py/bin/python3', ('/opt/py', '/usr/local')), network=False)
    ['/usr', '/bin', '/lib', '/lib64', '/etc/ld.so.cache', '/etc/localtime', '/opt/py']
    """
    if '/' in interpreter.prefixes:
        raise ConfigurationError(
            f'{interpreter.path} is installed in /: namespace mode would show the whole filesystem'
        )
    paths: list[str] = []
    for path in (*_SYSTEM_PATHS, *(_NETWORK_PATHS if network else ()), *interpreter.prefixes, interpreter.path):
        if not any(path == kept or path.startswith(kept + '/') for kept in paths):
            paths.append(path)
    return paths


@functools.cache
def _namespace_problem(interpreter: _Interpreter, network: bool) -> str | None:
    """Why namespace mode does not work here (the last line of a trial run's error), or None."""
    if shutil.which('unshare') is None:
        return 'there is no `unshare` (util-linux) on PATH'
    result = _Runner(SandboxLimits(wall_seconds=60, network=network), interpreter, 'namespace').run('pass', '')
    if result.exit_code == 0:
        return None
    last_line = (result.stderr.strip() or str(result.error)).rpartition('\n')[2]
    return f'a trial run ended with exit code {result.exit_code}: {last_line}'


def namespaces_available(python: str | None = None, network: bool = False) -> bool:
    """Whether ``'namespace'`` mode works here for ``python`` (probed once by a trial run)."""
    return _namespace_problem(_interpreter(python or sys.executable), network) is None


class Sandbox:
    """Runs Python source in a limited child process; see the module docstring for what each
    mode isolates. One instance serves any number of concurrent runs.

    ``python`` is the interpreter that runs the code (the trainer's by default); rlimits mode as
    root needs one every user may run, such as ``/usr/bin/python3``.
    """

    def __init__(self, limits: SandboxLimits | None = None, mode: str = 'auto', python: str | None = None):
        self.limits = limits or SandboxLimits()
        self.interpreter = _interpreter(python or sys.executable)
        self.mode = self._resolve(mode)
        self._runner = _Runner(self.limits, self.interpreter, self.mode)

    def _resolve(self, mode: str) -> str:
        if mode not in MODES:
            raise ConfigurationError(f'Unknown sandbox mode {mode!r}. Valid modes are: {list(MODES)}')
        if mode == 'rlimits':
            self._check_rlimits()
            return mode
        problem = _namespace_problem(self.interpreter, self.limits.network)
        if problem is None:
            return 'namespace'
        raise ConfigurationError(
            f'Sandbox mode {mode!r} needs namespace mode, which does not work here: {problem}. '
            "mode='rlimits' (with network=True) runs without namespaces; it leaves the host's network, "
            "sockets and files in reach (docs/agents.md, 'The sandbox')"
        )

    def _check_rlimits(self) -> None:
        if not self.limits.network:
            raise ConfigurationError("Sandbox mode 'rlimits' cannot block the network: pass network=True")
        if os.geteuid() != 0:
            logger.warning(
                "Sandbox mode 'rlimits' as uid %d: the code runs as the trainer's user and can read what it "
                "can: its files, its environment (/proc/<pid>/environ) and other runs' directories",
                os.geteuid(),
            )
            return
        with _UidLease() as lease:  # a leased uid: a run's end kills every process of its uid
            uid = lease.uid
            try:
                check = _run_as(uid, [self.interpreter.path, '-I', '-S', '-c', ''])
                error = check.stderr.decode(errors='replace').strip()[-200:]
                problem = f'exit code {check.returncode}: {error}' if check.returncode else ''
            except OSError as error:
                problem = str(error)
            lease.done()
        if problem:
            raise ConfigurationError(
                f"Sandbox mode 'rlimits' runs the code as a uid of its own (such as {uid}), which cannot run "
                f'{self.interpreter.path}: {problem}. Pass python= an interpreter every user may run '
                '(such as /usr/bin/python3)'
            )

    async def run_python_async(self, code: str, stdin: str = '') -> SandboxResult:
        """:meth:`run_python` on a worker thread, so many episodes can run code at once."""
        return await asyncio.to_thread(self.run_python, code, stdin)

    def run_python(self, code: str, stdin: str = '') -> SandboxResult:
        """Run ``code`` as ``main.py`` in a fresh directory with ``stdin`` as its input."""
        return self._runner.run(code, stdin)


@dataclass
class _Workspace:
    """One run's directories and, in rlimits mode as root, the lease of the uid its code runs as."""

    workdir: str
    jail: str
    lease: _UidLease | None = None

    @property
    def uid(self) -> int | None:
        return None if self.lease is None else self.lease.uid


class _Runner:
    """Runs code in one mode, unchecked: what :class:`Sandbox` and the namespace probe share."""

    def __init__(self, limits: SandboxLimits, interpreter: _Interpreter, mode: str):
        self.limits, self.interpreter, self.mode = limits, interpreter, mode
        self.own_uid = mode == 'rlimits' and os.geteuid() == 0

    def run(self, code: str, stdin: str) -> SandboxResult:
        with self._workspace() as space:
            Path(space.workdir, 'main.py').write_bytes(code.encode('utf-8', 'surrogatepass'))
            result = self._run_in(space, stdin.encode('utf-8', 'surrogatepass'))
            if space.lease is not None:
                if result.exit_code is None:  # the launcher was killed before it killed the uid's processes
                    _kill_uid(self.interpreter.path, space.lease.uid)
                space.lease.done()
            return result

    @contextlib.contextmanager
    def _workspace(self) -> Iterator[_Workspace]:
        run_dir = tempfile.mkdtemp(prefix='twinkle-sandbox-')  # 0700, the trainer's
        space = _Workspace(os.path.join(run_dir, 'work'), os.path.join(run_dir, 'root'))
        try:
            os.mkdir(space.workdir, 0o700)
            os.mkdir(space.jail, 0o700)  # namespace mode's new root is built on it
            if not self.own_uid:
                yield space
                return
            with _UidLease() as lease:
                if lease.left_over:  # its last run ended with the trainer: its processes may live on
                    _kill_uid(self.interpreter.path, lease.uid)
                os.chmod(run_dir, 0o711)  # the run's uid may pass through to its own directory
                os.chown(space.workdir, lease.uid, lease.uid)
                space.lease = lease
                yield space
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _command(self, status_fd: int, space: _Workspace) -> list[str]:
        plan = _Plan(self.interpreter.path, space.workdir, self.limits.rlimits(), tmp_mb=self.limits.tmp_mb)
        if self.mode == 'namespace':
            plan.jail, plan.read_only = space.jail, _read_only_paths(self.interpreter, self.limits.network)
        plan.kill_uid = space.lease is not None
        plan_hex = marshal.dumps(dataclasses.asdict(plan), 4).hex()
        launcher = [self.interpreter.path, '-I', '-S', '-c', _LAUNCHER, str(status_fd), plan_hex]
        if self.mode == 'rlimits':
            return launcher
        flags = [flag for flag in _UNSHARE if not (flag == '--net' and self.limits.network)]
        return [shutil.which('unshare') or 'unshare', *flags, *launcher]

    def _run_in(self, space: _Workspace, stdin: bytes) -> SandboxResult:
        path = f'{os.path.dirname(self.interpreter.path)}:{_PATH}'
        env = {'PATH': path, 'LANG': 'C.UTF-8', 'HOME': space.workdir, 'TMPDIR': space.workdir}
        status_r, status_w = os.pipe()
        try:
            with tempfile.TemporaryFile() as stdin_file:
                stdin_file.write(stdin)
                stdin_file.seek(0)
                start = time.monotonic()
                try:
                    proc = subprocess.Popen(
                        self._command(status_w, space),
                        stdin=stdin_file,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        cwd=space.workdir,
                        env=env,
                        start_new_session=True,
                        pass_fds=(status_w,),
                        user=space.uid,
                        group=space.uid,
                        extra_groups=None if space.uid is None else [],
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


def _run_as(uid: int, argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` as ``uid`` (and gid), with no groups, no environment, in /."""
    return subprocess.run(argv, user=uid, group=uid, extra_groups=[], cwd='/', env={}, capture_output=True, timeout=60)


def _kill_uid(python: str, uid: int) -> None:
    """SIGKILL every process of ``uid``: ``kill(-1)`` sent as that uid reaches exactly those."""
    code = 'import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass'
    _run_as(uid, [python, '-I', '-S', '-c', code])


class _UidLease:
    """A uid of :data:`RUN_UIDS` that no other run on this host holds: an ``flock`` on its lock
    file, held until the block ends (a dead trainer's locks go with it). The file reads ``1`` from
    the lease until :meth:`done` says no process of the uid is left, so a lease that finds ``1``
    knows that the last run's trainer died first (``left_over``)."""

    def __init__(self, locks: Path = _UID_LOCKS) -> None:
        self.locks, self.fd, self.uid, self.left_over = locks, -1, -1, False

    def __enter__(self) -> _UidLease:
        self.locks.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = self.locks.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
            raise ConfigurationError(f'{self.locks} must be a directory of root with mode 0700, got {info.st_mode:o}')
        for uid in RUN_UIDS:
            fd = os.open(self.locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an open file each: threads exclude too
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd, self.uid, self.left_over = fd, uid, os.pread(fd, 1, 0) == b'1'
            os.pwrite(fd, b'1', 0)
            return self
        raise BusyError(f'All {len(RUN_UIDS)} sandbox uids ({RUN_UIDS.start}...) are in use on this host')

    def done(self) -> None:
        """No process of the uid is left."""
        os.ftruncate(self.fd, 0)

    def __exit__(self, *exc_info: object) -> None:
        os.close(self.fd)


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
