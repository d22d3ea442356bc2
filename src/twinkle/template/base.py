"""Templates: a conversation in, token ids and training labels out.

The text comes from the tokenizer's own chat template (``apply_chat_template``), so any model
with a Hugging Face chat template works. Labels cover the assistant turns only: each turn's
span is found by rendering the conversation up to that turn with the generation prompt (the
span starts where that render stops agreeing with the full text) and up to the end of the
turn (the span stops there, trailing whitespace excluded, so ``<|im_end|>`` is learned but the
newline after it is not). Templates that render the last turn differently from earlier ones
(Qwen3 adds an empty think block to the last assistant turn only) are handled by finding the
turn's content in the full text instead.

The text is tokenized piece by piece, cut at the span edges, so no token straddles a prompt
and a completion: the completion tokens are exactly those a sampler would produce after the
prompt, and the decoded labels are exactly the assistant text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from twinkle.data_format import IGNORE_INDEX, InputFeature, Message, Trajectory
from twinkle.errors import ConfigurationError, DataError, SequenceTooLongError, one_of
from twinkle.registry import Registry

TruncationStrategy = Literal['raise', 'left', 'right', 'delete']
_ROLES = ('system', 'user', 'assistant', 'tool')
_SENTINEL = 'TWINKLE0SENTINEL0CONTENT'  # stands in for an assistant content to find what follows it


class Template:
    """Encodes trajectories (``{'messages': [...]}``) or raw text (``{'text': ...}``).

    Example::

        template = Template(tiny_model(), max_length=512)
        feature = template.encode({'messages': [{'role': 'user', 'content': 'hi'},
                                                {'role': 'assistant', 'content': 'hello'}]})
        # feature['labels'] holds the ids of 'hello<|im_end|>' at the positions that predict them
    """

    #: Whether rows may hold image parts (``VisionTemplate``); this one refuses them rather than
    #: render image tokens with no pixels behind them.
    takes_images = False

    def __init__(
        self,
        model_id: str,
        use_chat_template: bool = True,
        max_length: int | None = 8192,
        truncation_strategy: TruncationStrategy = 'raise',
        default_system: str | None = None,
        enable_thinking: bool = True,
        tokenizer: Any = None,
    ):
        if truncation_strategy not in ('raise', 'left', 'right', 'delete'):
            raise one_of('truncation_strategy', truncation_strategy, ['raise', 'left', 'right', 'delete'])
        if max_length is not None and max_length <= 0:
            raise ConfigurationError(f'max_length must be positive or None; got {max_length}')
        self.model_id = model_id
        self.use_chat_template = use_chat_template
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy
        self.default_system = default_system
        self.enable_thinking = enable_thinking
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_id)
        if use_chat_template and not self.tokenizer.chat_template:
            raise ConfigurationError(
                f'the tokenizer of {model_id!r} has no chat template; pass use_chat_template=False '
                'to join the messages as plain text'
            )

    # ---- public API -------------------------------------------------------------------------
    @property
    def pad_token_id(self) -> int:
        pad: int | None = self.tokenizer.pad_token_id
        eos: int = self.tokenizer.eos_token_id
        return pad if pad is not None else eos

    def encode(self, row: Mapping[str, Any], add_generation_prompt: bool = False) -> InputFeature | None:
        """Encode one row (a ``Trajectory``, or ``{'text': ...}``). Returns ``None`` only when
        ``truncation_strategy='delete'`` drops it.

        With ``add_generation_prompt=True`` the row is a prompt: it must not end with an
        assistant turn, and the assistant header is appended so a sampler continues from it.
        """
        if 'messages' in row:
            ids, trained = self._encode_messages(self._messages(row), add_generation_prompt, _tools(row))
        elif 'text' in row:
            ids, trained = self._encode_text(row['text'])
        else:
            raise DataError(f"a row to encode needs 'messages' or 'text'; it has fields {sorted(row)}")
        truncated = self._truncate(ids, trained)
        if truncated is None:
            return None
        feature = encoded_feature(*truncated)
        if 'user_data' in row:
            feature['user_data'] = row['user_data']
        return feature

    def batch_encode(
        self, rows: Sequence[Trajectory | Mapping[str, Any]], add_generation_prompt: bool = False
    ) -> list[InputFeature]:
        """Encode many rows; rows dropped by ``truncation_strategy='delete'`` are left out."""
        encoded = (self.encode(row, add_generation_prompt) for row in rows)
        return [feature for feature in encoded if feature is not None]

    def continuation(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The tokens that follow an assistant turn's end-of-turn token to add ``messages`` (a
        tool's answers, the user's next words) and open the next assistant turn.

        A multi-turn rollout appends these to the tokens the sampler produced, instead of
        rendering the whole conversation again: a chat template may render earlier turns
        differently once a later one exists (Qwen3 drops their think blocks), and text decoded
        and encoded again need not give the sampled ids back. The tokens are cut from a render of
        a probe conversation (a user turn, an assistant turn, then ``messages``): what follows
        the assistant turn's end-of-turn marker (``<|im_end|>``).

        Example (the embedded tokenizer's ChatML)::

            template.decode(template.continuation([{'role': 'user', 'content': 'and 3?'}]))
            # '\\n<|im_start|>user\\nand 3?<|im_end|>\\n<|im_start|>assistant\\n'
        """
        if not messages:
            raise DataError('continuation needs at least one message to add')
        probe: list[Message] = [{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'content': _SENTINEL}]
        alone = self._render(probe, False, tools)
        marker = alone[alone.rfind(_SENTINEL) + len(_SENTINEL) :].rstrip()
        if not marker:
            raise ConfigurationError(f'the chat template of {self.model_id!r} ends an assistant turn with no marker')
        full = self._render([*probe, *_checked(messages)], True, tools)
        at = full.find(marker, full.rfind(_SENTINEL))
        return self._tokenize(full[at + len(marker) :])

    def end_of_turn_id(self) -> int:
        """The token that ends an assistant turn (what a rollout appends after a turn cut short)."""
        eos: int = self.tokenizer.eos_token_id
        return eos

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    # ---- steps --------------------------------------------------------------------------------
    def _messages(self, row: Mapping[str, Any]) -> list[Message]:
        messages = row['messages']
        if not isinstance(messages, list) or not messages:
            raise DataError(f"'messages' must be a non-empty list of {{'role', 'content'}} dicts; got {messages!r}")
        messages = _checked(messages)
        if not self.takes_images:
            _refuse_images(messages)
        if self.default_system is not None and messages[0]['role'] != 'system':
            messages.insert(0, {'role': 'system', 'content': self.default_system})
        return messages

    def _render(self, messages: list[Message], add_generation_prompt: bool, tools: Any = None) -> str:
        if not self.use_chat_template:
            text = '\n'.join(m['content'] for m in messages)
            return text + '\n' if add_generation_prompt else text
        rendered: str = self.tokenizer.apply_chat_template(  # a str: tokenize=False
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=self.enable_thinking,
        )
        return rendered

    def _assistant_spans(self, messages: list[Message], full: str, tools: Any = None) -> list[tuple[int, int]]:
        spans = []
        for index, message in enumerate(messages):
            if message['role'] != 'assistant':
                continue
            start = _common_prefix(self._render(messages[:index], True, tools), full)
            turn = self._render(messages[: index + 1], False, tools)
            stop = _common_prefix(turn, full)
            if stop < len(turn):  # the template renders a last turn differently from the same turn in history
                stop = max(stop, self._turn_end(messages, index, full, start, tools))
            stop = max(start, len(full[:stop].rstrip()))
            if stop > start:
                spans.append((start, stop))
        return spans

    def _turn_end(self, messages: list[Message], index: int, full: str, start: int, tools: Any) -> int:
        """Where assistant turn ``index`` ends in ``full`` when the template renders it differently
        as the last turn than in history: after its content and as much of the end-of-turn marker
        (the text that follows the content in the last-turn render, ``<|im_end|>``) as ``full``
        has there. ``start`` (no span) when the content is not in ``full``."""
        content = messages[index].get('content') or ''
        at = full.find(content, start) if content else -1
        if at < 0:
            return start
        stop = at + len(content)
        probe: list[Message] = [*messages[:index], {**messages[index], 'content': _SENTINEL}]
        rendered = self._render(probe, False, tools)
        marker = rendered[rendered.rfind(_SENTINEL) + len(_SENTINEL) :].rstrip() if _SENTINEL in rendered else ''
        return stop + _common_prefix(marker, full[stop : stop + len(marker)])

    def _encode_messages(
        self, messages: list[Message], add_generation_prompt: bool, tools: Any = None
    ) -> tuple[list[int], list[bool]]:
        if add_generation_prompt and messages[-1]['role'] == 'assistant':
            raise DataError(
                'add_generation_prompt=True encodes a prompt, but the conversation ends with an assistant '
                'turn; remove it (keep reference answers in user_data)'
            )
        full = self._render(messages, add_generation_prompt, tools)
        spans = [] if add_generation_prompt else self._assistant_spans(messages, full, tools)
        ids: list[int] = []
        trained: list[bool] = []
        cursor = 0
        for start, stop in spans:
            start = max(start, cursor)
            for piece, is_trained in ((full[cursor:start], False), (full[start:stop], True)):
                piece_ids = self._tokenize(piece)
                ids += piece_ids
                trained += [is_trained] * len(piece_ids)
            cursor = max(cursor, stop)
        rest = self._tokenize(full[cursor:])
        return ids + rest, trained + [False] * len(rest)

    def _tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)['input_ids'] if text else []

    def _encode_text(self, text: str) -> tuple[list[int], list[bool]]:
        if not isinstance(text, str) or not text:
            raise DataError(f"'text' must be a non-empty string; got {text!r}")
        ids = self.tokenizer(text, add_special_tokens=False)['input_ids']
        if self.tokenizer.eos_token_id is not None:
            ids = [*ids, self.tokenizer.eos_token_id]
        return ids, [True] * len(ids)

    def _truncate(self, ids: list[int], trained: list[bool]) -> tuple[list[int], list[bool]] | None:
        limit = self.max_length
        if limit is None or len(ids) <= limit:
            return ids, trained
        if self.truncation_strategy == 'raise':
            raise SequenceTooLongError(
                f'an encoded sequence has {len(ids)} tokens, over max_length={limit}; raise max_length '
                "or set truncation_strategy to 'left', 'right' or 'delete'"
            )
        if self.truncation_strategy == 'delete':
            return None
        if self.truncation_strategy == 'left':
            return ids[-limit:], trained[-limit:]
        return ids[:limit], trained[:limit]


def _checked(messages: Sequence[Any]) -> list[Message]:
    """``messages`` with each one checked (a role and a content), ``None`` fields left out, and a
    number as content made its text: when a column's contents are text in some rows and lists of
    parts in others, ``datasets`` stores them as its ``Json`` feature, which reads the text ``"3"``
    back as the number 3."""
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or 'role' not in message or 'content' not in message:
            raise DataError(f"message {index} needs 'role' and 'content'; got {message!r}")
        if message['role'] not in _ROLES:
            raise DataError(f'message {index} has role {message["role"]!r}; accepted roles are {list(_ROLES)}')
    return [{k: _text(v) if k == 'content' else v for k, v in m.items() if v is not None} for m in messages]  # type: ignore[misc]


def _text(content: Any) -> Any:
    """A content that ``datasets``' ``Json`` feature decoded to a number, as the text it was."""
    return str(content) if isinstance(content, int | float) and not isinstance(content, bool) else content


def _refuse_images(messages: list[Message]) -> None:
    for index, message in enumerate(messages):
        content: Any = message['content']
        for part in content if isinstance(content, list) else []:
            if isinstance(part, Mapping) and (
                part.get('type') in ('image', 'image_url') or {'image', 'image_url'} & set(part)
            ):
                raise DataError(
                    f"message {index} holds an image part, which this template cannot encode: use 'VisionTemplate' "
                    "(model.set_template('VisionTemplate') or dataset.set_template('VisionTemplate', model_id=...))"
                )


def _tools(row: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The row's tool schemas for the chat template; a JSON string (how datasets often store
    them, since schemas differ row to row) is parsed."""
    tools = row.get('tools')
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"'tools' is a string but not JSON ({e}); got {tools[:80]!r}") from e
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"'tools' must be a list of tool schemas (or its JSON); got {type(tools).__name__}")
    return tools or None


def encoded_feature(ids: list[int], trained: list[bool]) -> InputFeature:
    """The ``InputFeature`` of token ``ids`` of which those flagged ``trained`` are learned. The
    labels are pre-shifted: position i predicts token i + 1 when that token is trained."""
    labels = [ids[i + 1] if trained[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)] + [IGNORE_INDEX]
    return {
        'input_ids': ids,
        'attention_mask': [1] * len(ids),
        'position_ids': list(range(len(ids))),
        'labels': labels,
        'completion_mask': [int(label != IGNORE_INDEX) for label in labels],
        'length': len(ids),
    }


def _common_prefix(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


def load_tokenizer(model_id: str) -> Any:
    """The tokenizer of a model id (``ms://``, ``hf://`` or a local directory)."""
    from transformers import AutoTokenizer

    from twinkle.hub import resolve_model

    path = resolve_model(model_id)
    if not os.path.isdir(path):
        raise ConfigurationError(f'model id {model_id!r} resolved to {path!r}, which is not a directory')
    return AutoTokenizer.from_pretrained(path)


TEMPLATES: Registry[Template] = Registry('template')
TEMPLATES.register(Template)
