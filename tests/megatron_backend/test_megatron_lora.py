"""LoRA on megatron's parallel linears: the same numbers at TP=1, TP=2 and PP=2, a mixed pass equal
to each adapter alone, and adapters that are peft's own (its draws, its keys, its logits and
gradients on the Hugging Face model).

One torchrun (2 ranks, gloo) runs ``dist_lora.py`` for the module; the Hugging Face side runs here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip('megatron.core')

import dist_lora
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from server_helpers import free_port
from transformers import AutoModelForCausalLM

from twinkle import assets
from twinkle.errors import ConfigurationError
from twinkle.model.lora.adapter import LoraSpec
from twinkle.model.megatron import lora

ROWS_OF = {name: [i for i, row in enumerate(dist_lora.ROWS) if row == name] for name in dist_lora.SPECS}


@pytest.fixture(scope='module')
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each layout's results (``dist_lora.scenario``), by layout."""
    import os

    out = tmp_path_factory.mktemp('megatron-lora')
    assets.tiny_model('tiny-qwen3')  # built once here, not by two ranks at once
    command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', f'--master_port={free_port()}']
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    done = subprocess.run(
        [*command, str(Path(dist_lora.__file__)), str(out)], env=env, capture_output=True, timeout=600, check=False
    )
    output = (done.stdout + done.stderr).decode()
    assert done.returncode == 0, output[output.find('Traceback') :][:6000]
    return {layout: torch.load(out / f'{layout}.pt') for layout in dist_lora.LAYOUTS}


def assert_close(
    actual: dict[str, torch.Tensor] | torch.Tensor, expected: dict[str, torch.Tensor] | torch.Tensor
) -> None:
    """Equal to 1e-5 of each tensor's scale (its largest magnitude, or 1 if that is smaller): a
    gradient of size 4 summed in another order over ranks moves by about 1e-5 in float32."""
    if isinstance(actual, dict):
        assert isinstance(expected, dict) and list(actual) == list(expected)
        for key in actual:
            assert_close(actual[key], expected[key])
        return
    assert isinstance(expected, torch.Tensor) and actual.shape == expected.shape
    error, scale = (actual - expected).abs().max().item(), max(1.0, expected.abs().max().item())
    assert error <= 1e-5 * scale, f'differs by {error:.3g} (scale {scale:.3g})'


@pytest.mark.parametrize('layout', ['tp2', 'pp2'])
def test_parallel_layouts_give_one_process_numbers(results: dict[str, Any], layout: str) -> None:
    one, parallel = results['tp1'], results[layout]
    for name in dist_lora.SPECS:  # drawn from the same seeds: the same numbers whatever the layout
        assert_close(parallel['state'][name], one['state'][name])
    for run in ['mixed', *(f'alone-{name}' for name in dist_lora.SPECS)]:
        assert_close(parallel[run]['logits'], one[run]['logits'])
        for name in dist_lora.SPECS:
            assert_close(parallel[run]['grads'][name], one[run]['grads'][name])


@pytest.mark.parametrize('layout', list(dist_lora.LAYOUTS))
def test_gradient_norm_counts_each_parameter_once(results: dict[str, Any], layout: str) -> None:
    """megatron's norm over the ranks' LoRA parameters (shards once, replicas once) is the norm of
    the whole gradients."""
    mixed = results[layout]['mixed']
    whole = sum(g.pow(2).sum() for grads in results['tp1']['mixed']['grads'].values() for g in grads.values())
    assert mixed['grad_norm'] == pytest.approx(float(whole) ** 0.5, rel=1e-5)


@pytest.mark.parametrize('layout', list(dist_lora.LAYOUTS))
def test_mixed_pass_equals_each_adapter_alone(results: dict[str, Any], layout: str) -> None:
    """Rows alice, alice, bob, carol in one pass: each row's logits and each adapter's gradients are
    those of the adapter alone on its rows (a gradient comes from its own rows only)."""
    mixed = results[layout]['mixed']
    for name, rows in ROWS_OF.items():
        alone = results[layout][f'alone-{name}']
        assert_close(mixed['logits'][rows], alone['logits'])
        assert_close(mixed['grads'][name], alone['grads'][name])
        assert any(g.abs().sum() > 0 for g in mixed['grads'][name].values())  # the test can fail
        others = [n for n in dist_lora.SPECS if n != name]
        assert all(not g.any() for n in others for g in alone['grads'][n].values())


def peft_model(state: dict[str, dict[str, torch.Tensor]]) -> Any:
    """The Hugging Face tiny Qwen3 under peft with adapters alice, bob and carol loaded from ``state``."""
    hf = AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3'))
    model = None
    for name, spec in dist_lora.SPECS.items():
        config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=spec.target_modules)
        if model is None:
            model = get_peft_model(hf, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        result = set_peft_model_state_dict(model, state[name], adapter_name=name)
        assert not result.unexpected_keys
    return model


def test_saved_adapters_load_in_peft_with_the_same_logits_and_gradients(results: dict[str, Any]) -> None:
    one = results['tp1']
    model = peft_model(one['state'])
    ids, positions, weights = dist_lora.batch()
    for name, rows in ROWS_OF.items():
        model.set_adapter(name)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[rows], position_ids=positions[rows]).logits
        (logits * weights[rows]).sum().backward()
        assert_close(logits.detach(), one[f'alone-{name}']['logits'])
        grads = {
            key.replace(f'.{name}.', '.'): param.grad
            for key, param in model.named_parameters()
            if f'.lora_A.{name}.' in key or f'.lora_B.{name}.' in key
        }
        expected = one[f'alone-{name}']['grads'][name]
        assert_close({key: grads[key] for key in expected}, expected)
        assert set(grads) == set(expected)


def test_dropout_keeps_tensor_parallel_replicas_equal(results: dict[str, Any]) -> None:
    """The ranks of one tensor-parallel group drop the same inputs of a column-parallel layer
    (their RNGs differ: two data-parallel replicas at tp1 do not), so replicated gradients agree."""
    assert results['tp2']['dropout']['spread'] == 0
    assert results['tp1']['dropout']['spread'] > 0
    assert all(results[layout]['dropout']['effect'] > 1e-3 for layout in dist_lora.LAYOUTS)


def test_adapter_loaded_from_peft_tensors_gives_the_same_logits(results: dict[str, Any]) -> None:
    for layout in dist_lora.LAYOUTS:
        assert_close(results[layout]['loaded'], results[layout]['alone-alice']['logits'])


def test_draws_are_peft_draws(results: dict[str, Any]) -> None:
    """Adapter alice was drawn after torch.manual_seed(0): peft draws the same numbers, under the same keys."""
    hf = AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3'))
    spec = dist_lora.SPECS['alice']
    torch.manual_seed(0)
    model = get_peft_model(
        hf, LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules='all-linear', init_lora_weights=False)
    )
    expected = get_peft_model_state_dict(model)
    assert list(results['tp1']['state']['alice']) == list(expected)
    for layout in dist_lora.LAYOUTS:
        assert_close(results[layout]['state']['alice'], expected)


def test_targets_megatron_does_not_have_are_refused_by_name(results: dict[str, Any]) -> None:
    for layout in dist_lora.LAYOUTS:
        messages = results[layout]['refused']
        assert "target_modules entry 'linear_qkv' matches no projection" in messages['megatron-name']
        assert (
            "['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj']" in messages['megatron-name']
        )
        assert "pattern 'model\\\\.layers\\\\.9\\\\..*' matches no projection" in messages['pattern']
        assert 'target_modules is empty' in messages['empty']


def test_a_model_without_megatron_layers_is_refused() -> None:
    with pytest.raises(ConfigurationError, match='no megatron decoder layer'):
        lora.add_adapter(torch.nn.Sequential(torch.nn.Linear(2, 2)), 'x', LoraSpec(r=2, alpha=2))


def test_attention_lora_on_a_mixture_of_experts_matches_peft() -> None:
    """On tiny Qwen3-MoE (one process): attention adapters drawn from a seed give peft's logits for
    that seed. 'all-linear' is refused: peft turns it into the attention projections, the router's
    weight and the expert stacks (gate_up_proj at rank 2r), and the router takes no adapter here
    (the expert stacks do: test_megatron_experts.py)."""
    from twinkle.model.lora import multi as multi_lora
    from twinkle.model.megatron import convert, state

    state.initialize(None)
    hf = AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3-moe'))
    peft_all_linear = LoraConfig(r=2, lora_alpha=4, target_modules='all-linear')
    get_peft_model(AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3-moe')), peft_all_linear)
    assert set(peft_all_linear.target_parameters) == {'gate.weight', 'gate_up_proj', 'down_proj'}  # why it is refused
    model = convert.build_model(hf.config)
    convert.load_hf_state_dict(model, hf.state_dict())
    with pytest.raises(ConfigurationError, match=r"'all-linear' on a mixture of experts: .*'mlp.gate.weight'"):
        lora.add_adapter(model, 'x', LoraSpec(r=2, alpha=4))
    targets = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
    torch.manual_seed(0)
    lora.add_adapter(model, 'x', LoraSpec(r=2, alpha=4, target_modules=targets, init='random'))
    ids, positions, _ = dist_lora.batch()
    with torch.no_grad(), multi_lora.row_adapters(model, 'x'):
        logits = model(ids, positions, None)
    with torch.no_grad(), multi_lora.row_adapters(model, None):
        base = model(ids, positions, None)
    torch.manual_seed(0)
    peft = get_peft_model(hf, LoraConfig(r=2, lora_alpha=4, target_modules=list(targets), init_lora_weights=False))
    with torch.no_grad():
        expected = peft(input_ids=ids, position_ids=positions).logits
    assert_close(logits, expected)
    assert (logits - base).abs().max() > 1e-2  # the adapter changed them
