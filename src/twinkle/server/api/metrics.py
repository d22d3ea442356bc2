"""The Prometheus metrics: ``GET /metrics`` for the admin key, and a listener of their own without a key.

The metrics count every tenant's requests and usage (``twinkle_usage_total``), so on the API's port they
answer the admin key only (``ServerConfig.admin_api_key``), like the dashboard's admin view; a tenant's key
is a 401 as no key is. A scraper that holds no key reads them on ``metrics.port``, a socket that serves
nothing else, bound to ``metrics.host`` (this machine by default). How they name a tenant is
``metrics.tenant_label`` (``Service``).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, start_http_server

from twinkle.errors import UnauthorizedError
from twinkle.server.api.deps import is_admin
from twinkle.server.api.errors import error_responses
from twinkle.server.config import MetricsSettings
from twinkle.server.service import Service


def metrics_router(service: Service) -> APIRouter:
    """``GET /metrics``, for the admin key."""
    routes = APIRouter(tags=['metrics'], responses=error_responses(401))

    text = {'description': "Prometheus' text format", 'content': {'text/plain': {'schema': {'type': 'string'}}}}

    @routes.get('/metrics', response_model=None, responses={200: text})  # its 401 is JSON, as every error
    async def metrics(request: Request) -> PlainTextResponse:
        """The Prometheus metrics of every tenant: the admin key only (a scraper without one: ``metrics.port``)."""
        if not is_admin(service, request):
            raise UnauthorizedError(_refusal(service))
        return PlainTextResponse(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return routes


def _refusal(service: Service) -> str:
    config = service.config
    if config.admin_api_key is None:
        remedy = 'this server has no admin key: set admin_api_key, or metrics.port for a scraper without a key'
    else:
        remedy = 'send the admin key (Authorization: Bearer <admin_api_key>), or scrape metrics.port without one'
    where = f' (here on {config.metrics.host}:{config.metrics.port})' if config.metrics.port is not None else ''
    return f'the metrics name every tenant and need the admin key: {remedy}{where}'


class MetricsListener:
    """The metrics alone on ``settings.port`` of ``settings.host``, without a key, on a thread of their own
    (prometheus_client's server: every path answers the metrics); ``stop`` closes the socket."""

    def __init__(self, settings: MetricsSettings, registry: CollectorRegistry):
        self.server: WSGIServer | None = None
        self.thread: threading.Thread | None = None
        if settings.port is not None:
            self.server, self.thread = start_http_server(settings.port, settings.host, registry)

    @property
    def port(self) -> int | None:
        """The port it listens on (the one picked, for ``port: 0``); None without a listener."""
        return None if self.server is None else int(self.server.server_port)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        if self.thread is not None:
            self.thread.join()


__all__ = ['MetricsListener', 'metrics_router']
