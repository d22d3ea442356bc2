"""``TransformersModel(fused_output=True)``: training passes run the output layer fused (label
logprobs in chunks of tokens, no ``[tokens, vocab]`` logits) and give the unfused numbers.

Each case trains one copy of the same model with the switch off and one with it on, from the same
adapter weights on the same rows, and compares the loss, every adapter gradient (1e-5, float32) and
the metrics; cases cover padded and packed rows, micro-batches, a LoRA on the output layer, the
reference pass of a KL term, the policy-gradient, preference and Tinker losses, and the mixed pass.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from peft import LoraConfig

from twinkle.loss import Loss, LossOutput
from twinkle.loss.tinker import TINKER_LOSSES
from twinkle.metric import Metric
from twinkle.model import AdapterCall, TransformersModel

TOL = 1e-5
ADAPTERS = {
    # 'head' adapts the output layer too: its LoRA runs inside the fused layer.
    'head': LoraConfig(r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj', 'lm_head'], init_lora_weights=False),
    'body': LoraConfig(r=8, lora_alpha=16, target_modules='all-linear', init_lora_weights=False),
}


def _rows(seed: int, lengths: list[int], prompt: int = 2) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        ids = torch.randint(0, 4000, (length,), generator=gen).tolist()
        rows.append({'input_ids': ids, 'labels': [-100] * prompt + ids[prompt:]})
    return rows


ROWS = _rows(0, [9, 14, 6, 11])


@pytest.fixture(scope='module')
def base(tiny_model_dir: str) -> TransformersModel:
    model = TransformersModel(model_id=tiny_model_dir, device='cpu')
    for index, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(index)
        model.add_adapter_to_model(name, config)
    return model


def _pair(base: TransformersModel) -> tuple[TransformersModel, TransformersModel]:
    unfused, fused = copy.deepcopy(base), copy.deepcopy(base)
    fused.fused_output = True
    return unfused, fused


def _grads(model: TransformersModel, name: str) -> list[torch.Tensor]:
    group = model.groups[name]
    return [p.grad / group.pending.items.clamp(min=1) for p in group.params]  # a summed loss (Tinker) counts 0


def _assert_same(unfused: TransformersModel, fused: TransformersModel, names: list[str]) -> dict[str, float]:
    """Equal gradients and metrics; the last adapter's metrics (reading them resets them)."""
    got: dict[str, float] = {}
    for name in names:
        assert fused._runner.fused_reads([fused.groups[name].spec.loss]) is not None, name  # the fused layer ran
        grads, expected = _grads(fused, name), _grads(unfused, name)
        assert all(g.abs().max() > 0 for g in expected), name  # every layer of the adapter trained
        worst = max((g - e).abs().max().item() for g, e in zip(grads, expected, strict=True))
        assert worst <= TOL, (name, worst)
        got, want = fused.calculate_metric(adapter_name=name), unfused.calculate_metric(adapter_name=name)
        assert got.keys() == want.keys() and 'accuracy' in want  # counted from the fused layer's hits
        for key in want:
            if key != 'tokens_per_s':
                assert got[key] == pytest.approx(want[key], rel=1e-6, abs=TOL), (name, key)
    return got


@pytest.mark.slow
@pytest.mark.parametrize('layout', ['padded', 'packed', 'packed-by-switch', 'micro'])
@pytest.mark.parametrize('adapter', ['head', 'body'])
def test_cross_entropy_fused_equals_unfused(base: TransformersModel, layout: str, adapter: str) -> None:
    unfused, fused = _pair(base)
    for model in (unfused, fused):
        if layout == 'packed':
            model.set_processor('InputProcessor', padding_free=True, adapter_name=adapter)
        else:
            model.padding_free = layout == 'packed-by-switch'  # False: the rows padded
    kwargs = {'micro_batch_size': 1} if layout == 'micro' else {}
    want = unfused.forward_backward(inputs=ROWS, adapter_name=adapter, **kwargs).loss
    got = fused.forward_backward(inputs=ROWS, adapter_name=adapter, **kwargs).loss
    assert got == pytest.approx(want, rel=1e-6, abs=TOL)  # a sum of many terms: relative
    _assert_same(unfused, fused, [adapter])


def _policy_inputs(rows: list[dict[str, Any]]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    old = [(-torch.rand(len(r['input_ids']) - 2, generator=gen) * 4).tolist() for r in rows]
    return {'advantages': torch.randn(len(rows), generator=gen).tolist(), 'old_logps': old}


@pytest.mark.slow
@pytest.mark.parametrize(('loss', 'kwargs'), [('GRPOLoss', {'beta': 0.04}), ('CISPOLoss', {}), ('GSPOLoss', {})])
def test_policy_gradient_losses_fused_equal_unfused(base: TransformersModel, loss: str, kwargs: dict) -> None:
    # GRPO with beta > 0 runs the reference pass too (the base model's label logprobs, fused).
    unfused, fused = _pair(base)
    for model in (unfused, fused):
        model.set_loss(loss, adapter_name='head', **kwargs)
        model.add_metric('GRPOMetric', adapter_name='head')
    inputs = _policy_inputs(ROWS)
    want = unfused.forward_backward(inputs=ROWS, adapter_name='head', **inputs).loss
    got = fused.forward_backward(inputs=ROWS, adapter_name='head', **inputs).loss
    assert got == pytest.approx(want, rel=1e-6, abs=TOL)  # a sum of many terms: relative
    metrics = _assert_same(unfused, fused, ['head'])
    assert metrics['entropy'] > 0  # the entropy metric, from the fused layer
    if kwargs.get('beta'):
        assert 'kl' in metrics


def test_dpo_fused_equals_unfused(base: TransformersModel) -> None:
    unfused, fused = _pair(base)
    for model in (unfused, fused):
        model.set_loss('DPOLoss', beta=0.1, adapter_name='body')
    pairs = _rows(3, [8, 10, 7, 12], prompt=3)  # chosen_0, rejected_0, chosen_1, rejected_1
    want = unfused.forward_backward(inputs=pairs, adapter_name='body').loss
    got = fused.forward_backward(inputs=pairs, adapter_name='body').loss
    assert got == pytest.approx(want, rel=1e-6, abs=TOL)  # a sum of many terms: relative
    _assert_same(unfused, fused, ['body'])


def _tinker_inputs(loss_fn: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    values = {
        'weights': lambda n: torch.rand(n, generator=gen).tolist(),
        'logprobs': lambda n: (-torch.rand(n, generator=gen) * 3).tolist(),
        'advantages': lambda n: torch.randn(n, generator=gen).tolist(),
    }
    lengths = [len(row['input_ids']) for row in rows]
    return {name: [values[name](n) for n in lengths] for name in TINKER_LOSSES[loss_fn].required}


@pytest.mark.slow
@pytest.mark.parametrize('loss_fn', ['cross_entropy', 'importance_sampling', 'ppo'])
def test_tinker_losses_fused_equal_unfused(base: TransformersModel, loss_fn: str) -> None:
    rows = _rows(5, [7, 12, 9], prompt=0)  # Tinker datums: every position has a target
    unfused, fused = _pair(base)
    for model in (unfused, fused):
        model.set_loss('TinkerLoss', loss_fn=loss_fn, adapter_name='head')
    inputs = _tinker_inputs(loss_fn, rows)
    want = unfused.forward_backward(inputs=rows, adapter_name='head', **inputs).loss
    got = fused.forward_backward(inputs=rows, adapter_name='head', **inputs).loss
    assert got == pytest.approx(want, rel=1e-6, abs=TOL)  # a sum of many terms: relative
    _assert_same(unfused, fused, ['head'])


def test_mixed_pass_fused_gives_each_adapter_its_unfused_numbers(base: TransformersModel) -> None:
    # 'head' (a LoRA on the output layer) and 'body' (none there) share one forward: the fused
    # layer runs 'head's rows through its head LoRA and 'body's through the base head.
    unfused, fused = _pair(base)
    for model in (unfused, fused):
        model.set_loss('GRPOLoss', adapter_name='body')
    calls = [
        AdapterCall('head', ROWS[:2]),
        AdapterCall('body', _rows(9, [5, 13, 8]), _policy_inputs(_rows(9, [5, 13, 8]))),
    ]
    want = unfused.forward_backward_mixed(calls)
    got = fused.forward_backward_mixed(calls)
    for w, g in zip(want, got, strict=True):
        assert not isinstance(w, Exception) and not isinstance(g, Exception)
        assert g.loss == pytest.approx(w.loss, abs=TOL)
    _assert_same(unfused, fused, ['head', 'body'])


class _Recorder(Loss):
    """Cross entropy that records what the model handed it."""

    def __init__(self, reads: str) -> None:
        self.output_reads = reads  # type: ignore[misc]
        self.seen: list[dict[str, tuple[int, ...]]] = []

    def __call__(self, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], **kwargs: Any) -> LossOutput:
        self.seen.append({key: tuple(value.shape) for key, value in outputs.items()})
        mask = inputs['labels'] != -100
        if 'logps' in outputs:
            logps = outputs['logps']
        else:
            logps = torch.log_softmax(outputs['logits'].float(), -1).gather(
                -1, inputs['labels'].clamp(min=0)[..., None]
            )
            logps = logps.squeeze(-1) * mask
        return LossOutput(loss=-logps.sum(), num_items=mask.sum())


def test_the_fused_layer_hands_the_loss_no_logits_and_a_logits_loss_gets_them(base: TransformersModel) -> None:
    _, fused = _pair(base)
    for reads in ('logps', 'logits'):
        recorder = _Recorder(reads)
        fused.set_loss(recorder, adapter_name='body')
        fused.forward_backward(inputs=ROWS, adapter_name='body')
        (seen,) = recorder.seen
        width = max(len(row['input_ids']) for row in ROWS)
        if reads == 'logps':
            assert 'logits' not in seen and seen['logps'] == seen['hits'] == (len(ROWS), width)
        else:  # a loss that reads the logits gets them on a fused model
            assert seen['logits'][:2] == (len(ROWS), width) and 'logps' not in seen
    # forward() still returns the logits a caller asked for.
    assert fused.forward(inputs=ROWS, adapter_name='body').logits is not None


class _TopLogit(Metric):
    """A user's metric that reads the logits (it keeps ``Metric.reads_logits``'s True)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: Any) -> None:
        self.shapes.append(tuple(outputs['logits'].shape))

    def calculate(self) -> dict[str, float]:
        return {'top_logit_calls': float(len(self.shapes))}

    def reset(self) -> None:
        self.shapes = []


@pytest.mark.slow
def test_a_metric_that_reads_the_logits_gets_them_and_the_unfused_numbers(base: TransformersModel) -> None:
    # An adapter whose metrics read the logits (a user's metric; Accuracy with its own ignore id)
    # runs its training passes unfused, alone and in a mixed pass; the others stay fused.
    unfused, fused = _pair(base)
    top = _TopLogit()
    fused.add_metric(top, adapter_name='body')
    for model in (unfused, fused):
        model.add_metric('Accuracy', ignore_index=-1, adapter_name='head')
    assert fused._runner.fused_reads([fused.groups['body'].spec.loss], fused.groups['body'].spec.train_metrics) is None
    assert fused._runner.fused_reads([fused.groups['head'].spec.loss], fused.groups['head'].spec.train_metrics) is None
    fused.forward_backward(inputs=ROWS, adapter_name='body')
    width = max(len(row['input_ids']) for row in ROWS)
    assert top.shapes == [(len(ROWS), width, 4096)]
    calls = [AdapterCall('head', ROWS[:2]), AdapterCall('body', ROWS[2:])]
    unfused.forward_backward(inputs=ROWS, adapter_name='body')
    for w, g in zip(unfused.forward_backward_mixed(calls), fused.forward_backward_mixed(calls), strict=True):
        assert not isinstance(w, Exception) and not isinstance(g, Exception)
        assert g.loss == pytest.approx(w.loss, abs=TOL)
    assert len(top.shapes) == 2
    for name in ('head', 'body'):
        worst = max((g - e).abs().max().item() for g, e in zip(_grads(fused, name), _grads(unfused, name), strict=True))
        assert worst <= TOL, (name, worst)
    got, want = fused.calculate_metric(adapter_name='head'), unfused.calculate_metric(adapter_name='head')
    assert got['accuracy'] == pytest.approx(want['accuracy'])


def test_bf16_autocast_runs_the_fused_head_in_bf16(base: TransformersModel) -> None:
    # Under autocast both heads project in bfloat16: the losses agree to bf16's precision.
    unfused, fused = _pair(base)
    for model in (unfused, fused):
        model._runner.mixed_precision = 'bf16'
    want = unfused.forward_backward(inputs=ROWS, adapter_name='head').loss
    got = fused.forward_backward(inputs=ROWS, adapter_name='head').loss
    assert got == pytest.approx(want, rel=2e-2)
    full = copy.deepcopy(base)
    full.fused_output = True
    exact = full.forward_backward(inputs=ROWS, adapter_name='head').loss  # float32: not the same numbers
    assert got != exact


def test_the_switch_refuses_a_non_bool(base: TransformersModel) -> None:
    from twinkle.errors import ConfigurationError

    model = copy.deepcopy(base)
    with pytest.raises(ConfigurationError, match="fused_output must be True or False; got 'yes'"):
        model.fused_output = 'yes'  # type: ignore[assignment]


def test_the_default_is_on_from_a_real_vocabulary(tiny_model_dir: str) -> None:
    from torch import nn

    from twinkle.model.output.layer import FUSED_BY_DEFAULT_FROM, fuses_by_default

    class Headed(nn.Module):
        def __init__(self, outputs: int | None) -> None:
            super().__init__()
            self.head = nn.Linear(4, outputs, bias=False) if outputs else None

        def get_output_embeddings(self) -> nn.Module | None:
            return self.head

    assert FUSED_BY_DEFAULT_FROM == 32_768
    assert [fuses_by_default(Headed(n)) for n in (4096, 32_767, 32_768, 151_936, None)] == [
        False, False, True, True, False
    ]  # fmt: skip
    assert not TransformersModel(model_id=tiny_model_dir, device='cpu').fused_output  # 4,096 outputs
    assert TransformersModel(model_id=tiny_model_dir, device='cpu', fused_output=True).fused_output


def test_a_head_lora_with_dropout_runs_unfused_even_after_an_evaluation_pass(tiny_model_dir: str) -> None:
    # forward_only leaves the model in eval mode, where dropout is off: the choice of the fused
    # layer is made after the training pass has set train mode, so the head's dropout is kept.
    model = TransformersModel(model_id=tiny_model_dir, device='cpu', fused_output=True)
    model.add_adapter_to_model('drop', LoraConfig(r=4, target_modules=['lm_head'], lora_dropout=0.1))
    recorder = _Recorder('logps')
    model.set_loss(recorder, adapter_name='drop')
    model.forward_only(inputs=ROWS, adapter_name='drop')
    model.forward_backward(inputs=ROWS, adapter_name='drop')
    assert 'logits' in recorder.seen[-1] and 'logps' not in recorder.seen[-1]


def test_models_whose_logits_are_more_than_the_projection_run_unfused() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from twinkle.model.output.layer import fusable

    sizes = {'vocab_size': 64, 'hidden_size': 16, 'intermediate_size': 32, 'num_hidden_layers': 1}
    heads = {'num_attention_heads': 2, 'num_key_value_heads': 1, 'head_dim': 8}
    assert fusable(Qwen3ForCausalLM(Qwen3Config(**sizes, **heads)))
    capped = Gemma2ForCausalLM(Gemma2Config(**sizes, **heads, final_logit_softcapping=30.0))
    assert not fusable(capped)  # Gemma caps its logits after the head: the fused layer would not
    assert fusable(Gemma2ForCausalLM(Gemma2Config(**sizes, **heads, final_logit_softcapping=None)))


@pytest.mark.slow
def test_bf16_weights_without_autocast_and_a_float32_head_lora(tiny_model_dir: str) -> None:
    # Adapters on a bf16 base are float32 (as peft makes them): the fused layer runs the LoRA in
    # its own dtype, as the unfused layer does.
    losses = []
    for fused in (False, True):
        model = TransformersModel(
            model_id=tiny_model_dir, device='cpu', dtype=torch.bfloat16, mixed_precision='no', fused_output=fused
        )
        torch.manual_seed(0)
        model.add_adapter_to_model('head', ADAPTERS['head'])
        losses.append(model.forward_backward(inputs=ROWS, adapter_name='head').loss)
        assert all(p.dtype == torch.float32 and p.grad is not None for p in model.groups['head'].params)
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
