"""The wheel a user installs: its name on the index, the typed marker of each package (PEP 561, so
users' type checkers read twinkle's annotations), and the dashboard's files served from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_is_twinkle_train_typed_with_its_dashboard(tmp_path):
    # A copy of what the wheel is built from, so the build leaves nothing in the checkout.
    source = tmp_path / 'source'
    source.mkdir()
    for name in ('pyproject.toml', 'README.md'):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / 'src', source / 'src', ignore=shutil.ignore_patterns('__pycache__', '*.egg-info'))
    command = [sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', str(tmp_path)]
    subprocess.run([*command, str(source)], check=True, timeout=600)
    (wheel,) = tmp_path.glob('*.whl')
    assert wheel.name.startswith('twinkle_train-')  # the distribution's name, not the unrelated `twinkle`
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {'twinkle/py.typed', 'twinkle_client/py.typed'} <= names
    static = 'twinkle/server/api/dashboard/static/'
    assert {f'{static}index.html', f'{static}dashboard.js', f'{static}vendor/uplot/uPlot.iife.min.js'} <= names
    assert not any(name.startswith(('tests/', 'benchmarks/', 'cookbook/')) for name in names)
