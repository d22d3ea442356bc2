"""The seeds' model families on their embedded tiny models: Qwen3.5 (gated-deltanet linear
attention beside full attention), Qwen3-MoE and Qwen3.5-MoE (fused expert stacks, a top-k
router, Qwen3.5-MoE's gated shared expert).

Each runs the paths that matter (local LoRA SFT, the mixed pass, ``TorchSampler`` with its
weights synced) and, on the MoE models, LoRA on the experts: 'all-linear' and peft's
``target_parameters`` reach the expert stacks, each row's tokens go through its own adapter's
experts, and the saved adapter loads in plain peft with the same logits."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from twinkle import assets
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.model import AdapterCall, TransformersModel
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.experts import MultiLoraExperts
from twinkle.model.output import layer as output_layer
from twinkle.sampler import TorchSampler

TOL = 1e-5
FAMILIES = ('tiny-qwen3.5', 'tiny-qwen3-moe', 'tiny-qwen3.5-moe')
MOE = ('tiny-qwen3-moe', 'tiny-qwen3.5-moe')
ALL_LINEAR = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
ATTENTION = LoraConfig(r=8, lora_alpha=8, target_modules=['q_proj', 'v_proj'], init_lora_weights=False)
EXPERTS_ONLY = LoraConfig(r=2, lora_alpha=4, target_parameters=['mlp.experts.down_proj'], init_lora_weights=False)


def rows(seed: int, lengths: list[int]) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(0, 4000, (length,), generator=generator).tolist()
        out.append({'input_ids': ids, 'labels': [-100, *ids[1:]]})
    return out


def model_with(name: str, adapters: dict[str, LoraConfig]) -> TransformersModel:
    model = TransformersModel(model_id=assets.tiny_model(name), device='cpu')
    for seed, (adapter, config) in enumerate(adapters.items()):
        torch.manual_seed(seed)
        model.add_adapter_to_model(adapter, config)
    return model


def grads(model: TransformersModel, adapter: str) -> list[torch.Tensor]:
    """The gradient the optimizer will see: summed over the loss items, divided by their count."""
    group = model.groups[adapter]
    return [p.grad / group.pending.items for p in group.params]


@pytest.mark.parametrize('name', FAMILIES)
def test_lora_sft_lowers_the_loss(name: str) -> None:
    model = model_with(name, {'a': ALL_LINEAR})
    model.set_optimizer('AdamW', lr=1e-2, adapter_name='a')
    batch = rows(0, [12, 9, 16])
    losses = []
    for _ in range(6):
        losses.append(model.forward_backward(inputs=batch, adapter_name='a').loss)
        model.clip_grad_and_step(adapter_name='a')
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize('name', FAMILIES)
def test_the_mixed_pass_gives_each_adapter_what_it_gets_alone(name: str) -> None:
    adapters = {'a': ALL_LINEAR, 'b': EXPERTS_ONLY if name in MOE else ATTENTION}
    mixed = model_with(name, adapters)
    alone = copy.deepcopy(mixed)
    calls = {'a': rows(1, [9, 14]), 'b': rows(2, [20, 5, 11])}
    losses = {
        adapter: alone.forward_backward(inputs=batch, adapter_name=adapter).loss for adapter, batch in calls.items()
    }
    outputs = mixed.forward_backward_mixed([AdapterCall(adapter, batch) for adapter, batch in calls.items()])
    for (adapter, loss), output in zip(losses.items(), outputs, strict=True):
        assert abs(output.loss - loss) <= TOL, adapter
        for g_mixed, g_alone in zip(grads(mixed, adapter), grads(alone, adapter), strict=True):
            assert (g_mixed - g_alone).abs().max().item() <= TOL, adapter


@pytest.mark.slow
@pytest.mark.parametrize('name', FAMILIES)
@pytest.mark.parametrize('merge', [True, False])
def test_the_sampler_samples_the_trained_adapter(name: str, merge: bool) -> None:
    """Synced into ``TorchSampler`` (merged or as an adapter), the sampler's logprobs of what it
    samples equal the trainer's teacher-forced logprobs of the same tokens."""
    model = model_with(name, {'a': ALL_LINEAR})
    sampler = TorchSampler(assets.tiny_model(name), device='cpu')
    CheckpointEngineManager(model, sampler).sync_weights(merge_and_sync=merge, adapter_name='a')
    # Prompts of different lengths (left padding), two sequences each, and a stop on a third of
    # the vocabulary, so rows finish at different steps and the cache drops them as they do.
    params = SamplingParams(max_tokens=8, seed=0, num_samples=2, ignore_eos=True, stop=list(range(0, 4096, 3)))
    prompts = [{'input_ids': [11, 23, 5, 42]}, {'input_ids': [7, 300, 9]}, {'input_ids': [1000, 2, 77, 18, 6, 4]}]
    replies = sampler.sample(prompts, params, adapter_name=None if merge else 'a')
    sequences = [sequence for reply in replies for sequence in reply.sequences]
    assert len({len(s.tokens) for s in sequences}) > 1  # rows did finish at different steps
    features = [sequence.new_input_feature for sequence in sequences]
    logps = model.forward_only(inputs=features, adapter_name='a').logps
    for i, (sequence, feature) in enumerate(zip(sequences, features, strict=True)):
        teacher = logps[i, : len(feature['labels'])][torch.tensor(feature['completion_mask']).bool()]
        assert len(sequence.token_logprobs) == len(teacher) == len(sequence.tokens)
        assert (torch.tensor(sequence.token_logprobs) - teacher).abs().max().item() <= 1e-4


# ---- LoRA on experts --------------------------------------------------------------------------------


@pytest.mark.parametrize('name', MOE)
def test_all_linear_reaches_the_experts_and_leaves_the_router(name: str) -> None:
    model = model_with(name, {'a': ALL_LINEAR})
    layers = multi_lora.multi_lora_layers(model.model)
    experts = [path for path, layer in layers.items() if isinstance(layer, MultiLoraExperts)]
    assert experts == [f'model.layers.{i}.mlp.experts' for i in range(2)]
    assert all(list(layers[path].adapter_stacks('a')) == ['gate_up_proj', 'down_proj'] for path in experts)
    assert not any(path.endswith('.gate') for path in layers)  # the router is not a linear layer, nor adapted
    assert multi_lora.adapter_expert_stacks(model.model, 'a') == [
        f'model.layers.{i}.mlp.experts.{stack}' for i in range(2) for stack in ('gate_up_proj', 'down_proj')
    ]


@pytest.mark.parametrize('name', MOE)
def test_expert_adapters_train_and_the_base_stays(name: str) -> None:
    model = model_with(name, {'a': ALL_LINEAR})
    model.set_optimizer('AdamW', lr=1e-2, adapter_name='a')
    base = {k: v.detach().clone() for k, v in model.model.named_parameters() if '.adapters.' not in k}
    model.forward_backward(inputs=rows(3, [16, 12]), adapter_name='a')
    expert_params = {
        k: p for k, p in multi_lora.adapter_named_parameters(model.model, 'a').items() if '.experts.adapters.' in k
    }
    assert len(expert_params) == 2 * 2 * 2  # layers x stacks x (A, B)
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in expert_params.values())
    before = {k: p.detach().clone() for k, p in expert_params.items()}
    model.clip_grad_and_step(adapter_name='a')
    assert all(not torch.equal(before[k], p) for k, p in expert_params.items())
    after = dict(model.model.named_parameters())
    assert all(torch.equal(after[k], v) and not after[k].requires_grad for k, v in base.items())
    assert any(k.endswith('mlp.gate.weight') for k in base)  # the router is among the unchanged


@pytest.mark.parametrize('name', MOE)
def test_each_row_goes_through_its_own_adapters_experts(name: str) -> None:
    """One adapter on the experts only: its rows change, the base rows beside them do not."""
    model = model_with(name, {'e': EXPERTS_ONLY})
    batch = rows(4, [10, 10])
    ids = torch.tensor([r['input_ids'] for r in batch])
    with torch.no_grad():
        with multi_lora.row_adapters(model.model, None):
            plain = model.model(input_ids=ids).logits
        with multi_lora.row_adapters(model.model, ['e', None]):
            mixed = model.model(input_ids=ids).logits
    # The base row beside the adapter's row: its numbers (to float rounding: with an adapter in the
    # batch the experts run in this module's loop, not transformers' own kernel).
    assert (mixed[1] - plain[1]).abs().max().item() <= TOL
    assert (mixed[0] - plain[0]).abs().max().item() > 1e-3


@pytest.mark.parametrize('name', MOE)
def test_rows_of_one_adapter_apart_get_what_they_get_alone(name: str) -> None:
    """Rows ['e', None, 'e'] (the adapter's rows not in one run: gathered, not sliced)."""
    model = model_with(name, {'e': EXPERTS_ONLY})
    batch = rows(10, [9, 9, 9])
    ids = torch.tensor([r['input_ids'] for r in batch])
    with torch.no_grad():
        with multi_lora.row_adapters(model.model, ['e', None, 'e']):
            together = model.model(input_ids=ids).logits
        for i, adapter in enumerate(['e', None, 'e']):
            with multi_lora.row_adapters(model.model, adapter):
                alone = model.model(input_ids=ids[i : i + 1]).logits
            assert (together[i] - alone[0]).abs().max().item() <= TOL


def test_target_parameters_beside_all_linear_name_the_stacks() -> None:
    config = LoraConfig(r=2, target_modules='all-linear', target_parameters=['mlp.experts.down_proj'])
    model = model_with('tiny-qwen3-moe', {'a': config})
    assert multi_lora.adapter_expert_stacks(model.model, 'a') == [
        'model.layers.0.mlp.experts.down_proj',
        'model.layers.1.mlp.experts.down_proj',
    ]


@pytest.mark.slow
@pytest.mark.parametrize('name', MOE)
@pytest.mark.parametrize('config', [ALL_LINEAR, EXPERTS_ONLY], ids=['all-linear', 'target_parameters'])
def test_a_saved_expert_adapter_loads_in_plain_peft_with_the_same_logits(
    name: str, config: LoraConfig, tmp_path
) -> None:
    model = model_with(name, {'a': config})
    model.set_optimizer('AdamW', lr=1e-2, adapter_name='a')
    model.forward_backward(inputs=rows(5, [12]), adapter_name='a')
    model.clip_grad_and_step(adapter_name='a')
    path = model.save('exported', str(tmp_path), adapter_name='a')
    ids = torch.tensor([rows(6, [14])[0]['input_ids']])
    with torch.no_grad(), multi_lora.row_adapters(model.model, 'a'):
        ours = model.model(input_ids=ids).logits
    base = AutoModelForCausalLM.from_pretrained(assets.tiny_model(name), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, path).eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= TOL


def test_target_parameters_that_match_no_stack_are_refused_by_name() -> None:
    config = LoraConfig(r=2, target_parameters=['mlp.experts.up_proj'])
    with pytest.raises(ConfigurationError, match=r"'mlp.experts.up_proj' matches no expert stack.*experts.down_proj"):
        model_with('tiny-qwen3-moe', {'a': config})


# ---- the router: its load-balancing loss and the experts' load ----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize('name', MOE)
def test_the_routers_load_balancing_loss_joins_the_training_loss(name: str) -> None:
    """With coefficient c the loss is the language-model loss plus c x transformers' own
    ``aux_loss`` of the same batch (padding left out), and the adapter's gradient changes."""
    batch = rows(7, [12, 7])
    losses, grad_norms = {}, {}
    for coef in (0.0, 0.5):
        model = TransformersModel(model_id=assets.tiny_model(name), device='cpu', router_aux_loss_coef=coef)
        torch.manual_seed(0)
        model.add_adapter_to_model('a', LoraConfig(r=4, lora_alpha=8, target_modules='all-linear'))  # B = 0
        losses[coef] = model.forward_backward(inputs=batch, adapter_name='a').loss
        grad_norms[coef] = torch.stack([p.grad.norm() for p in model.groups['a'].params]).norm().item()
    reference = AutoModelForCausalLM.from_pretrained(assets.tiny_model(name), dtype=torch.float32)
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, : len(row['input_ids'])], mask[i, : len(row['input_ids'])] = torch.tensor(row['input_ids']), 1
    with torch.no_grad():
        aux = reference(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss.item()
    assert abs(losses[0.5] - losses[0.0] - 0.5 * aux) <= TOL
    assert aux > 1.0  # not a perfect balance, so the term is there to see
    assert abs(grad_norms[0.5] - grad_norms[0.0]) > 1e-4


@pytest.mark.parametrize('name', MOE)
def test_forward_only_leaves_the_routers_loss_out(name: str) -> None:
    """Evaluation reports the language-model loss: the load-balancing term trains, it is not scored."""
    batch = rows(9, [11, 6])
    losses = {}
    for coef in (0.0, 0.5):
        model = TransformersModel(model_id=assets.tiny_model(name), device='cpu', router_aux_loss_coef=coef)
        torch.manual_seed(0)
        model.add_adapter_to_model('a', ALL_LINEAR)
        model.forward_only(inputs=batch, adapter_name='a')
        losses[coef] = model.calculate_loss(adapter_name='a')
    assert losses[0.5] == losses[0.0]


@pytest.mark.parametrize('name', MOE)
def test_the_experts_load_is_a_metric(name: str) -> None:
    model = model_with(name, {'a': ALL_LINEAR})
    batch = rows(8, [10, 6])
    model.forward_backward(inputs=batch, adapter_name='a')
    load = next(m for m in model.groups['a'].spec.train_metrics if type(m).__name__ == 'ExpertLoad')
    tokens = load.tokens_per_expert
    assert tokens is not None
    metrics = model.calculate_metric(adapter_name='a')
    assert tokens.shape == (2, 8)
    assert tokens.sum(dim=1).tolist() == [16 * 2, 16 * 2]  # every real token, to its top 2 experts
    for layer in range(2):
        assert metrics[f'expert_imbalance/layer_{layer}'] == pytest.approx((tokens[layer].max() / 4).item())
    assert metrics['expert_imbalance'] == pytest.approx((tokens.max(dim=1).values / 4).max().item())
    assert metrics['router_aux_loss'] > 0


def test_a_router_loss_on_a_dense_model_is_refused() -> None:
    with pytest.raises(ConfigurationError, match='needs a mixture of experts'):
        TransformersModel(model_id=assets.tiny_model('tiny-qwen3.5'), device='cpu', router_aux_loss_coef=0.1)


def test_vllm_refuses_an_expert_adapter_by_name() -> None:
    """vLLM is given merged weights for adapters on expert stacks (its LoRA format is not peft's)."""
    from twinkle.sampler.vllm_sampler import adapter_config_json

    model = model_with('tiny-qwen3-moe', {'a': ALL_LINEAR})
    with pytest.raises(ConfigurationError, match=r'merge_and_sync=True'):
        adapter_config_json(model.groups['a'].spec.config, multi_lora.peft_state_dict(model.model, 'a'))


def test_a_native_runs_expert_stacks_are_tinkers_train_mlp() -> None:
    from twinkle.server.api.tinker.rest import _switches

    targets = {'train_attn': {'q_proj'}, 'train_mlp': set(), 'train_unembed': {'lm_head'}}
    assert _switches({'target_parameters': ['mlp.experts.down_proj']}, targets) == {
        'train_attn': False,
        'train_mlp': True,
        'train_unembed': False,
    }
    assert _switches({'target_modules': ['q_proj']}, targets)['train_mlp'] is False


@pytest.mark.parametrize('name', ['tiny-qwen3', *FAMILIES])
def test_the_fused_output_layer_gives_every_family_its_unfused_loss_and_gradients(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fused_output is on by default at a real vocabulary (every real model of these families): the
    # embedded models' 4,096 outputs keep it off, so each family is checked with it on here.
    unfused = model_with(name, {'a': ALL_LINEAR})
    fused = copy.deepcopy(unfused)
    fused.fused_output = True
    chunked = []  # the fused layer's calls: the fused model must not fall back to whole logits
    real = output_layer.fused_token_logprobs
    monkeypatch.setattr(output_layer, 'fused_token_logprobs', lambda *a, **k: chunked.append(1) or real(*a, **k))
    assert not unfused.fused_output
    batch = rows(3, [12, 9, 16])
    loss = unfused.forward_backward(inputs=batch, adapter_name='a').loss
    assert fused.forward_backward(inputs=batch, adapter_name='a').loss == pytest.approx(loss, abs=1e-5)
    assert chunked
    for got, expected in zip(grads(fused, 'a'), grads(unfused, 'a'), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
