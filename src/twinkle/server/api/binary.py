"""The native API's binary bodies: MessagePack beside JSON, chosen by content type.

A request whose ``Content-Type`` is MessagePack (``twinkle.wire.MSGPACK``, or its ``x-`` and
``vnd.`` spellings) is read as MessagePack and validated by the same wire models as JSON: its 422s
and 4xx answers are the same. A compute request or a future poll whose ``Accept`` names
MessagePack is answered in it. Token ids and logprobs are what make a native body large: on an RL
batch of 8 x 1,024 tokens, writing and reading both ways cost 4.3 ms in MessagePack against 12.8 ms in
JSON, in half the bytes (``benchmarks/binary_body.py``). Errors stay JSON, as the Tinker and OpenAI routes
and a person with ``curl`` are answered.

>>> accepts_msgpack('application/msgpack, application/json;q=0.5')
True
>>> accepts_msgpack('application/json'), accepts_msgpack('*/*'), accepts_msgpack('application/msgpack;q=0')
(False, False, False)
>>> unpack(pack({'inputs': [{'input_ids': [1, 2]}]}))
{'inputs': [{'input_ids': [1, 2]}]}
>>> unpack(b'\\xc1')
Traceback (most recent call last):
...
twinkle.errors.DataError: the body is not valid MessagePack: a byte that starts no MessagePack value
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TypeVar, cast

import msgpack
from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, JsonValue

from twinkle.errors import DataError
from twinkle.wire import MSGPACK, MSGPACK_TYPES

_JSON_TYPE = (b'content-type', b'application/json')
Answer = TypeVar('Answer', bound=BaseModel)


def media_type(header: str) -> str:
    """The bare media type of a ``Content-Type`` or ``Accept`` entry, lower case."""
    return header.split(';', 1)[0].strip().lower()


def accepts_msgpack(accept: str) -> bool:
    """Whether an ``Accept`` header names MessagePack (with a quality above 0). A wildcard alone
    does not: a client that never asked for MessagePack gets JSON."""
    for entry in accept.split(','):
        kind, *parameters = entry.split(';')
        if media_type(kind) in MSGPACK_TYPES:
            return all(_quality(parameter) != 0 for parameter in parameters)
    return False


def _quality(parameter: str) -> float | None:
    name, _, value = parameter.partition('=')
    if name.strip().lower() != 'q':
        return None
    try:
        return float(value)
    except ValueError:
        return None


def pack(value: JsonValue | BaseModel) -> bytes:
    """A JSON value, or an answer model, as MessagePack. A model is packed field by field as it
    stands (a ``model_dump`` of thousands of logprobs would cost ten times the packing)."""
    return cast(bytes, msgpack.packb(value, use_bin_type=True, default=_fields))


def _fields(value: object) -> dict[str, object]:
    if isinstance(value, BaseModel):
        return dict(value)
    raise TypeError(f'{type(value).__name__} is not a JSON value')


def unpack(body: bytes) -> JsonValue:
    """A MessagePack body as the value JSON would give (maps with string keys, arrays as lists): what
    a client sent, validated by the route's wire model next."""
    try:
        return cast(JsonValue, msgpack.unpackb(body, raw=False, strict_map_key=True))
    except (ValueError, TypeError) as error:  # msgpack's errors are ValueErrors, UTF-8's too
        raise DataError(f'the body is not valid MessagePack: {_reason(error)}') from None


def _reason(error: Exception) -> str:
    if isinstance(error, msgpack.ExtraData):
        return 'more bytes follow its value'
    if isinstance(error, msgpack.FormatError):
        return 'a byte that starts no MessagePack value'
    if isinstance(error, msgpack.StackError):
        return 'values nested too deep'
    if isinstance(error, UnicodeDecodeError):
        return 'a string that is not UTF-8'
    if 'for map key' in str(error):
        return 'a map key that is not a string (JSON objects have string keys)'
    if 'incomplete input' in str(error):
        return 'it ends inside a value'
    return type(error).__name__


class BinaryRoute(APIRoute):
    """A route that reads a MessagePack body as it reads a JSON one (FastAPI's route-class hook): the
    body is read and unpacked before the handler, which is shown a JSON request holding its value
    (Starlette keeps a parsed body in ``_json``). A body that does not unpack is a 400 here, with
    MessagePack's reason, rather than FastAPI's "error parsing the body"."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[object, object, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            if media_type(request.headers.get('content-type', '')) in MSGPACK_TYPES:
                body = await request.body()
                headers = [_JSON_TYPE if name == b'content-type' else (name, v) for name, v in request.scope['headers']]
                request = Request({**request.scope, 'headers': headers}, request.receive)
                request._body = body
                if body:
                    request._json = unpack(body)
            return await handler(request)

        return route


def answer(request: Request, model: Answer, status_code: int = 200) -> Answer | Response:
    """``model`` as the request asked: a MessagePack response if its ``Accept`` names it, else the
    model itself for FastAPI to write as JSON (with the route's status)."""
    if not accepts_msgpack(request.headers.get('accept', '')):
        return model
    return Response(pack(model), status_code, media_type=MSGPACK, headers={'Vary': 'Accept'})
