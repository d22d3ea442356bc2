"""``TransformersModel(compile_layers=True)``: each decoder layer runs through ``torch.compile``
(inductor; its C++ backend on the CPU) and the numbers are the eager ones.

One eager and one compiled copy of the tiny Qwen3 train the same adapter on the same rows, for
steps of three kinds: cross entropy on rows of two lengths (dynamic shapes: the second length runs
the first compile), GRPO with a KL term (the reference pass runs with the adapter off, under
``no_grad``) and ``forward_only``. Losses, every adapter gradient and the logprobs agree to 1e-5
(float32) at each step, with the optimizer stepping in between. Compiling costs about a minute on
two cores the first time; inductor's cache makes a later run on the same machine cheaper.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig
from torch._dynamo.utils import counters

from twinkle import assets
from twinkle.errors import ConfigurationError
from twinkle.model import TransformersModel
from twinkle.model.loading import compile_blocks

TOL = 1e-5
ADAPTER = LoraConfig(r=8, lora_alpha=16, target_modules='all-linear', init_lora_weights=False)


def _rows(seed: int, lengths: list[int]) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for length in lengths:
        ids = torch.randint(0, 4000, (length,), generator=gen).tolist()
        rows.append({'input_ids': ids, 'labels': [-100, -100, *ids[2:]]})
    return rows


def _model(path: str, compiled: bool) -> TransformersModel:
    model = TransformersModel(model_id=path, device='cpu', compile_layers=compiled)
    torch.manual_seed(0)
    model.add_adapter_to_model('default', ADAPTER)
    model.set_optimizer('AdamW', lr=1e-3)
    return model


@pytest.fixture(scope='module')
def pair(tiny_model_dir: str) -> tuple[TransformersModel, TransformersModel]:
    return _model(tiny_model_dir, False), _model(tiny_model_dir, True)


def _grads(model: TransformersModel) -> list[torch.Tensor]:
    """The gradients the optimizer will step on: the summed ones over the call's item count."""
    group = model.groups['default']
    return [p.grad / group.pending.items for p in group.params]


def _train_step(models: tuple[TransformersModel, ...], rows: list[dict[str, Any]], **inputs: Any) -> None:
    """One ``forward_backward`` on each model: equal losses and adapter gradients; then a step."""
    eager, compiled = (model.forward_backward(inputs=rows, **inputs).loss for model in models)
    assert compiled == pytest.approx(eager, rel=1e-6, abs=TOL)
    want, got = (_grads(model) for model in models)
    assert all(g.abs().max() > 0 for g in want)  # every LoRA matrix trained
    worst = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    assert worst <= TOL, worst
    for model in models:
        model.clip_grad_and_step()


@pytest.mark.slow
def test_compiled_layers_train_to_the_eager_numbers(pair: tuple[TransformersModel, TransformersModel]) -> None:
    eager, compiled = pair
    assert (eager.compile_layers, compiled.compile_layers) == (False, True)
    graphs = counters['stats']['unique_graphs']
    _train_step(pair, _rows(0, [9, 14, 6, 11]))
    assert counters['stats']['unique_graphs'] > graphs  # the compiled layers ran through dynamo
    _train_step(pair, _rows(1, [23, 17, 30]))  # new lengths: dynamic shapes
    for model in pair:
        model.set_loss('GRPOLoss', beta=0.04)
    rows = _rows(2, [12, 8, 15])
    gen = torch.Generator().manual_seed(3)
    old = [(-torch.rand(len(r['input_ids']) - 2, generator=gen) * 4).tolist() for r in rows]
    _train_step(pair, rows, advantages=[1.0, -0.5, 0.25], old_logps=old)
    want, got = (model.forward_only(inputs=rows).logps for model in pair)
    assert (got - want).abs().max().item() <= TOL
    # One graph per kind of call into a layer: with grad (the first layer's input needs none, the
    # others' do), without grad, and without an adapter (GRPO's reference logprobs). Before the row
    # indices were placed ahead of the forward (RowAssignment.place), dynamo guarded on their cache
    # and compiled 6: one more for each layer that found it in another state.
    assert counters['stats']['unique_graphs'] - graphs == 4


def test_compiled_layers_keep_the_parameter_names(pair: tuple[TransformersModel, TransformersModel]) -> None:
    eager, compiled = pair
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())


def test_compile_layers_takes_a_bool(tiny_model_dir: str) -> None:
    with pytest.raises(ConfigurationError, match="compile_layers must be True or False; got 'yes'"):
        TransformersModel(model_id=tiny_model_dir, device='cpu', compile_layers='yes')  # type: ignore[arg-type]


def test_compiled_and_checkpointed_layers_are_refused_until_checked(tiny_model_dir: str) -> None:
    with pytest.raises(ConfigurationError, match='do not combine yet'):
        TransformersModel(model_id=tiny_model_dir, device='cpu', compile_layers=True, gradient_checkpointing=True)


def test_a_model_with_linear_attention_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r'has linear-attention layers, which torch\.compile fails'):
        TransformersModel(model_id=assets.tiny_model('tiny-qwen3.5'), device='cpu', compile_layers=True)


def test_a_model_without_repeated_blocks_is_refused() -> None:
    with pytest.raises(ConfigurationError, match='Linear names no repeated blocks'):
        compile_blocks(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
