"""The cookbook recipes run as users run them (a subprocess), so they cannot rot unnoticed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / 'cookbook' / script), *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_sft_recipe_lowers_the_held_out_loss_and_saves_an_adapter(tmp_path, tiny_model_dir):
    log = run('sft_self_cognition.py', '--samples', '64', '--epochs', '2', '--output-dir', 'out', cwd=tmp_path)
    before = float(re.search(r"eval before training: \{'loss': ([\d.]+)", log).group(1))
    after = float(re.search(r"eval after training: \{'loss': ([\d.]+)", log).group(1))
    assert after < before - 1.0, log[-2000:]
    assert (tmp_path / 'out' / 'last-checkpoint' / 'adapter_model.safetensors').is_file()


def test_single_device_recipe_trains_the_full_model(tmp_path, tiny_model_dir):
    log = run('single_device.py', cwd=tmp_path)
    losses = [float(x) for x in re.findall(r'loss ([\d.]+)', log)]
    assert len(losses) == 16 and losses[-1] < losses[0] - 1.0, losses
