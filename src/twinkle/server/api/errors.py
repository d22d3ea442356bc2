"""How an error becomes an HTTP answer: one table from the exception tree to statuses.

Routes raise the classes of ``twinkle.errors``; ``install_error_handlers`` answers each with
``{'detail': message, 'error': class name}`` and the status of its first matching row in
``STATUSES`` (a 429 also with ``Retry-After``). A request that fails validation is a 422 that
says where and what for its first ``MAX_PROBLEMS`` problems and how many there are
(``problems``), without the values sent, so its size is bounded whatever was sent; a body that
is not JSON at all is a 400. The
framework's own refusals (a path or method that does not exist, a body it cannot read, one over
its size limit) are answered in the same shape, under the tree's class of the same meaning.

>>> from twinkle.errors import DataError, NotFoundError, QueueFullError
>>> [status_of(e) for e in (NotFoundError('run x not found'), DataError('bad row'), QueueFullError('a', 2, 7.4))]
[404, 400, 429]
>>> retry_after_header(QueueFullError('a', 2, 7.4))
{'Retry-After': '7'}
>>> problems_sentence([{'loc': ('body', 'inputs', 0), 'msg': 'Field required', 'type': 'missing'}] * 12)
'inputs.0: Field required; inputs.0: Field required; inputs.0: Field required (and 9 more problems)'
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException
from starlette.routing import Match
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only from Python 3.12

from twinkle.errors import (
    BusyError,
    DataError,
    NotFoundError,
    QuotaError,
    RequestTimeoutError,
    RequestTooLargeError,
    SessionExpiredError,
    StateError,
    TwinkleError,
    UnauthorizedError,
    UnavailableError,
)

#: The first row whose class the error is an instance of gives its status; TwinkleError is the rest.
STATUSES: tuple[tuple[type[TwinkleError], int], ...] = (
    (BusyError, 429),
    (RequestTooLargeError, 413),
    (RequestTimeoutError, 408),
    (UnauthorizedError, 401),
    (QuotaError, 403),
    (NotFoundError, 404),
    (SessionExpiredError, 410),
    (StateError, 409),
    (UnavailableError, 503),
    (TwinkleError, 400),
)
#: The tree's class for each status the framework answers by itself (other statuses: TwinkleError).
FRAMEWORK_ERRORS: dict[int, type[TwinkleError]] = {
    400: DataError,
    401: UnauthorizedError,
    404: NotFoundError,
    408: RequestTimeoutError,
    413: RequestTooLargeError,
}
#: The methods a 405's ``Allow`` may name.
HTTP_METHODS = ('GET', 'HEAD', 'POST', 'PUT', 'PATCH', 'DELETE', 'OPTIONS')
#: Longest location part (a field name the client sent) repeated in a 422.
MAX_LOCATION_CHARS = 64
#: Most location parts a 422 repeats for one problem (a JSON value nests as deep as it was sent).
MAX_LOCATION_PARTS = 16
#: Longest message of one problem in a 422 (a validator's message may quote a name it was sent).
MAX_MESSAGE_CHARS = 300
#: Problems a 422 lists, the first ones found; it says how many there were in all.
MAX_PROBLEMS = 10
#: Problems a 422 spells out in one sentence (the Tinker and OpenAI APIs' ``detail``).
SENTENCE_PROBLEMS = 3


class ValidationProblem(TypedDict):
    """One problem of a 422: where it is (``loc``: body, query or path, then field names and list
    indices), what it is (``msg``) and its kind (pydantic's ``type``: missing, int_type...), not the input."""

    loc: list[str | int]
    msg: str
    type: str


class ErrorBody(BaseModel):
    """What every native and Tinker route answers for an error (4xx)."""

    detail: str = Field(description='What is wrong, naming the bad value and what is accepted')
    error: str = Field(description="The error's class in twinkle.errors, e.g. NotFoundError")


class ValidationBody(BaseModel):
    """What a native route answers for a request that fails validation (422)."""

    detail: list[ValidationProblem] = Field(description=f'The first problems found (at most {MAX_PROBLEMS})')
    problems: int = Field(description='How many problems the request has in all')


def status_of(error: TwinkleError) -> int:
    return next(status for kind, status in STATUSES if isinstance(error, kind))


def retry_after_header(error: TwinkleError) -> dict[str, str]:
    """``Retry-After`` in whole seconds (at least 1) for an error that frees up with time."""
    if not isinstance(error, BusyError | UnavailableError):
        return {}
    return {'Retry-After': str(max(1, round(error.retry_after_s)))}


def error_response(error: TwinkleError) -> JSONResponse:
    body = ErrorBody(detail=str(error), error=type(error).__name__)
    return JSONResponse(body.model_dump(), status_code=status_of(error), headers=retry_after_header(error))


def answer_framework_error(error: HTTPException) -> JSONResponse:
    """A refusal raised by FastAPI or Starlette (an unknown path, a body it cannot read, one
    ``http_limits`` cut off) in the error shape, under the tree's class of the same meaning."""
    body = ErrorBody(detail=str(error.detail), error=FRAMEWORK_ERRORS.get(error.status_code, TwinkleError).__name__)
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)


def unparsable(error: RequestValidationError) -> DataError | None:
    """A ``DataError`` when the body is not JSON at all (nothing to validate field by field): a
    400, as any body that cannot be parsed; None for a JSON body whose fields are wrong (a 422)."""
    problems = error.errors()
    if problems and all(problem['type'] == 'json_invalid' for problem in problems):
        reason = problems[0].get('ctx', {}).get('error', problems[0]['msg'])
        return DataError(f'the body is not valid JSON: {reason}')
    return None


def validation_problems(error: RequestValidationError) -> list[ValidationProblem]:
    """Where each of the first ``MAX_PROBLEMS`` problems is and what it is, without the input:
    a 6 MB body is not sent back, and NaN, infinities or bytes in it cannot break the answer.
    Locations and messages are cut (``MAX_LOCATION_PARTS``, ``MAX_LOCATION_CHARS``,
    ``MAX_MESSAGE_CHARS``) and made encodable, so the answer is small however many problems
    and however long the names the client sent."""
    return [_problem(problem) for problem in error.errors()[:MAX_PROBLEMS]]


def problems_sentence(problems: Sequence[ErrorDetails]) -> str:
    """The first ``SENTENCE_PROBLEMS`` problems (pydantic's error dicts) as one sentence,
    ``where: what; ...``, and how many more there are."""
    shown = [_problem(problem) for problem in problems[:SENTENCE_PROBLEMS]]
    sentence = '; '.join(f'{location_name(problem["loc"]) or "body"}: {problem["msg"]}' for problem in shown)
    more = len(problems) - len(shown)
    return f'{sentence} (and {more} more problem{"s" * (more != 1)})' if more > 0 else sentence


def location_name(loc: Sequence[int | str]) -> str:
    """A problem's location as a parameter name: ``('body', 'messages', 0, 'role')`` -> ``messages.0.role``."""
    parts = [part for part in loc if part != 'body'][:MAX_LOCATION_PARTS]
    return '.'.join(str(_location_part(part)) for part in parts)


def _problem(problem: ErrorDetails) -> ValidationProblem:
    return {
        'loc': [_location_part(part) for part in problem['loc'][:MAX_LOCATION_PARTS]],
        'msg': _encodable(str(problem['msg'])[:MAX_MESSAGE_CHARS]),
        'type': str(problem['type']),
    }


def _location_part(part: int | str) -> str | int:
    if isinstance(part, int):
        return part
    return _encodable(str(part)[:MAX_LOCATION_CHARS])


def _encodable(text: str) -> str:
    return text.encode('utf-8', errors='replace').decode('utf-8')  # a lone surrogate in a JSON key


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app takes at the request's path, for a 405's ``Allow``
    (``GET /runs`` and ``POST /runs`` are two routes; the framework names the first one's only).
    Each method is tried against the app's routes as the router matches them."""
    routes = request.app.router.routes
    return [
        method
        for method in HTTP_METHODS
        if any(route.matches({**request.scope, 'method': method})[0] is Match.FULL for route in routes)
    ]


def error_responses(*statuses: int) -> dict[int | str, dict[str, object]]:
    """The ``responses=`` of a router whose routes may answer these statuses, for the OpenAPI schema."""
    described: dict[int | str, dict[str, object]] = {}
    for status in statuses:
        model = ValidationBody if status == 422 else ErrorBody
        response: dict[str, object] = {'model': model, 'description': _DESCRIPTIONS[status]}
        if status == 429:
            seconds = {'description': 'Seconds to wait before trying again', 'schema': {'type': 'string'}}
            response['headers'] = {'Retry-After': seconds}
        described[status] = response
    return described


_DESCRIPTIONS = {
    400: 'The request is not valid (a bad value, an unknown name, a malformed path)',
    401: 'No API key, or one the server does not know',
    403: "Over the tenant's quota of something it holds (checkpoint bytes, runs): delete some first",
    404: 'No such run, checkpoint or request for this tenant',
    408: 'The body stopped arriving before it was whole (limits.body_read_timeout_s)',
    409: 'The run is not in a state to do this',
    410: 'The Tinker session expired (no heartbeat for tinker.session_timeout_s): open a new one',
    422: 'The request is not of the type the route takes: where and what, for the first problems',
    413: 'The body is over the size limit of its route (limits.max_body_bytes, limits.max_other_body_bytes)',
    429: 'A limit that frees up with time; retry after Retry-After seconds',
}


def install_error_handlers(app: FastAPI) -> None:
    """Answer the exception tree through ``STATUSES`` and validation errors without their input."""

    async def handle(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, TwinkleError)  # registered for TwinkleError only
        return error_response(error)

    async def invalid_request(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        not_json = unparsable(error)
        if not_json is not None:
            return error_response(not_json)
        return JSONResponse({'detail': validation_problems(error), 'problems': len(error.errors())}, status_code=422)

    async def refused(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException)
        if error.status_code == 405:  # Starlette's Allow names the methods of the first route of the path only
            error = HTTPException(405, error.detail, headers={'Allow': ', '.join(allowed_methods(request))})
        return answer_framework_error(error)

    app.add_exception_handler(TwinkleError, handle)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(HTTPException, refused)


__all__ = [
    'FRAMEWORK_ERRORS',
    'STATUSES',
    'ErrorBody',
    'ValidationBody',
    'ValidationProblem',
    'allowed_methods',
    'answer_framework_error',
    'error_response',
    'error_responses',
    'install_error_handlers',
    'location_name',
    'problems_sentence',
    'retry_after_header',
    'status_of',
    'unparsable',
    'validation_problems',
]
