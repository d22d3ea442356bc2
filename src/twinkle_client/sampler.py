"""``TorchSampler``: the local sampler's ``sample``, run on a server through a training run.

The server samples the run's adapter with the weights it has after its last step (the sampler
shares the trainer's model, so there is nothing to sync), or the base model with
``base_model=True``, and returns what the local ``twinkle.sampler.TorchSampler`` returns:
``SampleResponse`` s of ``SampledSequence`` s, whose ``new_input_feature`` goes back to
``forward_backward`` with ``old_logps`` (``token_logprobs``) and advantages.

Example::

    model = MultiLoraTransformersModel(client=client)
    model.add_adapter_to_model('policy', LoraConfig(r=8, target_modules='all-linear'))
    model.set_loss('GRPOLoss')
    sampler = TorchSampler(model=model)
    responses = sampler.sample(prompts, SamplingParams(max_tokens=64, num_samples=4, seed=0))
    sequences = [s for r in responses for s in r.sequences]
    model.forward_backward(inputs=[s.new_input_feature for s in sequences],
                           old_logps=[s.token_logprobs for s in sequences], advantages=advantages)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, cast

from pydantic import JsonValue, TypeAdapter
from typing_extensions import NotRequired, TypedDict

from twinkle.data_format import InputFeature, SampledSequence, SampleResponse, SamplingParams, TokenLogprob
from twinkle.data_format.sampling import StopReason
from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.wire import PROMPT_FIELDS, Sample, SampleWeights
from twinkle_client.client import PREFIX, TwinkleClient, build, default_client
from twinkle_client.images import sent_images
from twinkle_client.model import MultiLoraTransformersModel, Row

if TYPE_CHECKING:  # a type only: twinkle.template imports transformers, which the client does not need
    from twinkle.template import Template


class _SequenceJson(TypedDict):
    """A ``SampledSequence`` as the server sends it."""

    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[list[TokenLogprob]]
    decoded: str
    new_input_feature: dict[str, JsonValue]
    weight_version: NotRequired[int]


class _ResponseJson(TypedDict):
    """A ``SampleResponse`` as the server sends it."""

    sequences: list[_SequenceJson]
    prompt_token_ids: list[int]
    prompt_logprobs: NotRequired[list[float | None] | None]
    topk_prompt_logprobs: NotRequired[list[list[TokenLogprob] | None] | None]
    extra: NotRequired[dict[str, JsonValue] | None]
    prompt_cache_hit_tokens: NotRequired[int]


#: The answer of a ``sample`` request, checked (and ``(token, logprob)`` pairs made tuples).
_RESPONSES = TypeAdapter(list[_ResponseJson])


class TorchSampler:
    """Samples through a training run of ``model`` (``adapter_name`` picks among its adapters;
    the one adapter by default). The server decides how it samples (today a ``TorchSampler``
    over the trainer's own weights); ``vLLMSampler`` is this class under the name the local
    scripts use.

    Without ``model=`` it samples without a training run: the base model ``model_id`` names
    (None: the server's default), or the saved weights of ``model_path`` (a ``twinkle://``
    checkpoint, a run's ``save`` or a published one), as seed 003's client loop does with
    ``vLLMSampler(model_id=...)``.
    """

    def __init__(
        self,
        model_id: str | None = None,
        *,
        client: TwinkleClient | None = None,
        model: MultiLoraTransformersModel | None = None,
        adapter_name: str | None = None,
        model_path: str | None = None,
    ):
        if model is not None and not isinstance(model, MultiLoraTransformersModel):
            raise ConfigurationError(f'model must be a twinkle_client MultiLoraTransformersModel; got {model!r}')
        if model is not None and client is not None and client is not model.client:
            raise ConfigurationError("the sampler talks to its model's server: pass model= alone, or the same client")
        if model is not None and model_path is not None:
            raise ConfigurationError('sample a training run (model=) or saved weights (model_path=), not both')
        self.model_id = model_id
        self.model_path = model_path
        self.model = model
        self.client = model.client if model is not None else client or default_client()
        self.adapter_name = adapter_name
        self.requested_template: tuple[str | type[Template] | Template, dict[str, object]] | None = None

    def set_template(self, template_cls: str | type[Template] | Template = 'Template', **kwargs: object) -> None:
        """Kept for parity with the local sampler and otherwise ignored: the server encodes
        ``messages`` prompts with the run's template (``model.set_template``), else the base
        model's, and always with the base model's tokenizer."""
        self.requested_template = (template_cls, kwargs)

    def reset_prefix_cache(self) -> None:
        """Nothing to drop: the server samples the run's current weights. Kept for parity."""
        return None

    def sample(
        self,
        inputs: Row | Sequence[Row],
        sampling_params: SamplingParams | dict[str, JsonValue] | None = None,
        *,
        adapter_name: str | None = None,
        base_model: bool = False,
    ) -> list[SampleResponse]:
        """One ``SampleResponse`` per prompt, as the local sampler gives: each prompt an encoded
        ``{'input_ids': [...]}`` or a ``{'messages': [...]}`` trajectory. A prompt's
        ``user_data`` stays here and is put back into its sequences' ``new_input_feature``.
        ``base_model=True`` samples the base model without the adapter. Bad parameters are a
        ``RemoteError`` (status 400) naming the field."""
        rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        params = asdict(sampling_params) if isinstance(sampling_params, SamplingParams) else sampling_params
        fields: dict[str, object] = {
            'inputs': [_prompt_json(index, row) for index, row in enumerate(rows)],
            'sampling_params': params,  # checked by the server, whose 400 names a bad field
        }
        if self.model is None:  # no run: the base model, or saved weights
            if base_model and self.model_path is not None:
                raise StateError('base_model=True samples the base model; this sampler samples model_path')
            body = build(SampleWeights, {**fields, 'base_model': self.model_id, 'model_path': self.model_path})
            answer = self.client.call(f'{PREFIX}/sample', body)
        else:
            run_id = self.model._run(adapter_name or self.adapter_name)  # the model's errors name its adapters
            answer = self.client.call(
                f'{PREFIX}/runs/{run_id}/ops/sample', build(Sample, {**fields, 'base_model': base_model})
            )
        result = _RESPONSES.validate_python(answer)
        return [_response(data, row.get('user_data')) for data, row in zip(result, rows, strict=True)]


#: The name local scripts use; the server, not the client, decides how it samples.
vLLMSampler = TorchSampler


def _prompt_json(index: int, row: object) -> dict[str, object]:
    if not isinstance(row, Mapping):
        raise DataError(f'prompt {index} must be a dict with input_ids or messages; got {type(row).__name__}')
    prompt = {key: row[key] for key in PROMPT_FIELDS if key in row}
    images = sent_images(index, row)
    if images is not None:  # encoded by VisionTemplate: its token ids and the image files, not its messages
        if 'input_ids' not in prompt:
            raise DataError(f'prompt {index} has images but no input_ids: encode it with the VisionTemplate')
        prompt.pop('messages', None)
        prompt['images'] = images
    if 'input_ids' in prompt:
        prompt['input_ids'] = [int(token) for token in prompt['input_ids']]
    if 'messages' in prompt:
        prompt['messages'] = [dict(message) for message in prompt['messages']]
    return prompt


def _response(data: _ResponseJson, user_data: object) -> SampleResponse:
    """A ``SampleResponse`` rebuilt from its JSON, with the prompt's ``user_data`` put back."""
    sequences = []
    for seq in data['sequences']:
        feature: dict[str, object] = dict(seq['new_input_feature'])
        if user_data is not None:
            feature['user_data'] = user_data  # it stayed here, as any Python value
        sequences.append(
            SampledSequence(
                stop_reason=seq['stop_reason'],
                tokens=seq['tokens'],
                logprobs=seq['logprobs'],
                decoded=seq['decoded'],
                new_input_feature=cast(InputFeature, feature),  # the server's training_feature, as JSON
                weight_version=seq.get('weight_version', 0),
            )
        )
    return SampleResponse(
        sequences=sequences,
        prompt_token_ids=data['prompt_token_ids'],
        prompt_logprobs=data.get('prompt_logprobs'),
        topk_prompt_logprobs=data.get('topk_prompt_logprobs'),
        extra=dict(data.get('extra') or {}),
        prompt_cache_hit_tokens=data.get('prompt_cache_hit_tokens', 0),
    )


__all__ = ['TorchSampler', 'vLLMSampler']
