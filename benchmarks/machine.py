"""What a benchmark ran on, written beside its figures."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def describe() -> dict[str, Any]:
    """Python and torch versions, CPU count, torch threads and the load average at the end."""
    return {
        'python': platform.python_version(),
        'torch': torch.__version__,
        'cpu_count': os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'load_average': os.getloadavg(),
    }
