"""What a sampler takes (``SamplingParams``) and returns (``SampleResponse`` of
``SampledSequence`` s)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from twinkle.data_format.types import InputFeature
from twinkle.errors import ConfigurationError

#: ``(token_id, logprob)``.
TokenLogprob = tuple[int, float]
StopReason = Literal['stop', 'length']


@dataclass
class SamplingParams:
    """How to sample.

    - ``max_tokens``: most tokens to generate per sequence.
    - ``temperature``: 0 is greedy (argmax); otherwise logits are divided by it.
    - ``top_k``: keep the ``k`` most likely tokens (-1: all); ``top_p``: keep the smallest set
      whose probability reaches ``p`` (1: all).
    - ``stop``: strings or token ids that end a sequence (``stop_reason='stop'``), besides the
      model's end-of-sequence token (unless ``ignore_eos``). The stop token (or the tokens that
      complete the stop string) stay in ``tokens``; ``decoded`` ends before them.
    - ``seed``: the same seed, prompt and weights give the same sample, in whatever batch.
    - ``num_samples``: sequences per prompt.
    - ``logprobs``: the log-probability of every sampled token is always returned, under the
      distribution it was drawn from: the logits after the repetition penalty, temperature, top-k
      and top-p (``twinkle.sampler.logits.sampled_logprobs``; vLLM's ``processed_logprobs``, what
      Tinker returns). With top-k and top-p off that is ``log_softmax(logits / temperature)``, so
      at temperature 1 it equals the trainer's ``forward`` of the same tokens (which scores at
      temperature 1); at temperature 0 (greedy) it is the raw logits' (after the penalty, if any).
      ``logprobs=k`` adds the ``k`` most likely tokens of the same distribution (fewer where top-k
      or top-p leave fewer).
    - ``prompt_logprobs``: also return the log-probability of each prompt token (``None`` for
      the first) under the raw logits, at temperature 1 whatever ``temperature`` is: prompt tokens
      are given, not drawn. ``topk_prompt_logprobs=k`` adds the ``k`` most likely tokens there.
    - ``repetition_penalty``: divides positive (multiplies negative) logits of tokens already in
      the prompt or the completion, as in CTRL and transformers; 1 is off.
    - ``return_routed_experts``: on a mixture of experts, record the experts each MoE layer
      chose for every token; ``new_input_feature['routed_experts']`` carries them, and the
      trainer's forward of that feature routes the same (routing replay).
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: str | list[str] | list[int] | list[str | int] | None = None
    seed: int | None = None
    num_samples: int = 1
    logprobs: int | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        _positive_int('max_tokens', self.max_tokens)
        _positive_int('num_samples', self.num_samples)
        if not _finite(self.temperature) or self.temperature < 0:
            raise ConfigurationError(
                f'temperature must be a finite number >= 0 (0 is greedy); got {self.temperature!r}'
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise ConfigurationError(f'top_k must be a positive integer or -1 (no limit); got {self.top_k!r}')
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigurationError(f'top_p must be in (0, 1]; got {self.top_p!r}')
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ConfigurationError(f'repetition_penalty must be a positive number; got {self.repetition_penalty!r}')
        if self.topk_prompt_logprobs is None:
            self.topk_prompt_logprobs = 0
        for name in ('logprobs', 'topk_prompt_logprobs'):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConfigurationError(f'{name} must be a non-negative integer; got {value!r}')
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigurationError(f'seed must be an integer or None; got {self.seed!r}')
        self.stop = _normalize_stop(self.stop)
        if not isinstance(self.return_routed_experts, bool):
            raise ConfigurationError(f'return_routed_experts must be true or false; got {self.return_routed_experts!r}')

    @property
    def stop_strings(self) -> list[str]:
        return [s for s in self.stop or [] if isinstance(s, str)]

    @property
    def stop_token_ids(self) -> list[int]:
        return [s for s in self.stop or [] if isinstance(s, int)]

    @classmethod
    def from_dict(cls, params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """``params`` as given, a dict of fields, or the defaults for ``None``."""
        if params is None:
            return cls()
        if isinstance(params, cls):
            return params
        if not isinstance(params, dict):
            raise ConfigurationError(f'sampling_params must be SamplingParams or a dict; got {type(params).__name__}')
        unknown = sorted(set(params) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigurationError(
                f'unknown sampling parameters {unknown}; accepted: {sorted(cls.__dataclass_fields__)}'
            )
        return cls(**params)


@dataclass
class SampledSequence:
    """One generated completion.

    ``logprobs[i]`` lists ``(token, logprob)`` pairs for ``tokens[i]``: the sampled token first,
    then, with ``SamplingParams.logprobs=k``, the ``k`` most likely tokens in order (the sampled
    one again if it is among them), so ``[lp[0][1] for lp in seq.logprobs]`` are the sampled
    tokens' logprobs. ``new_input_feature`` is the prompt plus this completion, encoded to train
    on (labels and ``completion_mask`` on the completion), with ``messages`` (the prompt's plus an
    assistant turn of ``decoded``) and the prompt's ``user_data`` for rewards. ``weight_version``
    counts the weight syncs the sampler had received when it produced this sequence (the oldest
    weights, when ``token_versions`` says the generation spanned an update).
    """

    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[list[TokenLogprob]]
    decoded: str
    new_input_feature: InputFeature
    weight_version: int = 0
    #: Per token, the weight version that generated it, for a generation continued across a weight
    #: update (``twinkle.rl.generate_partial``); ``None``: every token came from ``weight_version``.
    token_versions: list[int] | None = None

    @property
    def token_logprobs(self) -> list[float]:
        """The sampled tokens' logprobs, as the RL losses take them (``old_logps``)."""
        return [entry[0][1] for entry in self.logprobs]


@dataclass
class SampleResponse:
    """The sequences sampled for one prompt, and the prompt's own logprobs when asked for
    (``prompt_logprobs[0]`` is ``None``: the first token has no context)."""

    sequences: list[SampledSequence]
    prompt_token_ids: list[int]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: Prompt tokens the sampler took from a prefix cache instead of computing them, counted once for
    #: the prompt whatever ``num_samples`` is (Tinker's ``SampleResponse.prompt_cache_hit_tokens``). 0
    #: where there is no prefix cache: ``TorchSampler`` prefills every prompt.
    prompt_cache_hit_tokens: int = 0


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigurationError(f'{name} must be a positive integer; got {value!r}')


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _normalize_stop(stop: object) -> list[str | int] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ConfigurationError(f'stop must be a string, a list of strings or a list of token ids; got {stop!r}')
    for item in stop:
        if isinstance(item, str):
            if not item:
                raise ConfigurationError('an empty stop string would end every sequence at once; remove it')
        elif not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ConfigurationError(f'stop entries must be non-empty strings or token ids >= 0; got {item!r}')
    return list(stop)
