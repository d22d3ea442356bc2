"""Partial rollouts: a generation interrupted by a weight update continues on the new weights.

``generate_partial`` samples ``max_tokens`` in chunks of ``chunk_tokens``, each chunk in its
own ``session.sampling()`` section, so a weight update the trainer published lands between two
chunks instead of waiting for the whole generation (Kimi k1.5's and AReaL's partial rollouts).
A continued sequence is the prompt plus the tokens so far, sampled one more chunk; the tokens
keep the logprobs of the weights that drew them, and ``token_versions`` records which weights
those were, so the rollout correction and the staleness count see the truth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from twinkle.data_format import SampledSequence, SampleResponse, SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.rl.async_rollout import Session
from twinkle.template.base import encoded_feature


class _Sampler(Protocol):
    def sample(
        self, inputs: Any, sampling_params: SamplingParams | dict[str, Any] | None = None
    ) -> list[SampleResponse]: ...


def generate_partial(
    sampler: _Sampler,
    session: Session,
    prompts: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    chunk_tokens: int,
) -> list[SampleResponse]:
    """``sampler.sample(prompts, params)``, in chunks of ``chunk_tokens`` between which new
    weights may arrive. Each returned sequence has ``token_versions`` (and ``weight_version``,
    its oldest); ``new_input_feature`` trains on every completion token."""
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigurationError(f'chunk_tokens must be a positive integer; got {chunk_tokens!r}')
    with session.sampling() as version:
        responses = sampler.sample(list(prompts), replace(params, max_tokens=min(chunk_tokens, params.max_tokens)))
    grown = [[_Growing(seq, version) for seq in response.sequences] for response in responses]
    chunk = 1
    while True:
        open_ = [(r, g) for r, group in enumerate(grown) for g in group if not g.done(params.max_tokens)]
        if not open_:
            break
        rows = [{'input_ids': responses[r].prompt_token_ids + g.tokens} for r, g in open_]
        step = replace(params, max_tokens=min(chunk_tokens, params.max_tokens - min(len(g.tokens) for _, g in open_)))
        step = replace(step, num_samples=1, seed=None if params.seed is None else params.seed + 7919 * chunk)
        with session.sampling() as version:
            more = sampler.sample(rows, step)
        for (_, g), response in zip(open_, more, strict=True):
            g.extend(response.sequences[0], version, params.max_tokens)
        chunk += 1
    return [
        replace(response, sequences=[g.sequence(response.prompt_token_ids) for g in group])
        for response, group in zip(responses, grown, strict=True)
    ]


class _Growing:
    """One sequence being generated chunk by chunk."""

    def __init__(self, first: SampledSequence, version: int):
        self.first = first
        self.tokens = list(first.tokens)
        self.logprobs = list(first.logprobs)
        self.versions = [version] * len(first.tokens)
        self.decoded = first.decoded
        self.stop_reason = first.stop_reason

    def done(self, max_tokens: int) -> bool:
        return self.stop_reason == 'stop' or len(self.tokens) >= max_tokens

    def extend(self, more: SampledSequence, version: int, max_tokens: int) -> None:
        room = max_tokens - len(self.tokens)
        self.tokens += more.tokens[:room]
        self.logprobs += more.logprobs[:room]
        self.versions += [version] * len(more.tokens[:room])
        self.decoded += more.decoded
        self.stop_reason = more.stop_reason

    def sequence(self, prompt_ids: list[int]) -> SampledSequence:
        feature = encoded_feature(prompt_ids + self.tokens, [False] * len(prompt_ids) + [True] * len(self.tokens))
        first = self.first.new_input_feature
        if 'messages' in first:
            feature['messages'] = [*first['messages'][:-1], {'role': 'assistant', 'content': self.decoded}]
        if 'user_data' in first:
            feature['user_data'] = first['user_data']
        return SampledSequence(
            stop_reason=self.stop_reason,
            tokens=self.tokens,
            logprobs=self.logprobs,
            decoded=self.decoded,
            new_input_feature=feature,
            weight_version=min(self.versions, default=0),
            token_versions=self.versions,
        )
