"""Giving freed memory back to the operating system.

glibc's malloc keeps freed blocks in its heap for reuse and returns pages only from the top of
the heap. A training server that frees a pass's activations and then allocates long-lived
tensors (an adapter, its optimizer state) ends up with free pages pinned between them: its
resident set grows by more than what it holds. ``malloc_trim(0)`` releases every free page.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, when it is glibc (the only one with ``malloc_trim``); None elsewhere. Looked up
    among the symbols this process has loaded (``CDLL(None)``), not by ``ctypes.util.find_library``,
    which runs ``ldconfig`` or a compiler to find a file name."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, 'malloc_trim') else None


def can_release_memory() -> bool:
    """Whether ``release_free_memory`` can do anything here (glibc)."""
    return _libc() is not None


def release_free_memory() -> bool:
    """Return the heap's free pages to the operating system; False where the C library cannot
    (not glibc). Costs about 10 ms for a 1 GiB heap, and the next allocations fault their
    pages back in: call it when the process goes idle, not between steps."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def resident_mib() -> float:
    """This process's resident set in MiB (``VmRSS`` of ``/proc/self/status``; where there is no
    ``/proc``, the peak resident set ``getrusage`` reports, in KiB on Linux and bytes on macOS)."""
    try:
        with open('/proc/self/status') as status:
            for line in status:
                if line.startswith('VmRSS:'):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == 'darwin' else peak / 1024
