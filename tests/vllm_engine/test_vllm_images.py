"""``vLLMSampler`` with images (issue 32, point 5) on vLLM's CPU build (``make test-vllm``).

vLLM takes a prompt's images as pictures and makes their pixels itself, and expands each image's
one ``<|image_pad|>`` to the image's tokens: the sampler gives it each image's run of pads as one
pad and the 8-bit pictures the prompt's ``pixel_values`` were made from (the pictures give the same
pixels again, checked here by hand against the dataset's PNG files).

vLLM's Qwen3-VL code, which its Qwen3.5 code imports, imports transformers' image processors, which
need torchvision: ``make setup-vllm`` installs its Python code beside the CPU torch
(``torchvision_cpu.py``), and where none loads the sampler refuses those models with that reason.
``tiny-qwen3-vl`` in float32 samples prompts with one, no and two pictures with the trainer's
logprobs (1e-4). ``tiny-qwen3.5-vl`` does not run on vLLM's CPU build: its linear-attention kernel
takes bfloat16 only ('CPU GDN attention requires BF16.') and heads of 32 not at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig
from PIL import Image

from twinkle.assets import dataset, resolve_images, tiny_model
from twinkle.data_format import SampledSequence, SamplingParams
from twinkle.errors import ConfigurationError, DataError, MissingExtraError
from twinkle.model import TransformersModel
from twinkle.model.lora import multi as multi_lora
from twinkle.sampler import vLLMSampler
from twinkle.sampler.base import Prompt
from twinkle.sampler.images import prompt_images
from twinkle.sampler.vllm_images import check_image_counts, collapse_images, pictures, refuse_tower
from twinkle.template import VisionTemplate

pytest.importorskip('vllm')

TOL = 1e-4
IMAGE_PAD = 4099


def _torchvision_error() -> str | None:
    try:
        import torchvision  # noqa: F401
    except (ImportError, OSError, RuntimeError) as error:
        return f'{type(error).__name__}: {error}'
    return None


TORCHVISION_ERROR = _torchvision_error()
needs_torchvision = pytest.mark.skipif(
    TORCHVISION_ERROR is not None, reason=f"vLLM's Qwen-VL code needs torchvision ({TORCHVISION_ERROR})"
)


@pytest.fixture(scope='module')
def shapes() -> list[dict[str, Any]]:
    return resolve_images(dataset('shapes', 'train'))


def picture(row: dict[str, Any]) -> str:
    path: str = row['messages'][0]['content'][0]['image']
    return path


def prompts(shapes: list[dict[str, Any]], count: int = 2) -> list[dict[str, Any]]:
    """A prompt with one picture, one with none, one with ``count``."""
    many: list[dict[str, Any]] = []
    for row in shapes[1 : 1 + count]:
        many += [{'type': 'image', 'image': picture(row)}, {'type': 'text', 'text': 'and'}]
    return [
        {'messages': shapes[0]['messages'][:1]},
        {'messages': [{'role': 'user', 'content': 'Name a colour.'}]},
        {'messages': [{'role': 'user', 'content': [*many, {'type': 'text', 'text': 'What are they?'}]}]},
    ]


# ---- what the sampler gives vLLM (no engine) ----------------------------------------------------
def test_the_pictures_are_those_the_pixels_were_made_from(shapes: list[dict[str, Any]]) -> None:
    """A 64 x 64 PNG comes back pixel for pixel; a 150 x 70 picture, which the image processor
    resizes to 160 x 64, comes back as the resized picture, which gives the same pixels again."""
    template = VisionTemplate(tiny_model('tiny-qwen3-vl'))
    odd = Image.fromarray((np.random.default_rng(0).random((70, 150, 3)) * 255).astype(np.uint8))
    content = [{'type': 'image', 'image': picture(shapes[1])}, {'type': 'image', 'image': odd}]
    feature = template.encode({'messages': [{'role': 'user', 'content': content}]}, add_generation_prompt=True)
    assert feature is not None
    images = prompt_images(0, feature, feature['input_ids'])
    assert images is not None and images.image_grid_thw == [[1, 4, 4], [1, 4, 10]]
    png, resized = pictures(0, images, template.image_processor)
    with Image.open(picture(shapes[1])) as original:
        assert np.array_equal(np.asarray(png), np.asarray(original.convert('RGB')))
    assert resized.size == (160, 64)  # 10 x 4 patches of 16 pixels
    again = template.image_processor(images=[png, resized], return_tensors='pt')
    assert torch.equal(again['pixel_values'], images.pixel_values)
    images.pixel_values[5, 7] += 0.01  # no longer what an 8-bit picture gives
    with pytest.raises(DataError, match=r'prompt 0, image 0: its pixel_values are not those of an 8-bit picture'):
        pictures(0, images, template.image_processor)


def test_each_images_tokens_reach_vllm_as_one_pad(shapes: list[dict[str, Any]]) -> None:
    """Two 64 x 64 pictures are 4 tokens each (4 x 4 patches merged 2 x 2): 8 pads become 2."""
    template = VisionTemplate(tiny_model('tiny-qwen3-vl'))
    feature = template.encode(prompts(shapes)[2], add_generation_prompt=True)
    assert feature is not None
    ids = feature['input_ids']
    images = prompt_images(0, feature, ids)
    assert images is not None
    collapsed = collapse_images(0, ids, images, merge_size=2)
    assert ids.count(IMAGE_PAD) == 8 and collapsed.count(IMAGE_PAD) == 2
    assert len(collapsed) == len(ids) - 6
    assert [token for token in ids if token != IMAGE_PAD] == [token for token in collapsed if token != IMAGE_PAD]
    with pytest.raises(DataError, match=r'prompt 3 has runs of \[4, 4\] image tokens .* take \[16, 16\] tokens'):
        collapse_images(3, ids, images, merge_size=1)


def test_prompts_over_the_image_limit_or_without_a_tower_are_refused(shapes: list[dict[str, Any]]) -> None:
    template = VisionTemplate(tiny_model('tiny-qwen3-vl'))
    rows = [template.encode(row, add_generation_prompt=True) for row in prompts(shapes, count=3)]
    batch = [Prompt(row['input_ids'], images=prompt_images(i, row, row['input_ids'])) for i, row in enumerate(rows)]
    check_image_counts(batch, limit=3, takes_images=True)
    with pytest.raises(DataError, match=r'prompt 2 has 3 images, over the engine limit of 2 per prompt'):
        check_image_counts(batch, limit=2, takes_images=True)
    with pytest.raises(ConfigurationError, match=r'prompts \[0, 2\] hold images but the sampler model has no vision'):
        check_image_counts(batch, limit=3, takes_images=False)


def test_adapters_on_the_vision_tower_are_refused() -> None:
    """vLLM's LoRA adapts the language model: an adapter with weights on ``model.visual`` is refused,
    one on the language model's layers is not."""
    trainer = TransformersModel(tiny_model('tiny-qwen3-vl'), device='cpu')
    trainer.add_adapter_to_model('tower', LoraConfig(r=4, lora_alpha=8, target_modules=['qkv', 'linear_fc1']))
    trainer.add_adapter_to_model('text', LoraConfig(r=4, lora_alpha=8, target_modules='all-linear'))
    tower = multi_lora.peft_state_dict(trainer.model, 'tower')
    text = multi_lora.peft_state_dict(trainer.model, 'text')
    assert tower and text and not any('visual' in key for key in text)
    refuse_tower('text', text)
    with pytest.raises(ConfigurationError, match=r"adapter 'tower' adapts the vision tower \(\d+ weights, e\.g\. '.*"):
        refuse_tower('tower', tower)


@pytest.mark.skipif(TORCHVISION_ERROR is None, reason='torchvision loads here')
def test_qwen_vl_models_are_refused_where_torchvision_does_not_load() -> None:
    """vLLM says only that the architecture 'failed to be inspected'; the sampler names why."""
    with pytest.raises(
        MissingExtraError,
        match=r'vLLM cannot load its code for Qwen3_5ForConditionalGeneration \(vllm\.model_executor\.models\.qwen3_5\)'
        r'.*torchvision.*sample this model with TorchSampler',
    ):
        vLLMSampler(tiny_model('tiny-qwen3.5-vl'), engine_args={'dtype': 'float32', 'max_model_len': 256})


# ---- on the engine, where torchvision loads ----------------------------------------------------------
ENGINE = {
    'dtype': 'float32',
    'max_model_len': 512,
    'limit_mm_per_prompt': {'image': 2},
    'enable_lora': True,
    'max_lora_rank': 8,
    'max_loras': 1,
}


@pytest.fixture(scope='module')
def sampler() -> Iterator[vLLMSampler]:
    sampler = vLLMSampler(tiny_model('tiny-qwen3-vl'), engine_args=ENGINE)
    yield sampler
    sampler.close()


@pytest.fixture(scope='module')
def trainer() -> TransformersModel:
    return TransformersModel(tiny_model('tiny-qwen3-vl'), device='cpu')


def sequences(responses: list[Any]) -> list[SampledSequence]:
    return [seq for response in responses for seq in response.sequences]


def gaps(trainer: TransformersModel, seqs: list[SampledSequence], **forward: Any) -> list[float]:
    """Per sequence, the largest gap between a sampled token's logprob and the trainer's
    teacher-forced one on the same prompt, completion and images."""
    features = [seq.new_input_feature for seq in seqs]
    logps = trainer.forward_only(inputs=features, **forward).logps
    out = []
    for row, (seq, feature) in enumerate(zip(seqs, features, strict=True)):
        trained = torch.tensor(feature['completion_mask']).bool()
        expected = logps[row, : len(feature['labels'])][trained]
        assert len(expected) == len(seq.token_logprobs) == len(seq.tokens)
        out.append((torch.tensor(seq.token_logprobs) - expected).abs().max().item())
    return out


@needs_torchvision
def test_sampled_logprobs_of_image_prompts_equal_the_trainers(
    sampler: vLLMSampler, trainer: TransformersModel, shapes: list[dict[str, Any]]
) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, num_samples=2, ignore_eos=True)
    seqs = sequences(sampler.sample(prompts(shapes), params))
    assert max(gaps(trainer, seqs)) <= TOL
    one, text, two = (seqs[i].new_input_feature for i in (0, 2, 4))
    assert one['image_grid_thw'] == [[1, 4, 4]] and two['image_grid_thw'] == [[1, 4, 4]] * 2
    assert 'pixel_values' not in text
    assert one['input_ids'].count(IMAGE_PAD) == 4 and two['input_ids'].count(IMAGE_PAD) == 8
    with pytest.raises(DataError, match=r'prompt 2 has 3 images, over the engine limit of 2 per prompt'):
        sampler.sample(prompts(shapes, count=3), params)


@needs_torchvision
def test_adapters_and_merged_weights_sample_image_prompts_as_the_trainer_scores_them(
    sampler: vLLMSampler, shapes: list[dict[str, Any]]
) -> None:
    """A language-model adapter samples image prompts with its logprobs; a tower adapter is refused;
    merged weights (the conditional-generation class's names) reload into the engine."""
    model = TransformersModel(tiny_model('tiny-qwen3-vl'), device='cpu')
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
    model.add_adapter_to_model('text', config)
    model.add_adapter_to_model('tower', LoraConfig(r=4, lora_alpha=8, target_modules=['qkv']))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    sampler.load_adapter_weights('text', multi_lora.peft_state_dict(model.model, 'text'), config)
    adapted = sequences(sampler.sample(prompts(shapes), params, adapter_name='text'))
    assert max(gaps(model, adapted, adapter_name='text')) <= TOL
    assert min(gaps(model, adapted, adapter_name='text', disable_lora=True)) > 1e-3
    with pytest.raises(ConfigurationError, match=r"adapter 'tower' adapts the vision tower"):
        sampler.load_adapter_weights('tower', multi_lora.peft_state_dict(model.model, 'tower'), config)
    sampler.remove_adapter('text')
    plain = TransformersModel(tiny_model('tiny-qwen3-vl'), device='cpu')
    base = {name: p.detach().clone() for name, p in plain.model.named_parameters()}
    changed = {name: t * 1.5 for name, t in base.items() if 'language_model.layers.0.mlp' in name}
    assert len(changed) == 3  # gate, up and down projections
    with torch.no_grad():
        for name, p in plain.model.named_parameters():
            p.copy_(changed.get(name, p))
    try:
        assert sampler.load_weights(changed) == 3
        merged = sequences(sampler.sample(prompts(shapes), params))
        assert max(gaps(plain, merged)) <= TOL
        assert min(gaps(model, merged, adapter_name='text', disable_lora=True)) > 1e-3  # the engine's weights changed
    finally:
        sampler.load_weights(base)
