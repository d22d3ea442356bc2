"""A vision-language model out of twinkle: an adapter trained on ``tiny-qwen3.5-vl`` or
``tiny-qwen3-vl`` exported merged (``twinkle export --merge``) loads in plain transformers as its
conditional-generation class with the trained model's logits, on text and on an image; merged or
not, the export keeps the processor's files, so it is used as the original folder is. Also: the
``shapes`` dataset copied by ``twinkle assets dataset --out`` with its images, and a server's model
host on a VLM reporting its context length (read from the text config).

Image inputs are built as ``vlm_helpers.image_inputs`` does (the PIL image processor and each
``<|image_pad|>`` expanded by the grid): ``AutoProcessor`` needs torchvision, absent here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
from vlm_helpers import VLMS, image_inputs

from twinkle import assets
from twinkle.assets import dataset, resolve_images
from twinkle.cli import main
from twinkle.model import TransformersModel
from twinkle.model.checkpoint.export import PROCESSOR_FILES, export_checkpoint
from twinkle.model.lora import multi as multi_lora
from twinkle.server.config import ServerConfig
from twinkle.server.execution.hosts.model_host import ModelHost

TOL = 1e-5
#: LoRA on the language model only, named by a regex over full module paths: Qwen3.5's full
#: attention (q/v) and gated deltanet (its fused qkv) projections, and Qwen3's attention, with
#: every MLP's down projection. No vision-tower path starts with ``model.language_model``.
TARGETS = r'model\.language_model\.layers\.\d+\.(self_attn\.(q_proj|v_proj)|linear_attn\.in_proj_qkv|mlp\.down_proj)'
#: What a checkpoint's training state is: never part of an export.
TRAINING_FILES = {'optimizer.pt', 'scheduler.pt', 'rng_state.pt', 'trainer_state.json', 'weights_step.json'}


def text_rows(seed: int, lengths: list[int]) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        ids = torch.randint(0, 4000, (length,), generator=generator).tolist()
        out.append({'input_ids': ids, 'labels': [-100, *ids[1:]]})
    return out


def probe_inputs(path: str) -> list[dict[str, torch.Tensor]]:
    """A text row and a picture of the shapes dataset with a question, as the model takes them."""
    first = resolve_images(dataset('shapes', 'test'))[0]['messages'][0]['content'][0]['image']
    picture = Image.open(first)
    return [
        {'input_ids': torch.tensor([text_rows(1, [14])[0]['input_ids']])},
        image_inputs(path, picture, 'What colour is it?'),
    ]


def in_float64(features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.double() if value.is_floating_point() else value for key, value in features.items()}


class Trained:
    """An adapter trained on VLM ``name`` and saved, with its logits on ``probe_inputs``: in
    float32 as trained, and with the model then cast to float64 (the same weights, exactly)."""

    def __init__(self, name: str, out: Path) -> None:
        self.name, self.base = name, assets.tiny_model(name)
        torch.manual_seed(0)
        model = TransformersModel(model_id=self.base, device='cpu')
        config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
        model.add_adapter_to_model('a', config)
        self.adapted = multi_lora.adapter_linear_paths(model.model, 'a')
        # A large learning rate, so that the adapter moves the logits well past the tolerance.
        model.set_optimizer('AdamW', lr=5e-2, adapter_name='a')
        for _ in range(3):
            model.forward_backward(inputs=text_rows(0, [12, 9, 16]), adapter_name='a')
            model.clip_grad_and_step(adapter_name='a')
        self.checkpoint = Path(model.save('trained', str(out), adapter_name='a', save_optimizer=True))
        with torch.no_grad(), multi_lora.row_adapters(model.model, 'a'):
            self.logits = [model.model(**features).logits for features in probe_inputs(self.base)]
        with torch.no_grad(), multi_lora.row_adapters(model.model, None):
            self.base_logits = [model.model(**features).logits for features in probe_inputs(self.base)]
        model.model.double()
        with torch.no_grad(), multi_lora.row_adapters(model.model, 'a'):
            self.logits64 = [model.model(**in_float64(features)).logits for features in probe_inputs(self.base)]


@pytest.fixture(scope='module', params=list(VLMS))
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return Trained(request.param, tmp_path_factory.mktemp('trained'))


def twinkle_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, '-m', 'twinkle.cli', *args], capture_output=True, text=True, timeout=300, check=False
    )


def assert_usable_like_the_base(export: Path, base: str) -> None:
    """The export's processor files are the base's, and its tokenizer, chat template (with an
    image part) and image processor give what the base's do."""
    for name in PROCESSOR_FILES:
        if (Path(base) / name).is_file():
            assert (export / name).read_bytes() == (Path(base) / name).read_bytes(), name
    assert {'preprocessor_config.json', 'video_preprocessor_config.json', 'chat_template.jinja'} <= {
        p.name for p in export.iterdir()
    }
    messages = [{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': 'Which colour?'}]}]
    ours, theirs = AutoTokenizer.from_pretrained(export), AutoTokenizer.from_pretrained(base)
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    assert '<|vision_start|><|image_pad|><|vision_end|>' in ours.apply_chat_template(messages, tokenize=False)
    picture = Image.new('RGB', (80, 48), (10, 200, 30))
    got, expected = image_inputs(str(export), picture, 'Hi?'), image_inputs(base, picture, 'Hi?')
    assert type(AutoImageProcessor.from_pretrained(export)).__name__ == 'Qwen2VLImageProcessorPil'
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[key], expected[key]) for key in got)


def test_the_adapter_is_on_the_language_model_and_moves_the_logits(trained: Trained) -> None:
    assert trained.adapted and all(p.startswith('model.language_model.layers.') for p in trained.adapted)
    for ours, base in zip(trained.logits, trained.base_logits, strict=True):
        assert (ours - base).abs().max().item() > 1e-2  # so a merge that dropped the adapter would fail


@pytest.mark.integration
def test_a_merged_export_loads_as_the_vlm_class_with_the_trained_logits(trained: Trained, tmp_path: Path) -> None:
    out = tmp_path / 'merged'
    result = twinkle_cli('export', str(trained.checkpoint), '--merge', '--out', str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == str(out)
    assert json.loads((out / 'config.json').read_text())['architectures'] == [VLMS[trained.name]]
    merged, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert type(merged).__name__ == VLMS[trained.name]
    assert not info['missing_keys'] and not info['unexpected_keys']
    assert not any('lora' in name for name, _ in merged.named_parameters())
    # The merge is W + scale * B @ A rounded once per weight to float32. Read in float64, where
    # the forward adds no error of its own, the export gives the trained model's logits (2.6e-6
    # measured). In float32 each forward is itself off by up to 1.5e-5 on the image row
    # (Qwen3.5's gated-delta recurrence, against float64), so the two float32 forwards are
    # compared to five times the tolerance (2.2e-5 measured).
    merged64 = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float64)
    for features, expected, expected64 in zip(probe_inputs(str(out)), trained.logits, trained.logits64, strict=True):
        with torch.no_grad():
            got, got64 = merged(**features).logits, merged64(**in_float64(features)).logits
        assert (got64 - expected64).abs().max().item() <= TOL
        assert (got - expected).abs().max().item() <= 5 * TOL
    # The class itself loads it too; the vision tower is the base's, unchanged.
    by_class = getattr(transformers, VLMS[trained.name]).from_pretrained(out)
    base = getattr(transformers, VLMS[trained.name]).from_pretrained(trained.base)
    base_tower = {n: p for n, p in base.named_parameters() if n.startswith('model.visual.')}
    assert base_tower and all(torch.equal(p, base_tower[n]) for n, p in by_class.named_parameters() if n in base_tower)
    names = {p.name for p in out.iterdir()}
    assert not names & ({'adapter_config.json', 'adapter_model.safetensors'} | TRAINING_FILES)
    assert_usable_like_the_base(out, trained.base)


def test_an_unmerged_export_is_the_adapter_with_the_processor(trained: Trained, tmp_path: Path) -> None:
    out = export_checkpoint(trained.checkpoint, tmp_path / 'adapter')
    names = {p.name for p in out.iterdir()}
    assert {'adapter_config.json', 'adapter_model.safetensors', 'tokenizer.json'} <= names
    assert not names & TRAINING_FILES
    assert not (trained.checkpoint / 'preprocessor_config.json').exists()  # the export adds it from the base
    assert_usable_like_the_base(out, trained.base)
    base = getattr(transformers, VLMS[trained.name]).from_pretrained(trained.base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    for features, expected in zip(probe_inputs(str(out)), trained.logits, strict=True):
        with torch.no_grad():
            got = peft_model(**features).logits
        assert (got - expected).abs().max().item() <= TOL


def test_an_adapter_export_whose_base_is_not_here_still_writes_the_adapter(trained: Trained, tmp_path: Path) -> None:
    """No download for an unmerged export: a base that is neither here nor in a hub cache gives
    no processor files, and the adapter is written all the same."""
    checkpoint = Path(shutil.copytree(trained.checkpoint, tmp_path / 'moved'))
    config = json.loads((checkpoint / 'adapter_config.json').read_text())
    config['base_model_name_or_path'] = str(tmp_path / 'gone')
    (checkpoint / 'adapter_config.json').write_text(json.dumps(config))
    out = export_checkpoint(checkpoint, tmp_path / 'adapter')
    names = {p.name for p in out.iterdir()}
    assert 'adapter_model.safetensors' in names and not names & set(PROCESSOR_FILES)
    # Told where the base is, it copies them.
    out = export_checkpoint(checkpoint, tmp_path / 'told', base_model=trained.name)
    assert_usable_like_the_base(out, trained.base)


# ---- the image dataset's copy ----------------------------------------------------------------------------


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob('*'))
        if p.is_file()
    }


def test_the_shapes_dataset_copies_with_its_images(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / 'mine' / 'shapes-test.jsonl'
    assert main(['assets', 'dataset', 'shapes', '--split', 'test', '--out', str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    source = Path(dataset('shapes', 'test'))
    assert out.read_bytes() == source.read_bytes()  # the rows as they are: paths relative to the file
    # The test split's 128 images beside the copy, byte for byte, and nothing of the train split.
    copied = digests(tmp_path / 'mine')
    assert len(copied) == 1 + 128
    originals = digests(source.parent)
    assert all(copied[name] == originals[name] for name in copied if name != out.name)
    assert all(name.startswith('images/test/') for name in copied if name != out.name)
    # The copy is whole on its own: moved elsewhere, every row's image opens from it.
    moved = tmp_path / 'moved'
    (tmp_path / 'mine').rename(moved)
    rows = resolve_images(moved / out.name)
    paths = [Path(row['messages'][0]['content'][0]['image']) for row in rows]
    assert len(paths) == 128 and all(p.is_relative_to(moved) and p.is_file() for p in paths)


def test_a_text_dataset_copies_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / 'gsm8k.jsonl'
    assert main(['assets', 'dataset', 'gsm8k', '--split', 'test', '--out', str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert [p.name for p in tmp_path.iterdir()] == ['gsm8k.jsonl']


# ---- the service's model host on a VLM ---------------------------------------------------------------


@pytest.fixture
def vlm_host() -> Iterator[ModelHost]:
    host = ModelHost(ServerConfig(base_model='tiny-qwen3.5-vl', device='cpu'))
    yield host
    host.shutdown()


def test_a_host_on_a_vlm_reports_the_language_models_context(vlm_host: ModelHost) -> None:
    config = AutoConfig.from_pretrained(assets.tiny_model('tiny-qwen3.5-vl'))
    assert getattr(config, 'max_position_embeddings', None) is None  # the composite config has none
    expected = AutoConfig.from_pretrained(assets.tiny_model('tiny-qwen3.5')).max_position_embeddings
    assert expected == config.text_config.max_position_embeddings  # the text model's shape
    assert vlm_host.context == expected
    assert vlm_host.describe()['context'] == expected
