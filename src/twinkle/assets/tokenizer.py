"""The embedded tokenizer: a Qwen-style byte-level BPE with 4096 ids, trained here.

Pipeline (no normalizer, so every UTF-8 string round-trips through encode/decode exactly):
Qwen2's regex split, then ``ByteLevel(add_prefix_space=False)``; ByteLevel decoder. The BPE
part has ``VOCAB_SIZE - 7`` ids (the 256 byte symbols first), followed by the Qwen special
tokens and the reasoning/tool tags, in Qwen's relative order.

Training is deterministic: a fixed corpus (``training_corpus``) in a fixed order, and the BPE
trainer breaks count ties by token id. ``tokenizer.json`` is written by the ``tokenizers``
library (vocab ordered by id, merges by rank) and ``tokenizer_config.json`` by us.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.assets import gsm8k, self_cognition
from twinkle.assets.cache import build_asset
from twinkle.assets.corpus import generated_text

if TYPE_CHECKING:  # imported lazily below, so that `twinkle assets list` stays light
    from tokenizers import Tokenizer

TOKENIZER_VERSION = 3  # bump when anything below (or the corpus it reads) changes the files
VOCAB_SIZE = 4096
TOKENIZER_NAME = f'twinkle-bpe-{VOCAB_SIZE}-v{TOKENIZER_VERSION}'
MODEL_MAX_LENGTH = 2048
CORPUS_SEED = 1
CORPUS_PARAGRAPHS = 16_000

# Qwen's control tokens (special: dropped by decode(skip_special_tokens=True)).
SPECIAL_TOKENS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
# Tags a model writes as text (not special, as in Qwen3).
TEXT_TOKENS = ('<tool_call>', '</tool_call>', '<think>', '</think>')
EOS_TOKEN = '<|im_end|>'
PAD_TOKEN = '<|endoftext|>'
BPE_SIZE = VOCAB_SIZE - len(SPECIAL_TOKENS) - len(TEXT_TOKENS)
# Ids are fixed by construction: the added tokens follow the BPE ids.
TOKEN_IDS: dict[str, int] = {tok: BPE_SIZE + i for i, tok in enumerate(SPECIAL_TOKENS + TEXT_TOKENS)}

# Qwen2's pre-tokenizer regex: letters run together, digits split one by one.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r'\s+(?!\S)|\s+'
)

# One ``<|im_start|>role\ncontent<|im_end|>\n`` block per message (a system message is just the
# first one). ``enable_thinking=False`` pre-fills an empty think block, as Qwen3's template does.
# Tools take Qwen3's formats: their schemas as JSON lines in the system turn, an assistant's calls
# as ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` after its content, and a run
# of tool answers as ``<tool_response>`` blocks in one user turn.
CHAT_TEMPLATE = (
    '{%- if tools %}'
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nCall a function with a JSON object in <tool_call></tool_call> tags. The functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    '{%- endif %}'
    '{%- for message in messages %}'
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    '{%- set call = call.function if call.function is defined else call %}'
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    '{{- call.arguments if call.arguments is string else call.arguments | tojson }}'
    "{{- '}\\n</tool_call>' }}"
    '{%- endfor %}'
    "{{- '<|im_end|>\\n' }}"
    '{%- endif %}'
    '{%- endfor %}'
    '{%- if add_generation_prompt %}'
    "{{- '<|im_start|>assistant\\n' }}"
    '{%- if enable_thinking is defined and enable_thinking is false %}'
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    '{%- endif %}'
    '{%- endif %}'
)

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json')


def training_corpus() -> list[str]:
    """The texts the BPE is trained on, in a fixed order: the embedded datasets, then prose."""
    texts = [f'{row["query"]}\n{row["response"]}' for row in self_cognition.rows()]
    for rows in gsm8k.splits().values():
        texts += [f'{row["question"]}\n{row["answer"]}' for row in rows]
    texts += generated_text(CORPUS_SEED, CORPUS_PARAGRAPHS)
    return texts


def train_tokenizer() -> Tokenizer:
    """Train the BPE on ``training_corpus`` and add the special and tag tokens."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior='isolated', invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    _check_ids(tokenizer)
    return tokenizer


def _check_ids(tokenizer: Tokenizer) -> None:
    got = {tok: tokenizer.token_to_id(tok) for tok in TOKEN_IDS}
    if tokenizer.get_vocab_size() != VOCAB_SIZE or got != TOKEN_IDS:
        raise RuntimeError(
            f'tokenizer recipe produced {tokenizer.get_vocab_size()} ids and added-token ids {got}; '
            f'expected {VOCAB_SIZE} and {TOKEN_IDS}. The corpus is too small for BPE_SIZE={BPE_SIZE}.'
        )


def tokenizer_config() -> dict[str, object]:
    """``tokenizer_config.json``; loads as the plain fast tokenizer in transformers 4 and 5.

    ``tokenizer_class`` must not be ``Qwen2Tokenizer``: transformers 5 would rebuild the
    pipeline from its own code (with an NFC normalizer) instead of reading ``tokenizer.json``.
    No ``add_bos_token`` key either: in transformers 5 its mere presence replaces the
    post-processor with a template.
    """
    decoder = {
        str(TOKEN_IDS[tok]): {
            'content': tok,
            'lstrip': False,
            'normalized': False,
            'rstrip': False,
            'single_word': False,
            'special': tok in SPECIAL_TOKENS,
        }
        for tok in SPECIAL_TOKENS + TEXT_TOKENS
    }
    return {
        'add_prefix_space': False,
        'added_tokens_decoder': decoder,
        'additional_special_tokens': list(SPECIAL_TOKENS[1:]),
        'bos_token': None,
        'chat_template': CHAT_TEMPLATE,
        'clean_up_tokenization_spaces': False,
        'eos_token': EOS_TOKEN,
        'errors': 'replace',
        'model_max_length': MODEL_MAX_LENGTH,
        'pad_token': PAD_TOKEN,
        'split_special_tokens': False,
        'tokenizer_class': 'PreTrainedTokenizerFast',
        'unk_token': None,
    }


def write_json(path: Path, obj: object) -> None:
    """JSON with a fixed layout (key order as given, two-space indent, UTF-8, final newline)."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + '\n', encoding='utf-8')


def write_tokenizer(folder: Path) -> None:
    """Train the tokenizer and write ``TOKENIZER_FILES`` into ``folder``."""
    train_tokenizer().save(str(folder / 'tokenizer.json'), pretty=True)
    write_json(folder / 'tokenizer_config.json', tokenizer_config())


def tokenizer_dir() -> Path:
    """The cached tokenizer folder, trained on first use (two or three seconds)."""
    return build_asset('tokenizers', TOKENIZER_NAME, write_tokenizer)
