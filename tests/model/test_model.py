"""TransformersModel on the embedded tiny model: training, isolation, accumulation, checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import (
    CheckpointError,
    ConfigurationError,
    DataError,
    StateError,
    UnknownNameError,
)
from twinkle.model import TransformersModel
from twinkle.model.checkpoint import files as ckpt
from twinkle.model.lora import multi as multi_lora
from twinkle.preprocessor import SelfCognitionProcessor


def lora(r: int = 8, **overrides) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules='all-linear', init_lora_weights=False, **overrides)


@pytest.fixture(scope='module')
def rows(tiny_model_dir: str, self_cognition_path: str) -> list[dict]:
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(48)))
    dataset.set_template('Template', model_id=tiny_model_dir, max_length=128)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()
    return [dataset[i] for i in range(len(dataset))]


def new_model(tiny_model_dir: str, *adapters: str, seed: int = 0, **adapter_kwargs) -> TransformersModel:
    model = TransformersModel(model_id=tiny_model_dir)
    for index, name in enumerate(adapters):
        torch.manual_seed(seed + index)
        model.add_adapter_to_model(name, lora(), **adapter_kwargs)
        model.set_optimizer('AdamW', lr=1e-3, adapter_name=name)
    return model


def adapter_state(model: TransformersModel, name: str) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.model.named_parameters() if f'.{name}.' in k}


def base_state(model: TransformersModel) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.model.named_parameters() if 'lora_' not in k}


def train(model: TransformersModel, batches: list[list[dict]], adapter: str | None = None) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(model.forward_backward(inputs=batch, adapter_name=adapter).loss)
        model.clip_grad_and_step(adapter_name=adapter)
    return losses


@pytest.mark.slow
def test_lora_sft_lowers_the_loss_and_keeps_the_base_bitwise(tiny_model_dir, rows):
    model = new_model(tiny_model_dir, 'default')
    model.set_optimizer('AdamW', lr=5e-3)
    before = base_state(model)
    batches = [rows[i : i + 8] for i in range(0, 48, 8)]
    losses = train(model, batches * 4)
    first, last = sum(losses[:6]) / 6, sum(losses[-6:]) / 6
    assert last < first - 0.5, losses
    after = base_state(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_full_parameter_training_changes_every_trained_weight(tiny_model_dir, rows):
    model = TransformersModel(model_id=tiny_model_dir)
    model.set_optimizer('SGD', lr=0.1)
    before = {k: p.detach().clone() for k, p in model.model.named_parameters()}
    train(model, [rows[:4]])
    changed = [k for k, p in model.model.named_parameters() if not torch.equal(before[k], p)]
    assert 'model.layers.0.self_attn.q_proj.weight' in changed
    assert len(changed) >= len(before) - 2  # norms of unused positions may stay put


def test_train_configs_count_the_base_and_the_adapter_asked_about_only(tiny_model_dir):
    model = new_model(tiny_model_dir)
    base = sum(p.numel() for p in model.model.parameters())
    assert f'trainable parameters: {base:,} of {base:,} (100.000%)' in model.get_train_configs()
    model.add_adapter_to_model('alice', lora(r=4))
    model.add_adapter_to_model('bob', lora(r=8))
    for name in ('alice', 'bob'):
        own = sum(p.numel() for k, p in model.model.named_parameters() if f'.{name}.' in k)
        assert own > 0
        # A tenant is not told the size of the other adapters on the model (bob's is twice alice's).
        assert f'trainable parameters: {own:,} of {base + own:,} (' in model.get_train_configs(adapter_name=name)


@pytest.mark.slow
def test_two_adapters_trained_alternately_match_each_trained_alone(tiny_model_dir, rows):
    batches_a = [rows[i : i + 4] for i in range(0, 16, 4)]
    batches_b = [rows[i : i + 4] for i in range(16, 32, 4)]
    both = new_model(tiny_model_dir, 'alice', 'bob')
    both.set_lr_scheduler('LinearLR', start_factor=0.5, total_iters=3, adapter_name='bob')
    for batch_a, batch_b in zip(batches_a, batches_b, strict=True):
        train(both, [batch_a], 'alice')
        train(both, [batch_b], 'bob')

    alone_a = new_model(tiny_model_dir, 'alice')
    train(alone_a, batches_a, 'alice')
    alone_b = new_model(tiny_model_dir, 'bob', seed=1)
    alone_b.set_lr_scheduler('LinearLR', start_factor=0.5, total_iters=3, adapter_name='bob')
    train(alone_b, batches_b, 'bob')

    for name, alone in (('alice', alone_a), ('bob', alone_b)):
        trained, reference = adapter_state(both, name), adapter_state(alone, name)
        assert trained.keys() == reference.keys() and trained
        for key in trained:
            torch.testing.assert_close(trained[key], reference[key], rtol=0, atol=1e-6)


def mean_loss_grad_norm(model: TransformersModel, batch: list[dict]) -> float:
    """The gradient norm of the token-mean cross-entropy of ``batch``, by plain autograd."""
    logits = model.forward(inputs=batch).logits
    labels = model.groups['default'].spec.processor(batch, pad_token_id=0)['labels']
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    grads = torch.autograd.grad(loss, model.groups['default'].params)
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def test_gradient_accumulation_equals_the_big_batch(tiny_model_dir, rows):
    # Micro-batches of different token counts: a per-micro-batch mean would not match.
    big = rows[:8]
    expected_norm = mean_loss_grad_norm(new_model(tiny_model_dir, 'default'), big)

    def sgd_model(**kwargs) -> TransformersModel:
        model = new_model(tiny_model_dir, 'default', **kwargs)
        model.set_optimizer('SGD', lr=1.0)  # the update is the gradient itself: scale errors show
        return model

    accumulated = sgd_model(gradient_accumulation_steps=2)
    norms = []
    for micro in (big[:3], big[3:]):
        accumulated.forward_backward(inputs=micro)
        norms.append(accumulated.clip_grad_and_step(max_grad_norm=100.0))
    assert norms[0] is None  # the step happens on the second call only
    assert math.isclose(norms[1], expected_norm, rel_tol=1e-5)

    single = sgd_model()
    single.forward_backward(inputs=big)
    assert math.isclose(single.clip_grad_and_step(max_grad_norm=100.0), expected_norm, rel_tol=1e-5)

    chunked = sgd_model()
    chunked.forward_backward(inputs=big, micro_batch_size=3)
    chunked.clip_grad_and_step(max_grad_norm=100.0)
    for key, value in adapter_state(single, 'default').items():
        torch.testing.assert_close(adapter_state(accumulated, 'default')[key], value, rtol=0, atol=1e-5)
        torch.testing.assert_close(adapter_state(chunked, 'default')[key], value, rtol=0, atol=1e-5)


def test_forward_backward_loss_is_the_token_mean_cross_entropy(tiny_model_dir, rows):
    model = new_model(tiny_model_dir, 'default')
    batch = rows[:3]
    out = model.forward(inputs=batch)
    # The mean of -log p(label) over the trained tokens, from the returned per-token logps.
    expected = -(out.logps.sum() / out.num_tokens).item()
    assert math.isclose(model.calculate_loss(), expected, rel_tol=1e-5)
    model.backward()
    assert math.isclose(
        new_model(tiny_model_dir, 'default').forward_backward(inputs=batch).loss, expected, rel_tol=1e-5
    )


def test_saved_adapter_loads_in_plain_peft_with_the_same_logits(tiny_model_dir, rows, tmp_path):
    model = new_model(tiny_model_dir, 'my-adapter')
    train(model, [rows[:4], rows[4:8]])
    path = model.save('ckpt', output_dir=str(tmp_path))
    assert sorted(p.name for p in Path(path).iterdir()) >= ['adapter_config.json', 'adapter_model.safetensors']
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.')]  # no staging left behind

    ids = torch.tensor([rows[0]['input_ids']])
    ours = model.forward_only(inputs=[rows[0]]).logits
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, path).eval()
    with torch.no_grad():
        theirs = plain(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    reloaded = new_model(tiny_model_dir, 'my-adapter', seed=7)
    reloaded.load(path)
    torch.testing.assert_close(reloaded.forward_only(inputs=[rows[0]]).logits, ours, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_resumed_run_reproduces_the_uninterrupted_losses(tiny_model_dir, rows, tmp_path):
    def setup() -> tuple[TransformersModel, DataLoader]:
        torch.manual_seed(0)
        model = TransformersModel(model_id=tiny_model_dir)
        model.add_adapter_to_model('default', lora(lora_dropout=0.1), gradient_accumulation_steps=2)
        model.set_optimizer('AdamW', lr=2e-3)
        model.set_lr_scheduler('CosineWarmupScheduler', num_warmup_steps=2, num_training_steps=10)
        return model, DataLoader(rows[:40], batch_size=4, shuffle=True, data_seed=3)

    def run(model, loader, steps):
        losses = []
        for batch in loader:
            losses.append(model.forward_backward(inputs=batch).loss)
            model.clip_grad_and_step()
            if len(losses) == steps:
                break
        return losses

    model, loader = setup()
    uninterrupted = run(model, loader, 14)  # crosses the epoch boundary at 10 batches

    model, loader = setup()
    first = run(model, loader, 6)
    path = model.save('resume', output_dir=str(tmp_path), save_optimizer=True)
    torch.manual_seed(123)  # disturb the global RNG: the checkpoint must restore it

    model, loader = setup()
    progress = model.resume_from_checkpoint(path)
    assert progress == {'cur_step': 6, 'optim_step': 3, 'consumed_train_samples': 24, 'gradient_accumulation_steps': 2}
    loader.resume_from_checkpoint(progress['consumed_train_samples'])
    second = run(model, loader, 8)
    assert first + second == pytest.approx(uninterrupted, abs=1e-6)


def test_the_public_face_the_model_gives_its_collaborators(tiny_model_dir, rows, tmp_path):
    model = new_model(tiny_model_dir, 'alice', 'bob')
    # One process: no mesh to find a data rank in, no FSDP2 sharding to run forwards in step.
    assert model.device_mesh is None and model.uses_fsdp is False
    assert model.train_group('alice') is model.groups['alice'] and model.train_group('alice').name == 'alice'
    with pytest.raises(ConfigurationError, match=r"adapter_name= one of \['alice', 'bob'\]"):
        model.train_group()
    with pytest.raises(UnknownNameError, match=r"Unknown adapter 'carol'"):
        model.train_group('carol')
    # Three calls of one accumulation step each: three optimizer steps for alice, none for bob;
    # a save without a name is named for alice's steps.
    train(model, [rows[:2]] * 3, adapter='alice')
    assert model.optimizer_steps(adapter_name='alice') == 3 and model.optimizer_steps(adapter_name='bob') == 0
    assert Path(model.save(output_dir=str(tmp_path), adapter_name='alice')) == tmp_path / 'checkpoint-3'
    assert Path(model.save(output_dir=str(tmp_path), adapter_name='bob')) == tmp_path / 'checkpoint-0'


def test_checkpoint_swap_is_atomic_when_a_save_fails(tiny_model_dir, rows, tmp_path, monkeypatch):
    model = new_model(tiny_model_dir, 'default')
    path = Path(model.save('ckpt', output_dir=str(tmp_path)))
    before = (path / 'adapter_model.safetensors').read_bytes()
    train(model, [rows[:4]])

    def crash(*args, **kwargs):
        raise OSError('disk full')

    monkeypatch.setattr(ckpt, 'save_training_state', crash)
    with pytest.raises(OSError, match='disk full'):
        model.save('ckpt', output_dir=str(tmp_path), save_optimizer=True)
    assert (path / 'adapter_model.safetensors').read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt']


def test_metrics_report_loss_accuracy_lr_grad_norm_and_throughput(tiny_model_dir, rows):
    model = new_model(tiny_model_dir, 'default')
    losses = train(model, [rows[:4], rows[4:8]])
    metrics = model.calculate_metric(is_training=True)
    assert set(metrics) >= {'loss', 'accuracy', 'lr', 'grad_norm', 'tokens_per_s', 'steps'}
    assert metrics['lr'] == 1e-3 and metrics['steps'] == 2 and metrics['tokens_per_s'] > 0
    assert 0 <= metrics['accuracy'] <= 1
    assert min(losses) <= metrics['loss'] <= max(losses)  # a token-weighted mean of the two
    assert 'loss' not in model.calculate_metric(is_training=True)  # reset after reading

    model.forward_only(inputs=rows[:4])
    eval_loss = model.calculate_loss()
    assert model.calculate_metric(is_training=False)['loss'] == pytest.approx(eval_loss)


def test_trajectories_are_encoded_with_the_model_template(tiny_model_dir, rows):
    model = new_model(tiny_model_dir, 'default')
    messages = [{'role': 'user', 'content': 'Who are you?'}, {'role': 'assistant', 'content': 'twinkle.'}]
    out = model.forward_only(inputs=[{'messages': messages}])
    assert out.num_tokens > 0


def test_nan_gradients_skip_the_step(tiny_model_dir, rows):
    model = new_model(tiny_model_dir, 'default')
    before = adapter_state(model, 'default')
    model.forward_backward(inputs=rows[:2])
    next(iter(model.groups['default'].params)).grad.fill_(float('nan'))
    norm = model.clip_grad_and_step()
    assert math.isnan(norm)
    assert all(torch.equal(before[k], v) for k, v in adapter_state(model, 'default').items())


def test_bad_names_and_values_fail_with_the_accepted_ones(tiny_model_dir, rows):
    model = new_model(tiny_model_dir, 'alice', 'bob')
    with pytest.raises(UnknownNameError, match=r"Unknown loss 'Nope'.*CrossEntropyLoss"):
        model.set_loss('Nope', adapter_name='alice')
    with pytest.raises(UnknownNameError, match=r'AdamW'):
        model.set_optimizer('Adamm', adapter_name='alice')
    with pytest.raises(UnknownNameError, match=r'CosineWarmupScheduler'):
        model.set_lr_scheduler('Cosine', adapter_name='alice')
    with pytest.raises(ConfigurationError, match=r'does not take \[.lrr.\]'):
        model.set_optimizer('AdamW', lrr=1e-3, adapter_name='alice')
    with pytest.raises(UnknownNameError, match=r"Unknown adapter 'carol'.*\['alice', 'bob'\]"):
        model.forward_backward(inputs=rows[:1], adapter_name='carol')
    with pytest.raises(ConfigurationError, match=r"adapter_name= one of \['alice', 'bob'\]"):
        model.forward_backward(inputs=rows[:1])
    with pytest.raises(ConfigurationError, match='gradient_accumulation_steps must be a positive integer; got 0'):
        model.add_adapter_to_model('carol', lora(), gradient_accumulation_steps=0)
    with pytest.raises(UnknownNameError, match='Template'):
        model.set_template('Nope', adapter_name='alice')


def test_bad_inputs_fail_before_any_compute(tiny_model_dir, rows):
    model = new_model(tiny_model_dir, 'default')
    vocab = model.model.get_input_embeddings().num_embeddings
    bad = {**rows[0], 'input_ids': [*rows[0]['input_ids'][:-1], vocab]}
    with pytest.raises(DataError, match=rf'token id {vocab}, outside the vocabulary \[0, {vocab}\)'):
        model.forward_backward(inputs=[rows[1], bad])
    with pytest.raises(DataError, match='inputs is empty'):
        model.forward_backward(inputs=[])
    with pytest.raises(StateError, match='needs forward'):
        model.backward()
    with pytest.raises(CheckpointError, match='does not exist'):
        model.load('/nonexistent/ckpt')
    assert model.groups['default'].window.micro_step == 0


def test_packed_batches_give_the_padded_loss_and_count_their_rows(tiny_model_dir, rows):
    padded = new_model(tiny_model_dir, 'default')
    expected = padded.forward_backward(inputs=rows[:3]).loss
    packed = new_model(tiny_model_dir, 'default')
    packed.set_processor('InputProcessor', padding_free=True)
    packed.forward(inputs=rows[:3])
    assert packed.calculate_loss() == pytest.approx(expected, rel=1e-5)
    packed.backward()
    # Three sequences in one packed tensor row still count as three consumed samples.
    assert packed.groups['default'].window.consumed_train_samples == 3


def test_a_failed_adapter_leaves_no_layers_behind(tiny_model_dir, rows):
    model = new_model(tiny_model_dir, 'first')
    before = set(dict(model.model.named_parameters()))
    # The unknown initialisation is refused before any layer is touched.
    with pytest.raises(ValueError, match='bogus'):
        model.add_adapter_to_model('second', LoraConfig(r=4, target_modules='all-linear', init_lora_weights='bogus'))
    assert set(dict(model.model.named_parameters())) == before
    assert model.adapter_names == ['first'] and multi_lora.adapter_names(model.model) == ['first']
    model.add_adapter_to_model('second', lora())  # the name is free again, and trains
    assert len(train(model, [rows[:2]], adapter='second')) == 1


@pytest.mark.slow
def test_a_step_closes_its_accumulation_window(tiny_model_dir, rows):
    """Seed 003's loop (``step()`` after each ``forward_backward``, no ``zero_grad()``) trains as
    the loop with ``zero_grad()``: each step uses its own window's gradient, divided by its own
    item count. Before, the first step's gradient stayed, and later steps skipped the division."""
    batches = [rows[2 * i : 2 * i + 2] for i in range(4)]
    for accumulation in (1, 2):
        with_zero_grad = new_model(tiny_model_dir, 'default', gradient_accumulation_steps=accumulation)
        step_only = new_model(tiny_model_dir, 'default', gradient_accumulation_steps=accumulation)
        losses: dict[str, list[float]] = {'with': [], 'without': []}
        for batch in batches:
            losses['with'].append(with_zero_grad.forward_backward(inputs=batch).loss)
            with_zero_grad.step()
            with_zero_grad.zero_grad()
            losses['without'].append(step_only.forward_backward(inputs=batch).loss)
            stepped = step_only.step()
            params = step_only.train_group().params
            assert stepped == all(p.grad is None for p in params)  # a step leaves no gradient behind
        assert step_only.optimizer_steps() == 4 // accumulation
        assert losses['without'] == pytest.approx(losses['with'], abs=1e-6)
        for key, value in adapter_state(with_zero_grad, 'default').items():
            torch.testing.assert_close(adapter_state(step_only, 'default')[key], value, rtol=0, atol=1e-7)


def test_a_save_keeps_the_gradients_waiting_for_a_step(tiny_model_dir, rows, tmp_path):
    """``save(save_optimizer=True)`` between ``forward_backward`` and the step keeps the window
    (gradients, item count, and whether ``clip_grad_norm`` ran); resumed, the step is the one the
    uninterrupted run takes, and ``clip_grad_norm`` does not run twice at one boundary."""
    batches = [rows[3 * i : 3 * i + 3] for i in range(4)]
    uninterrupted = new_model(tiny_model_dir, 'default')
    expected = train(uninterrupted, batches)

    for clipped_before_save in (False, True):
        model = new_model(tiny_model_dir, 'default')
        losses = train(model, batches[:2])
        losses.append(model.forward_backward(inputs=batches[2]).loss)
        norm = model.clip_grad_norm() if clipped_before_save else None
        path = model.save(f'pending-{clipped_before_save}', output_dir=str(tmp_path), save_optimizer=True)

        resumed = new_model(tiny_model_dir, 'default', seed=7)  # other weights: all of it comes from the save
        resumed.resume_from_checkpoint(path)
        if clipped_before_save:
            assert resumed.clip_grad_norm() is None  # done at this boundary already
            assert norm is not None
            resumed.step()
            resumed.zero_grad()
            resumed.lr_step()
        else:
            resumed.clip_grad_and_step()
        losses += train(resumed, batches[3:])
        assert losses == pytest.approx(expected, abs=1e-6)
        for key, value in adapter_state(uninterrupted, 'default').items():
            torch.testing.assert_close(adapter_state(resumed, 'default')[key], value, rtol=0, atol=1e-6)


def test_restore_state_continues_from_weights_alone_with_a_fresh_optimizer(tiny_model_dir, rows, tmp_path):
    model = new_model(tiny_model_dir, 'default')
    train(model, [rows[:2]] * 3)
    weights_only = model.save('weights', output_dir=str(tmp_path))
    full = model.save('full', output_dir=str(tmp_path), save_optimizer=True)
    probe = model.forward_only(inputs=rows[4:6]).logps

    for path, fresh in ((weights_only, True), (full, False)):
        restored = new_model(tiny_model_dir, 'default', seed=9)
        assert restored.restore_state(path) == {'optim_step': 3, 'fresh_optimizer': fresh}
        assert restored.optimizer_steps() == 3
        torch.testing.assert_close(restored.forward_only(inputs=rows[4:6]).logps, probe, rtol=0, atol=1e-6)
        assert restored.step() is False  # the boundary of step 3 is done: nothing to step on
        restored.forward_backward(inputs=rows[:2])
        restored.clip_grad_and_step()
        assert restored.optimizer_steps() == 4
        # A fresh optimizer: AdamW's state counts one step; restored, four.
        state = restored.train_group().optimizer.state_dict()['state']
        assert {int(s['step']) for s in state.values()} == ({1} if fresh else {4})
