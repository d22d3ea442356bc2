"""OpenAI's text completions, ``POST /v1/completions``, beside the chat completions of
:mod:`.openai_api` (as Tinker's OpenAI-compatible API serves both): a prompt, as text or as the
token ids to sample after, continued by the base model or by a tenant's saved weights.

The model is named as for chat: a hosted base model, a checkpoint's ``tinker://`` path, or
Tinker's ``<base model>;<checkpoint path>``. A text prompt is tokenized with the base model's
tokenizer (special tokens as the tokenizer adds them, as vLLM does); token ids are sampled after
as they are. ``logprobs: k`` gives each sampled token's logprob and the ``k`` most likely tokens'
in OpenAI's legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).
``stream: true`` answers with ``text_completion`` events, one per token, and ``data: [DONE]``.

Options this server does not implement (``echo``, ``best_of`` other than ``n``, ``suffix``,
``logit_bias``, penalties, a batch of prompts) are refused with a 400 naming them; the schema
declares only the values that change nothing, so a request that fits the schema is served.

Example::

    from openai import OpenAI
    client = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='tml-...')
    reply = client.completions.create(model='Qwen/Qwen3-0.6B', prompt='Twinkle, twinkle,', max_tokens=8)
    print(reply.choices[0].text)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from pydantic import Field, JsonValue

from twinkle.errors import FieldError
from twinkle.server.api.deps import Who
from twinkle.server.api.openai_api import (
    ERROR_RESPONSES,
    MAX_CHOICES,
    PREFIX,
    JsonObject,
    OpenAIRoute,
    SamplingOptions,
    Texts,
    _resolve_model,
    _usage,
    sampled,
    served_only,
)
from twinkle.server.execution.checks.requests import MAX_TOP_LOGPROBS
from twinkle.server.execution.groups.model_group import ModelGroup
from twinkle.server.execution.sampling.chat import ChatReply, ChatRequest, ReplyToken
from twinkle.server.service import Service
from twinkle.template.base import load_tokenizer

#: Tokens to sample when a request gives no ``max_tokens``: OpenAI's default for completions.
DEFAULT_MAX_TOKENS = 16
#: The prompts the schema declares: one text, or one prompt's token ids.
PROMPT_SCHEMA: dict[str, JsonValue] = {
    'anyOf': [
        {'type': 'string', 'minLength': 1},
        {'type': 'array', 'items': {'type': 'integer', 'minimum': 0}, 'minItems': 1},
    ],
    'description': 'The text to continue, or its token ids (one prompt; a batch of prompts is refused)',
}


#: Token ids; their validation stops at the first bad one (a million bad ids are one problem).
Ids = Annotated[list[int], Field(fail_fast=True)]


class CompletionRequest(SamplingOptions):
    """OpenAI's completion request; the fields below the line are accepted only to be refused
    when used (see ``UNSUPPORTED``)."""

    # One text or one prompt's ids; a batch (texts, or lists of ids) parses so that it can be refused by name.
    prompt: str | Ids | Texts | list[Ids] = Field(json_schema_extra=PROMPT_SCHEMA)
    max_tokens: int | None = Field(None, ge=1)
    # The sampled token's logprob and those of the k most likely tokens, for each token.
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # ---- accepted only to be refused when used
    echo: bool | None = Field(None, json_schema_extra=served_only(False))
    best_of: int | None = Field(None, ge=1, json_schema_extra={'maximum': 1, 'description': 'Only 1 (or n)'})
    suffix: str | None = Field(None, json_schema_extra=served_only())
    logit_bias: dict[str, float] | None = Field(None, fail_fast=True, json_schema_extra={'maxProperties': 0})
    presence_penalty: float | None = Field(None, ge=-2, le=2, json_schema_extra=served_only(0))
    frequency_penalty: float | None = Field(None, ge=-2, le=2, json_schema_extra=served_only(0))


#: Options this server does not implement, with how to tell that a request uses them.
UNSUPPORTED: dict[str, Callable[[CompletionRequest], bool]] = {
    'prompt': lambda body: isinstance(body.prompt, list) and not all(isinstance(t, int) for t in body.prompt),
    'echo': lambda body: bool(body.echo),
    'best_of': lambda body: body.best_of not in (None, body.n or 1),
    'suffix': lambda body: body.suffix is not None,
    'logit_bias': lambda body: bool(body.logit_bias),
    'presence_penalty': lambda body: bool(body.presence_penalty),
    'frequency_penalty': lambda body: bool(body.frequency_penalty),
}


def completions_router(service: Service) -> APIRouter:
    """``POST /v1/completions`` over ``service`` (see ``twinkle.server.app``)."""
    router = APIRouter(prefix=PREFIX, route_class=OpenAIRoute, responses=ERROR_RESPONSES)

    @router.post('/completions', response_model=None)
    async def completions(body: CompletionRequest, who: Who) -> JsonObject | StreamingResponse:
        group, checkpoint = _resolve_model(service, who, body.model)
        _check_options(body)
        prompt_ids = await asyncio.to_thread(_prompt_ids, group, body.prompt)
        max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS
        # token ids in the vocabulary, the prompt and max_tokens within the context and the request's token limit
        group.check_sample_request([{'input_ids': prompt_ids}], {'max_tokens': max_tokens, 'num_samples': body.n or 1})
        request = ChatRequest(
            params=body.sampling_params(max_tokens, body.logprobs or None),
            token_limit=service.config.limits.max_tokens_per_request,
            prompt_ids=prompt_ids,
        )
        reply, head = await sampled(service, who, group, request, body, checkpoint)
        head['id'] = f'cmpl-{head["id"]}'
        logprobs = body.logprobs is not None
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _events(head, reply, logprobs, include_usage)
            return StreamingResponse(events, media_type='text/event-stream', headers={'Cache-Control': 'no-cache'})
        return _completion_json(head, reply, logprobs)

    return router


# ---- the request ------------------------------------------------------------------------------------
def _check_options(body: CompletionRequest) -> None:
    """Refuse what this server would answer wrongly: unimplemented options, too many choices."""
    used = [name for name, uses in UNSUPPORTED.items() if uses(body)]
    if used:
        what = 'a batch of prompts' if used[0] == 'prompt' else used[0]
        message = f'{what} is not supported by this server (options it refuses: {sorted(UNSUPPORTED)})'
        raise FieldError(message, used[0], 'unsupported_parameter')
    if (body.n or 1) > MAX_CHOICES:
        raise FieldError(f'n={body.n} is over the limit of {MAX_CHOICES} choices per request', 'n')


def _prompt_ids(group: ModelGroup, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    """The prompt's token ids: as given, or the text tokenized with the base model's tokenizer."""
    if isinstance(prompt, list):
        ids = [token for token in prompt if isinstance(token, int)]  # _check_options refused other lists
    else:
        ids = list(_tokenizer(group.model_id)(prompt)['input_ids'])
    if not ids:
        raise FieldError('the prompt is empty: send text or at least one token id', 'prompt')
    return ids


@lru_cache(maxsize=8)
def _tokenizer(model_id: str) -> Any:
    """The tokenizer of a hosted base model, loaded once (a route tokenizes a text prompt)."""
    return load_tokenizer(model_id)


# ---- the reply --------------------------------------------------------------------------------------
def _completion_json(head: JsonObject, reply: ChatReply, logprobs: bool) -> JsonObject:
    choices: list[JsonValue] = [
        {
            'index': index,
            'text': choice['text'],
            'logprobs': _logprobs_json(choice['tokens']) if logprobs else None,
            'finish_reason': choice['finish_reason'],
        }
        for index, choice in enumerate(reply['choices'])
    ]
    return {**head, 'object': 'text_completion', 'system_fingerprint': None, 'choices': choices, 'usage': _usage(reply)}


def _logprobs_json(tokens: list[ReplyToken], offset: int = 0) -> JsonObject:
    """OpenAI's legacy logprobs: per token its text, its logprob, the most likely tokens' logprobs
    with its own (as vLLM gives them), and where its text starts in the completion."""
    offsets: list[JsonValue] = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token['piece'])
    top: list[JsonValue] = [{**dict(token['top']), token['token']: token['logprob']} for token in tokens]
    return {
        'tokens': [token['token'] for token in tokens],
        'token_logprobs': [token['logprob'] for token in tokens],
        'top_logprobs': top,
        'text_offset': offsets,
    }


async def _events(head: JsonObject, reply: ChatReply, logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    """The completion as server-sent events: per choice one chunk per token and a chunk with the
    finish reason; then the usage (if asked for) and ``[DONE]``."""

    def chunk(choices: list[JsonValue], **extra: JsonValue) -> str:
        data = {**head, 'object': 'text_completion', 'system_fingerprint': None, 'choices': choices, **extra}
        if include_usage:
            data.setdefault('usage', None)
        return f'data: {json.dumps(data)}\n\n'

    for index, choice in enumerate(reply['choices']):
        offset = 0
        for token in choice['tokens']:
            if token['piece'] or logprobs:
                chosen = _logprobs_json([token], offset) if logprobs else None
                yield chunk([{'index': index, 'text': token['piece'], 'logprobs': chosen, 'finish_reason': None}])
            offset += len(token['piece'])
        yield chunk([{'index': index, 'text': '', 'logprobs': None, 'finish_reason': choice['finish_reason']}])
    if include_usage:
        yield chunk([], usage=_usage(reply))
    yield 'data: [DONE]\n\n'


__all__ = ['DEFAULT_MAX_TOKENS', 'CompletionRequest', 'completions_router']
