"""twinkle.template: conversations to token ids and pre-shifted labels, on the embedded tokenizer.

The embedded chat template renders each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
(see ``twinkle/assets/tokenizer.py``), so every expected text below is written out by hand from
that rule. Label checks decode the trained label ids: they must be exactly the assistant contents,
each followed by its turn's ``<|im_end|>``, and nothing from the system or user turns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinkle.data_format import IGNORE_INDEX
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, DataError, SequenceTooLongError, UnknownNameError
from twinkle.template import TEMPLATES, Qwen3_5Template, Template

END = '<|im_end|>'


def turn(role: str, content: str) -> str:
    """One message as the embedded chat template renders it."""
    return f'<|im_start|>{role}\n{content}{END}\n'


def conversation(*pairs: tuple[str, str]) -> dict[str, Any]:
    return {'messages': [{'role': role, 'content': content} for role, content in pairs]}


def trained_text(template: Template, feature: dict[str, Any]) -> str:
    return template.decode([label for label in feature['labels'] if label != IGNORE_INDEX])


def check_feature_invariants(feature: dict[str, Any]) -> None:
    """Pre-shifted labels: position i predicts token i + 1; the mask marks the trained positions."""
    ids, labels = feature['input_ids'], feature['labels']
    n = len(ids)
    assert feature['length'] == n == len(labels) == len(feature['completion_mask'])
    assert feature['attention_mask'] == [1] * n
    assert feature['position_ids'] == list(range(n))
    assert labels[-1] == IGNORE_INDEX  # nothing follows the last token
    for i in range(n - 1):
        assert labels[i] in (IGNORE_INDEX, ids[i + 1])
    assert feature['completion_mask'] == [int(label != IGNORE_INDEX) for label in labels]


@pytest.fixture(scope='module')
def template(tiny_model_dir: str) -> Template:
    return Template(tiny_model_dir, max_length=None)


# ---------------------------------------------------------------------------------------------
# Encoding and labels


def test_single_turn_text_and_labels(template: Template) -> None:
    row = conversation(('system', 'Be brief.'), ('user', 'Who are you?'), ('assistant', 'I am twinkle.'))
    feature = template.encode(row)
    expected_text = turn('system', 'Be brief.') + turn('user', 'Who are you?') + turn('assistant', 'I am twinkle.')
    assert template.decode(feature['input_ids']) == expected_text
    assert trained_text(template, feature) == 'I am twinkle.' + END
    check_feature_invariants(feature)


def test_multi_turn_labels_cover_each_assistant_turn(template: Template) -> None:
    row = conversation(
        ('system', 'sys text'),
        ('user', 'first question'),
        ('assistant', 'first answer'),
        ('user', 'second question'),
        ('assistant', 'second answer'),
    )
    feature = template.encode(row)
    assert trained_text(template, feature) == f'first answer{END}second answer{END}'
    # Two separate runs of trained positions, one per assistant turn (the user turn between is not trained).
    mask = feature['completion_mask']
    runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
    assert runs == 2
    check_feature_invariants(feature)


def test_first_label_is_predicted_from_the_assistant_header(template: Template) -> None:
    """The position that predicts the first answer token is the last token of the prompt, so the
    ids up to and including it decode to exactly the prompt with the generation header."""
    row = conversation(('user', 'hi'), ('assistant', 'hello'))
    feature = template.encode(row)
    first = feature['completion_mask'].index(1)
    assert template.decode(feature['input_ids'][: first + 1]) == turn('user', 'hi') + '<|im_start|>assistant\n'
    # The newline after the final <|im_end|> is in the input but is not learned.
    assert template.decode(feature['input_ids'][-1:]) == '\n'
    assert feature['labels'][-2] == IGNORE_INDEX


@pytest.mark.parametrize('answer', ['\nstarts with a newline', '  two spaces', '123 digits', '!?', 'é漢字', ' ', ''])
def test_labels_are_exact_at_awkward_boundaries(template: Template, answer: str) -> None:
    # '\n...' used to merge with the header's newline into one untrained token, losing it.
    feature = template.encode(conversation(('user', 'q'), ('assistant', answer)))
    assert trained_text(template, feature) == answer + END
    assert template.decode(feature['input_ids']) == turn('user', 'q') + turn('assistant', answer)


# Text without '<' so that no content spells a special token such as <|im_end|>. Whitespace, digits
# and punctuation are drawn often: they are where BPE merges across a turn's edges.
_content = st.text(
    st.sampled_from(' \n\t.!1a') | st.characters(blacklist_categories=('Cs',), blacklist_characters='<'),
    max_size=24,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    system=st.none() | _content,
    turns=st.lists(st.tuples(_content, _content), min_size=1, max_size=3),
)
def test_property_labels_are_the_assistant_contents(
    template: Template, system: str | None, turns: list[tuple[str, str]]
) -> None:
    pairs = [('system', system)] if system is not None else []
    for user, assistant in turns:
        pairs += [('user', user), ('assistant', assistant)]
    feature = template.encode(conversation(*pairs))
    assert trained_text(template, feature) == ''.join(answer + END for _, answer in turns)
    assert template.decode(feature['input_ids']) == ''.join(turn(role, content) for role, content in pairs)
    check_feature_invariants(feature)


def test_text_rows_train_every_token_and_end_with_eos(template: Template) -> None:
    feature = template.encode({'text': 'plain text to learn'})
    ids = feature['input_ids']
    assert ids[-1] == template.tokenizer.eos_token_id
    assert template.decode(ids) == 'plain text to learn' + END
    # Every position but the last predicts the next token, so the labels are ids[1:] then ignore.
    assert feature['labels'] == [*ids[1:], IGNORE_INDEX]
    check_feature_invariants(feature)


def test_user_data_travels_with_the_feature(template: Template) -> None:
    row = {**conversation(('user', 'q'), ('assistant', 'a')), 'user_data': {'ground_truth': '4'}}
    assert template.encode(row)['user_data'] == {'ground_truth': '4'}


def test_default_system_is_added_only_when_missing(tiny_model_dir: str) -> None:
    template = Template(tiny_model_dir, default_system='You help.')
    plain = template.encode(conversation(('user', 'q'), ('assistant', 'a')))
    assert template.decode(plain['input_ids']).startswith(turn('system', 'You help.') + turn('user', 'q'))
    own = template.encode(conversation(('system', 'Mine.'), ('user', 'q'), ('assistant', 'a')))
    assert 'You help.' not in template.decode(own['input_ids'])
    assert trained_text(template, plain) == 'a' + END


def test_without_chat_template_messages_are_joined_by_newlines(tiny_model_dir: str) -> None:
    template = Template(tiny_model_dir, use_chat_template=False)
    feature = template.encode(conversation(('user', 'question'), ('assistant', 'answer')))
    assert template.decode(feature['input_ids']) == 'question\nanswer'
    assert trained_text(template, feature) == 'answer'


def test_decode_round_trip_and_skip_special_tokens(template: Template) -> None:
    feature = template.encode(conversation(('user', 'Wie geht es? ünïcödé 漢字'), ('assistant', 'ok')))
    text = turn('user', 'Wie geht es? ünïcödé 漢字') + turn('assistant', 'ok')
    assert template.decode(feature['input_ids']) == text
    # Without the <|im_start|> / <|im_end|> control tokens only the role names and contents remain.
    assert (
        template.decode(feature['input_ids'], skip_special_tokens=True)
        == 'user\nWie geht es? ünïcödé 漢字\nassistant\nok\n'
    )


def test_batch_encode_matches_encode(template: Template) -> None:
    rows = [conversation(('user', f'q{i}'), ('assistant', f'a{i}')) for i in range(3)]
    assert template.batch_encode(rows) == [template.encode(row) for row in rows]


def test_pad_token_is_the_tokenizer_pad(template: Template) -> None:
    assert template.pad_token_id == template.tokenizer.convert_tokens_to_ids('<|endoftext|>')


# ---------------------------------------------------------------------------------------------
# Generation prompts


def test_generation_prompt_ends_with_assistant_header_and_has_no_labels(template: Template) -> None:
    row = conversation(('system', 's'), ('user', 'What is 2+2?'))
    feature = template.encode(row, add_generation_prompt=True)
    assert template.decode(feature['input_ids']) == turn('system', 's') + turn('user', 'What is 2+2?') + (
        '<|im_start|>assistant\n'
    )
    assert set(feature['labels']) == {IGNORE_INDEX}
    assert set(feature['completion_mask']) == {0}


def test_generation_prompt_without_thinking_prefills_an_empty_think_block(tiny_model_dir: str) -> None:
    template = Template(tiny_model_dir, enable_thinking=False)
    feature = template.encode(conversation(('user', 'q')), add_generation_prompt=True)
    assert template.decode(feature['input_ids']).endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n')


def test_generation_prompt_refuses_a_finished_conversation(template: Template) -> None:
    with pytest.raises(DataError, match='ends with an assistant turn'):
        template.encode(conversation(('user', 'q'), ('assistant', 'a')), add_generation_prompt=True)


# ---------------------------------------------------------------------------------------------
# max_length and truncation


LONG = conversation(('user', 'a question with several words in it'), ('assistant', 'an answer that also has words'))


def test_truncation_raise_names_the_length_and_the_limit(template: Template, tiny_model_dir: str) -> None:
    n = template.encode(LONG)['length']
    short = Template(tiny_model_dir, max_length=n - 1)
    with pytest.raises(SequenceTooLongError) as info:
        short.encode(LONG)
    assert f'{n} tokens' in str(info.value) and f'max_length={n - 1}' in str(info.value)
    assert isinstance(info.value, ValueError)
    assert Template(tiny_model_dir, max_length=n).encode(LONG)['length'] == n  # exactly at the limit is fine


def test_truncation_left_keeps_the_end(template: Template, tiny_model_dir: str) -> None:
    full = template.encode(LONG)
    limit = full['length'] - 5
    cut = Template(tiny_model_dir, max_length=limit, truncation_strategy='left').encode(LONG)
    assert cut['input_ids'] == full['input_ids'][-limit:]
    # The window ends where the full sequence ends, so every kept label is unchanged.
    assert cut['labels'] == full['labels'][-limit:]
    check_feature_invariants(cut)


def test_truncation_right_keeps_the_start(template: Template, tiny_model_dir: str) -> None:
    full = template.encode(LONG)
    limit = full['length'] - 3
    cut = Template(tiny_model_dir, max_length=limit, truncation_strategy='right').encode(LONG)
    assert cut['input_ids'] == full['input_ids'][:limit]
    # The last kept position no longer sees the token it predicted, so its label becomes ignored.
    assert cut['labels'] == [*full['labels'][: limit - 1], IGNORE_INDEX]
    check_feature_invariants(cut)


def test_truncation_delete_drops_the_row(template: Template, tiny_model_dir: str) -> None:
    n = template.encode(LONG)['length']
    deleting = Template(tiny_model_dir, max_length=n - 1, truncation_strategy='delete')
    assert deleting.encode(LONG) is None
    short = conversation(('user', 'q'), ('assistant', 'a'))
    assert deleting.batch_encode([LONG, short, LONG]) == [deleting.encode(short)]


@pytest.mark.parametrize('kwargs', [{'truncation_strategy': 'middle'}, {'max_length': 0}, {'max_length': -3}])
def test_bad_truncation_settings_are_refused(tiny_model_dir: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError) as info:
        Template(tiny_model_dir, **kwargs)
    if 'truncation_strategy' in kwargs:
        assert "'delete'" in str(info.value) and "'middle'" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Bad rows


@pytest.mark.parametrize(
    ('row', 'message'),
    [
        ({'messages': []}, 'non-empty list'),
        ({'messages': [{'content': 'no role'}]}, "needs 'role' and 'content'"),
        ({'messages': [{'role': 'robot', 'content': 'x'}]}, "role 'robot'"),
        ({'text': ''}, "'text' must be a non-empty string"),
        ({'prompt': 'x'}, "needs 'messages' or 'text'"),
    ],
)
def test_bad_rows_raise_data_error(template: Template, row: dict[str, Any], message: str) -> None:
    with pytest.raises(DataError, match=message):
        template.encode(row)


# ---------------------------------------------------------------------------------------------
# Other chat templates: tools, and a last turn rendered differently (as Qwen3 does)


def _with_chat_template(tiny_model_dir: str, chat_template: str) -> Template:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = chat_template
    return Template(tiny_model_dir, tokenizer=tokenizer)


TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTOOLS ' + (tools | map(attribute='name') | join(','))"
    " + '<|im_end|>\\n' }}"
    '{%- endif %}'
    '{%- for m in messages %}'
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    '{%- endfor %}'
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize('as_json', [False, True])
def test_tools_reach_the_chat_template(tiny_model_dir: str, as_json: bool) -> None:
    template = _with_chat_template(tiny_model_dir, TOOLS_TEMPLATE)
    tools = [{'name': 'search', 'parameters': {}}, {'name': 'calc', 'parameters': {}}]
    row = {**conversation(('user', 'q'), ('assistant', 'a')), 'tools': json.dumps(tools) if as_json else tools}
    feature = template.encode(row)
    assert template.decode(feature['input_ids']).startswith('<|im_start|>system\nTOOLS search,calc<|im_end|>\n')
    assert trained_text(template, feature) == 'a' + END


def test_tools_that_are_not_a_list_are_refused(tiny_model_dir: str) -> None:
    template = _with_chat_template(tiny_model_dir, TOOLS_TEMPLATE)
    with pytest.raises(DataError, match="'tools'"):
        template.encode({**conversation(('user', 'q')), 'tools': '{not json'})


# Like Qwen3: only the last assistant turn carries a (here empty) think block.
LAST_TURN_THINKS = (
    '{%- for m in messages %}'
    "{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m['content'] + '<|im_end|>\\n' }}"
    '{%- endfor %}'
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_earlier_turns_keep_labels_when_the_last_turn_renders_differently(tiny_model_dir: str) -> None:
    template = _with_chat_template(tiny_model_dir, LAST_TURN_THINKS)
    row = conversation(('user', 'q1'), ('assistant', 'a1'), ('user', 'q2'), ('assistant', 'a2'))
    feature = template.encode(row)
    # Turn 1 is rendered without the think block in the full text; the last turn with it, and the
    # block follows the assistant header, so it is part of what the model learns to write.
    assert trained_text(template, feature) == f'a1{END}<think>\n\n</think>\n\na2{END}'
    check_feature_invariants(feature)


# ---------------------------------------------------------------------------------------------
# Qwen3_5Template and names


def test_qwen3_5_template_encodes_like_template_on_a_qwen_tokenizer(template: Template, tiny_model_dir: str) -> None:
    qwen = Qwen3_5Template(tiny_model_dir, max_length=None)
    row = conversation(('user', 'hi'), ('assistant', 'hello'))
    assert qwen.encode(row) == template.encode(row)


def _save_non_qwen_tokenizer(folder: Path, chat_template: str | None) -> str:
    """A word-level tokenizer with '<s>'/'</s>' instead of Qwen's <|im_start|>/<|im_end|>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {'[UNK]': 0, '<s>': 1, '</s>': 2, 'user': 3, 'assistant': 4, 'hi': 5, 'hello': 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token='[UNK]', bos_token='<s>', eos_token='</s>', pad_token='</s>'
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return str(folder)


PLAIN_CHAT = (
    "{%- for m in messages %}{{- '<s> ' + m['role'] + ' ' + m['content'] + ' </s> ' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<s> assistant ' }}{%- endif %}"
)


def test_qwen3_5_template_refuses_a_tokenizer_without_qwen_tokens(tmp_path: Path) -> None:
    folder = _save_non_qwen_tokenizer(tmp_path / 'tok', PLAIN_CHAT)
    with pytest.raises(ConfigurationError) as info:
        Qwen3_5Template(folder)
    assert '<|im_start|>' in str(info.value) and '<|im_end|>' in str(info.value)
    # The generic template takes it: the labels are the assistant words plus the turn's '</s>'.
    generic = Template(folder)
    feature = generic.encode(conversation(('user', 'hi'), ('assistant', 'hello')))
    assert trained_text(generic, feature).split() == ['hello', '</s>']


def test_a_tokenizer_without_chat_template_needs_use_chat_template_false(tmp_path: Path) -> None:
    folder = _save_non_qwen_tokenizer(tmp_path / 'tok', None)
    with pytest.raises(ConfigurationError, match='use_chat_template=False'):
        Template(folder)
    assert Template(folder, use_chat_template=False).encode({'text': 'hi hello'})['length'] == 3  # hi hello </s>


def test_unknown_template_name_lists_the_valid_ones(self_cognition_path: str, tiny_model_dir: str) -> None:
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(2)))
    with pytest.raises(UnknownNameError) as info:
        dataset.set_template('Nope', model_id=tiny_model_dir)
    assert "'Nope'" in str(info.value)
    assert "'Template'" in str(info.value) and "'Qwen3_5Template'" in str(info.value)
    assert isinstance(info.value, KeyError)


def test_set_template_by_name_class_or_instance(self_cognition_path: str, tiny_model_dir: str) -> None:
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(2)))
    assert type(dataset.set_template('Qwen3_5Template', model_id=tiny_model_dir).template) is Qwen3_5Template
    assert type(dataset.set_template(Template, model_id=tiny_model_dir).template) is Template
    instance = Template(tiny_model_dir)
    assert dataset.set_template(instance).template is instance
    with pytest.raises(ConfigurationError, match='cannot be applied'):
        dataset.set_template(instance, max_length=3)
    assert TEMPLATES.names() == ['Qwen3_5Template', 'Template', 'VisionTemplate']
