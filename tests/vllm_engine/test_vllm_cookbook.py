"""Seed 002's GRPO loop with ``vLLMSampler`` and ``engine_args`` (``cookbook/grpo_vllm.py``) runs as
a user runs it: a subprocess, Ray mode, the model and a vLLM engine on device groups of their own,
the merged weights reloaded into the running engine before each round of sampling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip('vllm')

ROOT = Path(__file__).resolve().parents[2]


def test_seed_002_grpo_loop_runs_on_vllm_and_saves(tmp_path, tiny_model_dir):
    command = [sys.executable, str(ROOT / 'cookbook' / 'grpo_vllm.py'), '--max-steps', '2', '--output-dir', 'out']
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert 'Training completed. optim_steps=2' in log and 'total_reward' in log, log[-2000:]
    assert (tmp_path / 'out' / 'grpo-gsm8k-checkpoint' / 'adapter_model.safetensors').is_file()
