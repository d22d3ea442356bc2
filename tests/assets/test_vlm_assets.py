"""The embedded vision-language models (``tiny-qwen3.5-vl``, ``tiny-qwen3-vl``), their processor
files, the ``shapes`` image dataset, and ``TransformersModel`` on the real VLM layout.

Everything is built into temporary ``TWINKLE_HOME`` folders (the base tokenizer once, copied into
the second home that checks the VLM builds are byte-identical). No processor call here needs
torchvision: the image processor and tokenizer are loaded on their own and each image's
``<|image_pad|>`` is expanded by hand, to the count the processor's grid gives.
"""

from __future__ import annotations

import doctest
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel
from PIL import Image
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedModel,
)
from vlm_helpers import VLMS, image_inputs

import twinkle.assets
from twinkle.assets import DATASETS, MODELS, dataset, images, resolve_images, tiny_model
from twinkle.assets import tokenizer as tok_recipe
from twinkle.model import TransformersModel
from twinkle.model.loading import auto_model_class
from twinkle.model.lora import multi as multi_lora

#: The text models whose shape each VLM's language model takes.
TEXT_MODELS = {'tiny-qwen3.5-vl': 'tiny-qwen3.5', 'tiny-qwen3-vl': 'tiny-qwen3'}
#: Every linear layer of the two language models (Qwen3.5's gated deltanet has the in_proj_* and
#: out_proj); none of these leaf names is a vision-tower layer's (qkv, proj, linear_fc1, linear_fc2).
LM_LINEARS = {
    'tiny-qwen3-vl': ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'],
    'tiny-qwen3.5-vl': [
        'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj',
        'in_proj_qkv', 'in_proj_z', 'in_proj_a', 'in_proj_b', 'out_proj',
    ],
}  # fmt: skip
TOL = 1e-5


@pytest.fixture(scope='module')
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One TWINKLE_HOME for the module: both VLMs and the image dataset built once."""
    path = tmp_path_factory.mktemp('vlm-home')
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv('TWINKLE_HOME', str(path))
        yield path


@pytest.fixture(scope='module')
def vlm_dirs(home: Path) -> dict[str, str]:
    return {name: tiny_model(name) for name in VLMS}


def file_digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob('*'))
        if p.is_file()
    }


# ---- building: listed, deterministic, the text models untouched -------------------------------------


def test_the_vlms_and_the_dataset_are_listed() -> None:
    assert MODELS[-2:] == ('tiny-qwen3.5-vl', 'tiny-qwen3-vl')
    assert 'shapes' in DATASETS


@pytest.mark.slow
def test_two_builds_are_byte_identical(
    vlm_dirs: dict[str, str], home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The base tokenizer's own determinism is test_assets' to check: copied, not retrained.
    base = home / 'assets' / 'tokenizers' / tok_recipe.TOKENIZER_NAME
    shutil.copytree(base, tmp_path / 'assets' / 'tokenizers' / base.name)
    first_data = file_digests(Path(dataset('shapes')).parent)
    monkeypatch.setenv('TWINKLE_HOME', str(tmp_path))
    for name, first in vlm_dirs.items():
        second = tiny_model(name)
        assert Path(second).is_relative_to(tmp_path)
        digests = file_digests(Path(first))
        assert set(digests) == {
            'config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json',
            'preprocessor_config.json', 'video_preprocessor_config.json', 'chat_template.jinja',
        }  # fmt: skip
        assert file_digests(Path(second)) == digests
    second_data = file_digests(Path(dataset('shapes')).parent)
    assert second_data == first_data
    assert len(first_data) == 2 + 512 + 128  # two JSONL files and one PNG per row


def test_the_vision_tokens_follow_the_embedded_vocabulary(vlm_dirs: dict[str, str]) -> None:
    text = AutoTokenizer.from_pretrained(tiny_model('tiny-qwen3.5'))
    assert len(text) == 4096  # the text models' tokenizer is as it was
    for name, path in vlm_dirs.items():
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert len(tokenizer) == 4096 + 5
        vocab = tokenizer.get_vocab()
        assert {t: i for t, i in vocab.items() if i < 4096} == text.get_vocab()  # every old id kept
        for i, token in enumerate(('<|vision_start|>', '<|vision_end|>', '<|vision_pad|>', '<|image_pad|>')):
            assert tokenizer.convert_tokens_to_ids(token) == 4096 + i
            assert tokenizer.encode(f'a{token}b', add_special_tokens=False)[1] == 4096 + i
        config = AutoConfig.from_pretrained(path)
        ids = (config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id)
        assert ids == (4096, 4097, 4099, 4100), name
        assert config.text_config.vocab_size == 4104 >= len(tokenizer)
        # Text in NFC (all the datasets' text) gets the text models' ids, whichever class loads it
        # (transformers loads the qwen3_5 folder as its Qwen3_5Tokenizer, which normalises to NFC).
        lines = Path(dataset('gsm8k', 'test')).read_text(encoding='utf-8').splitlines()
        sample = [row['question'] + '\n' + row['answer'] for row in map(json.loads, lines)]
        sample += ['你好，世界！我是一个助手。', '<|im_start|>user\nHi<|im_end|>\n<think>\n</think>']
        for line in sample[:40]:
            assert tokenizer.encode(line, add_special_tokens=False) == text.encode(line, add_special_tokens=False)


def test_the_chat_template_renders_text_as_before_and_images_as_qwen_does(vlm_dirs: dict[str, str]) -> None:
    text = AutoTokenizer.from_pretrained(tiny_model('tiny-qwen3'))
    messages = [
        {'role': 'system', 'content': 'You are helpful.'},
        {'role': 'user', 'content': 'Hi'},
        {'role': 'assistant', 'content': 'Hello!'},
    ]
    with_parts = [
        {'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': 'Which colour?'}, {'type': 'image'}]},
        {'role': 'assistant', 'content': [{'type': 'text', 'text': 'red'}]},
    ]
    for path in vlm_dirs.values():
        tokenizer = AutoTokenizer.from_pretrained(path)
        for prompt in (False, True):
            ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours == text.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        image = '<|vision_start|><|image_pad|><|vision_end|>'
        assert tokenizer.apply_chat_template(with_parts, tokenize=False) == (
            f'<|im_start|>user\n{image}Which colour?{image}<|im_end|>\n<|im_start|>assistant\nred<|im_end|>\n'
        )
        assert (Path(path) / 'chat_template.jinja').read_text() == tokenizer.chat_template


# ---- loading and a forward with an image --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize('name', VLMS)
def test_a_vlm_loads_and_sees_the_image(name: str, vlm_dirs: dict[str, str]) -> None:
    path = vlm_dirs[name]
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == VLMS[name]
    assert not info['missing_keys'] and not info['unexpected_keys']
    assert type(AutoImageProcessor.from_pretrained(path)).__name__ == 'Qwen2VLImageProcessorPil'
    assert model.config.vision_config.depth == 2
    # The language model is the text model's shape: the same parameters, plus 8 more vocabulary
    # rows (4104 - 4096) of width 128 in the embedding and in the head.
    text = AutoModelForCausalLM.from_pretrained(tiny_model(TEXT_MODELS[name]))
    language = sum(p.numel() for n, p in model.named_parameters() if not n.startswith('model.visual.'))
    assert language == sum(p.numel() for p in text.parameters()) + 2 * 8 * 128
    red = Image.new('RGB', (64, 64), images.COLOURS['red'])
    inputs = image_inputs(path, red, 'What colour is the square?')
    # A 64 x 64 image: 4 x 4 patches of 16 pixels, merged 2 x 2 into 4 tokens.
    assert inputs['image_grid_thw'].tolist() == [[1, 4, 4]]
    assert inputs['pixel_values'].shape == (16, 3 * 2 * 16 * 16)
    assert int(inputs['mm_token_type_ids'].sum()) == 4
    blue = image_inputs(path, Image.new('RGB', (64, 64), images.COLOURS['blue']), 'What colour is the square?')
    with torch.no_grad():
        logits = model(**inputs).logits
        other = model(**blue).logits
    assert logits.shape == (1, inputs['input_ids'].shape[1], 4104)
    # Causal: the tokens before the image see the same thing, those from the image on do not.
    first = int(inputs['mm_token_type_ids'][0].nonzero()[0])
    assert torch.equal(logits[0, :first], other[0, :first])
    assert (logits[0, first:] - other[0, first:]).abs().max().item() > 1e-3


def test_the_auto_processor_expands_the_image_tokens_as_by_hand(vlm_dirs: dict[str, str]) -> None:
    """transformers' Qwen3-VL processor always builds its video processor, which needs torchvision."""
    pytest.importorskip('torchvision')
    from transformers import AutoProcessor

    picture = Image.new('RGB', (64, 64), images.COLOURS['green'])
    for path in vlm_dirs.values():
        processor = AutoProcessor.from_pretrained(path)
        messages = [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': 'Which?'}]}]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        got = processor(text=[text], images=[picture], return_tensors='pt')
        expected = image_inputs(path, picture, 'Which?')
        assert torch.equal(got['input_ids'], expected['input_ids'])
        assert torch.equal(got['pixel_values'], expected['pixel_values'])


def test_the_model_class_follows_the_config(vlm_dirs: dict[str, str]) -> None:
    assert auto_model_class(AutoConfig.from_pretrained(tiny_model('tiny-qwen3.5'))) is AutoModelForCausalLM
    for path in vlm_dirs.values():
        config = AutoConfig.from_pretrained(path)
        assert auto_model_class(config) is AutoModelForImageTextToText
        config.architectures = None  # a config built in code names no class: its vision tower decides
        assert auto_model_class(config) is AutoModelForImageTextToText


# ---- the image dataset --------------------------------------------------------------------------------


def read_picture(path: str) -> tuple[str, np.ndarray]:
    """The one colour besides white (by its name in COLOURS) and where it is (a bool mask)."""
    pixels = np.asarray(Image.open(path).convert('RGB')).astype(int)
    colours = {tuple(c) for c in np.unique(pixels.reshape(-1, 3), axis=0).tolist()} - {(255, 255, 255)}
    assert len(colours) == 1, path
    (rgb,) = colours
    name = next(n for n, c in images.COLOURS.items() if c == rgb)
    return name, (pixels == np.array(rgb)).all(axis=-1)


def components(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected parts of ``mask``, each as its own mask."""
    seen = np.zeros_like(mask)
    parts = []
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        part, stack = np.zeros_like(mask), [start]
        while stack:
            y, x = stack.pop()
            if 0 <= y < mask.shape[0] and 0 <= x < mask.shape[1] and mask[y, x] and not seen[y, x]:
                seen[y, x] = part[y, x] = True
                stack += [(y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)]
        parts.append(part)
    return parts


def shape_of(part: np.ndarray) -> str:
    """By how much of its bounding box a shape fills: a square all, a disc pi/4, a triangle 1/2."""
    ys, xs = np.nonzero(part)
    fill = part.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
    return 'square' if fill > 0.95 else 'circle' if 0.7 < fill < 0.85 else 'triangle' if 0.4 < fill < 0.6 else '?'


#: The seven segments lit in each digit, written out (a top, b upper right, c lower right, d
#: bottom, e lower left, f upper left, g middle).
DIGITS = {
    'abcdef': 0, 'bc': 1, 'abdeg': 2, 'abcdg': 3, 'bcfg': 4, 'acdfg': 5, 'acdefg': 6, 'abc': 7, 'abcdefg': 8,
    'abcdfg': 9,
}  # fmt: skip


def digit_of(mask: np.ndarray) -> int:
    """Read a seven-segment digit: probe the middle of each segment inside the lit bounding box."""
    ys, xs = np.nonzero(mask)
    top, bottom, left, right = ys.min(), ys.max(), xs.min(), xs.max()
    if right - left < 8:  # only the two right segments: a narrow bar
        return 1
    centre_x, quarter, three_quarters = (left + right) // 2, top + (bottom - top) // 4, top + 3 * (bottom - top) // 4
    probes = {
        'a': (top + 1, centre_x), 'b': (quarter, right - 1), 'c': (three_quarters, right - 1),
        'd': (bottom - 1, centre_x), 'e': (three_quarters, left + 1), 'f': (quarter, left + 1),
        'g': ((top + bottom) // 2, centre_x),
    }  # fmt: skip
    return DIGITS[''.join(s for s, (y, x) in probes.items() if mask[y, x])]


@pytest.mark.slow
@pytest.mark.parametrize('split', ['train', 'test'])
def test_every_answer_is_what_the_picture_shows(home: Path, split: str) -> None:
    rows = resolve_images(dataset('shapes', split))
    assert len(rows) == images.SPLIT_SIZES[split]
    assert {row['task'] for row in rows} == {'colour', 'shape', 'count', 'digit', 'caption'}
    words = {w.lower(): i + 1 for i, w in enumerate(images.COUNT_WORDS)}
    for row in rows:
        (user, assistant) = row['messages']
        picture, question = user['content']
        assert picture['type'] == 'image' and question['type'] == 'text'
        assert assistant == {'role': 'assistant', 'content': row['answer']}
        colour, mask = read_picture(picture['image'])
        answer, task = row['answer'], row['task']
        if task == 'colour':
            assert answer == colour
            continue
        if task == 'digit' or answer.startswith('The digit'):
            match = re.fullmatch(r'(\d)|The digit (\d) in (\w+)\.', answer)
            assert match and int(match[1] or match[2]) == digit_of(mask)
            assert match[3] in (None, colour)
            continue
        parts = components(mask)
        if task == 'shape':
            assert len(parts) == 1 and answer == shape_of(parts[0])
        elif task == 'count':
            assert answer == str(len(parts)) and len({shape_of(p) for p in parts}) == 1
            assert question['text'] == f'How many {shape_of(parts[0])}s are there?'
        else:
            match = re.fullmatch(r'(A|One|Two|Three|Four) (\w+) (square|circle|triangle)s?\.', answer)
            assert match and match[2] == colour, answer
            assert words.get(match[1].lower(), 1) == len(parts)
            assert {shape_of(p) for p in parts} == {match[3]}


def test_the_splits_differ(home: Path) -> None:
    train = {Path(p).read_bytes() for p in Path(dataset('shapes')).parent.glob('images/train/*.png')}
    test = {Path(p).read_bytes() for p in Path(dataset('shapes')).parent.glob('images/test/*.png')}
    assert len(test - train) > 0.9 * len(test)


def test_doctests(home: Path) -> None:
    for module in (twinkle.assets, images):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, module


# ---- TransformersModel on the conditional-generation layout ------------------------------------------


def text_rows(seed: int, lengths: list[int]) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(0, 4000, (length,), generator=generator).tolist()
        out.append({'input_ids': ids, 'labels': [-100, *ids[1:]]})
    return out


def vision_tower(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith('model.visual.')}


@pytest.mark.slow
@pytest.mark.parametrize('name', VLMS)
def test_lora_on_the_language_model_trains_and_loads_in_plain_peft(
    name: str, vlm_dirs: dict[str, str], tmp_path: Path
) -> None:
    path = vlm_dirs[name]
    model = TransformersModel(model_id=path, device='cpu')
    assert type(model.model).__name__ == VLMS[name]  # the class the config names, vision tower and all
    tower = vision_tower(model.model)
    assert len(tower) > 10
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LM_LINEARS[name], init_lora_weights=False)
    model.add_adapter_to_model('a', config)
    adapted = multi_lora.adapter_linear_paths(model.model, 'a')
    assert adapted and all(p.startswith('model.language_model.layers.') for p in adapted)
    model.set_optimizer('AdamW', lr=1e-2, adapter_name='a')
    batch = text_rows(0, [12, 9, 16])
    losses = []
    for _ in range(4):
        losses.append(model.forward_backward(inputs=batch, adapter_name='a').loss)
        model.clip_grad_and_step(adapter_name='a')
    assert losses[-1] < losses[0], losses
    after = dict(model.model.named_parameters())
    assert all(torch.equal(after[n], p) and not after[n].requires_grad for n, p in tower.items())
    saved = model.save('exported', str(tmp_path), adapter_name='a')

    # The same logits in plain transformers + peft, on text and on an image.
    picture = Image.open(resolve_images(dataset('shapes', 'test'))[0]['messages'][0]['content'][0]['image'])
    inputs = [{'input_ids': torch.tensor([text_rows(1, [14])[0]['input_ids']])}, image_inputs(path, picture, 'Hi?')]
    base = getattr(transformers, VLMS[name]).from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, saved).eval()
    for features in inputs:
        with torch.no_grad(), multi_lora.row_adapters(model.model, 'a'):
            ours = model.model(**features).logits
        with torch.no_grad():
            theirs = peft_model(**features).logits
        assert (ours - theirs).abs().max().item() <= TOL
