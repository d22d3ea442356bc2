"""The Tinker API under ``/api/v1``: what the official ``tinker`` SDK calls to train, sample and
manage checkpoints (the wire protocol is in the project's reference notes).

Requests are parsed with the SDK's own request types (strict: unknown fields are a 422), and
every compute request is accepted at once as a future that ``retrieve_future`` long-polls.
A training client's requests run in ``seq_id`` order (:mod:`.sequencer`); a retried
``(model_id, seq_id)`` gets the request id it got the first time. Request failures are told as
``{error, category}`` futures, not HTTP errors, so that a rejected request still consumes its
number. A Tinker model is a run of the native API (``model_id`` is its run id) and a Tinker key
is a tenant's key, so a tenant sees the runs of both APIs together.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pydantic
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from tinker import types

from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError, DataError
from twinkle.server.deps import Who
from twinkle.server.scheduler import Batchable, QueueFullError, wait_job
from twinkle.server.store import Tenant, check_checkpoint_name, parse_checkpoint_path
from twinkle.server.tinker import codec
from twinkle.server.tinker.codec import ForwardBackwardCall
from twinkle.server.tinker.train import lora_config, optim_step, run_forward_backward, run_forward_backward_many

PREFIX = '/api/v1'
PROTO = 'application/x-protobuf'
#: A future result that is protobuf bytes is stored as ``{PROTO_KEY: base64}``.
PROTO_KEY = 'protobuf_base64'
Body = TypeVar('Body', bound=pydantic.BaseModel)
#: Request ids kept for answering retries of (model, seq_id); a retry comes within seconds.
REMEMBERED_REQUESTS = 100_000


class TinkerAPI:
    """What the Tinker routes share beside the service: request ordering and request ids."""

    def __init__(self, service: Any):
        self.service = service
        self.settings, self.sequencer, self.requests = (
            service.tinker.settings,
            service.tinker.sequencer,
            service.tinker.requests,
        )

    # ---- requests -------------------------------------------------------------------------------
    async def accept(
        self,
        who: Tenant,
        run_id: str | None,
        seq_id: int | None,
        operation: str,
        fn: Callable[[], Any],
        batch: Batchable | None = None,
    ) -> str:
        """Record a future for ``fn`` and start it in its model's turn; the future's id. With
        ``batch`` it may share a pass with other tenants' requests."""
        key = (who.id, run_id or '', seq_id) if seq_id is not None else None
        if key in self.requests:
            return self.requests[key]  # a retry of a request already accepted
        service = self.service
        limit = service.config.limits.max_queued_per_tenant
        if service.scheduler.queued(who.id) >= limit:
            raise QueueFullError(who.name, limit, retry_after_s=2.0)
        if run_id is not None:
            await asyncio.to_thread(service.touch, run_id)  # an active run is not idle
        record = await asyncio.to_thread(service.store.create_future, who.id, run_id, operation)
        if key is not None:
            self.requests[key] = record.id
            if len(self.requests) > REMEMBERED_REQUESTS:
                self.requests.popitem(last=False)

        def start() -> None:
            with contextlib.suppress(QueueFullError):  # enqueue failed the future with the reason
                service.enqueue(who, record.id, operation, fn, batch)

        def fail(message: str) -> None:
            service.store.fail_future(record.id, message, 'user')

        if run_id is None:
            start()  # sampling: no model order to keep
        else:
            self.sequencer.add(run_id, seq_id, start, fail)
        return record.id

    def mixable(self, run: Any, call: ForwardBackwardCall) -> Batchable | None:
        """How a ``forward_backward`` (or ``forward``) call can share a pass with other models'."""
        service = self.service
        if not service.config.mixed_batches:
            return None

        def run_many(payloads: list[tuple[Any, ForwardBackwardCall]]) -> list[dict[str, str] | Exception]:
            requests = [(service.loaded(run), call) for run, call in payloads]
            outputs = service.host.call(run_forward_backward_many, requests)
            return [o if isinstance(o, Exception) else {PROTO_KEY: base64.b64encode(o).decode()} for o in outputs]

        tokens = sum(len(datum.tokens) for datum in call.data)
        return Batchable(('tinker', call.forward_only), tokens, (run, call), run_many)

    def run_of(self, who: Tenant, model_id: str) -> Any:
        run = self.service.store.get_run(who.id, model_id)
        if run is None or run.status == 'deleted':
            raise HTTPException(404, f'model {model_id!r} not found')
        return run

    def session_of(self, who: Tenant, session_id: str) -> Any:
        session = self.service.store.get_session(who.id, session_id)
        if session is None:
            raise HTTPException(404, f'session {session_id!r} not found')
        return session

    def base_model(self, name: str | None) -> str:
        """The hosted base model if ``name`` names it (its id, with or without ``ms://`` or
        ``hf://``, or its local path); 404 otherwise."""
        hosted = self.service.config.base_model
        names = {hosted, _bare(hosted), self.service.host.model_id}
        if name not in names:
            raise HTTPException(404, f'base model {name!r} is not served here; this server hosts {_bare(hosted)!r}')
        return hosted

    def checkpoint(self, who: Tenant, path: str, kinds: tuple[str, ...]) -> Any:
        """The checkpoint a ``tinker://`` path names, if this tenant may read it; else 404."""
        try:
            run_id, kind, name = parse_checkpoint_path(path)
        except DataError as e:
            raise HTTPException(400, str(e)) from None
        found = self.service.store.get_readable_checkpoint(who.id, run_id, name, kind)
        if found is None or kind not in kinds:
            raise HTTPException(404, f'checkpoint {path!r} not found')
        return found


def tinker_router(service: Any) -> APIRouter:
    """The routes of the Tinker API, over ``service`` (see ``twinkle.server.app``)."""
    api = TinkerAPI(service)
    router = APIRouter(prefix=PREFIX)
    _session_routes(router, api)
    _training_routes(router, api)
    _checkpoint_routes(router, api)
    _sampling_routes(router, api)
    _future_routes(router, api)
    return router


# ---- sessions and configuration -------------------------------------------------------------------
def _session_routes(router: APIRouter, api: TinkerAPI) -> None:
    store = api.service.store

    @router.post('/client/config')
    async def client_config(who: Who) -> dict[str, Any]:
        return {
            'pjwt_auth_enabled': False,
            'use_pyqwest_transport': False,
            'parallel_fwdbwd_chunks': True,
            'proto_compress_fwdbwd': False,
            'fwdbwd_max_chunk_len': api.settings.fwdbwd_max_chunk_len,
        }

    @router.get('/healthz')
    async def healthz() -> dict[str, str]:
        return {'status': 'ok'}

    @router.get('/get_server_capabilities')
    async def capabilities(who: Who) -> dict[str, Any]:
        host = api.service.host
        model = {'model_name': _bare(api.service.config.base_model), 'trainable': True, 'sampleable': True}
        return {'supported_models': [{**model, 'max_context_length': host.context}]}

    @router.post('/create_session')
    async def create_session(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.CreateSessionRequest)
        info = body.model_dump(mode='json', exclude={'type'})
        session = await asyncio.to_thread(store.create_session, who.id, info)
        return {'type': 'create_session', 'session_id': session.id}

    @router.post('/session_heartbeat')
    async def heartbeat(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.SessionHeartbeatRequest)
        session = api.session_of(who, body.session_id)
        if session.status != 'active':
            raise HTTPException(410, f'session {body.session_id!r} is finished')
        await asyncio.to_thread(store.heartbeat, session.id)
        return {'type': 'session_heartbeat'}

    @router.post('/sessions/{session_id}/finish')
    async def finish(session_id: str, who: Who) -> dict[str, Any]:
        api.session_of(who, session_id)
        await asyncio.to_thread(store.finish_session, session_id)
        return {'session_id': session_id, 'status': 'finished'}

    @router.post('/telemetry')
    async def telemetry(who: Who) -> dict[str, str]:
        return {'status': 'accepted'}  # the server keeps its own metrics (/metrics)


# ---- training -------------------------------------------------------------------------------------
def _training_routes(router: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @router.post('/create_model')
    async def create_model(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.CreateModelRequest)
        api.session_of(who, body.session_id)
        base = api.base_model(body.base_model)
        if body.lora_config is None:
            raise HTTPException(400, 'this server trains LoRA adapters only: send a lora_config')
        _check_optimizer(body.optimizer_config)
        model_id = f'{body.session_id}:train:{body.model_seq_id}'
        lora = _http(lora_config, service.host, body.lora_config, api.settings.lora_alpha)
        _http(service.host.check_adapter, lora)
        config = {'api': 'tinker', 'lora': lora, 'tinker_lora': body.lora_config.model_dump(), 'setup': []}
        request_id = await _create_run(api, who, model_id, base, config, body.session_id, body.user_metadata)
        return {'request_id': request_id, 'model_id': model_id}

    @router.post('/get_info')
    async def get_info(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.GetInfoRequest)
        run = api.run_of(who, body.model_id)
        host, name = service.host, _bare(run.base_model)
        arch = host.architecture
        return {
            'type': 'get_info',
            'model_id': run.id,
            'model_data': {'arch': arch, 'model_name': name, 'tokenizer_id': host.model_id},
            'is_lora': True,
            'lora_rank': run.config.get('lora', {}).get('r'),
            'model_name': name,
        }

    @router.post('/forward_backward')
    async def forward_backward(request: Request, who: Who) -> dict[str, Any]:
        try:
            call = codec.parse_forward_backward(await request.body(), request.headers.get('content-encoding'))
        except DataError as e:
            raise HTTPException(400, f'malformed ForwardBackwardRequest: {e}') from None
        if call.seq_id <= 0:
            raise HTTPException(400, f'forward_backward needs a seq_id >= 1 (the model is seq 0); got {call.seq_id}')
        run = api.run_of(who, call.model_id)

        def compute() -> dict[str, str]:
            output = service.host.call(run_forward_backward, service.loaded(run), call)
            return {PROTO_KEY: base64.b64encode(output).decode()}

        operation = 'forward' if call.forward_only else 'forward_backward'
        request_id = await api.accept(who, run.id, call.seq_id, operation, compute, api.mixable(run, call))
        return {'request_id': request_id, 'model_id': run.id}

    @router.post('/optim_step')
    async def step(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.OptimStepRequest)
        run = api.run_of(who, body.model_id)
        if not isinstance(body.optim_params, types.AdamParams):
            raise HTTPException(400, f'optimizer {body.optim_params.type!r} is not supported; this server runs adamw')
        params = body.optim_params
        request_id = await api.accept(
            who, run.id, body.seq_id, 'optim_step', lambda: service.host.call(optim_step, service.loaded(run), params)
        )
        return {'request_id': request_id, 'model_id': run.id}


async def _create_run(
    api: TinkerAPI,
    who: Tenant,
    model_id: str,
    base: str,
    config: dict[str, Any],
    session_id: str,
    metadata: dict[str, Any] | None,
    then: Callable[[str], dict[str, Any]] | None = None,
) -> str:
    """Create the run ``model_id`` (seq 0 of its model) with a LoRA adapter and AdamW; ``then``
    runs on the new adapter (loading a checkpoint) and gives the result. A retry gets the first
    request's id."""
    service = api.service
    if (who.id, model_id, 0) in api.requests:
        return api.requests[(who.id, model_id, 0)]
    optimizer = {'operation': 'set_optimizer', 'kwargs': {'optimizer_cls': 'AdamW', 'lr': 1e-4, 'betas': [0.9, 0.95]}}
    config = {**config, 'setup': [optimizer], 'user_metadata': metadata or {}}
    try:
        run = await asyncio.to_thread(
            service.store.create_run, who.id, base, 'default', config, run_id=model_id, session_id=session_id
        )
    except Exception as e:
        raise HTTPException(400, f'model {model_id!r} cannot be created: {e}') from None

    def create() -> dict[str, Any]:
        adapter = service.adapter_name(run)
        try:
            service.host.add_adapter(adapter, config['lora'], 1, config['tinker_lora'].get('seed'))
            service.host.run(adapter, 'set_optimizer', dict(optimizer['kwargs']))
            result = then(adapter) if then is not None else {'model_id': model_id, 'type': 'create_model'}
        except BaseException:
            service.host.remove_adapter(adapter)
            service.store.set_run_status(run.id, 'deleted')
            raise
        service.adapters[run.id] = adapter
        return result

    return await api.accept(who, model_id, 0, 'create_model', create)


def _check_optimizer(config: Any) -> None:
    if config is not None and getattr(config, 'type', 'adamw') != 'adamw':
        raise HTTPException(400, f'optimizer {config.type!r} is not supported; this server runs adamw')


# ---- saving and loading ---------------------------------------------------------------------------
def _checkpoint_routes(router: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @router.post('/save_weights')
    async def save_weights(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.SaveWeightsRequest)
        run = api.run_of(who, body.model_id)
        name = _checkpoint_name(body.path, body.seq_id)
        expires = _expiry(body.ttl_seconds)

        def save() -> dict[str, Any]:
            if not body.overwrite and service.store.get_checkpoint(who.id, run.id, name) is not None:
                raise ConfigurationError(f'checkpoint weights/{name} exists; save with overwrite=True to replace it')
            checkpoint = _save(service, who, run, name, 'training', expires)
            return {'path': checkpoint.tinker_path, 'type': 'save_weights'}

        request_id = await api.accept(who, run.id, body.seq_id, 'save_weights', save)
        return {'request_id': request_id, 'model_id': run.id}

    @router.post('/save_weights_for_sampler')
    async def save_for_sampler(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.SaveWeightsForSamplerRequest)
        run = api.run_of(who, body.model_id)
        named = body.path is not None
        name = _checkpoint_name(body.path, body.seq_id) if named else f'sampler-{body.sampling_session_seq_id}'
        expires = _expiry(body.ttl_seconds)

        def save() -> dict[str, Any]:
            checkpoint = _save(service, who, run, name, 'sampler', expires)
            result = {'path': checkpoint.tinker_path, 'type': 'save_weights_for_sampler'}
            if not named:
                if run.session_id is None:
                    raise DataError(f'run {run.id!r} was made by the native API: save its sampler weights by name')
                sampling_id = f'{run.session_id}:sample:{body.sampling_session_seq_id}'
                service.store.create_sampling_session(
                    who.id, sampling_id, run.session_id, run.base_model, checkpoint.tinker_path
                )
                result['sampling_session_id'] = sampling_id
            return result

        request_id = await api.accept(who, run.id, body.seq_id, 'save_weights_for_sampler', save)
        return {'request_id': request_id, 'model_id': run.id}

    @router.post('/load_weights')
    async def load_weights(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.LoadWeightsRequest)
        checkpoint = api.checkpoint(who, body.path, kinds=('training',))
        if body.model_id is None:
            return await _create_from_checkpoint(api, who, body, checkpoint)
        run = api.run_of(who, body.model_id)

        def load() -> dict[str, Any]:
            service.host.load(service.loaded(run), Path(checkpoint.path), body.optimizer)
            return {'path': body.path, 'model_id': run.id, 'type': 'load_weights'}

        request_id = await api.accept(who, run.id, body.seq_id, 'load_weights', load)
        return {'request_id': request_id, 'model_id': run.id}


async def _create_from_checkpoint(api: TinkerAPI, who: Tenant, body: Any, checkpoint: Any) -> dict[str, Any]:
    """A new model from a training checkpoint: its source run's LoRA config, its weights, and
    with ``optimizer`` its AdamW state."""
    if body.session_id is None or body.model_seq_id is None:
        raise HTTPException(400, 'load_weights needs a model_id, or a session_id and model_seq_id to create one')
    api.session_of(who, body.session_id)
    _check_optimizer(body.optimizer_config)
    source = api.service.store.get_run_by_id(checkpoint.run_id)
    base = api.base_model(_bare(source.base_model) if body.base_model is None else body.base_model)
    model_id = f'{body.session_id}:train:{body.model_seq_id}'
    config = {key: source.config[key] for key in ('api', 'lora', 'tinker_lora') if key in source.config}
    config.setdefault('tinker_lora', {'rank': config['lora'].get('r')})

    def load(adapter: str) -> dict[str, Any]:
        api.service.host.load(adapter, Path(checkpoint.path), body.optimizer)
        return {'path': body.path, 'model_id': model_id, 'type': 'load_weights'}

    request_id = await _create_run(api, who, model_id, base, config, body.session_id, body.user_metadata, load)
    return {'request_id': request_id, 'model_id': model_id}


def _save(service: Any, who: Tenant, run: Any, name: str, kind: str, expires_at: float | None) -> Any:
    """Save the run's adapter (with the optimizer for training checkpoints) atomically, then record it."""
    directory = service.checkpoint_dir(who, run.id)
    if kind == 'sampler':
        directory = directory / 'sampler_weights'
    path = Path(service.host.save(service.loaded(run), directory, name, save_optimizer=kind == 'training'))
    size = sum(f.stat().st_size for f in path.rglob('*') if f.is_file())
    return service.store.add_checkpoint(who.id, run.id, name, str(path), kind, size, expires_at=expires_at)


def _checkpoint_name(path: str | None, seq_id: int | None) -> str:
    name = path if path is not None else f'step-{seq_id if seq_id is not None else int(time.time())}'
    try:
        return check_checkpoint_name(name)
    except DataError as e:
        raise HTTPException(400, str(e)) from None


def _expiry(ttl_seconds: int | None) -> float | None:
    if ttl_seconds is None:
        return None
    if ttl_seconds <= 0:
        raise HTTPException(400, f'ttl_seconds must be positive; got {ttl_seconds}')
    return time.time() + ttl_seconds


# ---- sampling -------------------------------------------------------------------------------------
def _sampling_routes(router: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @router.post('/create_sampling_session')
    async def create_sampling_session(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.CreateSamplingSessionRequest)
        api.session_of(who, body.session_id)
        base, path = _sampling_target(api, who, body.base_model, body.model_path)
        sampling_id = f'{body.session_id}:sample:{body.sampling_session_seq_id}'
        await asyncio.to_thread(service.store.create_sampling_session, who.id, sampling_id, body.session_id, base, path)
        return {'type': 'create_sampling_session', 'sampling_session_id': sampling_id}

    @router.get('/samplers/{sampler_id}')
    async def get_sampler(sampler_id: str, who: Who) -> dict[str, Any]:
        sampler = service.store.get_sampling_session(who.id, sampler_id)
        if sampler is None:
            raise HTTPException(404, f'sampler {sampler_id!r} not found')
        return {'sampler_id': sampler.id, 'base_model': _bare(sampler.base_model), 'model_path': sampler.model_path}

    @router.post('/asample')
    async def asample(request: Request, who: Who) -> dict[str, Any]:
        body = await _body(request, types.SampleRequest)
        if body.sampling_session_id is not None:
            sampler = service.store.get_sampling_session(who.id, body.sampling_session_id)
            if sampler is None:
                raise HTTPException(404, f'sampling session {body.sampling_session_id!r} not found')
            path = sampler.model_path
        else:
            _, path = _sampling_target(api, who, body.base_model, body.model_path)
        directory = Path(api.checkpoint(who, path, kinds=('sampler', 'training')).path) if path else None
        prompt, params = _sample_request(body, api.settings.default_max_tokens)
        _http(service.host.check_sampling_params, params)

        def sample() -> dict[str, str]:
            adapter = service.host.sampler_adapter(directory) if directory is not None else None
            response = service.host.generate([{'input_ids': prompt}], params, adapter)[0]
            output = codec.sample_response(
                response,
                topk_sample_logprobs=body.topk_sample_logprobs,
                topk_prompt_logprobs=body.topk_prompt_logprobs,
            )
            return {PROTO_KEY: base64.b64encode(output).decode()}

        request_id = await api.accept(who, None, None, 'sample', sample)
        return {
            'request_id': request_id,
            'sample_sequence_ids': [f'{request_id}:{i}' for i in range(params.num_samples)],
        }


def _sampling_target(api: TinkerAPI, who: Tenant, base_model: str | None, model_path: str | None) -> tuple[str, Any]:
    """(base model, sampler weights path or None) of a sampling request."""
    if model_path is not None:
        checkpoint = api.checkpoint(who, model_path, kinds=('sampler', 'training'))
        return api.service.store.get_run_by_id(checkpoint.run_id).base_model, model_path
    if base_model is None:
        raise HTTPException(400, 'sampling needs a base_model or a model_path')
    return api.base_model(base_model), None


def _sample_request(body: Any, default_max_tokens: int) -> tuple[list[int], SamplingParams]:
    """The prompt's tokens and twinkle's sampling parameters; features this server does not
    implement are refused, never ignored."""
    unsupported = {
        'prompt_alt_tokens_k': body.prompt_alt_tokens_k,
        'target_prompt_logprobs': body.target_prompt_logprobs is not None,
        'prompt_logprobs_last_n': body.prompt_logprobs_last_n is not None,
        'record_stability_info': bool(body.record_stability_info),
    }
    refused = sorted(name for name, value in unsupported.items() if value)
    if refused:
        raise HTTPException(400, f'sampling options {refused} are not supported by this server')
    tokens = []
    for chunk in body.prompt.chunks:
        if getattr(chunk, 'type', None) != 'encoded_text':
            raise HTTPException(400, f'prompt chunks of type {getattr(chunk, "type", None)!r} are not supported')
        tokens += list(chunk.tokens)
    if not tokens:
        raise HTTPException(400, 'the prompt has no tokens')
    given = body.sampling_params
    stop = given.stop if isinstance(given.stop, str) or given.stop is None else list(given.stop)
    try:
        params = SamplingParams(
            max_tokens=given.max_tokens if given.max_tokens is not None else default_max_tokens,
            temperature=given.temperature,
            top_k=given.top_k,
            top_p=given.top_p,
            seed=given.seed,
            stop=stop or None,
            ignore_eos=stop == [],  # Tinker's stop=[]: not even EOS stops a sequence
            num_samples=body.num_samples,
            logprobs=body.topk_sample_logprobs or None,
            prompt_logprobs=bool(body.prompt_logprobs) or body.topk_prompt_logprobs > 0,
            topk_prompt_logprobs=body.topk_prompt_logprobs,
        )
    except ConfigurationError as e:
        raise HTTPException(400, str(e)) from None
    return tokens, params


# ---- futures --------------------------------------------------------------------------------------
def _future_routes(router: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @router.post('/retrieve_future')
    async def retrieve_future(request: Request, who: Who) -> Any:
        body = await _body(request, types.FutureRetrieveRequest)
        record = service.store.get_future(who.id, body.request_id)
        if record is None:
            raise HTTPException(404, f'request {body.request_id!r} not found')
        deadline = time.monotonic() + api.settings.retrieve_wait_s
        while not record.finished and time.monotonic() < deadline:
            job = service.scheduler.get(record.id)
            if job is not None:
                await wait_job(job, max(0.0, deadline - time.monotonic()))
            else:
                await asyncio.sleep(0.05)  # waiting for its turn in the model's seq_id order
            record = service.store.get_future(who.id, body.request_id)
        if not record.finished:
            return {'type': 'try_again', 'request_id': record.id, 'queue_state': 'active'}
        if record.status == 'failed':
            return {'error': record.error, 'category': record.category}
        if isinstance(record.result, dict) and PROTO_KEY in record.result:
            return Response(base64.b64decode(record.result[PROTO_KEY]), media_type=PROTO)
        return record.result


# ---- helpers --------------------------------------------------------------------------------------
async def _body(request: Request, model: type[Body]) -> Body:
    """The JSON body as the SDK's request type; a 422 naming each bad field otherwise."""
    try:
        data = await request.json()
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than the parser goes
        raise HTTPException(400, f'the body must be JSON for {model.__name__}') from None
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        problems = '; '.join(f'{".".join(map(str, err["loc"])) or "body"}: {err["msg"]}' for err in e.errors())
        raise HTTPException(422, f'invalid {model.__name__}: {problems}') from None


def _http(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with twinkle's user errors as a 400 (capacity as 429)."""
    from twinkle.server.host import CapacityError

    try:
        return fn(*args)
    except CapacityError:
        raise
    except (ConfigurationError, DataError) as e:
        raise HTTPException(400, str(e)) from None


def _bare(model_id: str) -> str:
    """A model id without its hub scheme: ``ms://Qwen/Qwen3-4B`` -> ``Qwen/Qwen3-4B``."""
    for scheme in ('ms://', 'hf://'):
        if model_id.startswith(scheme):
            return model_id[len(scheme) :]
    return model_id


__all__ = ['PREFIX', 'TinkerAPI', 'tinker_router']
