"""Sampling with images (issue 32, point 5): ``TorchSampler`` on the embedded vision-language
models, its logprobs against the trainer's forward on the same images, its greedy tokens against
transformers' ``generate``, LoRA adapters, and prompts it refuses.

Expected values come from transformers and from twinkle's trainer: ``model.generate`` with the
pixels, grids and ``mm_token_type_ids`` (transformers computes the multimodal positions and
their ``rope_deltas`` itself), and ``TransformersModel.forward_only`` on each sampled sequence's
``new_input_feature`` (prompt, completion and images in one teacher-forced pass). A 64 x 64
picture is 4 x 4 patches merged 2 x 2: 4 image tokens on a 2 x 2 grid, so it takes 2 positions
of multimodal RoPE for its 4 tokens and shifts the text after it by -2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForImageTextToText

from twinkle.assets import dataset, resolve_images, tiny_model
from twinkle.data_format import SampledSequence, SampleResponse, SamplingParams
from twinkle.errors import ConfigurationError, DataError
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler
from twinkle.sampler.images import decode_positions, image_prefill, prompt_images
from twinkle.template import VisionTemplate

#: The issue's bound for sampler against trainer logprobs in float32 (they agree to about 1e-6).
TOL = 1e-4
IMAGE_PAD = 4099
#: Positions a 64 x 64 picture's 4 tokens lose against their count: 4 tokens at 2 positions.
SHIFT_PER_PICTURE = -2


@pytest.fixture(scope='module')
def shapes() -> list[dict[str, Any]]:
    return resolve_images(dataset('shapes', 'train'))


def picture(row: dict[str, Any]) -> str:
    path: str = row['messages'][0]['content'][0]['image']
    return path


def prompts(shapes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt with one picture, one with none, one with two."""
    two = [
        {'type': 'image', 'image': picture(shapes[1])},
        {'type': 'text', 'text': 'and'},
        {'type': 'image', 'image': picture(shapes[2])},
        {'type': 'text', 'text': 'What are they?'},
    ]
    return [
        {'messages': shapes[0]['messages'][:1], 'user_data': {'answer': shapes[0]['answer']}},
        {'messages': [{'role': 'user', 'content': 'Name a colour.'}]},
        {'messages': [{'role': 'user', 'content': two}]},
    ]


def sequences(responses: list[SampleResponse]) -> list[SampledSequence]:
    return [seq for response in responses for seq in response.sequences]


def gaps(trainer: TransformersModel, seqs: list[SampledSequence], **forward: Any) -> list[float]:
    """Per sequence, the largest gap between a sampled token's logprob and the trainer's
    teacher-forced one (``forward``: ``forward_only``'s adapter arguments)."""
    features = [seq.new_input_feature for seq in seqs]
    logps = trainer.forward_only(inputs=features, **forward).logps
    out = []
    for row, (seq, feature) in enumerate(zip(seqs, features, strict=True)):
        trained = torch.tensor(feature['completion_mask']).bool()
        expected = logps[row, : len(feature['labels'])][trained]
        assert len(expected) == len(seq.token_logprobs) == len(seq.tokens)
        out.append((torch.tensor(seq.token_logprobs) - expected).abs().max().item())
    return out


def worst_gap(trainer: TransformersModel, seqs: list[SampledSequence], **forward: Any) -> float:
    return max(gaps(trainer, seqs, **forward))


@pytest.mark.slow
@pytest.mark.parametrize('name', ['tiny-qwen3.5-vl', 'tiny-qwen3-vl'])
def test_sampled_logprobs_of_image_prompts_equal_the_trainers(name: str, shapes: list[dict[str, Any]]) -> None:
    """One batch of prompts with one, no and two pictures, two samples each (left-padded together),
    against the trainer's forward of each sampled sequence with its images."""
    path = tiny_model(name)
    sampler = TorchSampler(path, device='cpu')
    trainer = TransformersModel(path, device='cpu')
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, num_samples=2, ignore_eos=True)
    seqs = sequences(sampler.sample(prompts(shapes), params))
    assert worst_gap(trainer, seqs) <= TOL
    # The sampled rows carry their prompt's images; the completion's tokens are text.
    one, text, two = (seqs[i].new_input_feature for i in (0, 2, 4))
    assert one['image_grid_thw'] == [[1, 4, 4]] and two['image_grid_thw'] == [[1, 4, 4]] * 2
    assert 'pixel_values' not in text and 'image_grid_thw' not in text
    for feature in (one, two):
        kinds = feature['mm_token_type_ids']
        assert kinds == [int(token == IMAGE_PAD) for token in feature['input_ids']]
        assert sum(kinds[-10:]) == 0 and len(kinds) == len(feature['input_ids'])
    assert one['user_data'] == {'answer': shapes[0]['answer']}
    assert seqs[0].new_input_feature['messages'][-1]['role'] == 'assistant'


@pytest.mark.slow
def test_greedy_image_sampling_takes_the_tokens_transformers_generate_takes(shapes: list[dict[str, Any]]) -> None:
    path = tiny_model('tiny-qwen3.5-vl')
    sampler = TorchSampler(path, device='cpu')
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batch = prompts(shapes)
    together = [seq.tokens for seq in sequences(sampler.sample(batch, params))]
    for prompt, tokens in zip(batch, together, strict=True):
        feature = sampler.template.encode(prompt, add_generation_prompt=True)
        assert feature is not None
        ids = torch.tensor([feature['input_ids']])
        images = {}
        if 'pixel_values' in feature:
            images = {
                'pixel_values': feature['pixel_values'],
                'image_grid_thw': torch.tensor(feature['image_grid_thw']),
                'mm_token_type_ids': torch.tensor([feature['mm_token_type_ids']]),
            }
        out = reference.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, **images
        )
        assert out[0, ids.shape[1] :].tolist() == tokens


def test_decode_steps_sit_past_each_prompts_multimodal_positions(shapes: list[dict[str, Any]]) -> None:
    """The prefill's per-row delta is -2 per picture (4 tokens on 2 positions), by hand; without it
    the decode steps would sit 2 or 4 positions too far and the logprobs would disagree (0.27 on
    tiny-qwen3.5-vl when this was tried)."""
    path = tiny_model('tiny-qwen3.5-vl')
    sampler = TorchSampler(path, device='cpu')
    template = sampler.template
    assert isinstance(template, VisionTemplate)
    features = [template.encode(p, add_generation_prompt=True) for p in prompts(shapes)]
    rows = [f['input_ids'] for f in features if f is not None]
    images = [prompt_images(i, f, f['input_ids']) for i, f in enumerate(features) if f is not None]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    prefill = image_prefill(sampler.model, images, ids, mask, positions)
    assert prefill is not None
    assert prefill.deltas[:, 0].tolist() == [SHIFT_PER_PICTURE, 0, 2 * SHIFT_PER_PICTURE]
    position_ids = prefill.model_inputs['position_ids']
    assert position_ids.shape == (4, 3, width) and torch.equal(position_ids[0], positions)
    # The text row's last prompt token sits at length - 1 + delta in all three multimodal rows.
    last = torch.tensor([len(r) - 1 for r in rows]) + prefill.deltas[:, 0]
    assert torch.equal(position_ids[1:, :, -1], last.expand(3, -1))
    step = decode_positions(torch.tensor([[len(r)] for r in rows]), prefill.deltas)
    assert step[:, :, 0].tolist() == [[len(r) for r in rows]] + [(last + 1).tolist()] * 3
    assert image_prefill(sampler.model, [None, None, None], ids, mask, positions) is None


@pytest.mark.slow
def test_prompt_logprobs_and_batches_of_any_size_with_images(shapes: list[dict[str, Any]]) -> None:
    """A prompt already encoded (its pixels as nested lists, as a dataset row holds them after Arrow)
    samples as its messages do, alone or split into batches of two sequences; the prompt's own
    logprobs are the trainer's on the prompt tokens."""
    path = tiny_model('tiny-qwen3.5-vl')
    sampler = TorchSampler(path, device='cpu')
    trainer = TransformersModel(path, device='cpu')
    batch = prompts(shapes)
    encoded = sampler.template.encode(batch[2], add_generation_prompt=True)
    assert encoded is not None
    encoded['pixel_values'] = encoded['pixel_values'].tolist()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=9, num_samples=2, ignore_eos=True)
    whole = sequences(sampler.sample(batch, params))
    split = sequences(TorchSampler(path, device='cpu', max_batch_size=2).sample([*batch[:2], encoded], params))
    assert [s.tokens for s in split] == [s.tokens for s in whole]
    for got, want in zip(split, whole, strict=True):
        assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=TOL)
    response = sampler.sample(batch[2], SamplingParams(max_tokens=1, prompt_logprobs=True))[0]
    feature = response.sequences[0].new_input_feature
    logits = trainer.forward_only(inputs=[feature]).logits[0].float()
    ids = torch.tensor(response.prompt_token_ids)
    expected = torch.log_softmax(logits[: len(ids) - 1], -1).gather(-1, ids[1:, None])[:, 0]
    assert response.prompt_logprobs is not None and response.prompt_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(response.prompt_logprobs[1:], expected.tolist(), strict=True)) <= TOL


def test_lora_adapters_sample_image_prompts_as_the_trainer_scores_them(
    shapes: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Two adapters, one on the language model and one on the vision tower alone: a sampler sharing
    the trainer's model and a sampler with its own copy (the adapter loaded from a checkpoint)
    each give each adapter's logprobs. The tower's adapter changes the image prompts' logprobs
    (the sampler ran it on the pixels) and leaves the text prompt's as the base model's."""
    path = tiny_model('tiny-qwen3.5-vl')
    trainer = TransformersModel(path, device='cpu')
    for seed, (name, targets) in enumerate([('text', 'all-linear'), ('tower', ['qkv', 'linear_fc1'])]):
        torch.manual_seed(seed)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        trainer.add_adapter_to_model(name, config)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2, ignore_eos=True)
    batch = prompts(shapes)  # one picture, none, two pictures
    shared = TorchSampler.from_model(trainer.model, model_id=path)
    text = sequences(shared.sample(batch, params, adapter_name='text'))
    assert worst_gap(trainer, text, adapter_name='text') <= TOL
    assert min(gaps(trainer, text, adapter_name='text', disable_lora=True)) > 1e-3
    tower = sequences(shared.sample(batch, params, adapter_name='tower'))
    assert worst_gap(trainer, tower, adapter_name='tower') <= TOL
    with_picture, without, with_two = gaps(trainer, tower, adapter_name='tower', disable_lora=True)
    assert with_picture > 1e-3 and with_two > 1e-3 and without <= TOL
    saved = trainer.save('tower', str(tmp_path), adapter_name='tower')
    own = TorchSampler(path, device='cpu')
    own.add_adapter('tower', saved)
    copied = sequences(own.sample(batch, params, adapter_name='tower'))
    assert [s.tokens for s in copied] == [s.tokens for s in tower]
    assert worst_gap(trainer, copied, adapter_name='tower') <= TOL


def test_image_prompts_that_cannot_be_sampled_are_refused_before_any_compute(
    shapes: list[dict[str, Any]], tiny_model_dir: str
) -> None:
    path = tiny_model('tiny-qwen3.5-vl')
    feature = VisionTemplate(path).encode(prompts(shapes)[0], add_generation_prompt=True)
    assert feature is not None
    row = {key: feature[key] for key in ('input_ids', 'pixel_values', 'image_grid_thw', 'mm_token_type_ids')}
    text_sampler = TorchSampler(tiny_model_dir, device='cpu')
    with pytest.raises(ConfigurationError, match=r'prompts \[1\] hold images but Qwen3ForCausalLM has no vision tower'):
        text_sampler.sample([{'input_ids': [1, 2, 3]}, row])
    sampler = TorchSampler(path, device='cpu')
    with pytest.raises(DataError, match=r'prompt 0: mm_token_type_ids has 26 values; .* input_ids \(27\)'):
        sampler.sample({**row, 'mm_token_type_ids': row['mm_token_type_ids'][1:]})
    with pytest.raises(DataError, match=r'prompt 0 has 1 runs of image tokens, 2 image grids'):
        sampler.sample({**row, 'image_grid_thw': [[1, 4, 4], [1, 4, 4]]})
    with pytest.raises(DataError, match=r"prompt 0 has pixel_values but no \['image_grid_thw'\]"):
        sampler.sample({key: value for key, value in row.items() if key != 'image_grid_thw'})


def test_image_and_video_pads_are_never_sampled(shapes: list[dict[str, Any]]) -> None:
    # A completion holding a pad would be a row whose pads have no pixels, which the trainer
    # refuses; the head is pushed to prefer the pads, and the sampler still takes other tokens.
    path = tiny_model('tiny-qwen3.5-vl')
    sampler = TorchSampler(path, device='cpu')
    pads = torch.tensor([IMAGE_PAD, IMAGE_PAD + 1])  # <|image_pad|>, <|video_pad|>

    def prefer_pads(module: torch.nn.Module, args: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_add(-1, pads, torch.full((*logits.shape[:-1], 2), 50.0))

    handle = sampler.model.lm_head.register_forward_hook(prefer_pads)
    try:
        for temperature, top_k in ((0.0, -1), (1.0, -1), (1.0, 3)):
            params = SamplingParams(
                max_tokens=6, temperature=temperature, top_k=top_k, seed=3, num_samples=2, ignore_eos=True
            )
            seqs = sequences(sampler.sample(prompts(shapes), params))
            assert all(len(seq.tokens) == 6 and not set(seq.tokens) & set(pads.tolist()) for seq in seqs)
            # The pads keep their (near 1) probability in the logprobs, as in the trainer's forward;
            # top-k takes the 3 likeliest of the other tokens, as the draw did: no drawn token at -inf.
            assert all(-math.inf < lp < -20 for seq in seqs for lp in seq.token_logprobs)
    finally:
        handle.remove()
