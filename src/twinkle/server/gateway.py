"""A gateway: an HTTP process apart from the one that holds the models, several of them on one PostgreSQL store.

``twinkle-server gateway --worker http://10.0.0.5:8001`` (with ``store: postgresql://...``) serves the same API
as the worker it fronts, a ``twinkle-server serve`` on the same store. Clients may reach any gateway:

- A future is read from the store, not from the process that accepted it (``GET /twinkle/v1/futures/{id}``;
  one still running is waited for at the worker, which wakes when its job ends). So a gateway that dies
  loses no accepted request: the request is the worker's from its 202 on, and another gateway answers its
  future.
- Everything else is passed to the worker as it came (the method, the path and query byte for byte, the
  headers, the body) and its answer back as it came; the worker checks the key, the quotas and the body, and
  keeps each tenant's turns. Neither is held whole: the body is streamed to the worker as it arrives, the
  answer to the client as it leaves the worker.
- The worker's limits hold at the gateway first (``HttpLimits``, ``uvicorn_options``, with the config's
  ``limits``): a body is read only for a key the store knows (an unknown one reaches the worker without its
  body, which answers its 401), up to its route's cap, and a body or a request head that stops arriving is
  cut off as the worker would cut it off.
- The worker builds its links (checkpoint files, exported weights, traces) and redirects for the address the
  client used, never its own: the gateway passes the client's ``Host`` and says the scheme, the prefix and the
  client's address in ``X-Forwarded-Proto``, ``-Prefix`` and ``-For``, which the worker believes from its
  ``trusted_proxies`` (``twinkle.server.api.forwarded``); a client's own forwarded headers are dropped.
- A gateway holds no state, so it restarts, or another starts, while the models go on training.
- ``SIGTERM`` drains it: requests it had begun are answered; a new one is a 503 with ``Retry-After`` (the
  client tries again, at this gateway's address behind a load balancer, or at another); it exits when the
  last one is answered or after ``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from types import FrameType
from urllib.parse import quote

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette._utils import get_route_path
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from twinkle.errors import NotFoundError, UnauthorizedError, UnavailableError
from twinkle.server.api.binary import answer
from twinkle.server.api.deps import printable_path
from twinkle.server.api.errors import error_response, install_error_handlers
from twinkle.server.api.forwarded import ForwardedHeaders
from twinkle.server.api.request_limits import HttpLimits, uvicorn_options
from twinkle.server.auth import TENANT_KEY, key_from_headers
from twinkle.server.config import Limits
from twinkle.server.store import FutureRecord, Store, Tenant
from twinkle.wire import FutureInfo

#: Longest ``wait`` of a future poll, in seconds (the worker's own limit).
MAX_WAIT_S = 60.0
#: Seconds between two reads of a waited future from the store: the first, and the longest.
FIRST_POLL_S, MAX_POLL_S = 0.005, 0.1
#: Headers that belong to one connection, never passed on (RFC 9110, 7.6.1), and ``Expect`` (the gateway
#: answers a ``100-continue`` itself, when it reads the body).
HOP_HEADERS = frozenset(
    {'connection', 'keep-alive', 'proxy-connection', 'te', 'trailer', 'transfer-encoding', 'upgrade', 'expect'}
)
#: What a request's headers lose on the way to the worker besides: its host and length (the gateway sets
#: them), and any forwarded header it came with (the gateway says what it saw itself).
REQUEST_DROPPED = HOP_HEADERS | {
    'host', 'content-length', 'forwarded', 'x-forwarded-for', 'x-forwarded-host', 'x-forwarded-proto',
    'x-forwarded-prefix', 'x-forwarded-port', 'x-real-ip',
}  # fmt: skip
#: Bytes a path or a query keeps as they came: RFC 3986's unreserved and sub-delimiters, ':', '@', '/',
#: and '%' (a percent-escape stays as sent); any other byte is escaped, which the worker decodes to the same.
PATH_SAFE = "/!$&'()*+,;=:@%-._~"
QUERY_SAFE = PATH_SAFE + '?'


class GatewaySettings(BaseModel):
    """What a gateway needs beside the store: the worker it fronts, its limits, and how long it may drain."""

    worker_url: str = Field(pattern=r'^https?://')
    #: Seconds a request may take at the worker (a waited compute request, a checkpoint download).
    worker_timeout_s: float = Field(300.0, gt=0)
    #: Seconds ``SIGTERM`` waits for the requests begun before it.
    drain_timeout_s: float = Field(120.0, gt=0)
    #: What a client may send before the gateway spends anything on it: the worker's ``limits``.
    limits: Limits = Field(default_factory=Limits)
    #: The proxies in front of the gateway (a load balancer) whose ``X-Forwarded-*`` it believes.
    trusted_proxies: list[str] = Field(default_factory=lambda: ['127.0.0.1', '::1'])


class Gateway:
    """The gateway's state: the store, the worker's client, and the requests in flight."""

    def __init__(self, store: Store, settings: GatewaySettings):
        self.store, self.settings = store, settings
        # A kept connection is dropped well before the worker closes it as idle (``idle_connection_timeout_s``):
        # at the same expiry (httpx's 5 s, uvicorn's 5 s) a request sent as the worker closed it failed with a
        # ReadError, a 503 for a request the worker never saw (seen under load).
        kept = httpx.Limits(keepalive_expiry=settings.limits.idle_connection_timeout_s / 2)
        self.worker = httpx.AsyncClient(timeout=settings.worker_timeout_s, limits=kept)
        self.worker_url = httpx.URL(settings.worker_url)
        self.in_flight = 0
        self.draining = False
        self.idle = asyncio.Event()

    async def tenant(self, request: Request) -> Tenant:
        """The tenant of the request's key (read in a thread: a PostgreSQL round trip does not hold the loop),
        or the one ``HttpLimits`` found already."""
        if isinstance(found := request.scope.get(TENANT_KEY), Tenant):
            return found
        key = key_from_headers({name.lower(): value for name, value in request.headers.items()})
        if not key:  # the worker's words (``deps.key_holder``): a client sees one server
            raise UnauthorizedError('missing API key: send "Authorization: Bearer <key>" or "X-API-Key: <key>"')
        tenant = await asyncio.to_thread(self.store.tenants.for_key, key)
        if tenant is None:
            raise UnauthorizedError('unknown API key')
        return tenant

    async def future(self, tenant: Tenant, future_id: str, wait: float) -> FutureRecord:
        """The tenant's future from the store, read again until it settles or ``wait`` seconds pass."""
        deadline, pause = time.monotonic() + min(max(wait, 0.0), MAX_WAIT_S), FIRST_POLL_S
        while True:
            record = await asyncio.to_thread(self.store.futures.get, tenant.id, future_id)
            if record is None:
                raise NotFoundError(f'request {future_id!r} not found')
            if record.finished or time.monotonic() >= deadline:
                return record
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(2 * pause, MAX_POLL_S)

    async def forward(self, request: Request) -> Response:
        """The request passed to the worker as it came, its body streamed; the answer streamed back as it came."""
        scope = request.scope
        url = self.worker_url.copy_with(raw_path=self.worker_url.raw_path.rstrip(b'/') + worker_target(scope))
        sent = self.worker.build_request(request.method, url, headers=forwarded_headers(scope), content=_body(request))
        try:
            got = await self.worker.send(sent, stream=True)
        except httpx.TransportError as exc:
            raise UnavailableError(f'the model worker does not answer ({type(exc).__name__}); try again', 2.0) from None
        except ClientDisconnect:  # the client left while its body was on the way: nobody reads an answer
            return Response(status_code=400)
        passed = [(name, value) for name, value in got.headers.raw if name.decode('latin-1').lower() not in HOP_HEADERS]
        streamed = StreamingResponse(_relayed(got), got.status_code)
        streamed.raw_headers = passed  # as the worker sent them: its length and encoding match the raw bytes
        return streamed

    @contextlib.asynccontextmanager
    async def counted(self) -> AsyncIterator[None]:
        self.in_flight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def drain(self) -> None:
        """Refuse new requests; return once those in flight are answered (or ``drain_timeout_s`` passed)."""
        self.draining = True
        if self.in_flight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.idle.wait(), self.settings.drain_timeout_s)


def worker_target(scope: Scope) -> bytes:
    """The request's path and query as the client sent them (``raw_path``, under the gateway's own prefix),
    each byte httpx would change escaped (a dot segment, a space, a byte past ASCII): the worker decodes the
    path it gets to the one the gateway decoded, so it routes and answers the request as if sent to it.

    >>> worker_target({'path': '/a/../b c', 'raw_path': b'/a/../b c', 'query_string': b'x=%00&y=\\xff'})
    b'/a/%2E%2E/b%20c?x=%00&y=%FF'
    """
    raw: bytes = scope.get('raw_path') or scope['path'].encode()
    root = scope.get('root_path', '').encode()
    if root and raw.startswith(root):
        raw = raw[len(root) :]
    segments = [b'%2E' * len(segment) if segment in (b'.', b'..') else segment for segment in raw.split(b'/')]
    target = quote(b'/'.join(segments), safe=PATH_SAFE).encode()
    query: bytes = scope.get('query_string', b'')
    return target + b'?' + quote(query, safe=QUERY_SAFE).encode() if query else target


def forwarded_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's headers for the worker, as raw bytes: this hop's and the client's forwarded ones left
    out, the ``Host`` the client sent (this gateway's address), and what the gateway saw of the client."""
    headers: list[tuple[bytes, bytes]] = scope['headers']
    kept = [(name, value) for name, value in headers if name.decode('latin-1') not in REQUEST_DROPPED]
    host = next((value for name, value in headers if name == b'host'), None) or _server_netloc(scope)
    said = [(b'host', host), (b'x-forwarded-proto', scope.get('scheme', 'http').encode())]
    if scope.get('root_path'):
        said.append((b'x-forwarded-prefix', scope['root_path'].encode()))
    if scope.get('client'):
        said.append((b'x-forwarded-for', str(scope['client'][0]).encode()))
    return [*said, *kept]


def _server_netloc(scope: Scope) -> bytes:
    """This gateway's address as the request reached it, for a client that sent no ``Host`` (HTTP/1.0)."""
    host, port = scope.get('server') or ('localhost', None)
    host = f'[{host}]' if ':' in host else host
    return (host if port is None else f'{host}:{port}').encode()


async def _relayed(got: httpx.Response) -> AsyncIterator[bytes]:
    """The worker's answer as its bytes arrive; its connection back in the pool once read, or once the
    client left in the middle (the generator closed: its ``finally``)."""
    try:
        async for chunk in got.aiter_raw():
            yield chunk
    finally:
        await got.aclose()


def _body(request: Request) -> AsyncIterator[bytes] | None:
    """The request's body as it arrives (``HttpLimits`` counts and times each chunk), or None without one."""
    headers = request.headers
    if 'transfer-encoding' not in headers and headers.get('content-length', '0').strip() in ('', '0'):
        return None
    return request.stream()


class ToWorker:
    """The ASGI app of each request the gateway does not answer itself: the worker's answer to it. An app,
    not a function, so that its route takes every method (Starlette gives a function's route GET alone)."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        answer = await self.gateway.forward(Request(scope, receive))
        await answer(scope, receive, send)


class DrainAndCount:
    """ASGI middleware: while the gateway drains, a new request is a 503 with ``Retry-After``; the others
    are counted in flight until their answer's last byte is sent."""

    def __init__(self, app: ASGIApp, gateway: Gateway):
        self.app, self.gateway = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] != 'http':
            await self.app(scope, receive, send)
            return
        if self.gateway.draining and get_route_path(scope) != '/healthz':
            refused = error_response(
                UnavailableError('this gateway is stopping; send the request again (here or to another)', 1.0)
            )
            refused.headers['Connection'] = 'close'  # its body, if any, stays unread
            await refused(scope, receive, send)
            return
        async with self.gateway.counted():
            await self.app(scope, receive, send)


def create_gateway(store_url: str, settings: GatewaySettings) -> FastAPI:
    """The gateway's application over the PostgreSQL store at ``store_url``."""
    store = Store(store_url)
    gateway = Gateway(store, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await gateway.drain()
        await gateway.worker.aclose()
        store.close()

    # Its own routes refuse a path parameter no id can hold, as the worker's do (``printable_path``).
    app = FastAPI(title='twinkle gateway', version='1', lifespan=lifespan, dependencies=[Depends(printable_path)])
    app.state.gateway = gateway
    install_error_handlers(app)
    # Outermost first: the client's address (behind a trusted proxy), the drain, then the worker's limits.
    app.add_middleware(HttpLimits, limits=settings.limits, tenant_for_key=store.tenants.for_key, lookup_in_thread=True)
    app.add_middleware(DrainAndCount, gateway=gateway)
    app.add_middleware(ForwardedHeaders, trusted_proxies=settings.trusted_proxies)

    @app.get('/healthz')
    async def healthz() -> JSONResponse:
        status = 503 if gateway.draining else 200
        return JSONResponse({'status': 'draining' if gateway.draining else 'ok', 'role': 'gateway'}, status)

    @app.get('/twinkle/v1/futures/{future_id}', response_model=FutureInfo)
    async def get_future(future_id: str, request: Request, wait: float = 0.0) -> BaseModel | Response:
        """A settled future from the store; an unsettled one waited for at the worker, which wakes when its job
        ends (the store polled instead when the worker does not answer)."""
        tenant = await gateway.tenant(request)
        record = await gateway.future(tenant, future_id, 0.0)
        if not record.finished and wait > 0:
            with contextlib.suppress(UnavailableError):
                return await gateway.forward(request)
            record = await gateway.future(tenant, future_id, wait)
        return answer(request, FutureInfo.model_construct(**dict(record)))

    # Every other path, with any method: the worker answers it (a method it takes nowhere included).
    app.router.routes.append(Route('/{path:path}', ToWorker(gateway), include_in_schema=False))
    return app


def serve_gateway(store_url: str, settings: GatewaySettings, host: str, port: int, log_level: str = 'info') -> None:
    """Serve a gateway until ``SIGTERM`` or ``SIGINT``, draining it first (``DrainingServer``)."""
    app = create_gateway(store_url, settings)
    options = uvicorn_options(settings.limits)
    DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, **options), app.state.gateway).run()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal drains the gateway before uvicorn stops: it goes on
    listening, answers new requests 503 and waits for those in flight; a second signal stops it at once."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway):
        super().__init__(config)
        self.gateway = gateway
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.gateway.draining or self.loop is None:
            super().handle_exit(sig, frame)
            return
        self.gateway.draining = True
        self.loop.call_soon_threadsafe(lambda: self.loop and self.loop.create_task(self._drain_then_exit(sig, frame)))

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        await self.gateway.drain()
        super().handle_exit(sig, frame)


__all__ = ['DrainAndCount', 'DrainingServer', 'Gateway', 'GatewaySettings', 'create_gateway', 'serve_gateway']
