"""The HTTP application: one router per API over one ``Service`` (``state.py``: the store, the
scheduler's worker thread and the model host), the error table (``errors.py``), and the chores
that run beside the requests.

- native (``native.py``): ``/twinkle/v1``, the twinkle client's API, its shapes in ``twinkle.wire``;
- Tinker (``tinker/``): ``/api/v1``, what the official ``tinker`` SDK calls;
- OpenAI (``openai_api.py``, ``openai_completions.py``): ``/v1``, chat and text completions over
  a run's saved weights.

A tenant sees only its own runs, checkpoints and futures: anything else is a 404, as if it did
not exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from twinkle.server.api.dashboard import mount_dashboard
from twinkle.server.api.deps import printable_path
from twinkle.server.api.errors import install_error_handlers
from twinkle.server.api.forwarded import ForwardedHeaders
from twinkle.server.api.metrics import MetricsListener, metrics_router
from twinkle.server.api.native import native_router
from twinkle.server.api.openai_api import openai_router
from twinkle.server.api.openai_completions import completions_router
from twinkle.server.api.request_limits import HttpLimits
from twinkle.server.api.tinker.base import TinkerAPI
from twinkle.server.api.tinker.billing import billing_router
from twinkle.server.api.tinker.rest import expire_checkpoints_periodically, rest_router
from twinkle.server.api.tinker.sampling import sampling_router
from twinkle.server.api.tinker.session import expire_sessions_periodically, session_router
from twinkle.server.api.tinker.state import TinkerState
from twinkle.server.api.tinker.trace import trace_router
from twinkle.server.api.tinker.training import training_router
from twinkle.server.config import ServerConfig
from twinkle.server.execution.host import Host
from twinkle.server.service import Service
from twinkle.utils.logger import get_logger

logger = get_logger()


def create_app(config: ServerConfig, host: Host | None = None) -> FastAPI:
    """The FastAPI application; ``uvicorn.run(create_app(config))`` serves it."""
    service = Service(config, host)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        app.state.metrics = MetricsListener(config.metrics, service.registry)  # metrics.port: without a key
        chores = [
            asyncio.create_task(_release_periodically(service)),
            asyncio.create_task(_expire_gaps(tinker)),
            asyncio.create_task(expire_checkpoints_periodically(service)),
            asyncio.create_task(expire_sessions_periodically(tinker)),
        ]
        yield
        for chore in chores:
            chore.cancel()
        app.state.metrics.stop()
        service.release_all()  # a graceful stop keeps every adapter's state; a restart brings them back
        service.stop()
        service.store.close()

    # Every route refuses a path parameter no id can hold before it looks it up (``printable_path``).
    app = FastAPI(
        title='twinkle training service', version='1', lifespan=lifespan, dependencies=[Depends(printable_path)]
    )
    app.state.service = service
    install_error_handlers(app)

    # First: a route is matched by trying every one before it, and health checks come often.
    @app.get('/healthz')
    async def healthz() -> dict[str, str]:
        return {'status': 'ok'}

    app.include_router(metrics_router(service))  # the admin key's (metrics.port: a scraper's, without one)
    app.include_router(native_router(service))
    # A store across the network (PostgreSQL) is asked on a thread: its round trip does not hold the event loop.
    for_key, lookup = service.store.tenants.for_key, config.store is not None
    app.add_middleware(HttpLimits, limits=config.limits, tenant_for_key=for_key, lookup_in_thread=lookup)
    # Outermost: behind a trusted proxy (a gateway), the links and redirects name the address the client used.
    app.add_middleware(ForwardedHeaders, trusted_proxies=config.trusted_proxies)
    tinker = TinkerAPI(service, TinkerState(config.tinker))
    app.state.tinker = tinker
    for tinker_router in (session_router, training_router, sampling_router, rest_router, billing_router, trace_router):
        app.include_router(tinker_router(tinker))
    app.include_router(openai_router(service))
    app.include_router(completions_router(service))
    mount_dashboard(app, service)

    return app


async def _release_periodically(service: Service) -> None:
    idle = service.config.idle_release_s
    if idle is None:
        return
    while True:
        await asyncio.sleep(min(max(idle / 4, 0.05), 30.0))
        try:
            service.release_idle()
        except Exception:  # a chore that dies stops every later release: log it and go on
            logger.exception('queueing the release of idle adapters failed; trying again later')


async def _expire_gaps(tinker: TinkerAPI) -> None:
    """Fail Tinker requests that wait for a seq_id that never came."""
    while True:
        await asyncio.sleep(min(tinker.settings.seq_gap_timeout_s / 4, 5.0))
        tinker.state.sequencer.expire()


__all__ = ['Service', 'create_app']
