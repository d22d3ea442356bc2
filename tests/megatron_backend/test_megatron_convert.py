"""Hugging Face Qwen3 / Qwen3-MoE <-> megatron-core GPTModel (twinkle.model.megatron.convert, state, compat).

One process (TP=1) runs here; every other layout (TP=2, PP=2, TP2xPP2, EP=2, TP2xEP2) runs in one torchrun
launch of 4 ranks over gloo (convert_worker.py, shared by the module fixture). On each: the round trip
Hugging Face -> megatron -> Hugging Face gives back every tensor bit for bit; megatron's logits equal the
Hugging Face model's (fp32, 1e-5); the gradients of a next-token loss, mapped back to Hugging Face names, equal
the Hugging Face model's (1e-5, relative to each tensor's largest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip('megatron.core')

import torch
from convert_worker import BATCH, LAYOUTS, MODELS, SEQ, check, hf_model

from twinkle import DeviceMesh, assets
from twinkle.assets.models import model_config
from twinkle.errors import CheckpointError, ConfigurationError
from twinkle.model.megatron import compat, convert, state

WORKER = Path(__file__).with_name('convert_worker.py')
TOLERANCE = 1e-5
RANKS = 4
CASES = [(layout, name) for layout in LAYOUTS for name in MODELS if not ('ep' in layout and name == 'tiny-qwen3')]


@pytest.fixture(scope='module')
def ranks(torchrun: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the 4 ranks found, by ``layout/model``."""
    for name in MODELS:
        assets.tiny_model(name)  # built once here, not by 4 ranks at once
    out = tmp_path_factory.mktemp('convert')
    torchrun(WORKER, RANKS, out)
    return [json.loads((out / f'rank{rank}.json').read_text()) for rank in range(RANKS)]


def assert_exact_round_trip(found: dict[str, Any]) -> None:
    assert found['missing'] == [] and found['unknown'] == [], found
    assert found['different'] == [], found['different']


@pytest.mark.parametrize('name', MODELS)
def test_one_process_round_trip_is_exact_and_logits_and_gradients_match(name: str) -> None:
    found = check(name, None)
    assert found['layout']['tp_size'] == found['layout']['pp_size'] == found['layout']['ep_size'] == 1
    assert_exact_round_trip(found)
    assert found['logits_shape'] == [BATCH, SEQ, hf_model(name).config.vocab_size]
    assert found['logits_max_diff'] <= TOLERANCE
    assert found['grads_max_relative_diff'] <= TOLERANCE


@pytest.mark.parametrize(('layout', 'name'), CASES)
def test_every_rank_exports_every_tensor_exactly(ranks: list[dict[str, Any]], layout: str, name: str) -> None:
    for rank in ranks:
        assert_exact_round_trip(rank[f'{layout}/{name}'])


@pytest.mark.parametrize(('layout', 'name'), CASES)
def test_the_last_stage_gives_the_hugging_face_logits(ranks: list[dict[str, Any]], layout: str, name: str) -> None:
    for rank in ranks:
        found = rank[f'{layout}/{name}']
        if found['layout']['pp_rank'] == found['layout']['pp_size'] - 1:
            assert found['logits_shape'] == [BATCH, SEQ, hf_model(name).config.vocab_size]
            assert found['logits_max_diff'] <= TOLERANCE
        else:
            assert found['logits_max_diff'] is None


@pytest.mark.parametrize(('layout', 'name'), CASES)
def test_gradients_match_the_hugging_face_model(ranks: list[dict[str, Any]], layout: str, name: str) -> None:
    for rank in ranks:
        found = rank[f'{layout}/{name}']
        # The MoE model under tensor parallel trains with sequence parallel (megatron needs it; compat allows it).
        assert found['sequence_parallel'] == (name == 'tiny-qwen3-moe' and found['layout']['tp_size'] > 1)
        assert found['grads_max_relative_diff'] <= TOLERANCE


@pytest.mark.parametrize('layout', LAYOUTS)
def test_megatron_groups_follow_the_mesh(ranks: list[dict[str, Any]], layout: str) -> None:
    mesh = DeviceMesh.from_sizes(device_type='cpu', **LAYOUTS[layout])
    for rank, results in enumerate(ranks):
        found = results[f'{layout}/tiny-qwen3-moe']['layout']
        coords = mesh.coords(rank)
        assert (found['tp_rank'], found['pp_rank'], found['dp_rank']) == (coords['tp'], coords['pp'], coords['dp'])
        assert (found['tp_size'], found['pp_size'], found['ep_size']) == (mesh.tp_size, mesh.pp_size, mesh.ep_size)


def dense_parameters(tp: int, layers: int, first: bool, last: bool) -> int:
    """tiny-qwen3's parameters on one rank, by hand: hidden 128, 4 query and 2 key/value heads of 32, MLP 384,
    vocabulary 4096, untied head. Matrices split over tp; norms whole."""
    hidden, head, mlp, vocab = 128, 32, 384, 4096
    matrices = (4 + 2 * 2) * head * hidden + hidden * hidden + 2 * mlp * hidden + hidden * mlp
    norms = 2 * hidden + 2 * head
    return (
        layers * (matrices // tp + norms)
        + (vocab * hidden // tp if first else 0)
        + (vocab * hidden // tp + hidden if last else 0)
    )


def test_each_rank_holds_its_share_of_the_dense_model(ranks: list[dict[str, Any]]) -> None:
    expected = {
        'tp2': [dense_parameters(2, 2, True, True)] * 4,
        'pp2': [dense_parameters(1, 1, True, False)] * 2 + [dense_parameters(1, 1, False, True)] * 2,
        'tp2pp2': [dense_parameters(2, 1, True, False)] * 2 + [dense_parameters(2, 1, False, True)] * 2,
    }
    assert dense_parameters(1, 2, True, True) == sum(p.numel() for p in hf_model('tiny-qwen3').parameters())
    for layout, per_rank in expected.items():
        assert [rank[f'{layout}/tiny-qwen3']['local_parameters'] for rank in ranks] == per_rank


def test_each_expert_parallel_rank_holds_half_the_experts(ranks: list[dict[str, Any]]) -> None:
    # 2 layers of 8 experts, each [gate; up] 2*96 x 128 and down 128 x 96: EP=2 holds 4 per layer.
    expert = 3 * 96 * 128
    whole = sum(p.numel() for p in hf_model('tiny-qwen3-moe').parameters())
    assert [rank['ep2/tiny-qwen3-moe']['local_parameters'] for rank in ranks] == [whole - 2 * 4 * expert] * 4


# --------------------------------------------------------------------------------------------------- one process


@pytest.fixture(scope='module')
def one_process() -> state.Layout:
    return state.initialize(None, seed=0)


def test_hub_checkpoints_experts_one_by_one_load_the_same(one_process: state.Layout) -> None:
    reference = hf_model('tiny-qwen3-moe')
    model = convert.build_model(reference.config)
    convert.load_hf_state_dict(model, reference.state_dict())
    one_by_one = convert.export_hf_state_dict(model, fused_experts=False)
    assert 'model.layers.1.mlp.experts.7.down_proj.weight' in one_by_one
    assert 'model.layers.1.mlp.experts.down_proj' not in one_by_one
    assert one_by_one.keys() == convert.hf_names(reference.config)
    again = convert.build_model(reference.config)
    convert.load_hf_state_dict(again, one_by_one)
    for key, tensor in convert.export_hf_state_dict(again).items():
        assert torch.equal(tensor, reference.state_dict()[key]), key


def test_a_state_dict_of_another_model_is_refused(one_process: state.Layout) -> None:
    model = convert.build_model(hf_model('tiny-qwen3-moe').config)
    with pytest.raises(CheckpointError, match=r"missing \['model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight"):
        convert.load_hf_state_dict(model, hf_model('tiny-qwen3').state_dict())
    config = hf_model('tiny-qwen3').config
    config.intermediate_size = 256
    smaller = convert.build_model(config)
    with pytest.raises(CheckpointError, match=r'mlp\.linear_fc1\.weight: this rank holds \(512, 128\)'):
        convert.load_hf_state_dict(smaller, hf_model('tiny-qwen3').state_dict())


def test_compat_patches_once_and_only_named_modules(one_process: state.Layout) -> None:
    import importlib

    assert compat.install() is False  # state.initialize installed it
    for name in compat.CPU_TORCH_MODULES:
        patched = importlib.import_module(name).torch
        assert patched.cuda.current_device() == torch.device('cpu')
        assert patched.zeros(2, device='cuda').device.type == 'cpu'
        assert patched.Tensor is torch.Tensor
    assert importlib.import_module('megatron.core.transformer.attention').torch is torch


def test_the_seeded_rng_tracker_forks_the_cpu_generator(one_process: state.Layout) -> None:
    from megatron.core import tensor_parallel

    state.initialize(None, seed=3)  # same sizes: groups kept, nothing re-seeded
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    torch.manual_seed(11)
    outside = torch.get_rng_state()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # the default generator is back where it was
    # The model-parallel stream: megatron's seed + 2718 + tp rank, on a generator of its own.
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(3 + 2718)))


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ('name', 'sizes', 'message'),
    [
        ('tiny-qwen3', {'tp_size': 3}, r'tp_size=3 does not divide num_attention_heads=4, num_key_value_heads=2, '
         r'vocab_size=4096 of this Qwen3ForCausalLM; tp sizes that divide num_attention_heads, num_key_value_heads, '
         r'vocab_size, intermediate_size are \[1, 2\]'),
        ('tiny-qwen3', {'tp_size': 4}, r'does not divide num_key_value_heads=2 of this Qwen3ForCausalLM; .* \[1, 2\]'),
        ('tiny-qwen3-moe', {'tp_size': 8}, r'num_attention_heads=4, num_key_value_heads=2 of this Qwen3MoeForCausalLM'),
        ('tiny-qwen3', {'pp_size': 3}, r'pp_size=3 does not divide num_hidden_layers=2; pp sizes that do are \[1, 2\]'),
        ('tiny-qwen3-moe', {'ep_size': 3}, r'ep_size=3 does not divide num_experts=8; .* \[1, 2, 4, 8\]'),
        ('tiny-qwen3', {'ep_size': 2}, r'ep_size=2 but a Qwen3ForCausalLM has no experts; use ep_size=1'),
        ('tiny-qwen3', {'cp_size': 2}, r'cp_size=2: context parallel needs Transformer Engine attention'),
    ],
)  # fmt: skip
def test_sizes_that_do_not_divide_the_model_are_refused(name: str, sizes: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        convert.transformer_config(model_config(name), **sizes)


def test_an_unsupported_architecture_is_refused() -> None:
    message = (
        r"Invalid architecture for the Megatron backend 'qwen3_5_text'. Accepted values are: \['qwen3', 'qwen3_moe'\]"
    )
    with pytest.raises(ConfigurationError, match=message):
        convert.transformer_config(model_config('tiny-qwen3.5'))


@pytest.mark.parametrize(
    ('sizes', 'message'),
    [
        ({'fsdp_size': 2}, r'megatron has no FSDP dimension \(fsdp_size=2\); use dp_size=2'),
        ({'dp_size': 2, 'ulysses_size': 2}, r'Ulysses sequence parallel \(ulysses_size=2\).*use cp_size'),
        ({'tp_size': 2}, r'DeviceMesh\(world_size=2, tp=2, device_type=.cpu.\) spans 2 processes but'),
    ],
)
def test_meshes_megatron_cannot_lay_out_are_refused(sizes: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        state.initialize(DeviceMesh.from_sizes(device_type='cpu', **sizes))


def test_tied_embeddings_share_one_tensor(one_process: state.Layout) -> None:
    from transformers import Qwen3ForCausalLM

    config = model_config('tiny-qwen3')
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(config).eval()
    model = convert.build_model(config)
    convert.load_hf_state_dict(model, reference.state_dict())
    exported = convert.export_hf_state_dict(model)
    # save_pretrained's names: the head is the embedding, written once.
    assert exported.keys() == reference.state_dict().keys() - {'lm_head.weight'}
    for key, tensor in exported.items():
        assert torch.equal(tensor, reference.state_dict()[key]), key
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(input_ids, torch.arange(SEQ).expand_as(input_ids), None)
        assert (got - reference(input_ids).logits).abs().max() <= TOLERANCE
