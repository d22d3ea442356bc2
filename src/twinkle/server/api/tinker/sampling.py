"""The Tinker sampling routes: what a ``SamplingClient`` calls to sample the base model, or saved
sampler (or training) weights of a run the tenant may read.

A sampling request is a future like any other, with no model order to keep. Options this server
does not implement are refused with a 400 naming them, never ignored.

Every sampled sequence gets a ``sequence_id`` (``seq-<hex>:<i>``). With ``record_stability_info``
the server records, before the request's future settles, each sequence's prompt, sampled tokens
and the sampler's logprobs under the sampling session's Tinker session (``store.sequences``):
what ``stable_reinforce`` reads when a datum's provenance spans name the sequence.

A sampling session made by an ``inflight`` save names the training model's inflight sampler
weights, which each inflight save replaces: its requests sample whatever weights that name holds
when they are served (``Service.folder_now``), a snapshot's the weights saved for it.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import cast

from fastapi import APIRouter
from tinker import types

from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import DataError, NotFoundError
from twinkle.server.api.deps import Who
from twinkle.server.api.tinker.base import JsonObject, TinkerAPI, proto_result, router
from twinkle.server.execution.checks.images import IMAGE_SLOT, Images, ImageSlot, RowImages
from twinkle.server.execution.groups.model_group import ModelGroup, SampleCall, bare, sampling_tokens
from twinkle.server.execution.groups.sampler_group import saved_weights
from twinkle.server.execution.tinker import codec
from twinkle.server.metering import Meter
from twinkle.server.store import Store, Tenant


def sampling_router(api: TinkerAPI) -> APIRouter:
    """The routes of a Tinker sampling client."""
    return router(api, _session_routes, _sample_route)


def _session_routes(routes: APIRouter, api: TinkerAPI) -> None:
    store = api.service.store

    @routes.post('/create_sampling_session')
    async def create_sampling_session(body: types.CreateSamplingSessionRequest, who: Who) -> JsonObject:
        api.live_session(who, body.session_id)
        group, path = _sampling_target(api, who, body.base_model, body.model_path)
        sampling_id = f'{body.session_id}:sample:{body.sampling_session_seq_id}'
        await asyncio.to_thread(store.sessions.create_sampler, who.id, sampling_id, body.session_id, group.name, path)
        return {'type': 'create_sampling_session', 'sampling_session_id': sampling_id}

    @routes.get('/samplers/{sampler_id}')
    async def get_sampler(sampler_id: str, who: Who) -> JsonObject:
        sampler = store.sessions.sampler(who.id, sampler_id)
        if sampler is None:
            raise NotFoundError(f'sampler {sampler_id!r} not found')
        return {'sampler_id': sampler.id, 'base_model': bare(sampler.base_model), 'model_path': sampler.model_path}


def _sample_route(routes: APIRouter, api: TinkerAPI) -> None:
    service = api.service

    @routes.post('/asample')
    async def asample(body: types.SampleRequest, who: Who) -> JsonObject:
        session_id = None
        if body.sampling_session_id is not None:
            sampler = service.store.sessions.sampler(who.id, body.sampling_session_id)
            if sampler is None:
                raise NotFoundError(f'sampling session {body.sampling_session_id!r} not found')
            group, path = service.hosting(sampler.base_model, f'sampling session {sampler.id!r}'), sampler.model_path
            session_id = sampler.session_id
        else:
            group, path = _sampling_target(api, who, body.base_model, body.model_path)
        if body.record_stability_info and session_id is None:
            raise DataError('record_stability_info needs a sampling_session_id: the records belong to its session')
        checkpoint = api.checkpoint(who, path, kinds=('sampler', 'training')) if path else None
        prompt, params, images = _sample_request(body, api.settings.default_max_tokens)
        group.check_sampling_params(params)
        await asyncio.to_thread(group.check_images, [RowImages.of_slots('the prompt', prompt, images)], sampling=True)
        sequence_ids = [f'seq-{secrets.token_hex(8)}:{i}' for i in range(params.num_samples)]
        meter = Meter(session_id=session_id)

        def call() -> SampleCall:
            directory = service.folder_now(who, checkpoint, path) if checkpoint is not None and path else None
            return 'sample_ids', (prompt, params, saved_weights(directory, path), images)

        def sampled(response: SampleResponse) -> dict[str, str]:
            meter.sampled([len(prompt)], [len(sequence.tokens) for sequence in response.sequences])
            if body.record_stability_info and session_id is not None:
                _record(service.store, who, session_id, prompt, sequence_ids, response)
            return proto_result(
                codec.sample_response(
                    response,
                    topk_sample_logprobs=body.topk_sample_logprobs,
                    topk_prompt_logprobs=body.topk_prompt_logprobs,
                )
            )

        sample, batch = group.sampling_job(call, sampled, sampling_tokens([{'input_ids': prompt}], params))
        request_id = await api.accept(who, group, None, None, 'sample', sample, batch, meter=meter)
        return {'request_id': request_id, 'sample_sequence_ids': list(sequence_ids)}


def _record(
    store: Store, who: Tenant, session_id: str, prompt: list[int], sequence_ids: list[str], response: SampleResponse
) -> None:
    """Keep each sampled sequence's stability information: its tokens and the sampler's logprob of each."""
    if len(response.sequences) != len(sequence_ids):
        raise DataError(f'the sampler answered {len(response.sequences)} sequences for {len(sequence_ids)} asked')
    sequences = [
        (sequence_id, list(seq.tokens), [float(entry[0][1]) for entry in seq.logprobs])
        for sequence_id, seq in zip(sequence_ids, response.sequences, strict=True)
    ]
    store.sequences.record(who.id, session_id, prompt, sequences)


def _sampling_target(
    api: TinkerAPI, who: Tenant, base_model: str | None, model_path: str | None
) -> tuple[ModelGroup, str | None]:
    """(the base model's group, sampler weights path or None) of a sampling request."""
    if model_path is not None:
        checkpoint = api.checkpoint(who, model_path, kinds=('sampler', 'training'))
        source = api.service.store.runs.by_id(checkpoint.run_id)
        if source is None:  # deleted between the two reads
            raise NotFoundError(f'checkpoint {model_path!r} not found')
        return api.service.hosting(source.base_model, f'checkpoint {model_path!r}'), model_path
    if base_model is None:  # neither named: the server's base model, as the native API samples it
        return api.service.group_named(None), None
    return api.model_group(base_model), None


def _prompt_chunks(prompt: types.ModelInput) -> tuple[list[int], Images]:
    """The prompt's token ids, an image chunk's as ``IMAGE_SLOT`` s, and its image chunks."""
    tokens: list[int] = []
    images: list[ImageSlot] = []
    for position, chunk in enumerate(prompt.chunks):
        if isinstance(chunk, types.EncodedTextChunk):
            tokens += list(chunk.tokens)
        elif isinstance(chunk, types.ImageChunk):
            where = f'prompt chunk {position}'
            images.append(codec.image_slot(where, chunk.data, chunk.format, chunk.expected_tokens, len(tokens), False))
            tokens += [IMAGE_SLOT] * images[-1].length
        else:
            raise DataError(
                f'prompt chunks of type {getattr(chunk, "type", None)!r} are not supported; accepted: '
                'encoded_text and image chunks'
            )
    return tokens, tuple(images)


def _sample_request(body: types.SampleRequest, default_max_tokens: int) -> tuple[list[int], SamplingParams, Images]:
    """The prompt's tokens and image chunks, and twinkle's sampling parameters (a
    ``ConfigurationError`` for bad ones); features this server does not implement are refused,
    never ignored."""
    unsupported = {
        'prompt_alt_tokens_k': body.prompt_alt_tokens_k,
        'target_prompt_logprobs': body.target_prompt_logprobs is not None,
        'prompt_logprobs_last_n': body.prompt_logprobs_last_n is not None,
    }
    refused = sorted(name for name, value in unsupported.items() if value)
    if refused:
        raise DataError(f'sampling options {refused} are not supported by this server')
    tokens, images = _prompt_chunks(body.prompt)
    if not tokens:
        raise DataError('the prompt has no tokens')
    given = body.sampling_params
    stop = given.stop if isinstance(given.stop, str) or given.stop is None else cast(list[str | int], list(given.stop))
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
    return tokens, params, images


__all__ = ['sampling_router']
