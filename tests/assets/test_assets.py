"""Tests of ``twinkle.assets``: the embedded tokenizer, tiny models, datasets and their CLI.

Everything is built into temporary ``TWINKLE_HOME`` folders. The tiny model is built twice in
all (once shared by most tests, once more to compare bytes); small-qwen3 only has its
parameter count checked, on the meta device.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
import re
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM

from twinkle.assets import DATASETS, MODELS, dataset, dataset_splits, tiny_model, twinkle_home
from twinkle.assets import tokenizer as tok_recipe
from twinkle.assets.cache import build_once
from twinkle.assets.gsm8k import parse_templates
from twinkle.assets.models import qwen3_config
from twinkle.cli import main
from twinkle.errors import ConfigurationError, UnknownNameError

# --- fixtures: one shared home, built once per session ---------------------------------------


@pytest.fixture(scope='session')
def shared_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp('twinkle-home')


@pytest.fixture
def home(shared_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TWINKLE_HOME pointed at the shared home for one test."""
    monkeypatch.setenv('TWINKLE_HOME', str(shared_home))
    return shared_home


@pytest.fixture(scope='session')
def tiny_path(shared_home: Path) -> str:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv('TWINKLE_HOME', str(shared_home))
        return tiny_model()


@pytest.fixture(scope='session')
def tokenizer(tiny_path: str):
    return AutoTokenizer.from_pretrained(tiny_path)


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob('*'))
        if path.is_file()
    }


# --- cache location and build-once ------------------------------------------------------------


def test_twinkle_home_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv('TWINKLE_HOME', str(tmp_path / 'explicit'))
    assert twinkle_home() == tmp_path / 'explicit'
    monkeypatch.delenv('TWINKLE_HOME')
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    assert twinkle_home() == tmp_path / 'xdg' / 'twinkle'
    monkeypatch.delenv('XDG_CACHE_HOME')
    monkeypatch.setenv('HOME', str(tmp_path / 'user'))
    assert twinkle_home() == tmp_path / 'user' / '.cache' / 'twinkle'


def test_build_once_runs_one_builder_across_threads(tmp_path: Path) -> None:
    final = tmp_path / 'assets' / 'things' / 'thing-v1'
    calls: list[int] = []
    gate = threading.Barrier(4)

    def build(tmp: Path) -> None:
        calls.append(1)
        (tmp / 'data.txt').write_text('done')

    def worker() -> None:
        gate.wait()  # all four ask at the same moment
        assert build_once(final, build, tmp_path / 'thing.lock') == final

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert (final / 'data.txt').read_text() == 'done'


def test_build_once_leaves_nothing_when_the_build_fails(tmp_path: Path) -> None:
    final = tmp_path / 'assets' / 'things' / 'broken-v1'

    def build(tmp: Path) -> None:
        (tmp / 'half.txt').write_text('half')
        raise RuntimeError('boom')

    with pytest.raises(RuntimeError, match='boom'):
        build_once(final, build, tmp_path / 'broken.lock')
    assert list(final.parent.iterdir()) == []  # neither the final folder nor a temp one


# --- the model --------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_model_loads_and_gives_logits(tiny_path: str) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(tiny_path, output_loading_info=True)
    assert not info['missing_keys'] and not info['unexpected_keys']
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.config.model_type == 'qwen3'
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()  # untied
    # embed and head 2 * 4096*128 = 1048576; per layer: q 128*128 + k 128*64 + v 128*64 + o 128*128
    # = 49152, q/k norms 2*32, MLP 3*128*384 = 147456, two RMSNorms 2*128 -> 196928; 2 layers + norm.
    assert sum(p.numel() for p in model.parameters()) == 1048576 + 2 * 196928 + 128
    # The head is drawn wider than the other matrices (see LM_HEAD_STD).
    assert 0.09 < model.lm_head.weight.std().item() < 0.11
    assert 0.018 < model.model.embed_tokens.weight.std().item() < 0.022
    input_ids = torch.randint(0, 4096, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (2, 7, 4096)
    assert torch.isfinite(logits).all()


def test_tiny_model_generation_config(tiny_path: str) -> None:
    config = json.loads((Path(tiny_path) / 'generation_config.json').read_text())
    im_end, endoftext = tok_recipe.TOKEN_IDS['<|im_end|>'], tok_recipe.TOKEN_IDS['<|endoftext|>']
    assert config['eos_token_id'] == [im_end, endoftext]
    assert config['pad_token_id'] == endoftext


def test_small_qwen3_parameter_count_from_config() -> None:
    with torch.device('meta'):  # shapes only, no weights
        model = Qwen3ForCausalLM(qwen3_config('small-qwen3'))
    # embed and head 2 * 4096*512 = 4194304; per layer: q 512*512 + k 512*256 + v 512*256 + o 512*512
    # = 786432, q/k norms 2*64, MLP 3*512*1408 = 2162688, two RMSNorms 2*512 -> 2950272; 8 layers + norm.
    assert sum(p.numel() for p in model.parameters()) == 4194304 + 8 * 2950272 + 512 == 27_796_992


@pytest.mark.slow
def test_two_builds_are_byte_identical(
    tiny_path: str, shared_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv('TWINKLE_HOME', str(tmp_path))
    second = tiny_model()
    assert Path(second).is_relative_to(tmp_path)
    first_digests = file_digests(Path(tiny_path))
    assert set(first_digests) >= {'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'}
    assert file_digests(Path(second)) == first_digests
    for name in DATASETS:
        monkeypatch.setenv('TWINKLE_HOME', str(shared_home))
        first = Path(dataset(name)).parent
        monkeypatch.setenv('TWINKLE_HOME', str(tmp_path))
        assert file_digests(Path(dataset(name)).parent) == file_digests(first)


def test_second_call_reuses_the_cache(home: Path, tiny_path: str) -> None:
    folder = Path(tiny_path)
    before = {path: path.stat().st_mtime_ns for path in folder.iterdir()}
    assert tiny_model('tiny-qwen3') == tiny_path
    assert {path: path.stat().st_mtime_ns for path in folder.iterdir()} == before
    assert not [p for p in folder.parent.iterdir() if '.tmp-' in p.name]  # no half-built leftovers


def test_unknown_model_lists_valid_names(home: Path) -> None:
    with pytest.raises(UnknownNameError, match=r"Unknown model 'gpt-2'.*small-qwen3.*tiny-qwen3"):
        tiny_model('gpt-2')
    assert MODELS == (
        'tiny-qwen3', 'small-qwen3', 'wide-qwen3', 'tiny-qwen3.5', 'tiny-qwen3-moe', 'tiny-qwen3.5-moe',
        'tiny-qwen3.5-vl', 'tiny-qwen3-vl',
    )  # fmt: skip


# --- the tokenizer ----------------------------------------------------------------------------


def test_tokenizer_size_and_special_tokens(tokenizer) -> None:
    assert len(tokenizer) == 4096
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ('<|im_end|>', '<|endoftext|>', None)
    for token in ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<think>', '</think>', '<tool_call>', '</tool_call>'):
        assert tokenizer.encode(token, add_special_tokens=False) == [tok_recipe.TOKEN_IDS[token]]
    assert tokenizer.encode('hi', add_special_tokens=True) == tokenizer.encode('hi', add_special_tokens=False)


def test_skip_special_tokens_keeps_think_tags(tokenizer) -> None:
    ids = tokenizer.encode('<|im_start|>assistant\n<think>\nok</think>\n\nyes<|im_end|>')
    assert tokenizer.decode(ids, skip_special_tokens=True) == 'assistant\n<think>\nok</think>\n\nyes'


@pytest.mark.parametrize(
    'text',
    [
        '',
        'Hello, world!',
        '你好，世界！我是一个助手。',
        'emoji 😀🎉👍🏽 family 👨‍👩‍👧',
        'e\u0301 NFD vs é',
        '\x00\t\r\n  \u3000 end ',
    ],
)
def test_tokenizer_round_trips_examples(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_english_and_chinese_compress(tokenizer) -> None:
    # A trained BPE must beat one token per byte by a wide margin on its own languages.
    english = 'The teacher explained the problem to the students in the morning.'
    chinese = '我们今天去公园散步，天气非常好。'
    assert len(tokenizer.encode(english)) * 3 < len(english.encode())
    assert len(tokenizer.encode(chinese)) * 2 < len(chinese.encode())


# --- the chat template ------------------------------------------------------------------------

MESSAGES = [
    {'role': 'system', 'content': 'You are helpful.'},
    {'role': 'user', 'content': 'Hi'},
    {'role': 'assistant', 'content': 'Hello!'},
    {'role': 'user', 'content': '2+2?'},
]
RENDERED = (
    '<|im_start|>system\nYou are helpful.<|im_end|>\n'
    '<|im_start|>user\nHi<|im_end|>\n'
    '<|im_start|>assistant\nHello!<|im_end|>\n'
    '<|im_start|>user\n2+2?<|im_end|>\n'
)


def test_chat_template_renders_messages(tokenizer) -> None:
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == RENDERED
    no_system = tokenizer.apply_chat_template(MESSAGES[1:2], tokenize=False)
    assert no_system == '<|im_start|>user\nHi<|im_end|>\n'


def test_chat_template_generation_prompt_and_thinking(tokenizer) -> None:
    prompt = RENDERED + '<|im_start|>assistant\n'
    render = tokenizer.apply_chat_template
    assert render(MESSAGES, tokenize=False, add_generation_prompt=True) == prompt
    assert render(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=True) == prompt
    no_think = render(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think == prompt + '<think>\n\n</think>\n\n'
    # enable_thinking only matters with a generation prompt.
    assert render(MESSAGES, tokenize=False, enable_thinking=False) == RENDERED


def test_chat_template_tokens_are_single_ids(tokenizer) -> None:
    ids = tokenizer.encode(RENDERED, add_special_tokens=False)
    im_start, im_end = tok_recipe.TOKEN_IDS['<|im_start|>'], tok_recipe.TOKEN_IDS['<|im_end|>']
    assert ids.count(im_start) == ids.count(im_end) == 4


# --- the datasets -----------------------------------------------------------------------------


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding='utf-8').splitlines()]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expr: str) -> float:
    """Value of an arithmetic expression of numbers and + - * / (nothing else is allowed)."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        raise ValueError(f'not plain arithmetic: {expr!r}')

    return walk(ast.parse(expr, mode='eval').body)


def test_gsm8k_answers_are_correct(home: Path) -> None:
    for split, size in (('train', 1000), ('test', 200)):
        rows = read_jsonl(dataset('gsm8k', split))
        assert len(rows) == size
        for row in rows:
            assert list(row) == ['question', 'answer']
            # every <<expr=value>> must hold, and '#### N' must be the last computed value
            calcs = re.findall(r'<<([^=<>]+)=([^<>]+)>>(\S+)', row['answer'])
            assert calcs, row
            for expr, value, shown in calcs:
                assert evaluate(expr) == float(value), row
                assert shown.rstrip('.,') == value  # the result is also written after the annotation
            final = re.fullmatch(r'#### (-?\d+)', row['answer'].splitlines()[-1])
            assert final and int(final[1]) == float(calcs[-1][1]), row


def test_gsm8k_template_text_draws_then_calculates() -> None:
    (template,) = parse_templates(
        """
[socks]
draw: n = randint(3, 3); m = 2 * n
ask:  {n} pairs are {m}
      socks. Half of them?
say:  There are [total = n * 2] socks.
say:  Half is [total / 2].
"""
    )
    question, solution = template(random.Random(0))
    # randint(3, 3) is 3, so m = 6; then 3*2 = 6 and 6/2 = 3, the last result the answer.
    assert question == '3 pairs are 6 socks. Half of them?'
    assert solution.answer() == 'There are 3*2 = <<3*2=6>>6 socks.\nHalf is 6/2 = <<6/2=3>>3.\n#### 3'


@pytest.mark.parametrize(
    ('text', 'error', 'message'),
    [
        ('[t]\nask: q\nsay: s\nhint: h', ValueError, 'a line starts with draw:, ask: or say:'),
        ('[t]\nsay: s', ValueError, 'needs one ask: line'),
        ('[t]\ndraw: x == 1\nask: q\nsay: s', ValueError, 'a run of plain assignments'),
        ("[t]\ndraw: x = __import__('os')\nask: q\nsay: s", ValueError, 'not allowed in a draw'),
        ('[t]\ndraw: x = NAMES.pop()\nask: q\nsay: s', ValueError, 'not allowed in a draw'),
        ('[t]\ndraw: x = 7\nask: q\nsay: [x / 2]', ArithmeticError, '7/2 is not a whole number'),
    ],
)
def test_gsm8k_template_text_refuses_what_it_does_not_know(text: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        for template in parse_templates(text):
            template(random.Random(0))


def test_gsm8k_splits_are_distinct(home: Path) -> None:
    train = {row['question'] for row in read_jsonl(dataset('gsm8k'))}
    test = {row['question'] for row in read_jsonl(dataset('gsm8k', 'test'))}
    assert len(train) == 1000 and len(test) == 200 and not train & test


def test_self_cognition_rows(home: Path) -> None:
    rows = read_jsonl(dataset('self-cognition'))
    assert 200 <= len(rows) <= 1000
    assert {row['tag'] for row in rows} == {'en', 'zh'}
    for row in rows:
        assert list(row) == ['query', 'response', 'tag']
        assert '{{NAME}}' in row['response'] and '{{AUTHOR}}' in row['response']
    assert {'query': 'Who are you?', 'tag': 'en'}.items() <= rows[0].items()


def test_unknown_dataset_and_split_list_valid_ones(home: Path) -> None:
    with pytest.raises(UnknownNameError, match=r"Unknown dataset 'mmlu'.*gsm8k.*self-cognition"):
        dataset('mmlu')
    with pytest.raises(ConfigurationError, match=r"'dev'.*\['test', 'train'\]"):
        dataset('gsm8k', 'dev')
    assert dataset_splits('gsm8k') == ('train', 'test')


# --- the command line -------------------------------------------------------------------------


def test_cli_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(['assets', 'list']) == 0
    out = capsys.readouterr().out
    for name in (*MODELS, *DATASETS):
        assert name in out


def test_cli_model_prints_path(home: Path, tiny_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(['assets', 'model']) == 0
    assert capsys.readouterr().out.strip() == tiny_path


def test_cli_dataset_prints_path_or_copies(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(['assets', 'dataset', 'gsm8k', '--split', 'test']) == 0
    path = capsys.readouterr().out.strip()
    assert path == dataset('gsm8k', 'test')
    out = tmp_path / 'copy' / 'gsm8k-test.jsonl'
    assert main(['assets', 'dataset', 'gsm8k', '--split', 'test', '--out', str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes() == Path(path).read_bytes()


def test_cli_unknown_name_fails_with_valid_names(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(['assets', 'model', 'gpt-2']) == 2
    assert f'{sorted(MODELS)}' in capsys.readouterr().err
    assert main(['assets', 'dataset', 'gsm8k', '--split', 'dev']) == 2
    assert "['test', 'train']" in capsys.readouterr().err
