"""What a benchmark ran on, written beside its figures; its settings from the command line."""

from __future__ import annotations

import argparse
import os
import platform
from dataclasses import asdict
from typing import Any, TypeVar

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


Settings = TypeVar('Settings')


def settings_from_args(defaults: Settings, description: str, output: str) -> tuple[Settings, str]:
    """A dataclass of settings with each field a ``--flag`` (its default from ``defaults``), and ``--output``."""
    fields = asdict(defaults)  # type: ignore[call-overload]
    parser = argparse.ArgumentParser(description=description)
    for name, default in fields.items():
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(default), default=default)
    parser.add_argument('--output', default=output)
    args = parser.parse_args()
    return type(defaults)(**{name: getattr(args, name) for name in fields}), args.output
