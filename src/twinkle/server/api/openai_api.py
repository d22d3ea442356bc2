"""An OpenAI-compatible chat API under ``/v1``: a tenant chats with the base model or with its
saved weights (``save_weights_for_sampler``, or a training checkpoint) through any OpenAI client.

- ``GET /v1/models``: the base model, then the tenant's checkpoints, newest first; a
  checkpoint's model id is its ``tinker://`` path (or, as Tinker names it,
  ``<base model>;<checkpoint path>``). ``GET /v1/models/{id}`` shows one.
- ``POST /v1/chat/completions``: the messages are encoded with the base model's chat template
  and sampled on the worker thread, like every compute request, in slices that let the other
  tenants' jobs run between them (``sampling_slice_ms``), for at most ``max_sampling_s`` of worker
  time; n x max_tokens is held to ``max_sampled_tokens_per_request`` (a 400 naming it).
  ``stream: true`` answers with ``chat.completion.chunk`` events (sent once sampling has
  finished, one per token) and ``data: [DONE]``.

Text completions (``POST /v1/completions``) are in :mod:`.openai_completions`. Errors come in
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}`` (with the
message also as ``detail``, as the server's other routes give it). Unknown
request fields are ignored, as OpenAI does; options that would change the answer but are not
implemented here (``tools``, ``response_format`` other than text, ``logit_bias``, penalties...)
are refused with a 400 naming them, never silently dropped (the schema declares only their values
that change nothing, so a request that fits it is served). Another tenant's checkpoint is a
404, as if it did not exist (unless it was published).

Example::

    from openai import OpenAI
    client = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='tml-...')
    reply = client.chat.completions.create(
        model='tinker://<run>/sampler_weights/step-10',
        messages=[{'role': 'user', 'content': 'Hello'}],
        max_tokens=32,
    )
    print(reply.choices[0].message.content)
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, JsonValue
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException

from twinkle.data_format import SamplingParams
from twinkle.errors import BusyError, DataError, FieldError, NotFoundError, SequenceTooLongError, TwinkleError
from twinkle.server.api.deps import Who
from twinkle.server.api.errors import location_name, problems_sentence, retry_after_header, status_of, unparsable
from twinkle.server.execution.checks.requests import MAX_TOP_LOGPROBS, SavedWeights
from twinkle.server.execution.groups.model_group import ModelGroup, bare
from twinkle.server.execution.sampling.chat import ChatReply, ChatRequest, ChatTurn, ReplyToken
from twinkle.server.execution.scheduling.scheduler import wait_job
from twinkle.server.service import Service
from twinkle.server.store import Checkpoint, Store, Tenant, parse_checkpoint_path
from twinkle.utils.logger import get_logger

logger = get_logger()
PREFIX = '/v1'
#: Most choices (``n``) one request may ask for.
MAX_CHOICES = 8
#: Roles OpenAI has that the chat templates spell differently.
ROLE_ALIASES = {'developer': 'system'}
#: The ``type`` of an error body, by HTTP status (OpenAI's names).
ERROR_TYPES = {401: 'authentication_error', 409: 'conflict_error', 429: 'rate_limit_error', 500: 'server_error'}


# ---- the request ------------------------------------------------------------------------------------
#: Texts; their validation stops at the first bad one (a million bad items are one problem).
Texts = Annotated[list[str], Field(fail_fast=True)]
#: The schema of ``response_format``: only plain text is served.
TEXT_FORMAT: dict[str, JsonValue] = {
    'properties': {'type': {'const': 'text'}},
    'required': ['type'],
    'description': 'Not supported by this server other than {"type": "text"}',
}


def served_only(*values: JsonValue) -> dict[str, JsonValue]:
    """The schema of an option this server serves only with ``values`` (or left out): any other
    value is refused by the route with a 400 that names the option. The schema declares what is
    served, so a request that fits it is never refused."""
    served = f'other than {", ".join(json.dumps(value) for value in values)}' if values else 'at all: leave it out'
    return {'enum': [*values, None], 'description': f'Not supported by this server {served}'}


class ContentPart(BaseModel):
    """One part of a message's content; only ``text`` parts are served."""

    model_config = ConfigDict(extra='ignore')

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra='ignore')

    role: str
    content: str | Annotated[list[ContentPart], Field(fail_fast=True)] | None = None
    # Tool calls of an earlier assistant turn: refused, as this server has no tool calling.
    tool_calls: list[JsonValue] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra='ignore')

    # Send a last chunk with the usage counts (and empty choices).
    include_usage: bool | None = False


class SamplingOptions(BaseModel):
    """What OpenAI's chat and text completion requests share: the model and how to sample it.
    Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra='ignore', allow_inf_nan=False)

    model: str = Field(description='A base model, a checkpoint path, or "<base model>;<checkpoint path>"')
    # 0 is greedy; OpenAI's default is 1.
    temperature: float | None = Field(None, ge=0, le=2)
    # 0 keeps only the most likely token (greedy).
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, json_schema_extra={'maximum': MAX_CHOICES})
    stop: str | Texts | None = None
    # The same seed, prompt and weights give the same reply.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions: keep the k most likely tokens (0 or -1: all), and CTRL's repetition penalty.
    top_k: int | None = Field(None, ge=-1)
    repetition_penalty: float | None = Field(None, gt=0)

    def sampling_params(self, max_tokens: int | None, top_logprobs: int | None) -> SamplingParams:
        """OpenAI's options as the sampler's (``max_tokens`` None: the sampler's default, for the
        host to replace once the prompt's length is known)."""
        top_p = 1.0 if self.top_p is None else self.top_p
        temperature = 1.0 if self.temperature is None else self.temperature
        if top_p == 0:  # the smallest set of tokens reaching probability 0: the most likely one
            temperature, top_p = 0.0, 1.0
        return SamplingParams(
            max_tokens=max_tokens or SamplingParams.max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=-1 if self.top_k in (None, 0) else self.top_k,
            stop=self.stop or None,
            seed=self.seed,
            num_samples=self.n or 1,
            logprobs=top_logprobs,
            repetition_penalty=self.repetition_penalty or 1.0,
        )


class ChatCompletionRequest(SamplingOptions):
    """OpenAI's chat completion request; the fields below the line are accepted only to be
    refused when used (see ``UNSUPPORTED``)."""

    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    # Tokens to sample per choice; max_completion_tokens (OpenAI's newer name) wins over max_tokens.
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # ---- accepted only to be refused when used; the schema declares the values that change nothing
    tools: list[JsonValue] | None = Field(None, json_schema_extra={'maxItems': 0})
    tool_choice: str | dict[str, JsonValue] | None = Field(None, json_schema_extra=served_only('none', 'auto'))
    functions: list[JsonValue] | None = Field(None, json_schema_extra={'maxItems': 0})
    function_call: str | dict[str, JsonValue] | None = Field(None, json_schema_extra=served_only('none', 'auto'))
    response_format: dict[str, JsonValue] | None = Field(None, json_schema_extra=TEXT_FORMAT)
    logit_bias: dict[str, float] | None = Field(None, fail_fast=True, json_schema_extra={'maxProperties': 0})
    presence_penalty: float | None = Field(None, ge=-2, le=2, json_schema_extra=served_only(0))
    frequency_penalty: float | None = Field(None, ge=-2, le=2, json_schema_extra=served_only(0))
    modalities: list[str] | None = Field(None, fail_fast=True, json_schema_extra=served_only(['text']))
    audio: dict[str, JsonValue] | None = Field(None, json_schema_extra=served_only())
    prediction: dict[str, JsonValue] | None = Field(None, json_schema_extra=served_only())
    web_search_options: dict[str, JsonValue] | None = Field(None, json_schema_extra=served_only())


# ---- what the routes pass around --------------------------------------------------------------------
#: A JSON object, as the routes answer it.
JsonObject = dict[str, JsonValue]


#: Options this server does not implement, with how to tell that a request uses them.
UNSUPPORTED: dict[str, Callable[[ChatCompletionRequest], bool]] = {
    'tools': lambda body: bool(body.tools),
    'tool_choice': lambda body: body.tool_choice not in (None, 'none', 'auto'),
    'functions': lambda body: bool(body.functions),
    'function_call': lambda body: body.function_call not in (None, 'none', 'auto'),
    'response_format': lambda body: body.response_format is not None and body.response_format.get('type') != 'text',
    'logit_bias': lambda body: bool(body.logit_bias),
    'presence_penalty': lambda body: bool(body.presence_penalty),
    'frequency_penalty': lambda body: bool(body.frequency_penalty),
    'modalities': lambda body: body.modalities not in (None, ['text']),
    'audio': lambda body: body.audio is not None,
    'prediction': lambda body: body.prediction is not None,
    'web_search_options': lambda body: body.web_search_options is not None,
}


# ---- errors -----------------------------------------------------------------------------------------
class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description='invalid_request_error, authentication_error, rate_limit_error...')
    param: str | None = Field(description='The request field at fault, as the request spells it')
    code: str | None = Field(description='model_not_found, unsupported_parameter, context_length_exceeded...')


class OpenAIErrorBody(BaseModel):
    """What every route of this API answers for an error."""

    error: OpenAIErrorDetail
    detail: str = Field(description="The message again, as the server's other APIs give it")


#: OpenAI's ``param`` and ``code`` of the errors that do not name them themselves (a FieldError does).
ERROR_FIELDS: tuple[tuple[type[TwinkleError], str | None, str | None], ...] = (
    (NotFoundError, 'model', 'model_not_found'),  # a model is the one thing this API looks up
    (SequenceTooLongError, 'messages', 'context_length_exceeded'),
    (BusyError, None, 'rate_limit_exceeded'),
)
#: How the routes may fail, for the OpenAPI schema.
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    status: {'model': OpenAIErrorBody, 'description': description}
    for status, description in {
        400: 'The request asks for what this server does not serve, or holds a value it refuses',
        401: 'No API key, or one the server does not know',
        404: 'No such model for this tenant',
        422: 'The body is not a chat completion request; param names the first bad field',
        429: 'A limit that frees up with time; retry after Retry-After seconds',
    }.items()
}


class OpenAIRoute(APIRoute):
    """A route whose every error (authentication, validation, refusals, the sampling job's)
    is answered in OpenAI's error shape, with the status of the server's one table."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[object, None, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as error:
                return error_response(error)

        return handle


def error_response(error: Exception) -> JSONResponse:
    """``error`` as OpenAI would answer it: a 4xx for the client's mistakes, 429 to retry later."""
    status, message, param, code = _described(error)
    detail = OpenAIErrorDetail(
        message=message, type=ERROR_TYPES.get(status, 'invalid_request_error'), param=param, code=code
    )
    headers = retry_after_header(error) if isinstance(error, TwinkleError) else {}
    body = OpenAIErrorBody(error=detail, detail=message)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _described(error: Exception) -> tuple[int, str, str | None, str | None]:
    """(status, message, param, code) of an error."""
    if isinstance(error, RequestValidationError) and (not_json := unparsable(error)) is not None:
        return 400, str(not_json), None, None
    if isinstance(error, RequestValidationError):
        problems = error.errors()
        first = location_name(problems[0]['loc']) if problems else None
        return 422, f'invalid request: {problems_sentence(problems)}', first, None
    if isinstance(error, StarletteHTTPException):  # FastAPI's own: a body it cannot read
        return error.status_code, str(error.detail), None, None
    if isinstance(error, FieldError):
        return status_of(error), str(error), error.field, error.code
    if isinstance(error, TwinkleError):
        param, code = next(((p, c) for kind, p, c in ERROR_FIELDS if isinstance(error, kind)), (None, None))
        return status_of(error), str(error), param, code
    logger.exception('an OpenAI API request failed', exc_info=error)
    return 500, f'the server failed to answer: {type(error).__name__}', None, None


# ---- the routes -------------------------------------------------------------------------------------
class ModelIdConvertor(PathConvertor):
    """A model id in a path: anything after ``/models/``, slashes (``Qwen/Qwen3-0.6B``,
    ``tinker://...``) and line breaks included, so that every id is answered by the route, in this
    API's error shape (Starlette's ``path`` stops at a line break: a framework 404 otherwise)."""

    regex = r'[\s\S]*'


register_url_convertor('model_id', ModelIdConvertor())


def openai_router(service: Service) -> APIRouter:
    """The OpenAI-compatible routes, over ``service`` (see ``twinkle.server.app``)."""
    router = APIRouter(prefix=PREFIX, route_class=OpenAIRoute, responses=ERROR_RESPONSES)
    _model_routes(router, service)
    _chat_routes(router, service)
    return router


def _model_routes(router: APIRouter, service: Service) -> None:
    @router.get('/models')
    async def list_models(who: Who) -> JsonObject:
        models: list[JsonValue] = [_model_json(group, who) for group in service.groups.values()]
        for checkpoint in _tenant_checkpoints(service.store, who):
            trained_on = _group_of(service, checkpoint)
            if trained_on is not None:
                models.append(_model_json(trained_on, who, checkpoint))
        return {'object': 'list', 'data': models}

    @router.get('/models/{model:model_id}')
    async def get_model(model: str, who: Who) -> JsonObject:
        group, checkpoint = _resolve_model(service, who, model)
        return _model_json(group, who, checkpoint, model)


def _chat_routes(router: APIRouter, service: Service) -> None:
    @router.post('/chat/completions', response_model=None)
    async def chat_completions(body: ChatCompletionRequest, who: Who) -> JsonObject | StreamingResponse:
        group, checkpoint = _resolve_model(service, who, body.model)
        _check_options(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        limits = service.config.limits
        request = ChatRequest(
            params=body.sampling_params(max_tokens, body.top_logprobs if body.logprobs else None),
            token_limit=limits.max_tokens_per_request,
            messages=[_message(index, message) for index, message in enumerate(body.messages)],
            fit=max_tokens is None,
            sampled_limit=limits.max_sampled_tokens_per_request,
        )
        if not request.fit:  # the tokens it asks for: a 400 now (a fitted one is fitted to the limits)
            group.check_sampling_params(request.params)
        reply, head = await sampled(service, who, group, request, body, checkpoint)
        head['id'] = f'chatcmpl-{head["id"]}'
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _events(head, reply, bool(body.logprobs), include_usage)
            return StreamingResponse(events, media_type='text/event-stream', headers={'Cache-Control': 'no-cache'})
        return _completion_json(head, reply, bool(body.logprobs))


# ---- models -----------------------------------------------------------------------------------------
def _resolve_model(service: Service, who: Tenant, model: str) -> tuple[ModelGroup, Checkpoint | None]:
    """The hosted base model ``model`` names (its configured id, that id without a hub scheme,
    its local path), or the checkpoint it names with the base model it was trained on, if this
    tenant may read it; else 404. Tinker's ``<base model>;<checkpoint path>`` names the
    checkpoint too, and must name the base model it was trained on (a 400 otherwise)."""
    base_name, separator, path = model.partition(';')
    group = next((group for group in service.groups.values() if group.answers_to(base_name)), None)
    if not separator:
        return (group, None) if group is not None else _resolve_checkpoint(service, who, model, model)
    if group is None:
        raise _model_not_found(model)
    trained_on, checkpoint = _resolve_checkpoint(service, who, path, model)
    if trained_on is not group:
        message = f'checkpoint {path!r} holds weights for {bare(trained_on.name)!r}, not {base_name!r}'
        raise FieldError(f'{message}; name its base model, or the checkpoint alone', 'model')
    return group, checkpoint


def _resolve_checkpoint(service: Service, who: Tenant, path: str, model: str) -> tuple[ModelGroup, Checkpoint]:
    """The checkpoint ``path`` names and the base model it was trained on, if this tenant may read
    it; else a 404 for ``model``."""
    try:
        run_id, kind, name = parse_checkpoint_path(path)
    except DataError:
        raise _model_not_found(model) from None
    found = service.store.checkpoints.readable(who.id, run_id, name, kind) if kind != 'external' else None
    trained_on = _group_of(service, found) if found is not None else None
    if found is None or trained_on is None or not Path(found.path).is_dir():
        raise _model_not_found(model)
    return trained_on, found


def _group_of(service: Service, checkpoint: Checkpoint) -> ModelGroup | None:
    """The hosted base model a checkpoint was trained on (None: not hosted any more)."""
    run = service.store.runs.by_id(checkpoint.run_id)
    return None if run is None else service.find_group(run.base_model)


def _model_not_found(model: str) -> NotFoundError:
    return NotFoundError(f'model {model!r} does not exist or you do not have access to it; GET /v1/models lists yours')


def _tenant_checkpoints(store: Store, who: Tenant, page: int = 500) -> list[Checkpoint]:
    """Every checkpoint of the tenant, newest first."""
    checkpoints, total = store.checkpoints.page(who.id, limit=page)
    while len(checkpoints) < total:
        more, total = store.checkpoints.page(who.id, limit=page, offset=len(checkpoints))
        if not more:
            break
        checkpoints += more
    return checkpoints


def _model_json(
    group: ModelGroup, who: Tenant, checkpoint: Checkpoint | None = None, model_id: str | None = None
) -> JsonObject:
    """A base model (no ``checkpoint``) or a checkpoint of it as an OpenAI model; ``owned_by``
    of a checkpoint names the tenant, or is 'published' for another tenant's."""
    base = bare(group.name)
    model: JsonObject = {
        'id': base,
        'object': 'model',
        'created': 0,
        'owned_by': 'twinkle',
        'root': base,
        'parent': None,
    }
    model['max_model_len'] = group.context
    if checkpoint is None:
        return model
    owner = who.name if checkpoint.tenant_id == who.id else 'published'
    created = int(checkpoint.created_at)
    return {**model, 'id': model_id or checkpoint.tinker_path, 'created': created, 'owned_by': owner, 'parent': base}


# ---- checking the request ---------------------------------------------------------------------------
def _check_options(body: ChatCompletionRequest) -> None:
    """Refuse what this server would answer wrongly: unimplemented options, too many choices."""
    used = [name for name, uses in UNSUPPORTED.items() if uses(body)]
    if used:
        message = f'{used[0]} is not supported by this server (options it refuses: {sorted(UNSUPPORTED)})'
        raise FieldError(message, used[0], 'unsupported_parameter')
    if (body.n or 1) > MAX_CHOICES:
        raise FieldError(f'n={body.n} is over the limit of {MAX_CHOICES} choices per request', 'n')
    if body.top_logprobs is not None and not body.logprobs:
        raise FieldError('top_logprobs needs logprobs set to true', 'top_logprobs')


def _message(index: int, message: ChatMessage) -> ChatTurn:
    """A message as the chat template takes it: text content, the template's role names."""
    where = f'messages[{index}]'
    if message.tool_calls:
        raise FieldError(f'{where}.tool_calls: tool calls are not supported by this server', where)
    content = message.content
    if isinstance(content, list):
        for part_index, part in enumerate(content):
            if part.type != 'text' or part.text is None:
                param = f'{where}.content[{part_index}]'
                raise FieldError(f'{param}: content of type {part.type!r} is not supported; send text', param)
        content = '\n'.join(part.text or '' for part in content)
    return {'role': ROLE_ALIASES.get(message.role, message.role), 'content': content or ''}


# ---- sampling ---------------------------------------------------------------------------------------
async def sampled(
    service: Service,
    who: Tenant,
    group: ModelGroup,
    request: ChatRequest,
    body: SamplingOptions,
    checkpoint: Checkpoint | None,
) -> tuple[ChatReply, JsonObject]:
    """Sample ``request`` as a job on ``group``'s worker, from ``checkpoint``'s weights as the
    store names them when the job runs (None: the base model); its reply, and the head of the
    answer (the job's id, its time and the model as the request named it)."""
    operation = 'chat_completion' if isinstance(body, ChatCompletionRequest) else 'completion'

    def sample() -> ChatReply:
        if checkpoint is None:
            return group.sample_chat(request)
        weights = SavedWeights(service.folder_now(who, checkpoint, body.model), body.model)
        return group.sample_chat(replace(request, weights=weights))

    job = service.submit(who, group, None, operation, sample)
    await wait_job(job, None)
    if job.error is not None:
        raise job.error
    reply: ChatReply = job.result
    return reply, {'id': job.id, 'created': int(time.time()), 'model': body.model}


# ---- the reply --------------------------------------------------------------------------------------
def _completion_json(head: JsonObject, reply: ChatReply, logprobs: bool) -> JsonObject:
    choices: list[JsonValue] = [
        {
            'index': index,
            'message': {'role': 'assistant', 'content': choice['text'], 'refusal': None},
            'logprobs': _logprobs_json(choice['tokens']) if logprobs else None,
            'finish_reason': choice['finish_reason'],
        }
        for index, choice in enumerate(reply['choices'])
    ]
    return {**head, 'object': 'chat.completion', 'system_fingerprint': None, 'choices': choices, 'usage': _usage(reply)}


def _logprobs_json(tokens: list[ReplyToken]) -> JsonObject:
    def entry(token: str, logprob: float) -> JsonObject:
        return {'token': token, 'logprob': logprob, 'bytes': list(token.encode('utf-8'))}

    content: list[JsonValue] = [
        {**entry(t['token'], t['logprob']), 'top_logprobs': [entry(*top) for top in t['top']]} for t in tokens
    ]
    return {'content': content, 'refusal': None}


def _usage(reply: ChatReply) -> JsonObject:
    completion = sum(choice['completion_tokens'] for choice in reply['choices'])
    prompt = reply['prompt_tokens']
    return {'prompt_tokens': prompt, 'completion_tokens': completion, 'total_tokens': prompt + completion}


async def _events(head: JsonObject, reply: ChatReply, logprobs: bool, include_usage: bool) -> AsyncIterator[str]:
    """The reply as server-sent events: per choice a role chunk, one chunk per token, and a
    chunk with the finish reason; then the usage (if asked for) and ``[DONE]``."""

    def chunk(choices: list[JsonValue], **extra: JsonValue) -> str:
        data = {**head, 'object': 'chat.completion.chunk', 'system_fingerprint': None, 'choices': choices, **extra}
        if include_usage:
            data.setdefault('usage', None)
        return f'data: {json.dumps(data)}\n\n'

    def delta(
        index: int, content: JsonObject, finish: str | None = None, tokens: list[ReplyToken] | None = None
    ) -> JsonObject:
        chosen = _logprobs_json(tokens) if logprobs and tokens is not None else None
        return {'index': index, 'delta': content, 'logprobs': chosen, 'finish_reason': finish}

    for index, choice in enumerate(reply['choices']):
        yield chunk([delta(index, {'role': 'assistant', 'content': ''})])
        for token in choice['tokens']:
            if token['piece'] or logprobs:
                yield chunk([delta(index, {'content': token['piece']}, tokens=[token])])
        yield chunk([delta(index, {}, finish=choice['finish_reason'])])
    if include_usage:
        yield chunk([], usage=_usage(reply))
    yield 'data: [DONE]\n\n'


__all__ = ['PREFIX', 'ChatCompletionRequest', 'openai_router']
