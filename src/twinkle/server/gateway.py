"""A gateway: an HTTP process apart from the one that holds the models, several of them on one PostgreSQL store.

``twinkle-server gateway --worker http://10.0.0.5:8001`` (with ``store: postgresql://...``) serves the same API
as the worker it fronts, a ``twinkle-server serve`` on the same store. Clients may reach any gateway:

- A future is read from the store, not from the process that accepted it (``GET /twinkle/v1/futures/{id}``;
  one still running is waited for at the worker, which wakes when its job ends). So a gateway that dies
  loses no accepted request: the request is the worker's from its 202 on, and another gateway answers its
  future.
- Everything else is passed to the worker as it came (the key, the body, the content type) and its answer
  back as it came; the worker checks the key, the quotas and the body, and keeps each tenant's turns.
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
from collections.abc import AsyncIterator, Awaitable, Callable
from types import FrameType

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from twinkle.errors import NotFoundError, UnauthorizedError, UnavailableError
from twinkle.server.api.binary import answer
from twinkle.server.api.errors import error_response, install_error_handlers
from twinkle.server.auth import key_from_headers
from twinkle.server.store import FutureRecord, Store, Tenant
from twinkle.wire import FutureInfo

#: Longest ``wait`` of a future poll, in seconds (the worker's own limit).
MAX_WAIT_S = 60.0
#: Seconds between two reads of a waited future from the store: the first, and the longest.
FIRST_POLL_S, MAX_POLL_S = 0.005, 0.1
#: Headers that belong to one connection, never passed on (RFC 9110, 7.6.1), and those httpx sets itself.
HOP_HEADERS = frozenset(
    {'connection', 'keep-alive', 'proxy-connection', 'te', 'trailer', 'transfer-encoding', 'upgrade', 'host',
     'content-length'}
)  # fmt: skip


class GatewaySettings(BaseModel):
    """What a gateway needs beside the store: the worker it fronts, and how long it may drain."""

    worker_url: str = Field(pattern=r'^https?://')
    #: Seconds a request may take at the worker (a waited compute request, a checkpoint download).
    worker_timeout_s: float = Field(300.0, gt=0)
    #: Seconds ``SIGTERM`` waits for the requests begun before it.
    drain_timeout_s: float = Field(120.0, gt=0)


class Gateway:
    """The gateway's state: the store, the worker's client, and the requests in flight."""

    def __init__(self, store: Store, settings: GatewaySettings):
        self.store, self.settings = store, settings
        self.worker = httpx.AsyncClient(base_url=settings.worker_url.rstrip('/'), timeout=settings.worker_timeout_s)
        self.in_flight = 0
        self.draining = False
        self.idle = asyncio.Event()

    async def tenant(self, request: Request) -> Tenant:
        """The tenant of the request's key (read in a thread: a PostgreSQL round trip does not hold the loop)."""
        key = key_from_headers({name.lower(): value for name, value in request.headers.items()})
        tenant = await asyncio.to_thread(self.store.tenants.for_key, key) if key is not None else None
        if tenant is None:
            raise UnauthorizedError('a valid API key is required (Authorization: Bearer <key>)')
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
        """The request passed to the worker as it came, and its answer back as it came."""
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        try:
            sent = self.worker.build_request(
                request.method, request.url.path, params=request.url.query.encode(), headers=headers,
                content=await request.body(),
            )  # fmt: skip
            got = await self.worker.send(sent)
        except httpx.TransportError as exc:
            raise UnavailableError(f'the model worker does not answer ({type(exc).__name__}); try again', 2.0) from None
        passed = {k: v for k, v in got.headers.items() if k.lower() not in HOP_HEADERS | {'content-encoding'}}
        return Response(got.content, got.status_code, headers=passed)

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

    app = FastAPI(title='twinkle gateway', version='1', lifespan=lifespan)
    app.state.gateway = gateway
    install_error_handlers(app)

    @app.middleware('http')
    async def drain_and_count(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if gateway.draining and request.url.path != '/healthz':
            refused = UnavailableError('this gateway is stopping; send the request again (here or to another)', 1.0)
            return error_response(refused)
        async with gateway.counted():  # a route's errors are answered inside, by the error table's handlers
            return await call_next(request)

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

    @app.api_route('/{path:path}', methods=['GET', 'POST', 'PUT', 'PATCH', 'DELETE', 'HEAD', 'OPTIONS'])
    async def forward(request: Request, path: str) -> Response:
        return await gateway.forward(request)

    return app


def serve_gateway(store_url: str, settings: GatewaySettings, host: str, port: int, log_level: str = 'info') -> None:
    """Serve a gateway until ``SIGTERM`` or ``SIGINT``, draining it first (``DrainingServer``)."""
    app = create_gateway(store_url, settings)
    DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), app.state.gateway).run()


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


__all__ = ['DrainingServer', 'Gateway', 'GatewaySettings', 'create_gateway', 'serve_gateway']
