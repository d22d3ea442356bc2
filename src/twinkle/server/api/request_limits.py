"""What a connection may send before the server spends anything on it.

- **A body is read only for a known API key.** Every route that takes a body needs a key, so a
  request whose key is missing or unknown gets its route's own 401 (each API's error shape) with
  the body left unread: the app is shown an empty one.
- **Bodies have a cap by route**: routes that carry tokens (native operations, Tinker
  ``forward_backward`` and sampling, OpenAI chat) take up to ``limits.max_body_bytes``, the others
  ``limits.max_other_body_bytes``. A larger ``Content-Length`` is a 413 before a byte is read; a
  chunked body is counted as it comes and cut off at the cap.
- **A body that stops arriving** for ``limits.body_read_timeout_s`` is a 408.
- **An idle connection is closed**: one that sends no request head (or half of one) for
  ``limits.idle_connection_timeout_s``, as well as one idle between requests (uvicorn's keep-alive).

Each refusal closes the connection (``Connection: close``), so the unread rest is never parsed. The close is
staged (RFC 9112 §9.6): the answer is followed by a FIN, and what the client still sends is read and dropped
until it closes its side, for ``LINGER_S`` at most. A socket closed with unread bytes in it is reset by the
kernel, and the reset can reach the client before the answer it was sent after: a gateway streaming a body
to a route answered before reading it (a 405, a 401) got a ReadError in place of the answer, once in a few
thousand requests beside a loaded machine. uvicorn closes at once, and nginx's ``lingering_close`` is what
this does.
``HttpLimits`` is a plain ASGI middleware that holds no more of a body than one chunk;
``uvicorn_options`` gives the settings for the server underneath. A gateway (``twinkle.server.gateway``)
applies the same limits before it streams a body on to its worker.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import NoReturn, TypedDict

import h11
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from twinkle.errors import TwinkleError
from twinkle.server.api.errors import answer_framework_error, error_response
from twinkle.server.auth import TENANT_KEY, key_from_headers
from twinkle.server.config import Limits

#: Routes whose bodies carry tokens and take up to ``max_body_bytes``: the native operations
#: (forward_backward, sample, ...), Tinker's forward_backward (``forward`` too, as a flag in its
#: body) and asample, and OpenAI chat completions.
TOKEN_ROUTES = re.compile(
    r'/twinkle/v1/runs/[^/]+/ops/[^/]+'
    r'|/api/v1/(forward_backward|asample)'
    r'|/v1/(chat/)?completions'
)
#: Bytes in a request head (request line and headers); h11's own default, made explicit.
MAX_HEAD_BYTES = 16 * 1024
#: Seconds a connection closed before its request's body came is read on and dropped, at most, waiting for
#: the client to close its side (nginx's ``lingering_timeout``).
LINGER_S = 5.0


class HttpLimits:
    """ASGI middleware: the key before the body, a cap on the body, a timeout between its chunks.

    ``tenant_for_key(key)``: the tenant an API key belongs to, or None; called on a thread of its own
    with ``lookup_in_thread`` (a store across the network: its round trip does not hold the event loop).
    """

    def __init__(
        self,
        app: ASGIApp,
        limits: Limits,
        tenant_for_key: Callable[[str], object | None],
        lookup_in_thread: bool = False,
    ):
        self.app = app
        self.limits = limits
        self.tenant_for_key = tenant_for_key
        self.lookup_in_thread = lookup_in_thread

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] != 'http':
            await self.app(scope, receive, send)
            return
        await _Request(self, scope, receive, send).serve()

    def cap(self, path: str) -> tuple[int, str]:
        """The body cap of ``path`` and the name of the limit that sets it."""
        if TOKEN_ROUTES.fullmatch(path):
            return self.limits.max_body_bytes, 'max_body_bytes'
        return self.limits.max_other_body_bytes, 'max_other_body_bytes'


class RequestRefused(HTTPException):
    """Raised into the app from ``receive``: the body is over its cap or stopped arriving."""


class _Request:
    """One request passing through ``HttpLimits``.

    A refusal is raised into the app where it reads the body, so each API answers it in its own
    error shape; should the app answer something else (a route that catches every error), the
    refusal's own answer replaces it.
    """

    def __init__(self, middleware: HttpLimits, scope: Scope, receive: Receive, send: Send):
        self.middleware, self.scope, self._receive, self._send = middleware, scope, receive, send
        headers = {name.decode('latin-1').lower(): value.decode('latin-1') for name, value in scope['headers']}
        self.key = key_from_headers(headers)
        self.length = _content_length(headers)
        self.cap, self.cap_name = middleware.cap(get_route_path(scope))  # the path under a proxy's prefix
        self.received = 0
        self.body_done = not (self.length or 'transfer-encoding' in headers)
        self.refusal: RequestRefused | None = None
        self.started = False  # the client has the head of an answer
        self.dropping = False  # the app's answer is being replaced by the refusal's
        self.withheld = False  # the app was shown an empty body in place of this one

    async def serve(self) -> None:
        try:
            known = self.body_done or (self.key is not None and await self.tenant() is not None)
        except TwinkleError as error:  # the store cannot say whose key it is (unreachable): that, body unread
            answer = error_response(error)
            answer.headers['Connection'] = 'close'
            await answer(self.scope, self._receive, self._send)
            return
        receive = self.receive if known else self.empty_body  # unknown: the route's key check answers 401
        try:
            await self.middleware.app(self.scope, receive, self.send)
        except Exception:
            if self.refusal is None or self.started:
                raise
        if self.refusal is not None and not self.started:
            await self.answer(self.refusal)

    async def tenant(self) -> object | None:
        """The tenant of the request's key, looked up once: kept in the scope under ``TENANT_KEY``
        for the routes' key check (``deps.key_holder``), which then makes no second lookup."""
        lookup, key = self.middleware.tenant_for_key, self.key
        if key is None:
            tenant = None
        else:
            tenant = await asyncio.to_thread(lookup, key) if self.middleware.lookup_in_thread else lookup(key)
        self.scope[TENANT_KEY] = tenant
        return tenant

    async def receive(self) -> Message:
        """The next chunk of the body, counted against the cap and waited for at most the timeout."""
        if self.body_done:
            return await self._receive()
        if self.length is not None and self.length > self.cap:
            self.refuse(413, f'{self.where()} has a body of {self.length} bytes, over {self.limit()}')
        timeout = self.middleware.limits.body_read_timeout_s
        try:
            message = await asyncio.wait_for(self._receive(), timeout)
        except asyncio.TimeoutError:
            name = 'limits.body_read_timeout_s'
            self.refuse(408, f'the body of {self.where()} stopped arriving: nothing for {timeout:g} s ({name})')
        if message['type'] == 'http.request':
            self.received += len(message.get('body', b''))
            if self.received > self.cap:
                self.refuse(413, f'{self.where()} has a body of more than {self.cap} bytes, over {self.limit()}')
            self.body_done = not message.get('more_body', False)
        return message

    async def empty_body(self) -> Message:
        """What the app reads of a body from an unknown caller: nothing; later, the disconnect."""
        if not self.withheld:
            self.withheld = True
            return {'type': 'http.request', 'body': b'', 'more_body': False}
        while (message := await self._receive())['type'] != 'http.disconnect':
            pass  # body chunks of the refused request: dropped
        return message

    def refuse(self, status: int, detail: str) -> NoReturn:
        self.refusal = RequestRefused(status, detail)
        raise self.refusal

    async def send(self, message: Message) -> None:
        if message['type'] == 'http.response.start':
            if self.refusal is not None and message['status'] != self.refusal.status_code:
                self.dropping = True  # say, a "cannot parse the body" 400 to the body cut off
            else:
                self.started = True
                message = {**message, 'headers': [*message.get('headers', []), *self.closing()]}
        if not self.dropping:
            await self._send(message)

    def closing(self) -> list[tuple[bytes, bytes]]:
        """``Connection: close`` for an answer sent before the whole body came: the rest stays unread."""
        unread = not self.body_done or self.withheld or self.refusal is not None
        return [(b'connection', b'close')] if unread else []

    async def answer(self, refusal: RequestRefused) -> None:
        body = answer_framework_error(refusal).body
        headers = [(b'content-type', b'application/json'), (b'content-length', str(len(body)).encode())]
        self.started = True
        await self._send(
            {'type': 'http.response.start', 'status': refusal.status_code, 'headers': [*headers, *self.closing()]}
        )
        await self._send({'type': 'http.response.body', 'body': body})

    def where(self) -> str:
        return f'{self.scope["method"]} {self.scope["path"]}'

    def limit(self) -> str:
        return f'the limit of {self.cap} bytes (limits.{self.cap_name})'


def _content_length(headers: dict[str, str]) -> int | None:
    value = headers.get('content-length', '').strip()
    return int(value) if value.isdigit() else None


class IdleClosingH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol that also closes a connection whose request head does not come
    within ``timeout_keep_alive`` seconds: one that connects and sends nothing, or sends part of a
    head and stops (uvicorn by itself times only the wait between two requests, and any byte
    ends that wait); and closes in stages one whose request body has not all come (the module's
    docstring): its transport is a ``LingeringTransport``."""

    #: When the awaited request head is given up on; None while no head is awaited.
    head_deadline: asyncio.TimerHandle | None = None
    #: When a connection closed in stages is closed for good; None while it is not being closed.
    linger_deadline: asyncio.TimerHandle | None = None

    # override: asyncio.Protocol takes a BaseTransport; uvicorn's H11Protocol narrows it to the Transport
    # it is always given (with this same ignore), and this override keeps its signature.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringTransport(transport, self))
        self.await_head()

    def data_received(self, data: bytes) -> None:
        if self.linger_deadline is not None:  # the rest of a body nobody reads
            return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.head_deadline is not None:
            self.head_deadline.cancel()  # the head is in
            self.head_deadline = None

    def eof_received(self) -> None:
        if self.linger_deadline is not None:
            self.transport.close()  # the client closed its side: nothing more to wait for

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:
            self.await_head()  # the next request's head, should a first byte of it come

    def shutdown(self) -> None:
        if self.linger_deadline is not None:
            self.transport.close()  # the server stops: it waits for no client's unread body
        else:
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        for deadline in (self.head_deadline, self.linger_deadline):
            if deadline is not None:
                deadline.cancel()
        super().connection_lost(exc)

    def await_head(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
        self.head_deadline = self.loop.call_later(self.timeout_keep_alive, self.close_without_head)

    def close_without_head(self) -> None:
        self.head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def body_unread(self) -> bool:
        """Whether the client may still be sending the request's body."""
        return self.conn.their_state is h11.SEND_BODY

    def linger(self, transport: asyncio.Transport) -> None:
        """Close in stages: a FIN after the answer, the client's bytes dropped until it closes (``LINGER_S``)."""
        if self.linger_deadline is None:
            transport.write_eof()
            transport.resume_reading()
            self.linger_deadline = self.loop.call_later(LINGER_S, transport.close)


class LingeringTransport(asyncio.Transport):
    """The socket's transport as uvicorn's protocol sees it: the same, but ``close`` while the request's body
    is still coming closes in stages (``IdleClosingH11Protocol.linger``) and reads as closing from then on.
    uvicorn closes through its transport in several places (an answer with ``Connection: close``, a bad
    request, a timeout), so this is where one rule covers them all."""

    def __init__(self, transport: asyncio.Transport, protocol: IdleClosingH11Protocol):
        super().__init__()
        self.socket_transport, self.protocol, self.lingering = transport, protocol, False

    def close(self) -> None:
        if self.lingering or not self.protocol.body_unread() or not self.socket_transport.can_write_eof():
            self.socket_transport.close()
        else:
            self.lingering = True
            self.protocol.linger(self.socket_transport)

    def is_closing(self) -> bool:
        return self.lingering or self.socket_transport.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.socket_transport.write(data)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.socket_transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        if not self.lingering:  # a lingering connection reads until its client closes
            self.socket_transport.pause_reading()

    def resume_reading(self) -> None:
        self.socket_transport.resume_reading()

    def is_reading(self) -> bool:
        return self.socket_transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.socket_transport.set_protocol(protocol)  # a WebSocket upgrade: its protocol gets the socket's own

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.socket_transport.get_protocol()

    def abort(self) -> None:
        self.socket_transport.abort()

    def get_write_buffer_size(self) -> int:
        return self.socket_transport.get_write_buffer_size()


class UvicornOptions(TypedDict):
    """What ``uvicorn_options`` sets: the protocol class, seconds of idling, bytes of a request head, and
    uvicorn's own proxy headers off (``ServerConfig.trusted_proxies`` decides, ``api.forwarded``)."""

    http: type[IdleClosingH11Protocol]
    timeout_keep_alive: int  # as uvicorn annotates it; see uvicorn_options
    h11_max_incomplete_event_size: int
    proxy_headers: bool


def uvicorn_options(limits: Limits) -> UvicornOptions:
    """Keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` that bound idle and oversized connections."""
    return {
        'http': IdleClosingH11Protocol,
        # uvicorn annotates int, but only hands the value to loop.call_later, which takes seconds as a float.
        'timeout_keep_alive': limits.idle_connection_timeout_s,  # type: ignore[typeddict-item]
        'h11_max_incomplete_event_size': MAX_HEAD_BYTES,
        'proxy_headers': False,
    }
