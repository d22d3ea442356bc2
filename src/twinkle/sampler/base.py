"""The sampler interface, and the parts every sampler shares: turning inputs into prompts and
a finished completion into a ``SampledSequence`` ready to train on."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from twinkle.data_format import (
    InputFeature,
    Message,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    TokenLogprob,
)
from twinkle.errors import DataError, StateError
from twinkle.registry import Registry
from twinkle.sampler.images import PromptImages, prompt_images, with_images
from twinkle.template import TEMPLATES, Template
from twinkle.template.base import encoded_feature

#: What ``sample`` takes: one row or a list of rows. A row is an encoded prompt (``input_ids``,
#: e.g. from ``dataset.encode(add_generation_prompt=True)``) or a trajectory (``messages``).
SampleInputs = Mapping[str, Any] | Sequence[Mapping[str, Any]]
#: Which adapter ``sample`` samples from: one by name, one per row (``vLLMSampler``), or None
#: for the adapter the last weight sync installed (else the base model).
AdapterChoice = str | Sequence[str | None] | None


@dataclass
class Prompt:
    """One prompt to complete, and what its sequences carry back to the caller."""

    input_ids: list[int]
    messages: list[Message] | None = None
    user_data: Any = None
    #: Its images (a vision-language model's prompt encoded by ``VisionTemplate``), else None.
    images: PromptImages | None = None


@dataclass
class PromptLogprobs:
    """A prompt's own logprobs: each token's given the tokens before it (``None`` for the
    first), and the ``k`` most likely tokens at each position."""

    logprobs: list[float | None]
    topk: list[list[TokenLogprob] | None]


@dataclass
class Completion:
    """What a generation loop produced for one sequence."""

    tokens: list[int]
    logprobs: list[list[TokenLogprob]]
    stop_reason: StopReason
    text_end: int | None = None  # where a matched stop string starts in the decoded text
    # [prompt + completion tokens][MoE layers][top_k] experts, with ``return_routed_experts``.
    routed_experts: list[list[list[int]]] | None = None


class Turns(Protocol):
    """Where a generation in progress lets other work use the device, between two decode steps
    (``twinkle.server.execution.sampling.slicing.TURNS``: the server's sampling slices)."""

    def due(self) -> bool:
        """Whether the generation has had its turn: it should give way now."""
        ...

    def give_way(self) -> None:
        """Let the other work run; return once it is the generation's turn again."""
        ...

    def time_limit_s(self) -> float | None:
        """Seconds of batch steps a generation asked for now may take part in: past them its rows end
        as at ``max_tokens`` (None: no bound; ``vLLMSampler`` does not ask)."""
        ...


class Sampler(ABC):
    """Generates completions. ``weight_version`` counts the weight syncs received (see
    ``CheckpointEngineManager``); every sampled sequence records it."""

    weight_version: int = 0
    _template: Template | None = None
    model_id: str | None = None

    def sample(
        self,
        inputs: SampleInputs,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        *,
        adapter_name: AdapterChoice = None,
    ) -> list[SampleResponse]:
        """One ``SampleResponse`` per input row, in order, each with ``num_samples`` sequences.
        ``adapter_name``: the adapter to sample from; by default the one the last weight sync
        installed, else the base model (``vLLMSampler`` also takes a list, one per row)."""
        params = SamplingParams.from_dict(sampling_params)
        # As the call starts: a call that waits for others' rows may end after another set it anew.
        version = self.weight_version
        prompts = self._prompts(inputs)
        self._check(prompts, params)
        completions, prompt_info = self._complete(prompts, params, adapter_name)
        return self._responses(prompts, completions, prompt_info, params, version)

    @abstractmethod
    def _check(self, prompts: list[Prompt], params: SamplingParams) -> None:
        """Refuse, before any work, what this sampler cannot do with these prompts and params."""

    @abstractmethod
    def _complete(
        self, prompts: list[Prompt], params: SamplingParams, adapter_name: AdapterChoice
    ) -> tuple[list[Completion], list[PromptLogprobs]]:
        """Each prompt's ``num_samples`` completions, prompt after prompt, and with
        ``prompt_logprobs`` or ``topk_prompt_logprobs`` each completion's prompt logprobs."""

    def set_template(self, template_cls: str | type[Template] | Template = 'Template', **kwargs: Any) -> None:
        """The template that turns ``messages`` inputs into prompts; ``model_id`` defaults to
        the sampler's own."""
        if not isinstance(template_cls, Template):
            kwargs.setdefault('model_id', self.model_id)
        self._template = TEMPLATES.build(template_cls, Template, **kwargs)

    @property
    def template(self) -> Template:
        if self._template is None:
            if self.model_id is None:
                raise StateError('this sampler has no model_id to take a tokenizer from: call set_template(...)')
            self._template = Template(self.model_id)
        return self._template

    def reset_prefix_cache(self) -> None:
        """Drop cached prompt prefixes (after a weight sync they are stale). Kept for vLLM
        parity; a sampler without a prefix cache has nothing to drop."""
        return None

    # ---- shared steps ---------------------------------------------------------------------------
    def _prompts(self, inputs: SampleInputs) -> list[Prompt]:
        rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        if not rows:
            raise DataError('inputs is empty: pass at least one prompt')
        return [self._prompt(index, row) for index, row in enumerate(rows)]

    def _prompt(self, index: int, row: Mapping[str, Any]) -> Prompt:
        if not isinstance(row, Mapping):
            raise DataError(f'prompt {index} must be a dict with input_ids or messages; got {type(row).__name__}')
        messages = row.get('messages')
        if 'input_ids' in row:
            ids = list(row['input_ids'])
        elif messages is not None:
            feature = self.template.encode(row, add_generation_prompt=True)
            if feature is None:
                raise DataError(f'prompt {index} is over max_length and the template drops it')
            ids = feature['input_ids']
            row = {**row, **feature}  # the images VisionTemplate encoded
        else:
            raise DataError(f"prompt {index} needs 'input_ids' or 'messages'; it has fields {sorted(row)}")
        if not ids:
            raise DataError(f'prompt {index} has no tokens')
        messages = list(messages) if messages else None
        return Prompt(ids, messages, row.get('user_data'), images=prompt_images(index, row, ids))

    def _responses(
        self,
        prompts: list[Prompt],
        completions: list[Completion],
        prompt_info: list[PromptLogprobs],
        params: SamplingParams,
        version: int,
    ) -> list[SampleResponse]:
        responses = []
        for index, prompt in enumerate(prompts):
            first = index * params.num_samples
            group = completions[first : first + params.num_samples]
            sequences: list[SampledSequence] = [self._sequence(prompt, c, params, version) for c in group]
            response = SampleResponse(sequences=sequences, prompt_token_ids=prompt.input_ids)
            if prompt_info:
                response.prompt_logprobs = prompt_info[first].logprobs if params.prompt_logprobs else None
                response.topk_prompt_logprobs = prompt_info[first].topk if params.topk_prompt_logprobs else None
            responses.append(response)
        return responses

    def _sequence(
        self, prompt: Prompt, completion: Completion, params: SamplingParams, version: int
    ) -> SampledSequence:
        decoded = self._decode(completion, params)
        return SampledSequence(
            stop_reason=completion.stop_reason,
            tokens=completion.tokens,
            logprobs=completion.logprobs,
            decoded=decoded,
            new_input_feature=with_images(
                training_feature(prompt, completion.tokens, decoded, completion.routed_experts), prompt.images
            ),
            weight_version=version,
        )

    def _decode(self, completion: Completion, params: SamplingParams) -> str:
        tokens = completion.tokens
        if completion.stop_reason == 'stop' and completion.text_end is None and tokens:
            tokens = tokens[:-1]  # the stop token itself
        text = self.template.decode(tokens, skip_special_tokens=True)
        if completion.text_end is not None:
            text = text[: completion.text_end]
        return text


def training_feature(
    prompt: Prompt, tokens: list[int], decoded: str, routed_experts: list[list[list[int]]] | None = None
) -> InputFeature:
    """The prompt plus the completion ``tokens`` as an ``InputFeature`` whose labels are the
    completion (pre-shifted), with the conversation extended by the assistant's ``decoded`` and
    the sampler's routing, when recorded."""
    trained = [False] * len(prompt.input_ids) + [True] * len(tokens)
    feature = encoded_feature(prompt.input_ids + tokens, trained)
    if routed_experts is not None:
        feature['routed_experts'] = routed_experts
    if prompt.messages is not None:
        feature['messages'] = [*prompt.messages, {'role': 'assistant', 'content': decoded}]
    if prompt.user_data is not None:
        feature['user_data'] = prompt.user_data
    return feature


def row_seed(seed: int | None, prompt: list[int], sample_index: int) -> int | None:
    """The generator seed of sample ``j`` of ``prompt``: a hash of the three, so each of the
    ``num_samples`` sequences differs, different prompts draw different noise, and the same
    seed, prompt and weights give the same sequence in any batch."""
    if seed is None:
        return None
    digest = hashlib.blake2b(repr((seed, sample_index, prompt)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, 'little') >> 1


SAMPLERS: Registry[Sampler] = Registry('sampler')
