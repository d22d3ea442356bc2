"""``TorchSampler``: batched generation with a KV cache in plain PyTorch, on any device.

The loop is the one ``transformers.generate`` runs, written out so that it can return what RL
needs and ``generate`` does not give cheaply: the log-probability of every sampled token under
the distribution it was drawn from (``logits.sampled_logprobs``), per-sequence seeds
that do not depend on the batch, stop strings, and rows that leave the batch (and the cache) as
soon as they finish. Between two decode steps a generation may give the device up to other work
(``turns``: the server's slices), the model put back as it found it meanwhile; it goes on from its
cache and generators as they were, so the tokens are the ones it would have sampled without a pause.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from peft import PeftConfig
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from twinkle.data_format import SamplingParams, TokenLogprob
from twinkle.errors import ConfigurationError, DataError, SequenceTooLongError, StateError, UnknownNameError
from twinkle.hub import resolve_model
from twinkle.model import multi_lora, router
from twinkle.model.loading import load_causal_lm, resolve_device
from twinkle.sampler.base import SAMPLERS, AdapterChoice, Completion, Prompt, PromptLogprobs, Sampler, row_seed
from twinkle.sampler.images import (
    PromptImages,
    check_takes_images,
    decode_positions,
    image_prefill,
    placeholder_ids,
    takes_images,
)
from twinkle.sampler.logits import choose, processed_scores, sampled_logprobs, top_logprobs
from twinkle.template import Template, VisionTemplate
from twinkle.utils.weights import canonical_name, vocab_size


class Turns(Protocol):
    """Where a generation in progress lets other work use the device, between two decode steps
    (``twinkle.server.execution.slicing.TURNS``: the server's sampling slices)."""

    def due(self) -> bool:
        """Whether the generation has had its turn: it should give way now."""
        ...

    def give_way(self) -> None:
        """Let the other work run; return once it is the generation's turn again."""
        ...

    def out_of_time(self) -> bool:
        """Whether the generation has used all its time: its rows end as at ``max_tokens``."""
        ...


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
    ``max_batch_size`` caps the sequences decoded together (all of a call by default). With
    ``turns`` set, each generation asks it between two decode steps whether to give way (it puts
    the model back as it found it meanwhile) or to end.

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
        rows = [prompt.input_ids for prompt in prompts for _ in range(params.num_samples)]
        images = [prompt.images for prompt in prompts for _ in range(params.num_samples)]
        seeds = [row_seed(params.seed, p.input_ids, j) for p in prompts for j in range(params.num_samples)]
        want_prompt = params.prompt_logprobs or params.topk_prompt_logprobs > 0
        completions: list[Completion] = []
        prompt_info: list[PromptLogprobs] = []
        size = self.max_batch_size or len(rows)
        with self._sampling_with(adapter) as mode:
            for start in range(0, len(rows), size):
                part = slice(start, start + size)
                batch = _Generation(self, mode, rows[part], images[part], seeds[part], params, want_prompt)
                completions += batch.run()
                prompt_info += batch.prompt_logprobs
        return completions, prompt_info

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

    @contextlib.contextmanager
    def _sampling_with(self, adapter: str | None) -> Iterator[_SamplingMode]:
        """The model set up to sample from ``adapter`` (``_SamplingMode``), put back afterwards;
        ``adapter`` counts as busy meanwhile, pauses included."""
        mode = _SamplingMode(self.model, adapter)
        self.busy[adapter] += 1
        try:
            mode.enter()
            yield mode
        finally:
            mode.leave()
            self.busy[adapter] -= 1
            if not self.busy[adapter]:
                del self.busy[adapter]

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
    """The model set up to sample: eval mode, ``adapter`` on every row (``None``: every adapter
    off). ``leave`` puts back each module's mode, the rows' adapters and the ``requires_grad``
    flags as ``enter`` found them, so a model shared with a trainer (``from_model``) trains on as
    if nothing had happened, between two slices of a generation too."""

    def __init__(self, model: PreTrainedModel, adapter: str | None):
        self.model, self.adapter = model, adapter
        self._modes: list[tuple[torch.nn.Module, bool]] = []
        self._grads: list[tuple[torch.nn.Parameter, bool]] = []
        self._rows: contextlib.AbstractContextManager[object] | None = None

    def enter(self) -> None:
        self._modes = [(module, module.training) for module in self.model.modules()]
        self._grads = [(param, param.requires_grad) for param in self.model.parameters()]
        self.model.train(False)  # eval(), which transformers leaves unannotated
        rows = multi_lora.row_adapters(self.model, self.adapter)
        try:
            rows.__enter__()
        except BaseException:
            self._put_back()
            raise
        self._rows = rows

    def leave(self) -> None:
        """Put the model back as ``enter`` found it (nothing if it is not set up)."""
        rows, self._rows = self._rows, None
        if rows is None:
            return
        try:
            rows.__exit__(None, None, None)
        finally:
            self._put_back()

    def _put_back(self) -> None:
        for param, flag in self._grads:
            param.requires_grad_(flag)
        for module, mode in self._modes:
            module.training = mode


@dataclass
class _Generation:
    """One batch of rows decoded together."""

    sampler: TorchSampler
    mode: _SamplingMode
    rows: list[list[int]]
    images: list[PromptImages | None]
    seeds: list[int | None]
    params: SamplingParams
    want_prompt: bool
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)

    def run(self) -> list[Completion]:
        """Decode the rows; with ``return_routed_experts`` each completion also gets the experts
        every MoE layer chose for its tokens (``RoutingRecorder``)."""
        if not self.params.return_routed_experts:
            return self._decode(None)
        with router.RoutingRecorder(self.sampler.model) as recorder:
            return self._decode(recorder)

    @torch.no_grad()
    def _decode(self, recorder: router.RoutingRecorder | None) -> list[Completion]:
        sampler, params = self.sampler, self.params
        model, device = sampler.model, sampler.device
        ids, mask = _left_pad(self.rows, sampler.template.pad_token_id, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        logits, deltas = self._prefill(ids, mask, positions, cache)
        if self.want_prompt:
            self.prompt_logprobs = _prompt_logprobs(logits, ids, mask, self.params.topk_prompt_logprobs)
        routes = _Routes(recorder, self.rows)
        routes.prefilled(ids.shape[-1])
        logits = logits[:, -1]
        seen = _seen(ids, mask, logits.shape[-1]) if params.repetition_penalty != 1.0 else None
        generators = _generators(self.seeds, device)
        never = placeholder_ids(model)  # image pads are never sampled
        stop_ids, stop_strings = sampler._stop_ids(params), params.stop_strings
        window = 4 * max((len(s) for s in stop_strings), default=0) + 4
        out = [Completion(tokens=[], logprobs=[], stop_reason='length') for _ in self.rows]
        active = list(range(len(self.rows)))
        next_pos = positions[:, -1] + 1
        for step in range(params.max_tokens):
            tokens = choose(processed_scores(logits, params, seen, never), params, generators)
            self._record(out, active, sampled_logprobs(logits, params, seen), tokens)
            finished = {row for row in active if self._finished(out[row], stop_ids, stop_strings, window)}
            if step == params.max_tokens - 1 or len(finished) == len(active) or not self._take_turn(recorder):
                break
            keep = [j for j, row in enumerate(active) if row not in finished]
            if finished:
                index = torch.tensor(keep, device=device)
                _keep_rows(cache, index)
                tokens, mask, next_pos = tokens[index], mask[index], next_pos[index]
                deltas = deltas[index] if deltas is not None else None
                seen = seen[index] if seen is not None else None
                generators = [generators[j] for j in keep] if generators is not None else None
                active = [active[j] for j in keep]
            if seen is not None:
                seen[torch.arange(len(active), device=device), tokens] = True
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=-1)
            logits = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=decode_positions(next_pos[:, None], deltas),
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            routes.decoded(active)
            next_pos = next_pos + 1
        routes.finish(out)
        return out

    def _take_turn(self, recorder: router.RoutingRecorder | None) -> bool:
        """Between two decode steps: False once the generation is out of time (its rows end as at
        ``max_tokens``, their last token never fed, as there); else, if its turn is over, give way
        with the model put back as found and the routing recorder's hooks off. A job that fails
        meanwhile unwinds from ``give_way``, the model left put back."""
        turns = self.sampler.turns
        if turns is None:
            return True
        if turns.out_of_time():
            return False
        if turns.due():
            if recorder is not None:
                recorder.__exit__(None, None, None)
            self.mode.leave()
            turns.give_way()
            self.mode.enter()
            if recorder is not None:
                recorder.__enter__()
        return True

    def _prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompts' forward into ``cache``: its logits (every position's with ``want_prompt``, else
        the last), and with images each row's multimodal RoPE delta for the decode steps."""
        model = self.sampler.model
        inputs: dict[str, torch.Tensor] = {'position_ids': positions}
        deltas = None
        images = image_prefill(model, self.images, ids, mask, positions)
        if images is not None:
            inputs, deltas = images.model_inputs, images.deltas
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if self.want_prompt else 1,
            **inputs,
        ).logits
        return logits, deltas

    def _record(self, out: list[Completion], active: list[int], logps: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append each active row's token with its logprob under ``logps``, the distribution it was
        drawn from (``sampled_logprobs``), and the ``logprobs=k`` most likely of it."""
        chosen = logps.gather(-1, tokens[:, None]).squeeze(-1)
        tokens_l, chosen_l = tokens.tolist(), chosen.tolist()
        top = top_logprobs(logps, self.params.logprobs or 0)
        for j, row in enumerate(active):
            out[row].tokens.append(tokens_l[j])
            out[row].logprobs.append([(tokens_l[j], chosen_l[j]), *top[j]])

    def _finished(self, completion: Completion, stop_ids: set[int], stop_strings: list[str], window: int) -> bool:
        if completion.tokens[-1] in stop_ids:
            completion.stop_reason = 'stop'
            return True
        if not stop_strings:
            return False
        tail = self.sampler.template.decode(completion.tokens[-window:])
        if not any(s in tail for s in stop_strings):
            return False
        text = self.sampler.template.decode(completion.tokens, skip_special_tokens=True)
        found = [text.find(s) for s in stop_strings if s in text]
        completion.stop_reason = 'stop'
        completion.text_end = min(found) if found else len(text)
        return True


@dataclass
class _Routes:
    """The experts each row's tokens were routed to, call by call (nothing without a recorder)."""

    recorder: router.RoutingRecorder | None
    rows: list[list[int]]
    parts: list[list[torch.Tensor]] = field(default_factory=list)  # per row: [layers, tokens, K] pieces

    def prefilled(self, width: int) -> None:
        """The prompts' routing, from the left-padded prefill of ``width`` positions."""
        if self.recorder is None:
            return
        experts = self.recorder.take()
        experts = experts.view(experts.shape[0], len(self.rows), width, experts.shape[-1])
        self.parts = [[experts[:, j, width - len(row) :]] for j, row in enumerate(self.rows)]

    def decoded(self, active: list[int]) -> None:
        """The routing of the token each ``active`` row was just fed."""
        if self.recorder is None:
            return
        experts = self.recorder.take()
        for j, row in enumerate(active):
            self.parts[row].append(experts[:, j : j + 1])

    def finish(self, out: list[Completion]) -> None:
        """Each completion's ``routed_experts`` [tokens][layers][K] over prompt plus completion;
        the last token was never fed to the model: -1 (not recorded) there."""
        if self.recorder is None:
            return
        for completion, parts in zip(out, self.parts, strict=True):
            experts = torch.cat(parts, dim=1).permute(1, 0, 2)
            last = torch.full_like(experts[:1], router.NOT_RECORDED)
            completion.routed_experts = torch.cat([experts, last]).tolist()


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    """The model in eval mode (no dropout), no parameter requiring grad: a sampler never trains it."""
    model.train(False)  # eval(), which transformers leaves unannotated
    return model.requires_grad_(False)


def _left_pad(rows: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def _seen(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    seen = torch.zeros((ids.shape[0], vocab), dtype=torch.bool, device=ids.device)
    seen.scatter_(1, ids, mask.bool())
    return seen


def _prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, k: int) -> list[PromptLogprobs]:
    """Each prompt token's logprob given the tokens before it (``None`` for the first)."""
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    own = logps.gather(-1, ids[:, 1:, None]).squeeze(-1).tolist()
    top = torch.topk(logps, k, dim=-1) if k else None
    result = []
    for i, length in enumerate(mask.sum(-1).tolist()):
        start = ids.shape[1] - length  # the first real token; it has no logprob
        values = [None, *own[i][start:]]
        topk: list[list[TokenLogprob] | None] = [None]
        if top is not None:
            topk += [
                list(zip(t, v, strict=True))
                for t, v in zip(top.indices[i, start:].tolist(), top.values[i, start:].tolist(), strict=True)
            ]
        result.append(PromptLogprobs(logprobs=values, topk=topk))
    return result


def _generators(seeds: list[int | None], device: torch.device) -> list[torch.Generator] | None:
    if all(seed is None for seed in seeds):
        return None
    generators = []
    for seed in seeds:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        generators.append(generator)
    return generators


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


def _keep_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep rows ``index`` of every cache layer. ``reorder_cache`` selects every state a layer
    holds: keys and values, and a linear-attention layer's (Qwen3.5's gated deltanet) conv and
    recurrent states, which ``batch_select_indices`` does not know."""
    cache.reorder_cache(cast(torch.LongTensor, index))
