"""Images through the service: a server hosting the tiny vision-language model takes rows and
prompts with images from the native client (data URLs of the image files) and the Tinker SDK
(``ImageChunk`` s in a ``ModelInput``), gives the numbers a local model gives on the same rows,
keeps tenants' image rows apart in a shared pass, and refuses what is over its image limits with
a 400 that names the row, the image and the limit."""

from __future__ import annotations

import base64
import ctypes
import io
import itertools
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import torch
from peft import LoraConfig
from PIL import Image
from server_helpers import Gate, background_server
from tinker import types

from twinkle import assets
from twinkle.errors import DataError
from twinkle.model import TransformersModel
from twinkle.template.vision import VisionTemplate
from twinkle_client import TwinkleClient
from twinkle_client.client import PREFIX
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import TorchSampler as ClientSampler

TOL = 1e-5
VLM = 'tiny-qwen3.5-vl'
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
#: The server's image limits (the shapes' pictures are 64 x 64 PNGs of a few hundred bytes: 4,096 pixels,
#: 4 tokens each; a request of up to four of them fits). The model's image processor resizes to at most
#: 16,384 pixels; the server to at most 8,192.
LIMITS = {
    'max_images_per_request': 4,
    'max_image_bytes': 4096,
    'max_image_pixels': 100 * 100,
    'max_image_pixels_per_request': 4 * 64 * 64,
    'max_image_resized_pixels': 8192,
}


@pytest.fixture(scope='module')
def shapes() -> list[dict[str, Any]]:
    return assets.resolve_images(assets.dataset('shapes', 'train'))[:6]


@pytest.fixture(scope='module')
def vlm_dir() -> str:
    return assets.tiny_model(VLM)


@pytest.fixture(scope='module')
def features(vlm_dir: str, shapes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as a dataset encodes them: the template's features beside the row's messages."""
    template = VisionTemplate(vlm_dir)
    return [{**template.encode(row), 'messages': row['messages']} for row in shapes]


@pytest.fixture(scope='module')
def server(tmp_path_factory: Any, vlm_dir: str) -> Iterator[tuple[str, dict[str, str], Any]]:
    text = [{'base_model': 'tiny-qwen3', 'device': 'cpu'}]
    options = {'limits': LIMITS, 'more_models': text}
    with background_server(tmp_path_factory.mktemp('images'), VLM, ('alice', 'bob'), **options) as running:
        yield running


def local_logps(vlm_dir: str, rows: list[dict[str, Any]], seed: int) -> list[torch.Tensor]:
    model = TransformersModel(vlm_dir, device='cpu')
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter_to_model('local', LORA)
    logps = model.forward_only(inputs=rows, adapter_name='local').logps
    return [logps[i, : len(row['input_ids'])] for i, row in enumerate(rows)]


def worst(served: list[list[float]], local: list[torch.Tensor]) -> float:
    return max((torch.tensor(s[: len(x)]) - x).abs().max().item() for s, x in zip(served, local, strict=True))


def native(url: str, key: str, seed: int = 7) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel(VLM, client=TwinkleClient(url, key))
    model.add_adapter_to_model('default', LORA, seed=seed)
    return model


def data_url(image: Image.Image, image_format: str = 'PNG') -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return f'data:image/{image_format.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}'


@pytest.mark.integration
def test_native_image_rows_get_a_local_models_numbers_and_train(server, vlm_dir, features):
    url, keys, _ = server
    model = native(url, keys['alice'])
    rows = features[:3]
    assert worst(model.forward_only(inputs=rows).logps, local_logps(vlm_dir, rows, 7)) <= TOL
    without = [{k: v for k, v in row.items() if k in ('input_ids', 'labels')} for row in rows]
    assert worst(model.forward_only(inputs=rows).logps, local_logps(vlm_dir, without, 7)) > 1e-2  # the pixels count
    model.set_optimizer('AdamW', lr=5e-2)
    losses = []
    for _ in range(3):
        losses.append(model.forward_backward(inputs=rows).loss)
        model.clip_grad_and_step()
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.integration
def test_image_rows_of_two_tenants_in_one_pass_get_what_each_gets_alone(server, vlm_dir, features):
    url, keys, background = server
    scheduler = background.app.state.service.groups[VLM].scheduler
    models = {'alice': native(url, keys['alice'], seed=3), 'bob': native(url, keys['bob'], seed=4)}
    rows = {'alice': features[0:2], 'bob': features[2:5]}
    bodies = {tenant: {'inputs': [dict(r) for r in _wire_rows(rows[tenant])]} for tenant in models}
    gate = Gate(scheduler)
    futures = {
        tenant: model.client.submit(f'{PREFIX}/runs/{model.runs["default"]}/ops/forward_only', bodies[tenant])
        for tenant, model in models.items()
    }
    gate.open()
    results = {tenant: models[tenant].client.result(future) for tenant, future in futures.items()}
    jobs = [scheduler.get(future) for future in futures.values()]
    assert {job.pass_id for job in jobs} == {jobs[0].pass_id} and jobs[0].pass_size == 2  # one shared pass
    for tenant, seed in (('alice', 3), ('bob', 4)):
        assert worst(results[tenant]['logps'], local_logps(vlm_dir, rows[tenant], seed)) <= TOL, tenant


def _wire_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from twinkle_client.model import wire_rows

    return wire_rows(rows)


@pytest.mark.integration
def test_a_sampled_image_prompt_trains_with_its_images_and_scores_as_sampled(server, vlm_dir, features):
    url, keys, _ = server
    model = native(url, keys['alice'], seed=5)
    template = VisionTemplate(vlm_dir)
    prompt = {'messages': features[0]['messages'][:1]}
    encoded = {**template.encode(prompt, add_generation_prompt=True), 'messages': prompt['messages']}
    sampler = ClientSampler(model=model)
    [response] = sampler.sample([encoded], {'max_tokens': 4, 'temperature': 1.0, 'seed': 3, 'logprobs': 1})
    [sequence] = response.sequences
    feature = sequence.new_input_feature
    assert feature['images'][0].startswith('data:image/png;base64,')
    scored = model.forward_only(inputs=[feature]).logps[0]
    prompt_length = len(encoded['input_ids'])
    sampled = [entry[0][1] for entry in sequence.logprobs]
    scored_completion = scored[prompt_length - 1 : prompt_length - 1 + len(sampled)]
    assert max(abs(a - b) for a, b in zip(scored_completion, sampled, strict=True)) <= 1e-4


def _undecodable(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, 'images': ['data:image/png;base64,' + base64.b64encode(b'not a picture').decode()]}


def _cut(row: dict[str, Any]) -> dict[str, Any]:
    """The row's picture with its header whole (64 x 64, read without decoding) and its pixels cut in half."""
    whole = base64.b64decode(row['images'][0].partition(',')[2])
    return {**row, 'images': ['data:image/png;base64,' + base64.b64encode(whole[: len(whole) // 2]).decode()]}


def _file(image: Image.Image, image_format: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def _animated() -> bytes:
    """A GIF of three 64 x 64 frames (420 bytes): only its first would reach the model."""
    frames = [Image.new('RGB', (64, 64), (80 * i, 0, 0)) for i in range(3)]
    return _file(frames[0], 'GIF', save_all=True, append_images=frames[1:])


def _as_url(data: bytes) -> str:
    return 'data:image/png;base64,' + base64.b64encode(data).decode()


#: Images the checks refuse, each with what the 400 says (the file, and the limit as its config field).
#: 588 x 17 (9,996 pixels, under 10,000): Qwen's smart_resize makes the short side one factor (32) and the
#: long one floor(588 / 1.105 / 32) * 32 = 512, 16,384 pixels, over the server's 8,192 (its beta is
#: sqrt(9996 / 8192) = 1.105). 16 x 16 BMP: 822 bytes, a format PIL reads and the service does not take.
BAD_FILES: dict[str, tuple[bytes, str]] = {
    'aspect': (
        _file(Image.new('RGB', (1, 4000)), 'PNG'),
        'image 0 is 1 x 4000 pixels, an aspect ratio of 4000.0, over the limit of 200 of the image processor',
    ),
    'resized': (
        _file(Image.new('RGB', (588, 17)), 'PNG'),
        'image 0 is 588 x 17 pixels, resized to 512 x 32 = 16384 pixels, over the limit of 8192 after resizing '
        '(limits.max_image_resized_pixels)',
    ),
    'format': (
        _file(Image.new('RGB', (16, 16)), 'BMP'),
        'image 0 cannot be decoded as an image: it is not a PNG, JPEG, WebP or GIF file',
    ),
    'animated': (_animated(), 'image 0 is an animated GIF of 3 frames; accepted: a still image'),
}


def _bad_file(refusal: str) -> Any:
    return lambda row: {**row, 'images': [_as_url(BAD_FILES[refusal][0])]}


REFUSALS = {
    'count': (
        lambda row: {**row, 'images': row['images'] * 5},
        'the request holds 5 images, over the limit of 4 per request (limits.max_images_per_request)',
    ),
    'pixels': (
        lambda row: {**row, 'images': [data_url(Image.new('RGB', (120, 90)))]},
        'input row 0 image 0 is 120 x 90 = 10800 pixels, over the limit of 10000 per image (limits.max_image_pixels)',
    ),
    'bytes': (
        lambda row: {**row, 'images': [data_url(_noise(60))]},
        'bytes, over the limit of 4096 per image (limits.max_image_bytes)',
    ),
    'undecodable': (_undecodable, 'input row 0 image 0 cannot be decoded as an image'),
    'truncated': (_cut, 'input row 0 image 0 cannot be decoded as an image: image file is truncated'),
    'tokens': (
        lambda row: {**row, 'images': [data_url(Image.new('RGB', (32, 32)))]},
        'input row 0 image 0 has 4 pad tokens, but the image is 1 tokens',
    ),
    'runs': (lambda row: {**row, 'images': row['images'] * 2}, 'input row 0 has 2 images but 1 runs of image pad'),
    'path': (lambda row: {**row, 'images': ['/etc/passwd']}, "String should match pattern '^data:image/"),
    **{name: (_bad_file(name), f'input row 0 {message}') for name, (_, message) in BAD_FILES.items()},
}


@pytest.mark.integration
@pytest.mark.parametrize('refusal', sorted(REFUSALS))
def test_images_over_the_limits_are_a_400_naming_the_row_image_and_limit(server, features, refusal):
    change, message = REFUSALS[refusal]
    url, keys, _ = server
    model = native(url, keys['bob'], seed=1)
    [row] = _wire_rows(features[:1])
    response = httpx.post(
        f'{url}{PREFIX}/runs/{model.runs["default"]}/ops/forward_only',
        json={'inputs': [change(row)]},
        headers={'Authorization': f'Bearer {keys["bob"]}'},
    )
    assert response.status_code == (422 if refusal == 'path' else 400), response.text  # refused before it queues
    assert message in response.text
    assert '/tmp' not in response.text and 'twinkle.server' not in response.text
    assert model.forward_only(inputs=features[:1]).logps  # the server serves on


def _noise(side: int) -> Image.Image:
    gen = torch.Generator().manual_seed(0)
    return Image.fromarray(torch.randint(0, 256, (side, side, 3), generator=gen, dtype=torch.uint8).numpy())


@pytest.mark.integration
def test_a_text_model_refuses_image_rows_and_a_row_without_its_messages_is_refused_by_the_client(server, features):
    url, keys, _ = server
    text = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, keys['alice']))
    text.add_adapter_to_model('default', LORA, seed=1)
    with pytest.raises(DataError, match='holds 1 images, but this model takes no images'):
        text.forward_only(inputs=features[:1])
    model = native(url, keys['alice'])
    bare = {k: v for k, v in features[0].items() if k != 'messages'}
    with pytest.raises(DataError, match='row 0 has pixel_values but no messages with its images'):
        model.forward_only(inputs=[bare])


# ---- the Tinker API ----------------------------------------------------------------------------------
def tinker_datum(row: dict[str, Any], image_format: str = 'jpeg', expected: int | None = None) -> types.Datum:
    """A row of the shapes as Tinker's renderers send it: text chunks around an ``ImageChunk``."""
    ids, kinds = row['input_ids'], row['mm_token_type_ids']
    start, count = kinds.index(1), sum(kinds)
    picture = Image.open(row['messages'][0]['content'][0]['image']).convert('RGB')
    buffer = io.BytesIO()
    picture.save(buffer, format=image_format.upper())
    chunks = [
        types.EncodedTextChunk(tokens=ids[:start]),
        types.ImageChunk(data=buffer.getvalue(), format=image_format, expected_tokens=expected or count),
        types.EncodedTextChunk(tokens=ids[start + count : -1]),
    ]
    targets, weights = ids[1:], [0.0 if label == -100 else 1.0 for label in row['labels'][:-1]]
    if expected is not None:  # as a client that counts the image's tokens wrong would send it
        targets, weights = [0] * (len(ids) - 1 - count + expected), [0.0] * (len(ids) - 1 - count + expected)
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={'target_tokens': targets, 'weights': weights},
    )


@pytest.mark.integration
def test_tinker_image_chunks_train_and_score_as_the_native_rows(server, sdk_clients, vlm_dir, features):
    url, keys, _ = server
    service = sdk_clients(url, keys['alice'])
    trainer = service.create_lora_training_client(base_model=VLM, rank=4, seed=9).result()
    datums = [tinker_datum(row, 'png') for row in features[:2]]
    output = trainer.forward(datums, 'cross_entropy').result()
    native_model = MultiLoraTransformersModel(VLM, client=TwinkleClient(url, keys['alice']))
    native_model.attach(trainer.model_id)
    # Every label given (pre-shifted: label j is token j + 1); the server drops those of image tokens.
    rows = [{**row, 'labels': [*row['input_ids'][1:], -100]} for row in features[:2]]
    served = native_model.forward_only(inputs=rows).logps
    for i, row in enumerate(rows):  # Tinker's logprob j is of target j, token j + 1, as the native one
        kinds = row['mm_token_type_ids']
        text = torch.tensor([not (a or b) for a, b in itertools.pairwise(kinds)])
        tinker_logps = torch.tensor(output.loss_fn_outputs[i]['logprobs'].tolist())
        native_logps = torch.tensor(served[i][: len(row['input_ids']) - 1])
        assert text.sum() > 20 and (tinker_logps - native_logps)[text].abs().max().item() <= TOL
        assert (native_logps[~text] == 0).all()  # no label is an image token or read off one
    losses = []
    for _ in range(3):
        result = trainer.forward_backward([tinker_datum(row) for row in features[:3]], 'cross_entropy').result()
        losses.append(result.metrics['loss:sum'])
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[0] / 2  # 142 -> 23 when written


@pytest.mark.integration
def test_a_tinker_image_chunk_with_the_wrong_token_count_is_refused(server, sdk_clients, vlm_dir, features):
    url, keys, _ = server
    service = sdk_clients(url, keys['bob'])
    trainer = service.create_lora_training_client(base_model=VLM, rank=4).result()
    with pytest.raises(Exception, match='datum 0 image 0 has 9 pad tokens, but the image is 4 tokens'):
        trainer.forward([tinker_datum(features[0], expected=9)], 'cross_entropy').result()


@pytest.mark.integration
def test_tinker_samples_an_image_prompt_with_the_trainers_logprobs(server, sdk_clients, vlm_dir, features):
    url, keys, _ = server
    service = sdk_clients(url, keys['alice'])
    sampler = service.create_sampling_client(base_model=VLM).result()
    prompt_datum = tinker_datum(features[0], 'png')
    chunks = list(prompt_datum.model_input.chunks)
    prompt = types.ModelInput(chunks=chunks[:2])  # the text before the image, and the image
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=5)
    result = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
    [sequence] = result.sequences
    assert len(sequence.tokens) >= 1 and all(math.isfinite(lp) for lp in sequence.logprobs)
    full = types.ModelInput(chunks=[*chunks[:2], types.EncodedTextChunk(tokens=list(sequence.tokens))])
    scored = sampler.compute_logprobs(full).result()
    tail = scored[-len(sequence.tokens) :]
    assert max(abs(a - b) for a, b in zip(tail, sequence.logprobs, strict=True)) <= 1e-4
    blank = io.BytesIO()
    Image.new('RGB', (64, 64)).save(blank, format='PNG')  # another picture: other logprobs
    other = types.ImageChunk(data=blank.getvalue(), format='png', expected_tokens=chunks[1].expected_tokens)
    elsewhere = sampler.compute_logprobs(types.ModelInput(chunks=[chunks[0], other, full.chunks[2]])).result()
    assert max(abs(a - b) for a, b in zip(elsewhere[-len(tail) :], tail, strict=True)) > 1e-2


@pytest.mark.integration
def test_a_request_over_its_decoded_pixels_is_a_400_naming_the_total_and_the_limit(server, features):
    # Two rows of a 100 x 90 picture each: 2 x 9,000 = 18,000 pixels to decode, over 4 x 64 x 64 = 16,384.
    url, keys, _ = server
    model = native(url, keys['bob'], seed=2)
    rows = [{**row, 'images': [data_url(Image.new('RGB', (100, 90)))]} for row in _wire_rows(features[:2])]
    response = httpx.post(
        f'{url}{PREFIX}/runs/{model.runs["default"]}/ops/forward_only',
        json={'inputs': rows},
        headers={'Authorization': f'Bearer {keys["bob"]}'},
    )
    assert response.status_code == 400, response.text
    assert (
        "the request's 2 images are 18000 pixels (width x height, before resizing), over the limit of 16384 per "
        'request (limits.max_image_pixels_per_request)'
    ) in response.text


@pytest.mark.integration
def test_a_row_encoded_for_the_processors_own_resize_names_the_servers(server, vlm_dir, features):
    # 100 x 90: the model's processor (at most 16,384 pixels) keeps 96 x 96, 9 tokens, as the local template
    # encodes it; the server resizes to at most 8,192 pixels: beta = sqrt(9000 / 8192) = 1.048, 64 x 64, 4 tokens.
    url, keys, _ = server
    picture = Image.new('RGB', (100, 90), (200, 30, 30))
    messages = [{'role': 'user', 'content': [{'type': 'image', 'image': picture}, {'type': 'text', 'text': 'hi'}]}]
    row = VisionTemplate(vlm_dir).encode({'messages': messages})
    assert sum(row['mm_token_type_ids']) == 9
    model = native(url, keys['bob'], seed=2)
    with pytest.raises(DataError, match=r'has 9 pad tokens, but the image is 4 tokens \(resized to 64 x 64'):
        model.forward_only(inputs=[{**row, 'messages': messages}])


def test_images_are_decoded_one_at_a_time_and_resized_before_the_processor(vlm_dir):
    # Four 2000 x 2000 PNGs (4 M pixels, solid: a few kB each). PIL holds a decoded RGB image in 4 bytes a
    # pixel (16 MB); decoding one at a time and resizing it at once holds at most one such image, and its RGB
    # copy were it of another mode: 2 x 16 = 32 MB over the baseline. All four decoded first and copied into
    # arrays by the processor, as before this bound, was 146 MiB. The pixels are the processor's own on the
    # full-size images, bit for bit.
    from twinkle.server.config import Limits
    from twinkle.server.execution.checks.images import ImageRows
    from twinkle.template.vision import load_image_processor

    limits = Limits(max_image_pixels=2000 * 2000, max_image_pixels_per_request=4 * 2000 * 2000)
    rows = ImageRows.of(vlm_dir, limits)
    assert rows is not None
    files = [_file(Image.new('RGB', (2000, 2000), (60 * i, 90, 200)), 'PNG') for i in range(4)]
    pads = [rows.image_token_id] * 16  # 2000 x 2000 resizes to 128 x 128: 16 tokens
    row = {'input_ids': [1, *pads, 2, *pads, 3, *pads, 4, *pads, 5]}
    before = _reset_peak()
    attached = rows.attach('input row 0', row, files)
    peak = _status('VmHWM') - before
    assert peak < 2 * 4 * 2000 * 2000, f'{peak / 2**20:.0f} MiB over the baseline'
    processor = load_image_processor(vlm_dir)
    expected = processor(images=[Image.open(io.BytesIO(f)).convert('RGB') for f in files], return_tensors='pt')
    assert attached['image_grid_thw'] == expected['image_grid_thw'].tolist() == [[1, 8, 8]] * 4
    assert torch.equal(attached['pixel_values'], expected['pixel_values'])


def _status(field: str) -> int:
    """A byte figure of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``: its peak)."""
    line = next(line for line in Path('/proc/self/status').read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def _reset_peak() -> int:
    """Reset this process's peak resident memory to what it holds now (Linux's clear_refs); that figure.
    What was freed is first handed back (glibc's malloc_trim): memory the allocator kept resident from
    making the test's files would otherwise be reused unseen, hiding the peak."""
    ctypes.CDLL('libc.so.6').malloc_trim(0)
    Path('/proc/self/clear_refs').write_text('5')
    return _status('VmRSS')


def tinker_image_datum(data: bytes, expected: int) -> types.Datum:
    """A datum of three text tokens, an image chunk of ``data`` and two text tokens, trained on none."""
    chunks = [
        types.EncodedTextChunk(tokens=[11, 12, 13]),
        types.ImageChunk(data=data, format='png', expected_tokens=expected),
        types.EncodedTextChunk(tokens=[14, 15]),
    ]
    length = 5 + expected
    return types.Datum(
        model_input=types.ModelInput(chunks=chunks),
        loss_fn_inputs={'target_tokens': [0] * length, 'weights': [0.0] * length},
    )


def _cut_picture(features: list[dict[str, Any]]) -> bytes:
    return base64.b64decode(_cut(_wire_rows(features[:1])[0])['images'][0].partition(',')[2])


@pytest.mark.integration
@pytest.mark.parametrize('refusal', ['truncated', 'count', *sorted(BAD_FILES)])
def test_tinker_image_chunks_over_the_limits_are_a_400_naming_the_datum_and_image(
    server, sdk_clients, features, refusal
):
    url, keys, _ = server
    trainer = sdk_clients(url, keys['bob']).create_lora_training_client(base_model=VLM, rank=4).result()
    if refusal == 'truncated':  # its header: 64 x 64, 4 tokens; its pixels cut
        datums, message = [tinker_image_datum(_cut_picture(features), 4)], 'datum 0 image 0 cannot be decoded'
    elif refusal == 'count':
        datums = [tinker_datum(row) for row in (features * 2)[:5]]
        message = 'the request holds 5 images, over the limit of 4 per request (limits.max_images_per_request)'
    else:
        data, message = BAD_FILES[refusal]
        datums, message = [tinker_image_datum(data, 4)], f'datum 0 {message}'
    with pytest.raises(tinker.BadRequestError, match=re.escape(message)):
        trainer.forward(datums, 'cross_entropy').result()
    assert trainer.forward([tinker_datum(features[0])], 'cross_entropy').result().loss_fn_outputs  # serves on


@pytest.mark.integration
@pytest.mark.parametrize('refusal', ['truncated', 'aspect'])
def test_a_tinker_prompt_with_a_bad_image_is_a_400_on_both_sampling_routes(server, sdk_clients, features, refusal):
    url, keys, _ = server
    data = _cut_picture(features) if refusal == 'truncated' else BAD_FILES['aspect'][0]
    message = 'the prompt image 0 ' + ('cannot be decoded' if refusal == 'truncated' else 'is 1 x 4000 pixels')
    sampler = sdk_clients(url, keys['alice']).create_sampling_client(base_model=VLM).result()
    prompt = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=[11, 12]), tinker_image_datum(data, 4).model_input.chunks[1]]
    )
    params = types.SamplingParams(max_tokens=2, seed=1)
    with pytest.raises(tinker.BadRequestError, match=re.escape(message)):
        sampler.sample(prompt, num_samples=1, sampling_params=params).result()
    with pytest.raises(tinker.BadRequestError, match=re.escape(message)):
        sampler.compute_logprobs(prompt).result()


@pytest.mark.integration
def test_a_native_sample_prompt_with_a_bad_image_is_a_400(server, features):
    url, keys, _ = server
    model = native(url, keys['alice'], seed=6)
    [row] = _wire_rows(features[:1])
    prompt = {'input_ids': row['input_ids'], 'images': [_as_url(BAD_FILES['aspect'][0])]}
    headers = {'Authorization': f'Bearer {keys["alice"]}'}
    for path in (f'/runs/{model.runs["default"]}/ops/sample', '/sample'):
        body: dict[str, Any] = {'inputs': [prompt], 'sampling_params': {'max_tokens': 2}}
        response = httpx.post(
            f'{url}{PREFIX}{path}', json=body if 'ops' in path else {**body, 'base_model': VLM}, headers=headers
        )
        assert response.status_code == 400, (path, response.text)
        assert 'prompt 0 image 0 is 1 x 4000 pixels, an aspect ratio of 4000.0' in response.text, path
