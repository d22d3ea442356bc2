"""Giving freed heap memory back to the OS (``twinkle.utils.memory``), measured on the process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from twinkle.utils.memory import can_release_memory, release_free_memory

MIB = 2**20


def resident_bytes() -> int:
    status = Path('/proc/self/status').read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith('VmRSS'))) * 1024


@pytest.mark.skipif(not can_release_memory() or not Path('/proc/self/status').exists(), reason='needs glibc and /proc')
def test_release_returns_the_pages_freed_between_live_tensors():
    # 2048 blocks of 64 KiB (under malloc's mmap threshold: they live in the heap), written so
    # their pages are resident; then all but every 16th freed, which pins the heap's top.
    blocks = [torch.ones(16 * 1024) for _ in range(2048)]
    kept = blocks[::16]
    del blocks
    before = resident_bytes()
    assert release_free_memory()
    released = before - resident_bytes()
    assert released > 64 * MIB, f'only {released / MIB:.1f} MiB of the ~120 MiB freed went back'
    assert all(float(block[0]) == 1.0 for block in kept)  # what is live is untouched
