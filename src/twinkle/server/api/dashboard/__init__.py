"""The web dashboard at ``/dashboard``: a page, its scripts, and the few routes only it needs.

The page (``static/``) signs in with a key and then calls the APIs with it, as any client does:

- a tenant's key: its runs (``GET /twinkle/v1/runs``), each run's curves, polled as the run
  trains (``GET /twinkle/v1/runs/{id}/history?after=``), and its checkpoints, sampler weights and
  exported weights, which it downloads (signed links), publishes and deletes through the routes
  below. It never asks for anything but the tenant's own; the server answers nothing else.
- the admin key (``ServerConfig.admin_api_key``): tenants (names and counts, never their runs),
  each model's queue, requests per pass, adapters in memory, released runs and restarts.

The curves are drawn by uPlot (from the npm registry, MIT), served from the package
(``static/vendor/uplot``, refreshed by ``make dashboard-assets``): the page fetches nothing from
another host.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import JsonValue

from twinkle.errors import NotFoundError, UnauthorizedError
from twinkle.server.api.deps import Who, is_admin, key_holder
from twinkle.server.api.errors import error_responses
from twinkle.server.api.links import signed_links, weight_files
from twinkle.server.api.tinker.rest import delete_checkpoint
from twinkle.server.execution.groups.model_group import bare
from twinkle.server.service import Service
from twinkle.server.store import TINKER_FOLDERS, Checkpoint

STATIC = Path(__file__).parent / 'static'
PREFIX = '/dashboard'
Kind = Literal['training', 'sampler', 'external']
JsonObject = dict[str, JsonValue]


def dashboard_router(service: Service) -> APIRouter:
    """The page and the routes of its own (under ``/dashboard``)."""
    routes = APIRouter(prefix=PREFIX, tags=['dashboard'], responses=error_responses(400, 401, 404, 409, 422, 429))

    def admin(request: Request) -> None:
        if not is_admin(service, request):
            raise UnauthorizedError('the admin view needs the admin key')

    @routes.get('', include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / 'index.html', media_type='text/html')

    @routes.get('/api/session')
    async def session(request: Request) -> JsonObject:
        """Who the key is: ``{'role': 'admin'}`` or ``{'role': 'tenant', 'name': ...}``; 401 otherwise."""
        if is_admin(service, request):
            return {'role': 'admin'}
        return {'role': 'tenant', 'name': key_holder(request).name}

    @routes.get('/api/admin', dependencies=[Depends(admin)])
    async def overview() -> JsonObject:
        return await asyncio.to_thread(admin_overview, service)

    _checkpoint_routes(routes, service)
    return routes


def owned_checkpoint(request: Request, who: Who, run_id: str, kind: Kind, name: str) -> Checkpoint:
    """The tenant's checkpoint of the route's path; 404 for anything else, another tenant's included
    (and a name no checkpoint can have: the lookup is by the exact name a save checked)."""
    service: Service = request.app.state.service
    checkpoint = service.store.checkpoints.get(who.id, run_id, name, kind)
    if checkpoint is None:
        raise NotFoundError(f'{kind} checkpoint {name!r} of run {run_id!r} not found')
    return checkpoint


Owned = Annotated[Checkpoint, Depends(owned_checkpoint)]


def _checkpoint_routes(routes: APIRouter, service: Service) -> None:
    store = service.store
    path = '/api/runs/{run_id}/checkpoints/{kind}/{name}'

    @routes.post(path + '/links')
    async def links(checkpoint: Owned, request: Request) -> JsonObject:
        """Signed links to the checkpoint's weight files (not its optimizer or trainer state)."""
        urls, expires = signed_links(service, checkpoint, request, weight_files(checkpoint))
        return {'urls': urls, 'expires': expires}

    @routes.put(path + '/public')
    async def publish(checkpoint: Owned, public: bool = True) -> JsonObject:
        await asyncio.to_thread(store.checkpoints.set_public, checkpoint.id, public)
        return {'name': checkpoint.name, 'kind': checkpoint.kind, 'public': public}

    @routes.delete(path)
    async def delete(checkpoint: Owned, who: Who) -> JsonObject:
        folder = TINKER_FOLDERS[checkpoint.kind]
        await delete_checkpoint(service, who, checkpoint.run_id, f'{folder}/{checkpoint.name}')
        return {'name': checkpoint.name, 'kind': checkpoint.kind, 'deleted': True}


def admin_overview(service: Service) -> JsonObject:
    """Tenants (names, runs, queued requests) and models (queue, passes, adapters, restarts)."""
    store = service.store
    tenants: list[JsonValue] = []
    for tenant in store.tenants.all():
        _, total = store.runs.page(tenant.id, limit=1)
        tenants.append(
            {
                'name': tenant.name,
                'runs': total,
                'active_runs': store.runs.count('active', tenant_id=tenant.id),
                'queued': service.queued_jobs(tenant.id),
            }
        )
    per_pass = _requests_per_pass(service)
    models: list[JsonValue] = []
    for group in service.groups.values():
        models.append(
            {
                'name': Path(bare(group.name)).name,  # a local model's folder name, not its path
                'queued': sum(s.queued() for s in group.schedulers),
                'adapters_in_memory': len(group.adapters),
                'released_runs': store.runs.count('released', base_model=group.name),
                'restarts': [{'reason': reason, 'at': at} for reason, at in store.history.restarts(group.name)],
            }
        )
    return {'tenants': tenants, 'models': models, 'requests_per_pass': per_pass}


def _requests_per_pass(service: Service) -> JsonObject:
    """Mean requests per pass by operation, from the ``twinkle_pass_jobs`` histogram."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in service.registry.collect():
        if family.name != 'twinkle_pass_jobs':
            continue
        for sample in family.samples:
            operation = sample.labels.get('operation', '')
            if sample.name.endswith('_sum'):
                sums[operation] = sample.value
            elif sample.name.endswith('_count'):
                counts[operation] = sample.value
    return {op: {'passes': counts[op], 'mean': sums.get(op, 0.0) / counts[op]} for op in counts if counts[op]}


def mount_dashboard(app: FastAPI, service: Service) -> None:
    """The dashboard's routes and static files on ``app``."""
    app.include_router(dashboard_router(service))
    app.mount(f'{PREFIX}/static', StaticFiles(directory=STATIC), name='dashboard-static')
