"""The one thing a rollout asks of a sampler: continue these token ids, and say with which ids
and log-probabilities. Two adapters give it:

- ``SamplerGenerator``: anything with twinkle's ``sample(inputs, sampling_params)``: a
  ``TorchSampler`` or ``vLLMSampler`` in this process, one on a Ray ``DeviceGroup`` (its
  ``remote_group`` proxy), or ``twinkle_client``'s sampler against the service;
- ``TinkerGenerator``: a ``tinker`` SDK ``SamplingClient`` (the service's Tinker API, or any
  Tinker-compatible one).

``Batcher`` puts the requests of many episodes into one call: an episode asks for its next turn
and waits; the requests that arrive while a call runs go into the next one, so while one episode
waits on its tool the others generate.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError, DataError


@dataclass
class Generation:
    """A continuation: the sampled ids (the stop token included when it stopped on one), their
    log-probabilities, why it stopped, and the weight version it was sampled with."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    weight_version: int = 0


class Generator(Protocol):
    """Continues each prompt once with ``params`` (``num_samples`` is 1); blocking, so the
    batcher runs it in a thread."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...


class SamplesRows(Protocol):
    """twinkle's sampler interface, local, on Ray, or over HTTP."""

    def sample(self, inputs: Any, sampling_params: Any = None) -> Any: ...


class SamplerGenerator:
    """A twinkle sampler (``TorchSampler``, ``vLLMSampler``, a Ray proxy of one, the client's)."""

    def __init__(self, sampler: SamplesRows):
        self.sampler = sampler

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        responses = self.sampler.sample([{'input_ids': ids} for ids in prompts], params)
        out = []
        for response in responses:
            seq = response.sequences[0]
            out.append(Generation(list(seq.tokens), list(seq.token_logprobs), seq.stop_reason, seq.weight_version))
        return out


class TinkerGenerator:
    """A ``tinker.SamplingClient``: one request per prompt, sent at once (the SDK's futures)."""

    def __init__(self, sampling_client: Any, weight_version: int = 0):
        self.client = sampling_client
        self.weight_version = weight_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        from tinker import types

        tinker_params = types.SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop_token_ids or None,
        )
        futures = [
            self.client.sample(prompt=types.ModelInput.from_ints(ids), num_samples=1, sampling_params=tinker_params)
            for ids in prompts
        ]
        out = []
        for future in futures:
            seq = future.result().sequences[0]
            logprobs = [float(lp) for lp in (seq.logprobs or [])]
            out.append(Generation(list(seq.tokens), logprobs, str(seq.stop_reason), self.weight_version))
        return out


def as_generator(sampler: Any) -> Generator:
    """The ``Generator`` for a sampler of any kind this module knows."""
    import tinker

    if isinstance(sampler, tinker.SamplingClient):
        return TinkerGenerator(sampler)
    if hasattr(sampler, 'generate'):
        generator: Generator = sampler
        return generator
    if hasattr(sampler, 'sample'):
        return SamplerGenerator(sampler)
    raise ConfigurationError(
        f'cannot sample with a {type(sampler).__name__}: pass a twinkle sampler (TorchSampler, vLLMSampler, '
        "a Ray sampler, twinkle_client's), a tinker SamplingClient, or an object with generate(prompts, params)"
    )


@dataclass
class _Request:
    ids: list[int]
    params: SamplingParams
    future: asyncio.Future[Generation]


class Batcher:
    """Gathers the episodes' requests into calls of at most ``max_batch`` prompts, one call at a
    time, each in a worker thread so the event loop (tools, environments) keeps running.

    Requests with equal sampling parameters share a call (a seeded rollout gives each episode
    and turn its own seed, so its episodes are sampled one by one: leave ``seed`` unset to
    batch, and seed torch for a repeatable run).
    """

    def __init__(self, generator: Generator, max_batch: int = 64):
        if max_batch <= 0:
            raise ConfigurationError(f'max_batch must be positive; got {max_batch}')
        self.generator = generator
        self.max_batch = max_batch
        self.calls = 0  # calls made to the generator
        self._queue: list[_Request] = []
        self._running: asyncio.Task[None] | None = None

    async def generate(self, ids: list[int], params: SamplingParams) -> Generation:
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(ids, params, future))
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await _settle()  # let the episodes that are ready to ask, ask, before the first call
        while self._queue:
            batch = self._next_batch()
            try:
                generations = await asyncio.to_thread(self.generator.generate, [r.ids for r in batch], batch[0].params)
                if len(generations) != len(batch):
                    raise DataError(f'the generator returned {len(generations)} generations for {len(batch)} prompts')
            except Exception as e:  # the episodes of this call fail; the others go on
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(e)
            else:
                self.calls += 1
                for request, generation in zip(batch, generations, strict=True):
                    if not request.future.done():  # an episode timed out meanwhile
                        request.future.set_result(generation)

    def _next_batch(self) -> list[_Request]:
        params = self._queue[0].params
        batch = [r for r in self._queue if r.params == params][: self.max_batch]
        taken = {id(r) for r in batch}
        self._queue = [r for r in self._queue if id(r) not in taken]
        return batch


async def _settle(rounds: int = 3) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)
