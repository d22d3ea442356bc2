"""``TorchSampler``: batched generation with a KV cache in plain PyTorch, on any device.

The loop is the one ``transformers.generate`` runs, written out so that it can return what RL
needs and ``generate`` does not give cheaply: the log-probability of every sampled token under
the distribution it was drawn from (``logits.sampled_logprobs``), per-sequence seeds
that do not depend on the batch, stop strings, and rows that leave the batch (and the cache) as
soon as they finish. Every call on one sampler shares one running batch (``batching.py``: continuous
batching): calls made while another generates (other threads, the server's other sampling jobs) join
it at its next step, each with its own adapter, parameters, seeds and stop conditions, and get the
tokens they would get alone. Between two decode steps a generation may give the device up to other
work (``turns``: the server's slices), the model put back as it found it meanwhile; it goes on from
its cache and generators as they were, so the tokens are the ones it would have sampled without a pause.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from peft import PeftConfig
from transformers import PretrainedConfig, PreTrainedModel

from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError, DataError, SequenceTooLongError, StateError, UnknownNameError
from twinkle.hub import resolve_model
from twinkle.model.loading import load_causal_lm, resolve_device
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.adapter import RowAssignment
from twinkle.sampler.base import (
    SAMPLERS,
    AdapterChoice,
    Completion,
    Prompt,
    PromptLogprobs,
    Sampler,
    Turns,
    row_seed,
)
from twinkle.sampler.batching import ContinuousBatch, Request
from twinkle.sampler.images import check_takes_images, placeholder_ids, takes_images
from twinkle.template import Template, VisionTemplate
from twinkle.utils.weights import canonical_name, vocab_size


@SAMPLERS.register
class TorchSampler(Sampler):
    """Samples from ``model_id`` (``ms://``, ``hf://`` or a local directory), or a model built
    from ``config``, with its own copy of the weights.

    Example::

        sampler = TorchSampler(assets.tiny_model())
        responses = sampler.sample([{'messages': [{'role': 'user', 'content': 'hi'}]}],
                                   SamplingParams(max_tokens=16, temperature=0.7, num_samples=4))
        completion = responses[0].sequences[0].decoded

    ``adapter_name`` picks a LoRA adapter added with ``add_adapter`` or received by a weight
    sync; without it the sampler uses the adapter the last sync installed, else the base model.
    ``max_batch_size`` caps the sequences decoded together (None: every row of every call in
    flight); rows past it wait and join as others end. With ``turns`` set, each generation asks it
    between two decode steps whether to give way (it puts the model back as it found it meanwhile)
    and how long its rows may take.

    A vision-language model (``tiny-qwen3.5-vl``, a ``Qwen3_5ForConditionalGeneration``) takes prompts
    with images: its template is the ``VisionTemplate``, the prefill gets the pixels and Qwen's
    multimodal RoPE positions (``twinkle.sampler.images``), and each sampled sequence's
    ``new_input_feature`` carries the images, so the trainer scores it as it was sampled.
    """

    def __init__(
        self,
        model_id: str | None = None,
        model_cls: type[PreTrainedModel] | None = None,
        config: PretrainedConfig | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        attn_implementation: str = 'sdpa',
        max_batch_size: int | None = None,
        **from_pretrained_kwargs: Any,
    ):
        device = resolve_device(device)
        dtype = dtype or (torch.bfloat16 if device.type == 'cuda' else torch.float32)
        kwargs = {'dtype': dtype, 'attn_implementation': attn_implementation, **from_pretrained_kwargs}
        model = load_causal_lm('TorchSampler', model_id, model_cls, config, **kwargs)
        model.to(device)  # type: ignore[arg-type]  # transformers wraps to() in functools.wraps: self is not bound
        self._attach(_frozen(model), model_id, device, max_batch_size, shared=False)

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        model_id: str | None = None,
        template: str | Template | None = None,
    ) -> TorchSampler:
        """A sampler over ``model``'s own weights, shared, not copied: every ``sample`` call
        sees them as they are then, so there is nothing to sync (``load_weights`` and adding
        adapters are refused). Made for a trainer and a sampler that take turns on one device,
        as the server's worker thread does with ``TransformersModel.model``.

        ``adapter_name`` picks one of the model's adapters; without it the base model samples,
        every adapter switched off. Each call leaves the model as it found it: each module's
        train/eval mode, which adapter rows use, and which parameters require grad. ``model_id``
        (for the tokenizer) defaults to the directory the model was loaded from.

        Example::

            trainer = TransformersModel(assets.tiny_model())
            trainer.add_adapter_to_model('policy', LoraConfig(r=8, target_modules='all-linear'))
            sampler = TorchSampler.from_model(trainer.model)
            responses = sampler.sample(prompts, SamplingParams(max_tokens=16), adapter_name='policy')
        """
        if not isinstance(model, PreTrainedModel):
            raise ConfigurationError(
                f'from_model takes a transformers PreTrainedModel (TransformersModel.model); got {type(model).__name__}'
            )
        sampler = cls.__new__(cls)
        model_id = model_id or getattr(model.config, 'name_or_path', None) or None
        sampler._attach(model, model_id, next(model.parameters()).device, None, shared=True)
        if template is not None:
            sampler.set_template(template)
        return sampler

    def _attach(
        self,
        model: PreTrainedModel,
        model_id: str | None,
        device: torch.device,
        max_batch_size: int | None,
        shared: bool,
    ) -> None:
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size <= 0):
            raise ConfigurationError(f'max_batch_size must be a positive integer or None; got {max_batch_size!r}')
        self.model: PreTrainedModel = model
        self.model_id = model_id
        self.device = device
        self.max_batch_size = max_batch_size
        self.default_adapter: str | None = None
        self.weight_version = 0
        #: Whether the weights are another component's (``from_model``): never loaded into.
        self.shared = shared
        #: Asked between two decode steps whether to give the device up or to end (None: never).
        self.turns: Turns | None = None
        #: The adapters of the generations in progress (paused ones too), with how many use each.
        self.busy: Counter[str | None] = Counter()
        #: The rows of every call in flight (made on first use: it needs the template's pad token).
        self._batch: ContinuousBatch | None = None
        #: Held by the thread stepping the batch (released while it gives the device up).
        self._driving = threading.Lock()

    # ---- adapters and weights -------------------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        return multi_lora.adapter_names(self.model)

    def add_adapter(self, adapter_name: str, config_or_dir: PeftConfig | str) -> None:
        """Add a LoRA adapter: a ``peft`` config (weights as initialised) or a saved adapter
        directory, such as one ``TransformersModel.save`` wrote."""
        self._own_weights('add an adapter')
        weights = None
        if isinstance(config_or_dir, str):
            path = resolve_model(config_or_dir)
            config = PeftConfig.from_pretrained(path)
            weights = _read_adapter(path)
        else:
            config = config_or_dir
        self._ensure_adapter(adapter_name, config)
        if weights is not None:
            self.load_adapter_weights(adapter_name, weights)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> int:
        """Copy base-model tensors in, by name (``TransformersModel`` or PEFT names both work:
        ``base_model.model.`` and ``.base_layer`` are ignored). Returns how many were copied."""
        self._own_weights('load weights')
        params = {canonical_name(name): p for name, p in self.model.named_parameters() if '.lora_' not in name}
        unknown = sorted(set(map(canonical_name, weights)) - set(params))
        if unknown:
            raise ConfigurationError(f'the sampler model has no parameters {unknown[:5]} (of {len(unknown)} unknown)')
        with torch.no_grad():
            for name, tensor in weights.items():
                target = params[canonical_name(name)]
                if target.shape != tensor.shape:
                    raise ConfigurationError(
                        f'weight {name!r} has shape {tuple(tensor.shape)}; expected {target.shape}'
                    )
                target.copy_(tensor)
        return len(weights)

    def load_adapter_weights(
        self, adapter_name: str, weights: Mapping[str, torch.Tensor], config: PeftConfig | None = None
    ) -> None:
        """Set an adapter's tensors (PEFT state-dict names, as ``get_peft_model_state_dict``
        gives them); with ``config`` the adapter is created first if missing."""
        self._own_weights('load adapter weights')
        if config is not None:
            self._ensure_adapter(adapter_name, config)
        if adapter_name not in self.adapter_names:
            raise UnknownNameError('adapter', adapter_name, self.adapter_names)
        multi_lora.load_peft_state_dict(self.model, adapter_name, weights)

    def _own_weights(self, action: str) -> None:
        if self.shared:
            raise StateError(
                f"cannot {action}: this sampler shares its model's weights (TorchSampler.from_model) and samples "
                'them as they are; change the model itself, or sync into a TorchSampler with its own copy'
            )

    def _ensure_adapter(self, adapter_name: str, config: PeftConfig) -> None:
        if adapter_name in self.adapter_names:
            return
        multi_lora.add_adapter(self.model, adapter_name, multi_lora.spec_from_peft(config, self.model))
        _frozen(self.model)

    # ---- sampling -------------------------------------------------------------------------------
    @property
    def template(self) -> Template:
        """The template ``set_template`` set, else the model's: the ``VisionTemplate`` for a model with a
        vision tower (its prompts may hold images), the text ``Template`` otherwise."""
        if self._template is None and self.model_id is not None and takes_images(self.model):
            self._template = VisionTemplate(self.model_id)
        return super().template

    def _complete(
        self, prompts: list[Prompt], params: SamplingParams, adapter_name: AdapterChoice
    ) -> tuple[list[Completion], list[PromptLogprobs]]:
        adapter = self._resolve_adapter(adapter_name)
        n = params.num_samples
        request = Request(
            rows=[prompt.input_ids for prompt in prompts for _ in range(n)],
            images=[prompt.images for prompt in prompts for _ in range(n)],
            seeds=[row_seed(params.seed, prompt.input_ids, j) for prompt in prompts for j in range(n)],
            params=params,
            adapter=adapter,
            stop_ids=frozenset(self._stop_ids(params)),
            want_prompt=params.prompt_logprobs or params.topk_prompt_logprobs > 0,
            limit_s=self.turns.time_limit_s() if self.turns is not None else None,
        )
        self.busy[adapter] += 1
        try:
            self._drive(request)
        finally:
            self.busy[adapter] -= 1
            if not self.busy[adapter]:
                del self.busy[adapter]
        return request.out, request.prompt_logprobs

    @property
    def batch(self) -> ContinuousBatch:
        """The running batch every call's rows join."""
        if self._batch is None:
            pad = self.template.pad_token_id
            decode = lambda *args, **kwargs: self.template.decode(*args, **kwargs)  # noqa: E731  # set_template's
            self._batch = ContinuousBatch(self.model, pad, decode, placeholder_ids(self.model), self.max_batch_size)
        return self._batch

    def _drive(self, request: Request) -> None:
        """Add ``request``'s rows to the batch and step it, every request in it, until they end. A call
        made while another thread steps waits for it, its rows stepped meanwhile, and steps on if they
        have not ended when it gets the batch. Before each step, with ``turns``, it may give the device
        up (the model put back as found): before its first too, so that when several calls arrive
        together each adds its rows and the last prefills them all in one forward; each later turn
        steps at least once, so every turn moves the batch on. A call unwound meanwhile takes its
        rows out."""
        batch = self.batch
        batch.submit(request)
        mode = _SamplingMode(self.model)
        may_yield = True  # before the call's first step and after each step: a turn steps at least once
        with self._driving:
            try:
                while not request.done:
                    if may_yield and self.turns is not None and self.turns.due():
                        self._give_way(mode, self.turns)
                        may_yield = False
                        continue
                    mode.enter()  # set up once, and again after a pause
                    batch.step(mode.assign)
                    may_yield = True
            finally:
                mode.leave()
                if not request.done:
                    batch.drop(request)
        if request.error is not None:
            raise request.error

    def _give_way(self, mode: _SamplingMode, turns: Turns) -> None:
        """Between two steps: the model put back as found, the batch left to whoever needs it, until
        this generation's turn comes again. A job that fails meanwhile unwinds from ``give_way``."""
        mode.leave()
        self._driving.release()
        try:
            turns.give_way()
        finally:
            self._driving.acquire()

    def _resolve_adapter(self, adapter_name: AdapterChoice) -> str | None:
        if adapter_name is None:
            return self.default_adapter
        if not isinstance(adapter_name, str):
            raise ConfigurationError(
                f'TorchSampler samples a call from one adapter; got adapter_name={list(adapter_name)!r}: make a call '
                'per adapter (vLLMSampler takes one adapter per prompt)'
            )
        if adapter_name not in self.adapter_names:
            raise UnknownNameError('adapter', adapter_name, self.adapter_names or ['(none: no adapter was added)'])
        return adapter_name

    def _check(self, prompts: list[Prompt], params: SamplingParams) -> None:
        vocab = vocab_size(self.model)
        # A vision-language config keeps the language model's context in its text config.
        context = getattr(self.model.config.get_text_config(), 'max_position_embeddings', None)
        check_takes_images(self.model, [index for index, prompt in enumerate(prompts) if prompt.images is not None])
        for token in params.stop_token_ids:
            if token >= vocab:
                raise ConfigurationError(f'stop token id {token} is outside the vocabulary [0, {vocab})')
        for index, prompt in enumerate(prompts):
            low, high = min(prompt.input_ids), max(prompt.input_ids)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise DataError(f'prompt {index} has token id {bad}, outside the vocabulary [0, {vocab})')
            if context is not None and len(prompt.input_ids) + params.max_tokens > context:
                raise SequenceTooLongError(
                    f'prompt {index} has {len(prompt.input_ids)} tokens; with max_tokens={params.max_tokens} it '
                    f'would exceed the model context of {context} tokens'
                )

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= _eos_ids(self.model, self.template)
        return stop


class _SamplingMode:
    """The model set up to sample: eval mode, and ``assign`` sets which adapter each row of the next
    forward uses. ``leave`` puts back each module's mode, the layers' row assignment and the
    ``requires_grad`` flags as ``enter`` found them, so a model shared with a trainer
    (``from_model``) trains on as if nothing had happened, between two slices of a generation too."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self._modes: list[tuple[torch.nn.Module, bool]] = []
        self._grads: list[tuple[torch.nn.Parameter, bool]] = []
        self._layers: dict[str, multi_lora.AdapterLayer] = {}
        self._assignments: dict[str, RowAssignment | None] | None = None  # as enter found them

    def enter(self) -> None:
        """Set the model up to sample (nothing if it is already)."""
        if self._assignments is not None:
            return
        self._modes = [(module, module.training) for module in self.model.modules()]
        self._grads = [(param, param.requires_grad) for param in self.model.parameters()]
        self._layers = multi_lora.multi_lora_layers(self.model)
        self._assignments = {path: layer.assignment for path, layer in self._layers.items()}
        self.model.train(False)  # eval(), which transformers leaves unannotated

    def assign(self, names: Sequence[str | None]) -> None:
        """Row ``i`` of the next forward through adapter ``names[i]`` (None: the base model only)."""
        assignment = RowAssignment.from_names(names[0] if len(set(names)) == 1 else names)
        for layer in self._layers.values():
            layer.assignment = assignment

    def leave(self) -> None:
        """Put the model back as ``enter`` found it (nothing if it is not set up)."""
        assignments, self._assignments = self._assignments, None
        if assignments is None:
            return
        for path, before in assignments.items():
            self._layers[path].assignment = before
        for param, flag in self._grads:
            param.requires_grad_(flag)
        for module, mode in self._modes:
            module.training = mode


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    """The model in eval mode (no dropout), no parameter requiring grad: a sampler never trains it."""
    model.train(False)  # eval(), which transformers leaves unannotated
    return model.requires_grad_(False)


def _eos_ids(model: PreTrainedModel, template: Any) -> set[int]:
    ids = set()
    eos = getattr(getattr(model, 'generation_config', None), 'eos_token_id', None)
    for value in eos if isinstance(eos, list) else [eos]:
        if value is not None:
            ids.add(int(value))
    if template.tokenizer.eos_token_id is not None:
        ids.add(int(template.tokenizer.eos_token_id))
    return ids


def _read_adapter(path: str) -> dict[str, torch.Tensor]:
    from peft.utils import load_peft_weights

    return load_peft_weights(path, device='cpu')
