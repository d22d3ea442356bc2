"""LoRA on megatron's routed experts (tiny Qwen3-MoE): the same numbers at EP=2 and TP=2 (sequence
parallel) as in one process, a mixed pass equal to each adapter alone, and adapters that are peft's own
``target_parameters`` adapters on the Hugging Face model (its draws, its keys, its logits and gradients),
both ways.

One torchrun (2 ranks, gloo) runs ``dist_experts.py`` for the module; the Hugging Face side runs here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip('megatron.core')

import dist_experts
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from server_helpers import free_port
from test_megatron_lora import assert_close
from transformers import AutoModelForCausalLM

from twinkle import assets
from twinkle.errors import ConfigurationError
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.adapter import LoraSpec

MODEL = 'tiny-qwen3-moe'
ROWS_OF = {name: [i for i, row in enumerate(dist_experts.ROWS) if row == name] for name in dist_experts.SPECS}


@pytest.fixture(scope='module')
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each layout's results (``dist_experts.scenario``), by layout."""
    out = tmp_path_factory.mktemp('megatron-experts')
    assets.tiny_model(MODEL)  # built once here, not by two ranks at once
    command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', f'--master_port={free_port()}']
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    done = subprocess.run(
        [*command, str(Path(dist_experts.__file__)), str(out)], env=env, capture_output=True, timeout=600, check=False
    )
    output = (done.stdout + done.stderr).decode()
    assert done.returncode == 0, output[output.find('Traceback') :][:6000]
    return {layout: torch.load(out / f'{layout}.pt') for layout in dist_experts.LAYOUTS}


def peft_config(spec: LoraSpec, **extra: Any) -> LoraConfig:
    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=list(spec.target_modules) or None,
        target_parameters=list(spec.target_parameters),
        **extra,
    )


@pytest.mark.parametrize('layout', ['ep2', 'tp2'])
def test_parallel_layouts_give_one_process_numbers(results: dict[str, Any], layout: str) -> None:
    one, parallel = results['one'], results[layout]
    for name in dist_experts.SPECS:  # drawn from the same seeds: the same numbers whatever the layout
        assert_close(parallel['state'][name], one['state'][name])
    for run in ['mixed', *(f'alone-{name}' for name in dist_experts.SPECS)]:
        assert_close(parallel[run]['logits'], one[run]['logits'])
        for name in dist_experts.SPECS:
            assert_close(parallel[run]['grads'][name], one[run]['grads'][name])
    assert_close(parallel['base'], one['base'])


@pytest.mark.parametrize('layout', list(dist_experts.LAYOUTS))
def test_mixed_pass_equals_each_adapter_alone(results: dict[str, Any], layout: str) -> None:
    """Rows alice, bob, carol, None in one pass (under ep2 the two ranks hold different rows): each
    row's logits and each adapter's gradients, experts' included, are those of the adapter alone;
    the row without an adapter gets the base model's logits."""
    mixed = results[layout]['mixed']
    for name, rows in ROWS_OF.items():
        alone = results[layout][f'alone-{name}']
        assert_close(mixed['logits'][rows], alone['logits'][rows])
        assert_close(mixed['grads'][name], alone['grads'][name])
        expert_grads = [g for key, g in mixed['grads'][name].items() if '.experts.' in key]
        assert expert_grads and all(g.abs().sum() > 0 for g in expert_grads)  # the test can fail
        others = [n for n in dist_experts.SPECS if n != name]
        assert all(not g.any() for n in others for g in alone['grads'][n].values())
    base = results[layout]['base']
    assert_close(mixed['logits'][3], base[3])
    # Each adapter changes its row (bob's through the experts alone): the comparisons above can fail.
    assert all((mixed['logits'][rows] - base[rows]).abs().max() > 0.1 for rows in ROWS_OF.values())


def test_saved_adapters_load_in_peft_with_the_same_logits_and_gradients(results: dict[str, Any]) -> None:
    """Each adapter's saved tensors, on a fresh Hugging Face model under plain peft (``target_parameters``):
    the logits of every row to 1e-5, the gradients of a loss over its own rows to 1e-4."""
    one = results['one']
    ids, positions, weights = dist_experts.batch()
    for name, spec in dist_experts.SPECS.items():
        hf = AutoModelForCausalLM.from_pretrained(assets.tiny_model(MODEL))
        model = get_peft_model(hf, peft_config(spec))
        state = one['state'][name]
        assert list(get_peft_model_state_dict(model)) == list(state)
        assert not set_peft_model_state_dict(model, state).unexpected_keys
        own = torch.tensor([row == name for row in dist_experts.ROWS], dtype=weights.dtype)[:, None, None]
        logits = model(input_ids=ids, position_ids=positions).logits
        (logits * weights * own).sum().backward()
        assert_close(logits.detach(), one[f'alone-{name}']['logits'])
        grads = {key.replace('.default.', '.'): p.grad for key, p in model.named_parameters() if p.grad is not None}
        expected = one[f'alone-{name}']['grads'][name]
        assert set(grads) == set(expected)
        for key, grad in expected.items():
            error, scale = (grads[key] - grad).abs().max().item(), max(1.0, grad.abs().max().item())
            assert error <= 1e-4 * scale, f'{key}: differs by {error:.3g}'


def test_draws_are_peft_draws(results: dict[str, Any]) -> None:
    """Adapter alice was drawn after torch.manual_seed(0): peft draws the same numbers, under the same keys."""
    hf = AutoModelForCausalLM.from_pretrained(assets.tiny_model(MODEL))
    torch.manual_seed(0)
    model = get_peft_model(hf, peft_config(dist_experts.SPECS['alice'], init_lora_weights=False))
    expected = get_peft_model_state_dict(model)
    assert any('.experts.base_layer.lora_A' in key for key in expected)
    for layout in dist_experts.LAYOUTS:
        assert list(results[layout]['state']['alice']) == list(expected)
        assert_close(results[layout]['state']['alice'], expected)


def test_adapter_loaded_from_peft_tensors_gives_the_same_logits(results: dict[str, Any]) -> None:
    for layout in dist_experts.LAYOUTS:
        assert_close(results[layout]['loaded'], results[layout]['alone-alice']['logits'])


def test_megatron_model_saves_and_loads_peft_expert_adapters(tmp_path: Path) -> None:
    """One process, end to end: an adapter peft made on the Hugging Face model loads into
    ``MegatronModel`` with the same logits (1e-5), and ``MegatronModel.save`` writes files
    ``PeftModel.from_pretrained`` loads with the same logits."""
    from twinkle.model.megatron.model import MegatronModel

    hf = AutoModelForCausalLM.from_pretrained(assets.tiny_model(MODEL))
    torch.manual_seed(3)
    config = LoraConfig(
        r=2, lora_alpha=4, target_modules=['k_proj'], target_parameters=list(dist_experts.BOTH), init_lora_weights=False
    )
    peft = get_peft_model(hf, config)
    peft.save_pretrained(str(tmp_path / 'from-peft'))
    ids, positions, _ = dist_experts.batch()
    with torch.no_grad():
        expected = peft(input_ids=ids, position_ids=positions).logits
        with peft.disable_adapter():
            base = peft(input_ids=ids, position_ids=positions).logits
    assert (expected - base).abs().max() > 1e-2  # the adapter changes them: the test can fail

    model = MegatronModel(model_id=assets.tiny_model(MODEL))
    model.add_adapter_to_model('x', str(tmp_path / 'from-peft'))
    gpt = model.mcore.gpt
    with torch.no_grad(), multi_lora.row_adapters(gpt, 'x'):
        logits = model.mcore(ids, position_ids=positions).logits
    assert_close(logits, expected)

    saved = model.save('x-saved', str(tmp_path), adapter_name='x')
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets.tiny_model(MODEL)), saved)
    with torch.no_grad():
        assert_close(reloaded(input_ids=ids, position_ids=positions).logits, expected)


def test_expert_targets_that_cannot_work_are_refused() -> None:
    """One process: a target_parameters entry naming no stack, dropout on the stacks (peft refuses
    it there), and expert targets on a dense model; each names what would fit."""
    from twinkle.model.megatron import convert, lora, state

    state.initialize(None)
    moe = AutoModelForCausalLM.from_pretrained(assets.tiny_model(MODEL))
    model = convert.build_model(moe.config)
    convert.load_hf_state_dict(model, moe.state_dict())
    with pytest.raises(ConfigurationError, match=r"'mlp.experts.up_proj' matches no expert stack; stacks: \["):
        lora.add_adapter(model, 'x', LoraSpec(r=2, alpha=2, target_parameters=('mlp.experts.up_proj',)))
    with pytest.raises(ConfigurationError, match=r'lora_dropout=0\.1 with target_parameters'):
        lora.add_adapter(model, 'x', LoraSpec(r=2, alpha=2, dropout=0.1, target_parameters=dist_experts.BOTH))
    assert multi_lora.adapter_names(model) == []
    dense = AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3'))
    dense_model = convert.build_model(dense.config)
    with pytest.raises(ConfigurationError, match='matches no expert stack; stacks: none: no experts'):
        lora.add_adapter(dense_model, 'x', LoraSpec(r=2, alpha=2, target_parameters=('mlp.experts.down_proj',)))
