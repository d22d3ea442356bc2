"""``twinkle export``: a trained adapter as a merged Hugging Face model that plain transformers
loads with the logits of base plus adapter, or as the peft adapter alone, never half-written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle import assets
from twinkle.errors import CheckpointError, ConfigurationError
from twinkle.model import TransformersModel
from twinkle.model.checkpoint.export import export_checkpoint, write_tinker_adapter

TOKENS = torch.tensor([[3, 17, 42, 99, 5, 8, 64, 21], [7, 7, 120, 33, 2, 90, 11, 4]])


def train_and_save(model_name: str, out: Path) -> Path:
    """Three steps of LoRA with a large learning rate (so the adapter moves the logits), saved
    with the optimizer state a resume needs."""
    torch.manual_seed(0)
    model = TransformersModel(model_id=assets.tiny_model(model_name))
    model.add_adapter_to_model('default', LoraConfig(r=8, lora_alpha=16, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=5e-2)
    rows = [{'input_ids': row.tolist(), 'labels': row.tolist()} for row in TOKENS]
    for _ in range(3):
        model.forward_backward(inputs=rows)
        model.clip_grad_and_step()
    return Path(model.save('trained', output_dir=str(out), save_optimizer=True))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def base_plus_adapter(model_name: str, adapter: Path) -> torch.Tensor:
    base = AutoModelForCausalLM.from_pretrained(assets.tiny_model(model_name), dtype=torch.float32)
    return logits(PeftModel.from_pretrained(base, str(adapter)))


def twinkle_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, '-m', 'twinkle.cli', *args], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.integration
@pytest.mark.parametrize('model_name', ['tiny-qwen3', 'tiny-qwen3-moe'])
def test_a_merged_export_loads_in_plain_transformers_with_base_plus_adapter_logits(tmp_path, model_name):
    checkpoint = train_and_save(model_name, tmp_path)
    result = twinkle_cli('export', str(checkpoint), '--merge', '--out', str(tmp_path / 'merged'))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(tmp_path / 'merged')
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / 'merged')
    expected = base_plus_adapter(model_name, checkpoint)
    base = logits(AutoModelForCausalLM.from_pretrained(assets.tiny_model(model_name), dtype=torch.float32))
    assert (expected - base).abs().max() > 1e-2  # the adapter changes the logits ...
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=1e-5)  # ... and the merge keeps that
    names = {p.name for p in (tmp_path / 'merged').iterdir()}
    assert {'config.json', 'model.safetensors', 'tokenizer_config.json'} <= names
    assert not names & {'adapter_config.json', 'optimizer.pt', 'trainer_state.json'}
    assert AutoTokenizer.from_pretrained(tmp_path / 'merged')('hello').input_ids


@pytest.mark.slow
def test_an_unmerged_export_is_the_peft_adapter_without_the_training_state(tmp_path):
    checkpoint = train_and_save('tiny-qwen3', tmp_path)
    assert (checkpoint / 'optimizer.pt').is_file()
    out = export_checkpoint(checkpoint, tmp_path / 'adapter')
    names = {p.name for p in out.iterdir()}
    assert {'adapter_config.json', 'adapter_model.safetensors', 'tokenizer_config.json'} <= names
    assert not names & {'optimizer.pt', 'scheduler.pt', 'rng_state.pt', 'trainer_state.json', 'weights_step.json'}
    torch.testing.assert_close(base_plus_adapter('tiny-qwen3', out), base_plus_adapter('tiny-qwen3', checkpoint))


@pytest.mark.slow
def test_a_merge_into_another_dtype_and_an_explicit_base(tmp_path):
    checkpoint = train_and_save('tiny-qwen3', tmp_path)
    out = export_checkpoint(checkpoint, tmp_path / 'bf16', merge=True, base_model='tiny-qwen3', dtype='bfloat16')
    assert json.loads((out / 'config.json').read_text())['dtype'] == 'bfloat16'
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert next(merged.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(logits(merged), base_plus_adapter('tiny-qwen3', checkpoint), atol=0.1, rtol=0.05)


@pytest.mark.integration
def test_bad_exports_are_refused_and_leave_nothing_behind(tmp_path):
    with pytest.raises(CheckpointError, match='no checkpoint folder'):
        export_checkpoint(tmp_path / 'missing', tmp_path / 'out')
    (tmp_path / 'empty').mkdir()
    with pytest.raises(CheckpointError, match='neither a peft adapter'):
        export_checkpoint(tmp_path / 'empty', tmp_path / 'out')
    (tmp_path / 'full').mkdir()
    (tmp_path / 'full' / 'file').write_text('x')
    with pytest.raises(ConfigurationError, match='is not empty'):
        export_checkpoint(tmp_path / 'empty', tmp_path / 'full')
    with pytest.raises(ConfigurationError, match=r"dtype 'int8'.*float32"):
        export_checkpoint(tmp_path / 'empty', tmp_path / 'out', dtype='int8')
    assert not (tmp_path / 'out').exists()
    result = twinkle_cli('export', str(tmp_path / 'missing'), '--out', str(tmp_path / 'out'))
    assert (result.returncode, result.stderr.strip()) == (
        2,
        f"twinkle: error: no checkpoint folder at '{tmp_path / 'missing'}'",
    )


@pytest.mark.slow
@pytest.mark.parametrize('model_name', ['tiny-qwen3', 'tiny-qwen3-moe'])
def test_tinker_format_builds_with_tinker_cookbook_to_base_plus_adapter_logits(tmp_path, model_name):
    """The adapter in Tinker's layout (expert stacks as 3-D tensors per expert): tinker-cookbook's
    build_hf_model merges it, and its build_lora_adapter writes a peft adapter, each with peft's
    base-plus-adapter logits of the adapter as twinkle saved it."""
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter

    checkpoint = train_and_save(model_name, tmp_path)
    tinker = tmp_path / 'tinker'
    tinker.mkdir()
    write_tinker_adapter(checkpoint, tinker)
    assert sorted(p.name for p in tinker.iterdir()) == ['adapter_config.json', 'adapter_model.safetensors']
    base = assets.tiny_model(model_name)
    expected = base_plus_adapter(model_name, checkpoint)
    build_hf_model(base_model=base, adapter_path=str(tinker), output_path=str(tmp_path / 'hf'), dtype='float32')
    torch.testing.assert_close(
        logits(AutoModelForCausalLM.from_pretrained(tmp_path / 'hf')), expected, atol=1e-5, rtol=1e-5
    )
    build_lora_adapter(base_model=base, adapter_path=str(tinker), output_path=str(tmp_path / 'peft'))
    torch.testing.assert_close(base_plus_adapter(model_name, tmp_path / 'peft'), expected, atol=1e-5, rtol=1e-5)
