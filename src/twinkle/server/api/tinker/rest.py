"""The Tinker REST API under ``/api/v1``: what the SDK's ``RestClient`` calls to list and manage
training runs, checkpoints and sessions.

A tenant sees its own runs (of both APIs: a native run ``run-...`` is listed beside the Tinker
models ``<session>:train:<n>``), checkpoints and sessions; another tenant's are a 404, exactly like
ones that do not exist. A published checkpoint may be loaded by any tenant through its tinker path
(``weights_info`` answers for it too), but only its owner lists, changes or deletes it. Checkpoints
past their TTL are deleted with their files by :func:`expire_checkpoints_periodically`, within
``tinker.checkpoint_expiry_interval_s`` of their expiry.

Exported weights (``external_weights/<name>``) are listed, deleted, published and given a TTL
like the others; their download links are ``external``'s.

What the SDK can call but this server has no notion of (projects, weight copies, trace exports,
session search) is refused with a 4xx that says so: never a 5xx or an empty 400,
which the SDK retries for minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, JsonValue

from twinkle.errors import ConfigurationError, DataError, NotFoundError, QueueFullError, StateError
from twinkle.server.api import links
from twinkle.server.api.deps import Who
from twinkle.server.api.tinker import external
from twinkle.server.api.tinker.base import JsonObject, TinkerAPI, router
from twinkle.server.execution.groups.model_group import ModelGroup, bare
from twinkle.server.service import Service
from twinkle.server.store import TINKER_FOLDERS, Checkpoint, Run, Session, Store, Tenant, check_name
from twinkle.utils.logger import get_logger

logger = get_logger()
#: A page size or offset: SQLite integers are 64-bit.
Page = Annotated[int, Query(ge=0, lt=2**63)]
#: The SDK asks for its own things ('owned') or everything it may read ('accessible'); other
#: tenants' runs and sessions are never listed, so both mean the tenant's own.
Scope = Annotated[Literal['owned', 'accessible'], Query()]
#: The longest TTL a checkpoint may get (Tinker's own limit for copies): ten years.
MAX_TTL_S = 10 * 365 * 24 * 3600
#: The kind of checkpoint each folder of a checkpoint id names: 'weights' -> 'training'.
KINDS = {folder: kind for kind, folder in TINKER_FOLDERS.items()}
#: Tinker's LoRA switches, as ``weights_info`` reports them.
SWITCHES = ('train_attn', 'train_mlp', 'train_unembed')
#: The scheduler queue of the server's own chores (unloading deleted sampler weights).


class TTLRequest(BaseModel):
    model_config = ConfigDict(extra='forbid')

    #: Seconds from now until the checkpoint is deleted; None keeps it until it is deleted.
    ttl_seconds: int | None = Field(None, gt=0, le=MAX_TTL_S)


class WeightsInfoRequest(BaseModel):
    model_config = ConfigDict(extra='forbid')

    #: ``tinker://<run_id>/weights/<name>`` or ``tinker://<run_id>/sampler_weights/<name>``.
    tinker_path: str


def rest_router(api: TinkerAPI) -> APIRouter:
    """The REST routes of the Tinker API (what the SDK's ``RestClient`` calls)."""
    service, routes = api.service, router(api, _run_routes)
    _checkpoint_routes(routes, service)  # before the catch-all of a checkpoint id that holds a '/'
    links.files_route(routes, service)
    _delete_route(routes, service)
    _session_routes(routes, service)
    _refused_routes(routes, service.store)
    return routes


# ---- training runs --------------------------------------------------------------------------------
def _run_routes(router: APIRouter, api: TinkerAPI) -> None:
    service = api.service
    store: Store = service.store
    targets = {name: _module_targets(group) for name, group in service.groups.items()}

    @router.get('/training_runs')
    async def list_training_runs(
        who: Who, limit: Page = 20, offset: Page = 0, access_scope: Scope = 'owned', project_id: str | None = None
    ) -> JsonObject:
        if project_id is None:
            runs, total = store.runs.page(who.id, limit=limit, offset=offset)
        else:
            matching = _project_runs(store, who, project_id)
            runs, total = matching[offset : offset + limit], len(matching)
        cursor: JsonObject = {'offset': offset, 'limit': limit, 'total_count': total}
        return {'training_runs': [_run_json(store, run, who.name) for run in runs], 'cursor': cursor}

    @router.get('/training_runs/{run_id}')
    async def get_training_run(run_id: str, who: Who, access_scope: Scope = 'owned') -> JsonObject:
        return _run_json(store, _own_run(store, who, run_id), who.name)

    @router.post('/weights_info')
    async def weights_info(body: WeightsInfoRequest, who: Who) -> JsonObject:
        """What loading a checkpoint needs; answered for published checkpoints of others too."""
        checkpoint = api.checkpoint(who, body.tinker_path, kinds=('training', 'sampler'))
        run = store.runs.by_id(checkpoint.run_id)
        if run is None:  # deleted between the two reads
            raise NotFoundError(f'checkpoint {body.tinker_path!r} not found')
        tinker = run.config.get('tinker_lora') or {}
        group = service.find_group(run.base_model)
        derived = _switches(run.config.get('lora') or {}, targets[group.name] if group is not None else {})
        info: JsonObject = {'base_model': bare(run.base_model), 'is_lora': True, 'lora_rank': _lora_rank(run)}
        return {**info, **{name: tinker.get(name, derived.get(name)) for name in SWITCHES}}


def _own_run(store: Store, who: Tenant, run_id: str) -> Run:
    run = store.runs.get(who.id, run_id)
    if run is None or run.status == 'deleted':
        raise NotFoundError(f'training run {run_id!r} not found')
    return run


def _project_runs(store: Store, who: Tenant, project_id: str) -> list[Run]:
    """The tenant's runs made in sessions of ``project_id``, newest first."""
    sessions = {s.id for s in store.sessions.page(who.id, limit=2**62) if s.info.get('project_id') == project_id}
    runs, _ = store.runs.page(who.id, limit=2**62)
    return [run for run in runs if run.session_id in sessions]


def _run_json(store: Store, run: Run, owner: str) -> JsonObject:
    """A ``tinker.types.TrainingRun``: its LoRA rank, last request and latest checkpoints."""
    latest = {c.kind: c for c in store.checkpoints.of_run(run.tenant_id, run.id)}  # oldest first
    return {
        'training_run_id': run.id,
        'base_model': bare(run.base_model),
        'model_owner': owner,
        'is_lora': True,
        'lora_rank': _lora_rank(run),
        'corrupted': False,
        'last_request_time': _iso(run.last_request_at),
        'last_checkpoint': _checkpoint_json(latest['training']) if 'training' in latest else None,
        'last_sampler_checkpoint': _checkpoint_json(latest['sampler']) if 'sampler' in latest else None,
        'user_metadata': _strings(run.config.get('user_metadata')),
    }


def _lora_rank(run: Run) -> int:
    tinker = run.config.get('tinker_lora') or {}
    return int(tinker.get('rank') or (run.config.get('lora') or {}).get('r', 8))  # peft's default rank is 8


def _module_targets(group: ModelGroup) -> dict[str, set[str]]:
    """The linear layers each of Tinker's switches trains, by leaf name."""
    flags = {
        'train_attn': (True, False, False),
        'train_mlp': (False, True, False),
        'train_unembed': (False, False, True),
    }
    return {name: set(group.lora_targets(*flag)) for name, flag in flags.items()}


def _switches(lora: JsonObject, targets: dict[str, set[str]]) -> dict[str, bool]:
    """Tinker's switches of a native run's peft config, where its ``target_modules`` tell them
    (a list of layer names, or 'all-linear', which leaves out the output head); {} otherwise."""
    modules, stacks = lora.get('target_modules'), lora.get('target_parameters')
    if modules == 'all-linear':
        return {'train_attn': True, 'train_mlp': True, 'train_unembed': False}
    if isinstance(modules, list) or (modules is None and stacks):
        names = {module for module in modules or [] if isinstance(module, str)}
        switches = {name: bool(names & layers) for name, layers in targets.items()}
        switches['train_mlp'] = switches['train_mlp'] or bool(stacks)  # expert stacks are the MLP's
        return switches
    return {}


# ---- checkpoints ----------------------------------------------------------------------------------
def _checkpoint_routes(router: APIRouter, service: Service) -> None:
    store: Store = service.store

    @router.get('/training_runs/{run_id}/checkpoints')
    async def list_checkpoints(run_id: str, who: Who) -> JsonObject:
        _own_run(store, who, run_id)
        return {'checkpoints': [_checkpoint_json(c) for c in store.checkpoints.of_run(who.id, run_id)]}

    @router.get('/checkpoints')
    async def list_user_checkpoints(who: Who, limit: Page = 100, offset: Page = 0) -> JsonObject:
        checkpoints, total = store.checkpoints.page(who.id, limit=limit, offset=offset)
        cursor: JsonObject = {'offset': offset, 'limit': limit, 'total_count': total}
        return {'checkpoints': [_checkpoint_json(c) for c in checkpoints], 'cursor': cursor}

    @router.post('/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish')
    async def publish(run_id: str, checkpoint_id: str, who: Who) -> JsonObject:
        checkpoint = _own_checkpoint(store, who, run_id, checkpoint_id)
        await asyncio.to_thread(store.checkpoints.set_public, checkpoint.id, True)
        return {'tinker_path': checkpoint.tinker_path, 'public': True}

    @router.delete('/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish')
    async def unpublish(run_id: str, checkpoint_id: str, who: Who) -> JsonObject:
        if '/' not in checkpoint_id:  # DELETE .../weights/publish: the checkpoint named 'publish'
            return await delete_checkpoint(service, who, run_id, f'{checkpoint_id}/publish')
        checkpoint = _own_checkpoint(store, who, run_id, checkpoint_id)
        await asyncio.to_thread(store.checkpoints.set_public, checkpoint.id, False)
        return {'tinker_path': checkpoint.tinker_path, 'public': False}

    @router.put('/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl')
    async def set_ttl(run_id: str, checkpoint_id: str, body: TTLRequest, who: Who) -> JsonObject:
        checkpoint = _own_checkpoint(store, who, run_id, checkpoint_id)
        expires_at = None if body.ttl_seconds is None else time.time() + body.ttl_seconds
        await asyncio.to_thread(store.checkpoints.set_expiry, checkpoint.id, expires_at)
        return {'tinker_path': checkpoint.tinker_path, 'expires_at': _iso(expires_at)}

    @router.get('/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls')
    async def external_weights_urls(run_id: str, checkpoint_id: str, who: Who, request: Request) -> JsonObject:
        checkpoint = _own_checkpoint(store, who, run_id, checkpoint_id)
        return external.links_json(service, checkpoint, request)


def _delete_route(router: APIRouter, service: Service) -> None:
    @router.delete('/training_runs/{run_id}/checkpoints/{checkpoint_id:path}')
    async def delete(run_id: str, checkpoint_id: str, who: Who) -> JsonObject:
        return await delete_checkpoint(service, who, run_id, checkpoint_id)


async def delete_checkpoint(service: Service, who: Tenant, run_id: str, checkpoint_id: str) -> JsonObject:
    """Forget the tenant's checkpoint and remove its files."""
    checkpoint = _own_checkpoint(service.store, who, run_id, checkpoint_id)
    await asyncio.to_thread(service.store.checkpoints.delete, who.id, run_id, checkpoint.name, checkpoint.kind)
    await asyncio.to_thread(discard_files, service, [checkpoint])
    return {'tinker_path': checkpoint.tinker_path, 'deleted': True}


def _own_checkpoint(store: Store, who: Tenant, run_id: str, checkpoint_id: str) -> Checkpoint:
    """The tenant's checkpoint ``weights/<name>`` or ``sampler_weights/<name>`` of its run; 404 if
    either is not the tenant's, 400 for a malformed id."""
    _own_run(store, who, run_id)
    folder, _, name = checkpoint_id.partition('/')
    try:
        kind = KINDS[folder]
        check_name('checkpoint', name)
    except (KeyError, DataError):
        raise DataError(
            f'Invalid checkpoint id {checkpoint_id!r}: expected weights/<name>, sampler_weights/<name> or '
            'external_weights/<name>, where '
            'name is 1 to 64 of A-Z, a-z, 0-9, ".", "_", "-" starting with a letter or digit',
        ) from None
    checkpoint = store.checkpoints.get(who.id, run_id, name, kind)
    if checkpoint is None:
        raise NotFoundError(f'checkpoint {checkpoint_id!r} of training run {run_id!r} not found')
    return checkpoint


def _checkpoint_json(checkpoint: Checkpoint) -> JsonObject:
    """A ``tinker.types.Checkpoint`` (its server path stays on the server)."""
    return {
        'checkpoint_id': checkpoint.checkpoint_id,
        'checkpoint_type': checkpoint.kind,
        'training_run_id': checkpoint.run_id,
        'time': _iso(checkpoint.created_at),
        'tinker_path': checkpoint.tinker_path,
        'size_bytes': checkpoint.size_bytes,
        'public': checkpoint.public,
        'expires_at': _iso(checkpoint.expires_at),
    }


# ---- expiry ---------------------------------------------------------------------------------------
def discard_files(service: Service, checkpoints: list[Checkpoint]) -> None:
    """Remove the files of checkpoints already forgotten by the store, and have the worker thread
    unload their weights where sampling loaded them (no sampling job can be using them there)."""
    paths = [Path(c.path) for c in checkpoints]
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    if not paths:
        return

    for group in service.groups.values():  # any model may have loaded them for sampling
        try:
            group.unload_saved_weights(paths)
        except (QueueFullError, StateError) as e:  # stopping, or flooded: saving there again unloads them
            logger.warning(f'deleted checkpoints stay loaded for sampling until evicted: {e}')


def expire_checkpoints(service: Service) -> list[Checkpoint]:
    """Delete every checkpoint past its TTL, files included; the deleted ones."""
    expired = service.store.checkpoints.pop_expired()
    discard_files(service, expired)
    return expired


async def expire_checkpoints_periodically(service: Service) -> None:
    """Enforce checkpoint TTLs every ``tinker.checkpoint_expiry_interval_s`` seconds (and at start,
    for those that expired while the server was down)."""
    while True:
        try:
            expired = await asyncio.to_thread(expire_checkpoints, service)
        except Exception:  # a failed sweep must not end TTL enforcement
            logger.exception('deleting expired checkpoints failed; trying again at the next sweep')
        else:
            if expired:
                logger.info(f'deleted {len(expired)} expired checkpoints: {[c.tinker_path for c in expired]}')
        await asyncio.sleep(service.config.tinker.checkpoint_expiry_interval_s)


# ---- sessions -------------------------------------------------------------------------------------
def _session_routes(router: APIRouter, service: Service) -> None:
    store: Store = service.store

    @router.get('/sessions')
    async def list_sessions(who: Who, limit: Page = 20, offset: Page = 0, access_scope: Scope = 'owned') -> JsonObject:
        return {'sessions': [s.id for s in store.sessions.page(who.id, limit=limit, offset=offset)]}

    @router.get('/sessions/{session_id}')
    async def get_session(session_id: str, who: Who, access_scope: Scope = 'owned') -> JsonObject:
        session = _own_session(store, who, session_id)
        runs: list[JsonValue] = [
            r for r in store.sessions.runs(who.id, session_id) if _own_run_or_none(store, who, r) is not None
        ]
        samplers: list[JsonValue] = [*store.sessions.samplers(who.id, session_id)]
        return {
            'training_run_ids': runs,
            'sampler_ids': samplers,
            'user_metadata': _strings(session.info.get('user_metadata')),
            'display_name': session.info.get('display_name'),
        }


def _own_session(store: Store, who: Tenant, session_id: str) -> Session:
    session = store.sessions.get(who.id, session_id)
    if session is None:
        raise NotFoundError(f'session {session_id!r} not found')
    return session


def _own_run_or_none(store: Store, who: Tenant, run_id: str) -> Run | None:
    with contextlib.suppress(NotFoundError):
        return _own_run(store, who, run_id)
    return None


# ---- what this server has no notion of ------------------------------------------------------------
# These routes answer the SDK's calls with a 400 that says what to do instead; the schema leaves them
# out, as it declares what the server serves.
def _refused_routes(router: APIRouter, store: Store) -> None:
    @router.post('/copy_weights', include_in_schema=False)
    async def copy_weights(who: Who) -> None:
        raise ConfigurationError(
            'copy_weights is not supported: this server has no projects. Load the checkpoint into a new '
            'training run with create_training_client_from_state (another tenant can once it is published)',
        )

    @router.put('/sessions/{session_id}/project', include_in_schema=False)
    async def assign_project(session_id: str, who: Who) -> None:
        _own_session(store, who, session_id)
        raise ConfigurationError('assign_session_project is not supported: this server has no projects')

    @router.post('/sessions/search', include_in_schema=False)
    async def search_sessions(who: Who) -> None:
        raise ConfigurationError('search_sessions is not supported by this server: use list_sessions and get_session')


# ---- helpers --------------------------------------------------------------------------------------
def _iso(timestamp: float | None) -> str | None:
    """Unix seconds as an ISO 8601 time in UTC, as the SDK's datetime fields take it."""
    return None if timestamp is None else datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


def _strings(metadata: JsonObject | None) -> JsonObject | None:
    """User metadata as the SDK's ``dict[str, str]``: other values as JSON."""
    if not metadata:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


__all__ = ['discard_files', 'expire_checkpoints', 'expire_checkpoints_periodically', 'rest_router']
