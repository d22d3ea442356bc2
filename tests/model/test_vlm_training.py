"""Images in training (issue 32, points 3 and 4): ``VisionTemplate`` rows, their collation and
packing, and LoRA on the embedded vision-language models with the vision tower frozen.

Expected values come from transformers itself: the image processor run on the picture alone,
the model's own forward (which computes Qwen's multimodal RoPE positions from
``mm_token_type_ids``) and plain peft on the saved adapter; and from each adapter run alone.
"""

from __future__ import annotations

import base64
import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel
from peft.tuners.tuners_utils import _maybe_include_all_linear_layers
from PIL import Image
from transformers import AutoImageProcessor

from twinkle.assets import dataset, resolve_images, tiny_model
from twinkle.data_format import IGNORE_INDEX, InputFeature
from twinkle.dataset import IterableDataset, PackedStream, PackingDataset
from twinkle.errors import ConfigurationError, DataError
from twinkle.model import AdapterCall, TransformersModel
from twinkle.model.lora import multi as multi_lora
from twinkle.model.output import layer as output_layer
from twinkle.model.runner import mrope_positions
from twinkle.processor import InputProcessor
from twinkle.processor.base import split_rows
from twinkle.template import Template, VisionTemplate

TOL = 1e-5
VISION_START, VISION_END, IMAGE_PAD = 4096, 4097, 4099
#: A 64 x 64 picture: 4 x 4 patches of 16 pixels, merged 2 x 2 into 4 tokens.
TOKENS_PER_PICTURE = 4
PATCH_VALUES = 3 * 2 * 16 * 16  # channels x temporal patch x patch height x patch width


@pytest.fixture(scope='module')
def vlm() -> str:
    return tiny_model('tiny-qwen3.5-vl')


@pytest.fixture(scope='module')
def template(vlm: str) -> VisionTemplate:
    return VisionTemplate(vlm)


@pytest.fixture(scope='module')
def shapes() -> list[dict[str, Any]]:
    return resolve_images(dataset('shapes', 'train'))


def picture(row: dict[str, Any]) -> str:
    path: str = row['messages'][0]['content'][0]['image']
    return path


def two_pictures(shapes: list[dict[str, Any]], answer: str = 'Two pictures.') -> dict[str, Any]:
    parts = [
        {'type': 'image', 'image': picture(shapes[1])},
        {'type': 'text', 'text': 'and'},
        {'type': 'image', 'image': picture(shapes[2])},
    ]
    return {'messages': [{'role': 'user', 'content': parts}, {'role': 'assistant', 'content': answer}]}


def without_images(row: dict[str, Any]) -> dict[str, Any]:
    """The row with its image parts left out (a text-only user turn)."""
    messages = []
    for message in row['messages']:
        content = message['content']
        if isinstance(content, list):
            content = ''.join(p['text'] for p in content if p['type'] == 'text')
        messages.append({**message, 'content': content})
    return {'messages': messages}


# ---- the template ---------------------------------------------------------------------------------


def test_an_image_row_has_its_image_tokens_untrained_and_the_text_labels_of_the_text_template(
    vlm: str, template: VisionTemplate, shapes: list[dict[str, Any]]
) -> None:
    row = shapes[0]
    feature = template.encode(row)
    assert feature is not None
    ids, labels = feature['input_ids'], feature['labels']
    # <|vision_start|>, one <|image_pad|> per merged patch, <|vision_end|>.
    start = ids.index(VISION_START)
    assert ids[start + 1 : start + 2 + TOKENS_PER_PICTURE] == [IMAGE_PAD] * TOKENS_PER_PICTURE + [VISION_END]
    assert ids.count(IMAGE_PAD) == TOKENS_PER_PICTURE
    assert feature['mm_token_type_ids'] == [int(t == IMAGE_PAD) for t in ids]
    assert all(labels[i] == IGNORE_INDEX for i, t in enumerate(ids) if t == IMAGE_PAD)
    assert feature['completion_mask'] == [int(label != IGNORE_INDEX) for label in labels]
    # The pixels are what the image processor gives for the picture alone.
    alone = AutoImageProcessor.from_pretrained(vlm)(images=[Image.open(picture(row))], return_tensors='pt')
    assert torch.equal(feature['pixel_values'], alone['pixel_values'])
    assert feature['pixel_values'].shape == (16, PATCH_VALUES)
    assert feature['image_grid_thw'] == [[1, 4, 4]]
    # Without its vision tokens the row is the text-only template's row of the same conversation.
    text = Template(vlm).encode(without_images(row))
    assert text is not None
    vision = set(range(start, start + 2 + TOKENS_PER_PICTURE))
    assert [t for i, t in enumerate(ids) if i not in vision] == text['input_ids']
    assert [x for i, x in enumerate(labels) if i not in vision] == text['labels']
    assert template.decode([x for x in labels if x != IGNORE_INDEX]) == row['answer'] + '<|im_end|>'


def test_several_images_in_a_row_keep_their_order(template: VisionTemplate, shapes: list[dict[str, Any]]) -> None:
    feature = template.encode(two_pictures(shapes))
    assert feature is not None
    assert feature['image_grid_thw'] == [[1, 4, 4], [1, 4, 4]]
    assert feature['input_ids'].count(IMAGE_PAD) == 2 * TOKENS_PER_PICTURE
    first, second = (template.encode(shapes[i]) for i in (1, 2))
    assert first is not None and second is not None
    assert torch.equal(feature['pixel_values'], torch.cat([first['pixel_values'], second['pixel_values']]))


def test_paths_bytes_pil_images_and_data_urls_give_identical_features(
    template: VisionTemplate, shapes: list[dict[str, Any]]
) -> None:
    path = picture(shapes[3])
    data = Path(path).read_bytes()
    url = 'data:image/png;base64,' + base64.b64encode(data).decode()
    question = {'type': 'text', 'text': 'Describe the picture.'}
    parts = [
        {'type': 'image', 'image': path},
        {'type': 'image', 'image': f'file://{path}'},
        {'type': 'image', 'image': data},
        {'type': 'image', 'image': Image.open(io.BytesIO(data))},
        {'type': 'image', 'image': Image.open(io.BytesIO(data)).convert('RGBA')},  # converted to RGB
        {'type': 'image', 'image': {'bytes': data, 'path': None}},  # a datasets.Image value
        {'type': 'image_url', 'image_url': {'url': url}},
        {'image': url},
    ]
    features = []
    for part in parts:
        row = {'messages': [{'role': 'user', 'content': [part, question]}, {'role': 'assistant', 'content': 'A.'}]}
        features.append(template.encode(row))
    first = features[0]
    assert first is not None
    for feature in features[1:]:
        assert feature is not None
        assert torch.equal(feature['pixel_values'], first['pixel_values'])
        assert {k: v for k, v in feature.items() if k != 'pixel_values'} == {
            k: v for k, v in first.items() if k != 'pixel_values'
        }


def test_remote_and_missing_images_are_refused_naming_the_row_and_part(
    vlm: str, template: VisionTemplate, shapes: list[dict[str, Any]]
) -> None:
    def row(image: Any) -> dict[str, Any]:
        parts = [{'type': 'text', 'text': 'Look:'}, {'type': 'image_url', 'image_url': {'url': image}}]
        return {'messages': [{'role': 'user', 'content': parts}, {'role': 'assistant', 'content': 'ok'}]}

    with pytest.raises(DataError, match=r"row 1: message 0, part 1: remote image 'https://x.org/a.png' refused.*data:"):
        template.batch_encode([shapes[0], row('https://x.org/a.png')])
    with pytest.raises(DataError, match=r'message 0, part 1: image file .*nowhere.png. does not exist'):
        template.encode(row('/nowhere.png'))
    with pytest.raises(DataError, match='cannot be decoded'):
        template.encode(row('data:image/png;base64,' + base64.b64encode(b'not a png').decode()))
    # The text template renders no pixels, so it refuses image rows rather than train on pad tokens.
    with pytest.raises(DataError, match=r"message 0 holds an image part.*'VisionTemplate'"):
        Template(vlm).encode(shapes[0])


def test_truncation_never_cuts_through_an_image(vlm: str, shapes: list[dict[str, Any]]) -> None:
    full = VisionTemplate(vlm).encode(shapes[0])
    assert full is not None
    right = VisionTemplate(vlm, max_length=len(full['input_ids']) - 1, truncation_strategy='right').encode(shapes[0])
    assert right is not None and right['input_ids'] == full['input_ids'][:-1]  # the image is whole
    with pytest.raises(DataError, match='would cut through an image'):
        VisionTemplate(vlm, max_length=len(full['input_ids']) - 8, truncation_strategy='left').encode(shapes[0])


# ---- collation and packing ------------------------------------------------------------------------


def test_two_rows_of_one_and_two_images_collate_in_row_order(
    template: VisionTemplate, shapes: list[dict[str, Any]]
) -> None:
    one, two = template.encode(shapes[0]), template.encode(two_pictures(shapes))
    text = template.encode(without_images(shapes[5]))
    assert one is not None and two is not None and text is not None
    assert 'pixel_values' not in text  # a text row through the vision template is a text row
    batch = InputProcessor()([one, text, two], pad_token_id=0)
    width = max(len(one['input_ids']), len(two['input_ids']))
    assert torch.equal(batch['pixel_values'], torch.cat([one['pixel_values'], two['pixel_values']]))
    assert batch['image_grid_thw'].tolist() == [[1, 4, 4]] * 3
    assert batch['image_counts'].tolist() == [1, 0, 2]
    assert batch['mm_token_type_ids'].shape == (3, width)
    assert batch['mm_token_type_ids'].sum(-1).tolist() == [4, 0, 8]
    # Cut back into parts of rows (the mixed pass's calls), each part keeps its rows' images.
    first, second = split_rows(batch, [2, 1])
    assert torch.equal(first['pixel_values'], one['pixel_values']) and first['image_counts'].tolist() == [1, 0]
    assert torch.equal(second['pixel_values'], two['pixel_values']) and len(second['image_grid_thw']) == 2
    # Packed: one row, its images in the order of its tokens.
    packed = InputProcessor(padding_free=True)([two, one], pad_token_id=0)
    assert torch.equal(packed['pixel_values'], torch.cat([two['pixel_values'], one['pixel_values']]))
    assert packed['image_counts'].tolist() == [3]


def rows_with_images(template: VisionTemplate, shapes: list[dict[str, Any]]) -> list[InputFeature]:
    """Six rows of 1, 2 or no images and different lengths."""
    rows = [
        template.encode(shapes[0]),
        template.encode(two_pictures(shapes, 'A digit, then a shape, drawn apart.')),
        template.encode(without_images(shapes[6])),
        template.encode(shapes[7]),
        template.encode(two_pictures(shapes[3:], 'Two.')),
        template.encode(shapes[9]),
    ]
    return [row for row in rows if row is not None]


def lora_model(path: str, target_modules: Any = 'all-linear', names: tuple[str, ...] = ('a',)) -> TransformersModel:
    model = TransformersModel(model_id=path, device='cpu')
    for index, name in enumerate(names):
        torch.manual_seed(index)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False)
        model.add_adapter_to_model(name, config)
    return model


def grads(model: TransformersModel, name: str = 'a') -> list[torch.Tensor]:
    group = model.groups[name]
    return [p.grad / group.pending.items for p in group.params]


def worst(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True))


def test_packed_image_rows_give_the_loss_and_gradients_of_the_rows_padded(shapes: list[dict[str, Any]]) -> None:
    """On tiny-qwen3-vl (full attention): each packed row gets the multimodal RoPE positions it
    has alone (``mrope_positions`` runs the model's ``get_rope_index`` on each packed row), so the
    packed batch is exact."""
    path = tiny_model('tiny-qwen3-vl')
    rows = rows_with_images(VisionTemplate(path), shapes)
    padded = lora_model(path)
    # The positions of two rows packed: the text positions restart, the 3-D ones are each row's alone.
    pair = [rows[1], rows[0]]
    batch = InputProcessor(padding_free=True)(pair, pad_token_id=0)
    alone = [
        padded.model.model.get_rope_index(
            torch.tensor([row['input_ids']]),
            torch.tensor([row['mm_token_type_ids']]),
            image_grid_thw=torch.tensor(row['image_grid_thw']),
        )[0][:, 0]
        for row in pair
    ]
    positions = mrope_positions(padded.model, batch)
    assert torch.equal(positions[0], batch['position_ids'])
    assert torch.equal(positions[1:, 0], torch.cat(alone, dim=-1))
    assert int(positions[1:, 0, len(pair[0]['input_ids'])].max()) == 0  # the second row starts again
    packed = copy.deepcopy(padded)
    packed.set_processor('InputProcessor', padding_free=True, adapter_name='a')
    packed_rows = list(PackingDataset(rows, max_length=64))
    assert len(packed_rows) < len(rows) and max(r['packed_rows'] for r in packed_rows) > 1
    assert sum(len(r['image_grid_thw']) for r in packed_rows if 'image_grid_thw' in r) == 7
    loss = padded.forward_backward(inputs=rows, adapter_name='a').loss
    assert packed.forward_backward(inputs=packed_rows, adapter_name='a').loss == pytest.approx(loss, rel=TOL)
    assert worst(grads(packed), grads(padded)) <= TOL


def test_packed_image_rows_are_exact_on_a_model_with_linear_attention(
    vlm: str, template: VisionTemplate, shapes: list[dict[str, Any]]
) -> None:
    """tiny-qwen3.5-vl: its gated deltanet runs once per packed row (``twinkle.model.packed_recurrence``;
    before it, packed image rows were 0.05 off the padded ones in the loss), so packing is exact."""
    rows = rows_with_images(template, shapes)[:4]
    padded = lora_model(vlm)
    packed = copy.deepcopy(padded)
    packed.set_processor('InputProcessor', padding_free=True, adapter_name='a')
    packed_rows = list(PackingDataset(rows, max_length=128))
    assert max(r['packed_rows'] for r in packed_rows) > 1
    loss = padded.forward_backward(inputs=rows, adapter_name='a').loss
    assert packed.forward_backward(inputs=packed_rows, adapter_name='a').loss == pytest.approx(loss, rel=TOL)
    assert worst(grads(packed), grads(padded)) <= TOL


def test_a_stream_of_image_rows_encodes_and_packs_with_its_images(
    vlm: str, shapes: list[dict[str, Any]], tmp_path: Path
) -> None:
    path = tmp_path / 'shapes.jsonl'
    path.write_text('\n'.join(json.dumps(row) for row in shapes[:6]))  # absolute image paths
    stream = IterableDataset(str(path))
    stream.set_template('VisionTemplate', model_id=vlm)
    stream.encode()
    packed_stream = PackedStream(stream, max_length=64, buffer_size=3)  # from the stream's start
    encoded = list(stream)
    assert [row['image_grid_thw'] for row in encoded] == [[[1, 4, 4]]] * 6
    packed = list(packed_stream)
    assert sum(s['packed_rows'] for s in packed) == 6 and len(packed) < 6
    for sequence in packed:
        assert len(sequence['image_grid_thw']) == sequence['packed_rows']
        assert sum(sequence['mm_token_type_ids']) == TOKENS_PER_PICTURE * sequence['packed_rows']
        assert len(sequence['pixel_values']) == 16 * sequence['packed_rows']


def test_a_dataset_of_the_shapes_encodes_every_answer_as_its_text(vlm: str, tmp_path: Path) -> None:
    # User contents are lists of parts and answers text, so datasets keeps them as its Json feature,
    # which reads the answer "3" back as the number 3: the template takes it as the text it was.
    from twinkle.dataset import Dataset, DatasetMeta

    rows = resolve_images(dataset('shapes', 'train'))
    counts = [row for row in rows if row['task'] == 'count'][:4]
    path = tmp_path / 'counts.jsonl'
    path.write_text('\n'.join(json.dumps(row) for row in counts))
    loaded = Dataset(DatasetMeta(str(path)))
    assert isinstance(loaded[0]['messages'][1]['content'], int)  # what datasets gives back
    loaded.set_template('VisionTemplate', model_id=vlm)
    loaded.encode()
    template = VisionTemplate(vlm)
    for row, raw in zip(loaded, counts, strict=True):
        assert row['labels'] == template.encode(raw)['labels']


# ---- training ---------------------------------------------------------------------------------------


def test_sft_on_the_captions_lowers_the_loss_with_the_vision_tower_untouched(
    vlm: str, shapes: list[dict[str, Any]]
) -> None:
    model = TransformersModel(model_id=vlm, device='cpu')
    tower = {n: p.detach().clone() for n, p in model.model.named_parameters() if n.startswith('model.visual.')}
    torch.manual_seed(0)
    model.add_adapter_to_model('a', LoraConfig(r=8, lora_alpha=16, target_modules='all-linear'))
    adapted = multi_lora.adapter_linear_paths(model.model, 'a')
    assert adapted and all(p.startswith('model.language_model.') for p in adapted)
    # peft's own 'all-linear' takes the tower's linears too: twinkle's leaves them out on purpose.
    theirs = _maybe_include_all_linear_layers(LoraConfig(target_modules='all-linear'), model.model).target_modules
    assert any(name.startswith('model.visual.') for name in theirs)
    model.set_optimizer('AdamW', lr=1e-2, adapter_name='a')
    captions = [row for row in shapes if row['task'] == 'caption'][:4]
    losses = []
    for _ in range(4):
        losses.append(model.forward_backward(inputs=captions, adapter_name='a').loss)
        model.clip_grad_and_step(adapter_name='a')
    print('caption SFT losses', [round(x, 3) for x in losses])
    assert losses[-1] < 0.5 * losses[0], losses
    after = dict(model.model.named_parameters())
    assert all(torch.equal(after[n], p) and not after[n].requires_grad for n, p in tower.items())


def test_a_saved_adapter_gives_plain_peft_the_same_logits_on_image_rows(
    vlm: str, template: VisionTemplate, shapes: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Two rows padded into one batch (1 and 2 images): transformers computes the multimodal RoPE
    positions itself from ``mm_token_type_ids``; twinkle passes its own (``mrope_positions``)."""
    model = lora_model(vlm)
    rows = [template.encode(shapes[0]), template.encode(two_pictures(shapes))]
    ours = model.forward_only(inputs=rows, adapter_name='a').logits
    saved = model.save('vlm-adapter', str(tmp_path), adapter_name='a')
    base = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vlm, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, saved).eval()
    batch = InputProcessor()([r for r in rows if r is not None], pad_token_id=0)
    inputs = {
        k: batch[k] for k in ('input_ids', 'attention_mask', 'pixel_values', 'image_grid_thw', 'mm_token_type_ids')
    }
    with torch.no_grad():
        theirs = peft_model(**inputs).logits
    real = batch['attention_mask'].bool()
    assert (ours[real] - theirs[real]).abs().max().item() <= TOL
    # The image changes the logits after it (the pixels reached the model).
    other = copy.deepcopy(rows[0])
    assert other is not None
    other['pixel_values'] = torch.flip(other['pixel_values'], dims=[0])
    changed = model.forward_only(inputs=[other], adapter_name='a').logits
    assert (changed[0, -3:] - ours[0, len(other['input_ids']) - 3 : len(other['input_ids'])]).abs().max() > 1e-4


def test_the_vision_tower_trains_when_its_layers_are_named(vlm: str, shapes: list[dict[str, Any]]) -> None:
    model = lora_model(vlm, target_modules=['q_proj', 'qkv', 'linear_fc1'])
    adapted = multi_lora.adapter_linear_paths(model.model, 'a')
    tower = [p for p in adapted if p.startswith('model.visual.')]
    assert tower and any(p.startswith('model.language_model.') for p in adapted)
    model.forward_backward(inputs=shapes[:2], adapter_name='a')
    params = multi_lora.adapter_named_parameters(model.model, 'a')
    tower_grads = [p.grad for n, p in params.items() if n.startswith('model.visual.')]
    assert tower_grads and all(g is not None and g.abs().max() > 0 for g in tower_grads)
    # A tower adapter sees patches, not rows: it cannot share a pass with another adapter's image rows.
    model.add_adapter_to_model('b', LoraConfig(r=4, target_modules='all-linear'))
    with pytest.raises(ConfigurationError, match='adapt the vision tower'):
        model.forward_backward_mixed([AdapterCall('a', shapes[:1]), AdapterCall('b', shapes[1:2])])


def test_image_rows_of_two_adapters_in_one_pass_get_what_each_gets_alone(
    vlm: str, template: VisionTemplate, shapes: list[dict[str, Any]]
) -> None:
    rows = rows_with_images(template, shapes)
    calls = {'a': rows[:2], 'b': rows[2:5]}  # 'b' has a text row, one picture, two pictures
    base = lora_model(vlm, names=('a', 'b'))
    alone, mixed = copy.deepcopy(base), copy.deepcopy(base)
    losses = {name: alone.forward_backward(inputs=r, adapter_name=name).loss for name, r in calls.items()}
    outputs = mixed.forward_backward_mixed([AdapterCall(name, r) for name, r in calls.items()])
    for (name, loss), output in zip(losses.items(), outputs, strict=True):
        assert output.loss == pytest.approx(loss, rel=TOL), name
        assert worst(grads(mixed, name), grads(alone, name)) <= TOL, name
    # The other order: 'b' first, its images still with its rows.
    swapped = copy.deepcopy(base)
    outputs = swapped.forward_backward_mixed([AdapterCall(name, calls[name]) for name in ('b', 'a')])
    assert [o.loss for o in outputs] == pytest.approx([losses['b'], losses['a']], rel=TOL)


def test_grpo_on_image_rows_in_one_pass_equals_each_adapter_alone(
    vlm: str, template: VisionTemplate, shapes: list[dict[str, Any]]
) -> None:
    rows = rows_with_images(template, shapes)[:4]
    advantages = {'a': [1.0, -0.5], 'b': [-1.0, 0.25]}
    calls = {'a': rows[:2], 'b': rows[2:4]}
    base = lora_model(vlm, names=('a', 'b'))
    for name in calls:
        # beta > 0: the KL reference runs each adapter's share of the pass again, with its own images.
        base.set_loss('GRPOLoss', adapter_name=name, epsilon=0.2, beta=0.1)
    alone, mixed = copy.deepcopy(base), copy.deepcopy(base)
    losses = {
        name: alone.forward_backward(inputs=r, adapter_name=name, advantages=advantages[name]).loss
        for name, r in calls.items()
    }
    outputs = mixed.forward_backward_mixed(
        [AdapterCall(name, r, {'advantages': advantages[name]}) for name, r in calls.items()]
    )
    for (name, loss), output in zip(losses.items(), outputs, strict=True):
        assert loss is not None and loss != 0.0
        assert output.loss == pytest.approx(loss, rel=TOL), name
        assert worst(grads(mixed, name), grads(alone, name)) <= TOL, name


@pytest.mark.parametrize('name', ['tiny-qwen3-vl', 'tiny-qwen3.5-vl'])
def test_image_rows_through_the_fused_output_layer_get_the_unfused_loss_and_gradients(
    name: str, shapes: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # fused_output is on by default at a real vocabulary (Qwen3-VL's, Qwen3.5's): on here by hand.
    path = tiny_model(name)
    rows = rows_with_images(VisionTemplate(path), shapes)
    unfused = lora_model(path)
    fused = copy.deepcopy(unfused)
    fused.fused_output = True
    chunked = []  # the fused layer's calls: the fused model must not fall back to whole logits
    real = output_layer.fused_token_logprobs
    monkeypatch.setattr(output_layer, 'fused_token_logprobs', lambda *a, **k: chunked.append(1) or real(*a, **k))
    loss = unfused.forward_backward(inputs=rows, adapter_name='a').loss
    assert fused.forward_backward(inputs=rows, adapter_name='a').loss == pytest.approx(loss, abs=TOL)
    assert chunked
    assert worst(grads(fused), grads(unfused)) <= TOL
