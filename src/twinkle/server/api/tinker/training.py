"""The Tinker training routes: what a ``TrainingClient`` calls to create a LoRA model, run
``forward_backward`` and ``optim_step``, save and load its weights, and unload it.

Each compute request is accepted at once as a future and runs in its model's ``seq_id`` order
(see :mod:`.api`); what a request does to the model is in :mod:`.train`. A request the model
refuses fails its future (``{error, category}``), so its number is still consumed.

A ``stable_reinforce`` datum's provenance spans are checked against the recorded sampled
sequences before the request is accepted (:mod:`.provenance`); a bad one is a 400 that still
consumes the request's number.

``save_weights_for_sampler`` with ``kind='inflight'`` saves the model's inflight sampler weights
(``sampler_weights/inflight``, each such save replacing the last) and gives a sampling session
that names them: every inflight sampling client of the model samples the latest ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Request
from pydantic import JsonValue
from tinker import types

from twinkle.errors import ConfigurationError, DataError, NotFoundError, TwinkleError
from twinkle.server.api.deps import Who
from twinkle.server.api.tinker import external, provenance
from twinkle.server.api.tinker.base import PROTO, JsonObject, TinkerAPI, proto_result, router
from twinkle.server.execution.groups.model_group import ModelGroup, bare
from twinkle.server.execution.tinker import codec
from twinkle.server.execution.tinker.compute import check_adam, lora_config
from twinkle.server.metering import Meter
from twinkle.server.service import Service
from twinkle.server.store import Checkpoint, Run, Tenant, check_checkpoint_name

#: ``forward_backward`` takes a protobuf ``ForwardBackwardRequest`` (FastAPI cannot declare it).
PROTOBUF_BODY = {
    'requestBody': {
        'required': True,
        'description': 'A ForwardBackwardRequest of the tinker_public protobuf package, optionally zstd-compressed',
        'content': {PROTO: {'schema': {'type': 'string', 'format': 'binary'}}},
    }
}
#: The sampler weights an inflight save replaces: one mutable target per training model.
INFLIGHT = 'inflight'
#: The optimizer a new model starts with; each ``optim_step`` then sets its hyperparameters.
ADAMW: JsonObject = {'optimizer_cls': 'AdamW', 'lr': 1e-4, 'betas': [0.9, 0.95]}


def training_router(api: TinkerAPI) -> APIRouter:
    """The routes of a Tinker training client."""
    return router(api, _model_routes, _step_routes, _checkpoint_routes)


# ---- models ---------------------------------------------------------------------------------------
def _model_routes(routes: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @routes.post('/create_model')
    async def create_model(body: types.CreateModelRequest, who: Who) -> JsonObject:
        api.live_session(who, body.session_id)
        group = api.model_group(body.base_model)
        if body.lora_config is None:
            raise ConfigurationError('this server trains LoRA adapters only: send a lora_config')
        _check_optimizer(body.optimizer_config)
        model_id = f'{body.session_id}:train:{body.model_seq_id}'
        lora = lora_config(group, body.lora_config, api.settings.lora_alpha)
        group.check_lora(lora)
        loras = (lora, body.lora_config.model_dump(mode='json'))
        request_id = await _create_run(api, who, model_id, group, loras, body.session_id, body.user_metadata)
        return {'request_id': request_id, 'model_id': model_id}

    @routes.post('/unload_model')
    async def unload_model(body: types.UnloadModelRequest, who: Who) -> JsonObject:
        """The client is done with the model (SDKs up to 0.24 call it): as a native run's delete, its
        adapter and the state the server kept of it go, its checkpoints stay (its sampler weights
        sample on, its training ones load into a new model). It runs after the requests the model
        started before; any still waiting for their seq_id turn fail, and later ones are a 404."""
        run = api.run_of(who, body.model_id)
        group = service.group_of(run)

        def unload() -> JsonObject:
            api.run_of(who, run.id)  # a 404 if an unload before this one deleted it
            group.delete_run(run)
            api.state.sequencer.drop(run.id, f'NotFoundError: model {run.id!r} was unloaded before this request ran')
            return {'model_id': run.id, 'type': 'unload_model'}

        unloading = Meter(session_id=run.session_id)
        request_id = await api.accept(who, group, run.id, None, 'unload_model', unload, meter=unloading)
        return {'request_id': request_id, 'model_id': run.id}

    @routes.post('/get_info')
    async def get_info(body: types.GetInfoRequest, who: Who) -> JsonObject:
        run = api.run_of(who, body.model_id)
        group, name = service.group_of(run), bare(run.base_model)
        return {
            'type': 'get_info',
            'model_id': run.id,
            'model_data': {'arch': group.architecture, 'model_name': name, 'tokenizer_id': group.model_id},
            'is_lora': True,
            'lora_rank': run.config.get('lora', {}).get('r'),
            'model_name': name,
        }


async def _create_run(
    api: TinkerAPI,
    who: Tenant,
    model_id: str,
    group: ModelGroup,
    loras: tuple[JsonObject, JsonObject],
    session_id: str,
    metadata: dict[str, JsonValue] | None,
    then: Callable[[Run], JsonObject] | None = None,
) -> str:
    """Create the run ``model_id`` (seq 0 of its model) with a LoRA adapter (``loras``: its peft
    config and the Tinker config it came from) and AdamW; ``then``
    runs on the new adapter (loading a checkpoint) and gives the result.

    A request refused (a full queue, a quota) leaves nothing: its run is not made, or is removed
    before the refusal is answered, so the SDK's retry of the same ``model_seq_id`` is a new
    request. A retry of one accepted gets the first request's id, after a restart too."""
    service, requests = api.service, api.state.requests
    key = (who.id, model_id, 0)
    if key in requests:
        return requests[key]
    lora, tinker_lora = loras
    setup: JsonObject = {'operation': 'set_optimizer', 'kwargs': ADAMW}
    config: JsonObject = {
        'api': 'tinker', 'lora': lora, 'tinker_lora': tinker_lora, 'setup': [setup], 'user_metadata': metadata or {}
    }  # fmt: skip
    service.ledger.admit_run(who)  # a 403 past the tenant's runs quota
    api.check_room(who, group)  # a 429 before the run is made; accept checks again, after the await
    try:
        run = await asyncio.to_thread(
            service.store.runs.create, who.id, group.name, 'default', config, run_id=model_id, session_id=session_id
        )
    except TwinkleError as e:
        first = await asyncio.to_thread(service.store.futures.first_of, who.id, model_id, 'create_model')
        if first is not None:  # a retry of a request accepted before (the in-memory map forgot it)
            return first.id
        raise DataError(f'model {model_id!r} cannot be created: {e}') from None  # a 400: the SDK retries a 409

    def create() -> JsonObject:
        seed = tinker_lora.get('seed')
        try:
            seed = seed if isinstance(seed, int) else None
            group.add_run(run, lora, seed=seed, setup=[('set_optimizer', dict(ADAMW))])
            created: JsonObject = {'model_id': model_id, 'type': 'create_model'}
            return then(run) if then is not None else created
        except BaseException:
            group.remove_run(run)
            service.store.runs.set_status(run.id, 'deleted')
            raise

    try:
        return await api.accept(who, group, model_id, 0, 'create_model', create, meter=Meter(session_id=session_id))
    except Exception:  # refused before it was accepted: the run goes (with a future, if one was recorded)
        requests.pop(key, None)
        await asyncio.to_thread(service.store.runs.forget, who.id, model_id)
        raise


def _check_optimizer(config: types.OptimizerConfig | None) -> None:
    if config is not None and getattr(config, 'type', 'adamw') != 'adamw':
        raise ConfigurationError(f'optimizer {config.type!r} is not supported; this server runs adamw')


# ---- forward, backward and step -------------------------------------------------------------------
def _step_routes(routes: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @routes.post('/forward_backward', openapi_extra=PROTOBUF_BODY)
    async def forward_backward(request: Request, who: Who) -> JsonObject:
        try:
            call = codec.parse_forward_backward(await request.body(), request.headers.get('content-encoding'))
        except DataError as e:
            raise DataError(f'malformed ForwardBackwardRequest: {e}') from None
        if call.seq_id <= 0:
            raise DataError(f'forward_backward needs a seq_id >= 1 (the model is seq 0); got {call.seq_id}')
        run = api.run_of(who, call.model_id)
        group = service.group_of(run)
        try:
            await asyncio.to_thread(group.check_images, codec.datum_images(call))  # as the native rows' images
            call = await asyncio.to_thread(provenance.checked_call, service.store, who, run, call)
        except DataError:
            api.state.sequencer.skip(run.id, call.seq_id)  # refused before it was accepted: its turn passes
            raise

        def compute() -> dict[str, str]:
            return proto_result(group.tinker_forward_backward(run, call))

        operation = 'forward' if call.forward_only else 'forward_backward'
        batch = api.mixable(group, run, call)
        meter = Meter(training_tokens=sum(len(datum.tokens) for datum in call.data), session_id=run.session_id)
        request_id = await api.accept(who, group, run.id, call.seq_id, operation, compute, batch, meter)
        return {'request_id': request_id, 'model_id': run.id}

    @routes.post('/optim_step')
    async def step(body: types.OptimStepRequest, who: Who) -> JsonObject:
        run = api.run_of(who, body.model_id)
        params = body.optim_params
        if not isinstance(params, types.AdamParams):
            raise ConfigurationError(f'optimizer {params.type!r} is not supported; this server runs adamw')
        check_adam(params)  # lr=-1 or beta1=1: a 400 now, as the native set_optimizer, not a failed future

        group = service.group_of(run)

        def compute() -> JsonObject:
            return group.tinker_optim_step(run, params)

        batch = group.tinker_steppable(run, params)
        meter = Meter(session_id=run.session_id)
        request_id = await api.accept(who, group, run.id, body.seq_id, 'optim_step', compute, batch, meter)
        return {'request_id': request_id, 'model_id': run.id}


# ---- saving and loading ---------------------------------------------------------------------------
def _checkpoint_routes(routes: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @routes.post('/save_weights')
    async def save_weights(body: types.SaveWeightsRequest, who: Who) -> JsonObject:
        run = api.run_of(who, body.model_id)
        name = _checkpoint_name(body.path, body.seq_id)
        expires = _expiry(body.ttl_seconds)

        def save() -> JsonObject:
            if not body.overwrite and service.store.checkpoints.get(who.id, run.id, name) is not None:
                raise ConfigurationError(f'checkpoint weights/{name} exists; save with overwrite=True to replace it')

            def answer(checkpoint: Checkpoint) -> JsonObject:
                return {'path': checkpoint.tinker_path, 'type': 'save_weights'}

            return _save(service, run, name, 'training', expires, answer)

        saved, group = Meter(checkpoints=1, session_id=run.session_id), service.group_of(run)
        request_id = await api.accept(who, group, run.id, body.seq_id, 'save_weights', save, meter=saved)
        return {'request_id': request_id, 'model_id': run.id}

    @routes.post('/save_weights_external')
    async def save_weights_external(body: types.SaveWeightsExternalRequest, who: Who) -> JsonObject:
        run = api.run_of(who, body.model_id)
        name = _checkpoint_name(body.path, body.seq_id)
        expires = _expiry(body.ttl_seconds)
        recipients = external.age_recipients(body.age_encryption_recipients or [])

        def save() -> JsonObject:
            def answer(checkpoint: Checkpoint) -> JsonObject:
                size = checkpoint.size_bytes
                return {'path': checkpoint.tinker_path, 'size_bytes': size, 'type': 'save_weights_external'}

            return external.export_weights(service, run, name, expires, recipients, answer)

        group = service.group_of(run)
        saved = Meter(checkpoints=1, session_id=run.session_id)
        request_id = await api.accept(who, group, run.id, body.seq_id, 'save_weights_external', save, meter=saved)
        return {'request_id': request_id, 'model_id': run.id}

    @routes.post('/save_weights_for_sampler')
    async def save_for_sampler(body: types.SaveWeightsForSamplerRequest, who: Who) -> JsonObject:
        run = api.run_of(who, body.model_id)
        named = body.path is not None
        if named and (body.kind == 'inflight' or body.path == INFLIGHT):
            raise DataError(
                f"sampler weights named {INFLIGHT!r} are the model's inflight ones: save them with kind='inflight' "
                'and no path, and name other sampler weights otherwise'
            )
        if body.kind == 'inflight':
            name = INFLIGHT
        else:
            name = _checkpoint_name(body.path, body.seq_id) if named else f'sampler-{body.sampling_session_seq_id}'
        expires = _expiry(body.ttl_seconds)

        def save() -> JsonObject:
            if not named and run.session_id is None:
                raise DataError(f'run {run.id!r} was made by the native API: save its sampler weights by name')

            def answer(checkpoint: Checkpoint) -> JsonObject:  # one commit with the checkpoint's row
                result: JsonObject = {'path': checkpoint.tinker_path, 'type': 'save_weights_for_sampler'}
                if not named and run.session_id is not None:
                    sampling_id = f'{run.session_id}:sample:{body.sampling_session_seq_id}'
                    service.store.sessions.create_sampler(
                        who.id, sampling_id, run.session_id, run.base_model, checkpoint.tinker_path
                    )
                    result['sampling_session_id'] = sampling_id
                return result

            return _save(service, run, name, 'sampler', expires, answer)

        group = service.group_of(run)
        saved = Meter(checkpoints=1, session_id=run.session_id)
        request_id = await api.accept(who, group, run.id, body.seq_id, 'save_weights_for_sampler', save, meter=saved)
        return {'request_id': request_id, 'model_id': run.id}

    @routes.post('/load_weights')
    async def load_weights(body: types.LoadWeightsRequest, who: Who) -> JsonObject:
        checkpoint = api.checkpoint(who, body.path, kinds=('training',))
        if body.model_id is None:
            return await _create_from_checkpoint(api, who, body, checkpoint)
        run = api.run_of(who, body.model_id)
        group = service.group_of(run)
        service.check_trained_on(checkpoint, group, body.path)

        def load() -> JsonObject:
            now = api.checkpoint(who, body.path, kinds=('training',))  # a save may have replaced it since
            group.load(run, Path(now.path), body.optimizer, body.path)
            return {'path': body.path, 'model_id': run.id, 'type': 'load_weights'}

        loading = Meter(session_id=run.session_id)
        request_id = await api.accept(who, group, run.id, body.seq_id, 'load_weights', load, meter=loading)
        return {'request_id': request_id, 'model_id': run.id}


async def _create_from_checkpoint(
    api: TinkerAPI, who: Tenant, body: types.LoadWeightsRequest, checkpoint: Checkpoint
) -> JsonObject:
    """A new model from a training checkpoint: its source run's LoRA config, its weights, and
    with ``optimizer`` its AdamW state."""
    if body.session_id is None or body.model_seq_id is None:
        raise DataError('load_weights needs a model_id, or a session_id and model_seq_id to create one')
    api.live_session(who, body.session_id)
    _check_optimizer(body.optimizer_config)
    source = api.service.store.runs.by_id(checkpoint.run_id)
    if source is None:  # deleted between the two reads
        raise NotFoundError(f'checkpoint {body.path!r} not found')
    group = api.model_group(bare(source.base_model) if body.base_model is None else body.base_model)
    api.service.check_trained_on(checkpoint, group, body.path)
    model_id = f'{body.session_id}:train:{body.model_seq_id}'
    lora = source.config['lora']
    tinker_lora = source.config.get('tinker_lora') or {'rank': lora.get('r')}  # a native run's: its rank

    def load(run: Run) -> JsonObject:
        now = api.checkpoint(who, body.path, kinds=('training',))  # a save may have replaced it since
        group.load(run, Path(now.path), body.optimizer, body.path)
        return {'path': body.path, 'model_id': model_id, 'type': 'load_weights'}

    loras = (lora, tinker_lora)
    request_id = await _create_run(api, who, model_id, group, loras, body.session_id, body.user_metadata, load)
    return {'request_id': request_id, 'model_id': model_id}


def _save(
    service: Service,
    run: Run,
    name: str,
    kind: str,
    expires_at: float | None,
    answer: Callable[[Checkpoint], JsonObject],
) -> JsonObject:
    """Save the run's adapter (with the optimizer for training checkpoints) as checkpoint ``name``:
    its row and the request's answer are one commit (``ModelGroup.record_checkpoint``)."""
    group = service.group_of(run)
    return group.save_checkpoint(run, kind, name, answer, save_optimizer=kind == 'training', expires_at=expires_at)


def _checkpoint_name(path: str | None, seq_id: int | None) -> str:
    name = path if path is not None else f'step-{seq_id if seq_id is not None else int(time.time())}'
    return check_checkpoint_name(name)  # a DataError (400) naming what a name may hold


def _expiry(ttl_seconds: int | None) -> float | None:
    if ttl_seconds is None:
        return None
    if ttl_seconds <= 0:
        raise DataError(f'ttl_seconds must be positive; got {ttl_seconds}')
    return time.time() + ttl_seconds


__all__ = ['training_router']
