"""``TransformersModel``: a Hugging Face causal LM with named LoRA adapters, each trained on its
own optimizer, schedule, loss and accumulation count, behind the methods the user's loop calls.

The model is the front; its parts work behind it, each handed what it needs (none imports this
module): ``ModelRunner`` (``runner.py``) runs rows through the model to losses and gradients,
``mixed_pass.py`` runs several adapters' calls as one pass through it, ``Stepper``
(``optim/stepping.py``) builds and steps the optimizers, ``Checkpointer`` (``checkpoint/checkpointer.py``) saves
and loads, and ``ModelParallel`` (``layout.py``) spreads all of it over a device mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftConfig
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from transformers import PretrainedConfig, PreTrainedModel

from twinkle.data_format import ModelOutput
from twinkle.errors import ConfigurationError, DataError, StateError, UnknownNameError, one_of
from twinkle.hub import resolve_model
from twinkle.infra.mesh import DeviceMesh
from twinkle.infra.runtime import get_runtime
from twinkle.loss import LOSSES, Loss
from twinkle.metric import METRICS, Metric, TrainMetric
from twinkle.model import mixed_pass, packed_recurrence
from twinkle.model.base import AdapterCall, Inputs, OptimizerStep, StepCall, TwinkleModel
from twinkle.model.checkpoint.checkpointer import Checkpointer, Restored, existing_checkpoint
from twinkle.model.layout import ModelParallel
from twinkle.model.loading import (
    Precision,
    compile_blocks,
    default_precision,
    enable_gradient_checkpointing,
    load_causal_lm,
    resolve_device,
)
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.adapter import check_name
from twinkle.model.optim.offload import OptimizerOffloader
from twinkle.model.optim.stepping import Stepper, describe_optimizer
from twinkle.model.output.layer import fuses_by_default
from twinkle.model.output.value_head import ValueHead, has_saved_head, new_value_head
from twinkle.model.passes import check_positive
from twinkle.model.router import Router, model_router
from twinkle.model.runner import ModelRunner, packs_by_default
from twinkle.model.train_group import FULL, Accumulation, AdapterSpec, TrainGroup
from twinkle.processor import PROCESSORS, InputProcessor
from twinkle.template import TEMPLATES, Template


class TransformersModel(TwinkleModel):
    """A causal LM from ``model_id`` (``ms://``, ``hf://`` or a local directory), or built from
    ``config`` with random weights.

    Example::

        model = TransformersModel(model_id=assets.tiny_model())
        model.add_adapter_to_model('default', LoraConfig(r=8, target_modules='all-linear'))
        model.set_optimizer('AdamW', lr=1e-4)
        for batch in dataloader:
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()

    ``mixed_precision='bf16'`` runs forward passes under bfloat16 autocast (the default on a
    GPU that supports it; ``'no'`` on a CPU). Weights keep ``dtype`` (float32 unless given).

    ``device_mesh`` (default: the runtime's ``global_device_mesh``) spreads the model over the
    torchrun processes (see ``twinkle.model.layout``): data parallel over ``dp`` (not
    ``DistributedDataParallel``: each adapter's summed gradients and item counts are all-reduced
    at its step), FSDP2 sharding over ``fsdp`` (``fully_shard`` at the first forward, so adapters
    come first). Each rank runs its slice of the global batch; losses, metrics and updates are
    those of one process running the whole batch.

    ``fused_output=True`` runs the output layer fused in training passes (``forward_backward``,
    the mixed pass) whose loss reads no more than the labels' log-probabilities (cross entropy,
    the policy-gradient, preference and Tinker losses; ``Loss.output_reads``): each label's
    logprob comes from the last hidden states in chunks of tokens, and the ``[tokens, vocab]``
    logits never exist whole (``twinkle.model.output.fused``). The numbers equal the unfused
    ones to 1e-5; ``forward``/``forward_only`` still return logits. By default (``None``) it is on
    for a head of a real vocabulary (``output_layer.FUSED_BY_DEFAULT_FROM``, 32,768 outputs or more),
    where it was measured faster and leaner, and off for the small ones. It can be switched at any
    time (``model.fused_output = False``).

    ``padding_free=True`` packs the rows of a ``forward_backward`` call into one row without
    padding, for an adapter that sets no processor of its own: no compute is spent on padding, and
    the loss and gradients are the padded ones (1e-5). ``forward``/``forward_only`` and the mixed
    pass keep rows padded (their callers read per-row outputs; packed rows do not mix). By default
    (``None``) it is on where it pays, under a flash attention kernel (``attn_implementation``
    ``'flash_attention_2'`` and its kin), and off under ``sdpa`` and ``eager``, where a packed row
    needs a mask over all its tokens (``runner.packs_by_default``).

    ``compile_layers=True`` compiles each decoder layer with ``torch.compile`` (regional: one
    layer's code serves all of them; dynamic shapes, so new row lengths do not compile again), in
    place, so parameter names and checkpoints are unchanged. The first pass of each kind pays the
    compile (a training pass, a ``no_grad`` pass, a pass with the adapters off for a KL
    reference); the numbers equal eager ones to 1e-5. Off by default: see ``docs/training.md``,
    "Compiled layers", for what it measured on the CPU.
    """

    def __init__(
        self,
        model_id: str | None = None,
        model_cls: type[PreTrainedModel] | None = None,
        config: PretrainedConfig | None = None,
        *,
        device_mesh: DeviceMesh | None = None,
        device: str | torch.device | None = None,
        mixed_precision: Precision | None = None,
        dtype: torch.dtype | None = None,
        attn_implementation: str = 'sdpa',
        gradient_checkpointing: bool = False,
        router_aux_loss_coef: float | None = None,
        fused_output: bool | None = None,
        padding_free: bool | None = None,
        compile_layers: bool = False,
        **from_pretrained_kwargs: Any,
    ):
        self.model_id = model_id
        self._parallel = ModelParallel(device_mesh if device_mesh is not None else get_runtime().global_device_mesh)
        device = resolve_device(device, self._parallel.default_device())
        mixed_precision = mixed_precision or default_precision(device)
        if mixed_precision not in ('no', 'bf16'):
            raise one_of('mixed_precision', mixed_precision, ['no', 'bf16'])
        kwargs = {'dtype': dtype or torch.float32, 'attn_implementation': attn_implementation}
        self.model = load_causal_lm(
            'TransformersModel', model_id, model_cls, config, **kwargs, **from_pretrained_kwargs
        )
        self.model.to(device)  # type: ignore[arg-type]  # transformers wraps to() in functools.wraps: self is not bound
        self._parallel.shard_experts(self.model)
        packed_recurrence.attach(self.model)  # packed rows kept apart in linear-attention layers too
        self._parallel.split_sequences(self.model, moe=model_router(self.model.config, None) is not None)
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        if not isinstance(compile_layers, bool):
            raise ConfigurationError(f'compile_layers must be True or False; got {compile_layers!r}')
        if compile_layers and gradient_checkpointing:
            # Until RowAssignment.place, dynamo gave transformers' checkpointed layers no graph (the row-index
            # cache filled inside the checkpoint); now it compiles one, whose speed and gradients against the
            # eager ones no test checks yet.
            raise ConfigurationError(
                'compile_layers=True and gradient_checkpointing=True do not combine yet: compiled checkpointed '
                'layers are not checked against the eager numbers; choose one'
            )
        self._compile_layers = compile_layers
        if compile_layers:
            compile_blocks(self.model)
        moe_router = model_router(self.model.config, router_aux_loss_coef)
        self._assemble(device, mixed_precision, moe_router, Checkpointer)
        self.fused_output = fuses_by_default(self.model) if fused_output is None else fused_output
        self.padding_free = packs_by_default(self.model.config) if padding_free is None else padding_free

    def _assemble(
        self,
        device: torch.device,
        mixed_precision: Precision,
        moe_router: Router | None,
        checkpointer_cls: type[Checkpointer],
    ) -> None:
        """The parts behind the front, around ``self.model`` and ``self._parallel`` (set first):
        the runner, the full-model group, the stepper and the checkpointer."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        #: The base model's parameter count (adapters add theirs; nothing changes this one).
        self._base_numel = sum(p.numel() for p in self.model.parameters())
        #: Each adapter's training state by name (only ``FULL``, every weight, before any adapter).
        self.groups: dict[str, TrainGroup] = {}
        self._runner = ModelRunner(
            self.model,
            self.model_id,
            self.groups,
            self._parallel,
            device=device,
            mixed_precision=mixed_precision,
            model_router=moe_router,
        )
        self.groups[FULL] = TrainGroup(self._spec(FULL), params)
        self._stepper = Stepper(self._parallel)
        self._checkpointer = checkpointer_cls(self.model, self.model_id, self._parallel, self._stepper.optimizer_ready)
        #: Most padded tokens one forward of a mixed pass holds: calls past it get forwards of
        #: their own (``mixed_pass.length_buckets``). None: no cap. See ``forward_token_cap``.
        self.mixed_forward_tokens: int | None = mixed_pass.forward_token_cap(device)

    # ---- what the model's collaborators read ----------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device this process runs the model on."""
        return self._runner.device

    @property
    def fused_output(self) -> bool:
        """Whether training passes run the output layer fused (see the class docstring)."""
        return self._runner.fused_output

    @fused_output.setter
    def fused_output(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigurationError(f'fused_output must be True or False; got {value!r}')
        self._runner.fused_output = value

    @property
    def padding_free(self) -> bool:
        """Whether ``forward_backward`` packs rows (see the class docstring)."""
        return self._runner.padding_free

    @padding_free.setter
    def padding_free(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigurationError(f'padding_free must be True or False; got {value!r}')
        self._runner.padding_free = value

    @property
    def compile_layers(self) -> bool:
        """Whether the decoder layers run compiled (set at construction; see the class docstring)."""
        return self._compile_layers

    @property
    def mixed_precision(self) -> Precision:
        """``'bf16'``: forwards run under bfloat16 autocast; ``'no'``: in the weights' dtype."""
        return self._runner.mixed_precision

    @property
    def router(self) -> Router | None:
        """A mixture of experts' router (None for a dense model): its load-balancing loss joins the
        training loss with ``router.aux_loss_coef`` (the config's ``router_aux_loss_coef`` unless
        given), and the experts' load is a metric (``ExpertLoad``)."""
        return self._runner.router

    @property
    def offloader(self) -> OptimizerOffloader | None:
        """Moves idle adapters' optimizer state off the device (to CPU memory, then disk); a server
        sets one. None: every optimizer state stays where its parameters are."""
        return self._stepper.offloader

    @offloader.setter
    def offloader(self, offloader: OptimizerOffloader | None) -> None:
        self._stepper.offloader = offloader

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh the model is spread over (None: one process): a rank worker finds its data rank in it."""
        return self._parallel.mesh

    @property
    def uses_fsdp(self) -> bool:
        """Whether the weights are sharded over the mesh's ``fsdp`` ranks (FSDP2): every forward then
        all-gathers them, so every rank must run each forward in step with the others."""
        return self._parallel.fsdp

    def train_group(self, adapter_name: str | None = None) -> TrainGroup:
        """The training state of ``adapter_name`` (its parameters, optimizer, loss, counters...).
        Left out: the only adapter, or the full model when no adapter was added."""
        if adapter_name is None:
            if len(self.groups) == 1:
                return next(iter(self.groups.values()))
            raise ConfigurationError(f'this model has several adapters; pass adapter_name= one of {self.adapter_names}')
        try:
            return self.groups[adapter_name]
        except KeyError:
            valid = self.adapter_names or ['(none: no adapter was added)']
            raise UnknownNameError('adapter', adapter_name, valid) from None

    # ---- adapters and components ---------------------------------------------------------------
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: LoraConfig | str,
        *,
        gradient_accumulation_steps: int = 1,
        value_head: bool = False,
    ) -> None:
        """Add a LoRA adapter named ``adapter_name``; from then on the base weights are frozen.
        ``config_or_dir`` is a peft ``LoraConfig``, or a saved adapter directory whose config and
        weights are loaded. The layers are this project's (``twinkle.model.lora.multi``): every
        adapter stays in the model, and one forward pass can run each row through its own.

        ``value_head=True`` makes the adapter a critic (``twinkle.model.output.value_head``): a scalar
        head on the last hidden state, trained, saved and loaded with it; its forwards return
        ``values`` and it takes a value loss (``ValueLoss``). A directory saved from a critic
        brings its head back whatever ``value_head`` says."""
        check_name(adapter_name)
        if adapter_name in self.groups:
            raise ConfigurationError(f'adapter {adapter_name!r} already exists; adapters: {self.adapter_names}')
        check_positive('gradient_accumulation_steps', gradient_accumulation_steps)
        self._parallel.check_can_add_adapter(adapter_name)
        config, weights_dir = adapter_source(config_or_dir)
        value_head = value_head or (weights_dir is not None and has_saved_head(weights_dir))
        self._check_value_head(adapter_name, value_head)
        params = self._inject_adapter(adapter_name, config)
        self.groups.pop(FULL, None)
        head = new_value_head(self.model, self.device) if value_head else None
        if head is not None:
            params = [*params, *head.parameters()]
        spec = self._spec(adapter_name, config, head)
        group = TrainGroup(spec, params, window=Accumulation(gradient_accumulation_steps=gradient_accumulation_steps))
        self.groups[adapter_name] = group
        if weights_dir is not None:
            try:
                self._checkpointer.load_adapter_weights(group, weights_dir)
            except BaseException:
                self.remove_adapter(adapter_name)
                raise
        self._parallel.adapter_added(group)
        self._runner.forget_mode()  # the new LoRA modules start in train mode whatever the rest is in

    def _spec(self, name: str, config: Any = None, value_head: ValueHead | None = None) -> AdapterSpec:
        """A new group's spec, with the experts' load among its metrics on a mixture of experts."""
        spec = AdapterSpec(name, config, value_head)
        spec.train_metrics += self._runner.router_metrics()
        spec.eval_metrics += self._runner.router_metrics()
        return spec

    def _check_value_head(self, adapter_name: str, value_head: bool) -> None:
        """``ConfigurationError`` where the adapter cannot have the value head it asks for."""
        if value_head and self.uses_fsdp:
            raise ConfigurationError(
                f'adapter {adapter_name!r}: a value head is not supported under FSDP2 sharding (the head lives '
                'outside the sharded model); train the critic in one process or on a data-parallel mesh'
            )

    def _inject_adapter(self, adapter_name: str, config: PeftConfig) -> list[nn.Parameter]:
        """The adapter's LoRA layers into the model; their parameters (the adapter's to train)."""
        multi_lora.add_adapter(self.model, adapter_name, multi_lora.spec_from_peft(config, self.model))
        return multi_lora.adapter_parameters(self.model, adapter_name)

    def shard_base(self) -> None:
        """Under an FSDP2 mesh, shard the base model now, before any adapter is added: adapters
        may then come and go while training (a server's tenants), each whole on every rank, its
        gradients all-reduced at its step (``ModelParallel.shard_base``). Every rank must have
        loaded the same weights (a checkpoint, not a random ``config``). Nothing to do otherwise."""
        if self.adapter_names:
            raise StateError(f'shard_base comes before any adapter; the model has {self.adapter_names}')
        self._parallel.shard_base(self.model, self.groups.values())

    def remove_adapter(self, adapter_name: str) -> None:
        """Drop an adapter, its layers and its training state."""
        self.train_group(adapter_name)
        multi_lora.remove_adapter(self.model, adapter_name)
        del self.groups[adapter_name]
        self._stepper.forget(adapter_name)

    @property
    def adapter_names(self) -> list[str]:
        return [name for name in self.groups if name != FULL]

    def set_optimizer(
        self, optimizer_cls: str | type[Optimizer] = 'AdamW', *, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """Any ``torch.optim`` optimizer by name or class; ``kwargs`` go to its constructor
        (``lr`` defaults to 1e-5). Parameters of fewer than 2 dimensions (biases, norms) get no
        weight decay."""
        self._stepper.set_optimizer(self.train_group(adapter_name), optimizer_cls, kwargs)

    def set_lr_scheduler(
        self, scheduler_cls: str | type[LRScheduler], *, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """A ``torch.optim.lr_scheduler`` scheduler, ``CosineWarmupScheduler`` or
        ``LinearWarmupScheduler``; stepped once per optimizer step."""
        self._stepper.set_lr_scheduler(self.train_group(adapter_name), scheduler_cls, kwargs)

    def set_optimizer_hyperparams(
        self,
        *,
        adapter_name: str | None = None,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
    ) -> None:
        """Change the optimizer's hyperparameters for its next steps, keeping its state (moments,
        step counts); those left None stay. A scheduler sets ``lr`` again at its next step."""
        values = {'lr': lr, 'betas': betas, 'eps': eps, 'weight_decay': weight_decay}
        self._stepper.set_hyperparams(self.train_group(adapter_name), values)

    def set_loss(self, loss_cls: str | type[Loss] | Loss, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        """The adapter's loss; a value loss (``needs_values``) only on an adapter with a value head."""
        group = self.train_group(adapter_name)
        loss = LOSSES.build(loss_cls, Loss, **kwargs)
        if loss.needs_values and group.spec.value_head is None:
            raise ConfigurationError(
                f'{type(loss).__name__} trains a value head, and adapter {group.name!r} has none; add the critic '
                f'with add_adapter_to_model(name, lora_config, value_head=True). Adapters with a value head: '
                f'{[name for name, g in self.groups.items() if g.spec.value_head is not None]}'
            )
        group.spec.loss = loss

    def set_template(
        self, template_cls: str | type[Template] | Template, *, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """The template that encodes trajectories given to this adapter; ``model_id`` defaults
        to the model's own."""
        if not isinstance(template_cls, Template):
            kwargs.setdefault('model_id', self.model_id)
        self.train_group(adapter_name).spec.template = TEMPLATES.build(template_cls, Template, **kwargs)

    def set_processor(
        self,
        processor_cls: str | type[InputProcessor] | InputProcessor,
        *,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        group = self.train_group(adapter_name)
        group.spec.processor = PROCESSORS.build(processor_cls, InputProcessor, **kwargs)
        group.spec.processor_set = True

    def add_metric(
        self,
        metric: str | type[Metric] | Metric,
        *,
        is_training: bool = True,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Add a metric fed ``accumulate(inputs=, outputs=, loss=)`` after every loss."""
        group = self.train_group(adapter_name)
        built = METRICS.build(metric, Metric, **kwargs)
        if isinstance(built, TrainMetric):
            raise ConfigurationError('TrainMetric is always on: calculate_metric() reports lr, grad_norm, tokens_per_s')
        (group.spec.train_metrics if is_training else group.spec.eval_metrics).append(built)

    # ---- forward and backward -------------------------------------------------------------------
    def forward(self, *, inputs: Inputs, adapter_name: str | None = None) -> ModelOutput:
        """A training-mode forward pass; ``calculate_loss`` and ``backward`` continue it."""
        group = self.train_group(adapter_name)
        return self._runner.forward(group, self._runner.features(group, inputs), training=True)

    def forward_only(
        self, *, inputs: Inputs, adapter_name: str | None = None, disable_lora: bool = False
    ) -> ModelOutput:
        """An evaluation-mode forward pass without gradients (``disable_lora=True``: the base
        model alone). ``calculate_loss`` afterwards feeds the evaluation metrics."""
        group = self.train_group(adapter_name)
        features = self._runner.features(group, inputs)
        with torch.no_grad():
            return self._runner.forward(group, features, training=False, lora=not disable_lora)

    def forward_values(self, *, inputs: Inputs, adapter_name: str | None = None) -> torch.Tensor:
        """A critic's values of ``inputs``, ``[batch, seq]`` float32 (evaluation mode, no gradient):
        at position ``t`` the value of the state that chooses label ``t`` (``twinkle.model.output.value_head``).
        ``ConfigurationError`` before any compute if the adapter has no value head."""
        group = self.train_group(adapter_name)
        if group.spec.value_head is None:
            raise ConfigurationError(
                f'adapter {group.name!r} has no value head to compute values with; add the critic with '
                'add_adapter_to_model(name, lora_config, value_head=True)'
            )
        values: torch.Tensor = self.forward_only(inputs=inputs, adapter_name=group.name).values
        return values

    def calculate_loss(self, *, adapter_name: str | None = None, **loss_inputs: Any) -> float:
        """The loss of the last forward pass (its mean over the items the loss counts)."""
        return self._runner.calculate_loss(self.train_group(adapter_name), loss_inputs)

    def backward(self, *, adapter_name: str | None = None) -> None:
        self._runner.backward_pending(self.train_group(adapter_name))

    def forward_backward(
        self,
        *,
        inputs: Inputs,
        adapter_name: str | None = None,
        micro_batch_size: int | None = None,
        **loss_inputs: Any,
    ) -> ModelOutput:
        """Forward, loss and backward over ``inputs`` (in chunks of ``micro_batch_size`` rows
        if given: one accumulation step either way). Returns the loss of these inputs (under a
        mesh: of every rank's inputs together, the global batch). A loss that is NaN or infinite
        raises ``DataError`` before its backward, leaving the gradients and metrics as they were
        (with ``micro_batch_size``: the chunks before it have been accumulated)."""
        group = self.train_group(adapter_name)
        return self._runner.forward_backward(group, self._runner.features(group, inputs), micro_batch_size, loss_inputs)

    def forward_backward_mixed(
        self, calls: Sequence[AdapterCall], *, forward_only: bool = False
    ) -> list[ModelOutput | DataError]:
        """Several adapters' ``forward_backward`` (or ``forward_only``) calls as one pass: every
        call's rows go through the base model together, each row through its own adapter, and
        each adapter gets the loss, gradient, logprobs and counters it would get alone.

        The adapters must differ and share a collation (``batch_key``). ``forward_only`` leaves
        each adapter's forward pending, as ``forward_only`` does, for ``calculate_loss``. A call
        whose loss is NaN or infinite gets its ``DataError`` in place of its output, and nothing
        of it is accumulated (gradients, metrics, counters); the others train as they would alone."""
        if self._parallel.sequence is not None:
            raise ConfigurationError(
                f'forward_backward_mixed is not supported with Ulysses sequence parallel (ulysses_size='
                f'{self._parallel.sequence.size}): call forward_backward for each adapter'
            )
        groups = [self.train_group(call.adapter_name) for call in calls]
        return mixed_pass.forward_backward_mixed(self._runner, groups, calls, forward_only, self.mixed_forward_tokens)

    def batch_key(self, adapter_name: str | None = None) -> mixed_pass.BatchKey | None:
        """Adapters whose keys are equal can share a ``forward_backward_mixed`` pass (the same
        collation); None: this adapter's rows cannot be mixed with others (packed rows, Ulysses)."""
        if self._parallel.sequence is not None:
            return None
        return mixed_pass.batch_key(self._runner, self.train_group(adapter_name))

    # ---- optimizer ------------------------------------------------------------------------------
    def clip_grad_norm(
        self, max_grad_norm: float = 1.0, norm_type: float = 2.0, *, adapter_name: str | None = None
    ) -> float | None:
        """At an accumulation boundary: normalise the summed gradient, clip it to
        ``max_grad_norm`` and return its norm before clipping; ``None`` elsewhere."""
        return self._stepper.clip_grad_norm(self.train_group(adapter_name), max_grad_norm, norm_type)

    def step(self, *, adapter_name: str | None = None) -> bool:
        """At an accumulation boundary, take an optimizer step; returns whether it did. A step
        whose gradient norm (from ``clip_grad_norm``) is NaN or infinite is skipped. Either way
        the step closes the accumulation window: its gradients are spent, and the next
        ``forward_backward`` starts the next window (``zero_grad`` after it changes nothing)."""
        return self._stepper.step(self.train_group(adapter_name))

    def clip_grad_and_step_many(self, calls: Sequence[StepCall]) -> list[OptimizerStep]:
        """``clip_grad_and_step`` of several adapters, one result per call, in order. The adapters
        at an accumulation boundary whose optimizers allow it (``multi_step.fusable``: Adam or
        AdamW after their first step) are clipped and stepped together, with multi-tensor
        kernels over all their tensors; their numbers are those of one-by-one calls, bit for bit."""
        groups = [self.train_group(call.adapter_name) for call in calls]
        if len({group.name for group in groups}) < len(groups):
            raise ConfigurationError(f'each adapter may step once per call; got {[g.name for g in groups]}')
        results = self._stepper.step_fused(groups, calls)
        for i, call in enumerate(calls):
            if i not in results:
                results[i] = super().clip_grad_and_step_many([call])[0]
        return [results[i] for i in range(len(calls))]

    def zero_grad(self, *, adapter_name: str | None = None) -> None:
        self._stepper.zero_grad(self.train_group(adapter_name))

    def lr_step(self, *, adapter_name: str | None = None) -> None:
        self._stepper.lr_step(self.train_group(adapter_name))

    # ---- metrics and configuration -------------------------------------------------------------
    def calculate_metric(self, is_training: bool = True, *, adapter_name: str | None = None) -> dict[str, float]:
        """Metrics since the last call, then reset: ``loss``, ``accuracy`` (token accuracy),
        and for training ``lr``, ``grad_norm``, ``tokens``, ``tokens_per_s`` and ``steps``. Under a mesh,
        every rank reports the figures of all ranks together."""
        group = self.train_group(adapter_name)
        metrics = group.spec.train_metrics if is_training else group.spec.eval_metrics
        if is_training:
            metrics = [*metrics, group.stats]
        self._parallel.merge_metrics(metrics)
        result: dict[str, float] = {}
        for metric in metrics:
            result.update(metric.calculate())
            metric.reset()
        return result

    def log_step_figures(self, figures: dict[str, float], *, adapter_name: str | None = None) -> None:
        """Figures of the trainer's own (rewards, say), recorded with the adapter's next optimizer
        step in its step log (``take_step_logs``; a server's run history)."""
        self.train_group(adapter_name).step_log.log(figures)

    def take_step_logs(self) -> dict[str, list[dict[str, float]]]:
        """Each adapter's optimizer steps since the last call (``StepLog``): step, loss, lr,
        grad_norm, tokens_per_s. Unlike ``calculate_metric`` it leaves the metrics alone."""
        return {name: steps for name, group in self.groups.items() if (steps := group.step_log.take())}

    def get_train_configs(self, *, adapter_name: str | None = None) -> str:
        group = self.train_group(adapter_name)
        trainable = sum(p.numel() for p in group.params)
        # The base's count and this adapter's: other adapters (other tenants' on a server) are not told
        total = self._base_numel + (trainable if group.name != FULL else 0)
        lines = [
            f'model: {self.model_id}',
            f'adapter: {group.name or "(full model)"}',
            f'trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%)',
            f'gradient_accumulation_steps: {group.window.gradient_accumulation_steps}',
            f'optimizer: {describe_optimizer(group.optimizer)}',
            f'lr scheduler: {type(group.scheduler).__name__ if group.scheduler else None}',
            f'loss: {type(group.spec.loss).__name__}',
            f'mixed precision: {self.mixed_precision}, device: {self.device}',
            f'parallel: {self._parallel.describe()}',
        ]
        if group.spec.config is not None:
            lines.append(f'adapter config: {group.spec.config.to_dict()}')
        return '\n'.join(lines)

    # ---- checkpoints ----------------------------------------------------------------------------
    def optimizer_steps(self, *, adapter_name: str | None = None) -> int:
        """The optimizer steps the adapter has taken (restored ones included)."""
        return self.train_group(adapter_name).window.optim_step

    def write_checkpoint(
        self, destination: Path, *, adapter_name: str | None, save_optimizer: bool, consumed_train_samples: int | None
    ) -> None:
        """The adapter as PEFT files (``PeftModel.from_pretrained`` loads it) or, without adapters,
        the full model in Hugging Face format; the tokenizer; with ``save_optimizer=True`` also the
        optimizer, scheduler, RNG and trainer state that ``resume_from_checkpoint`` needs.

        Under a mesh every rank calls it: FSDP2 shards are gathered into whole tensors, rank 0
        writes, and the others wait until it is done."""
        group = self.train_group(adapter_name)
        tokenizer = self._runner.template_for(group).tokenizer
        self._checkpointer.save(
            group, destination, tokenizer, save_optimizer=save_optimizer, consumed=consumed_train_samples
        )

    def load(
        self,
        name: str,
        output_dir: str | None = None,
        *,
        adapter_name: str | None = None,
        load_optimizer: bool = False,
    ) -> str:
        """Load adapter weights (and with ``load_optimizer=True`` the optimizer and scheduler)
        from a checkpoint ``save`` wrote; ``name`` is a path, or a name under ``output_dir``."""
        path = existing_checkpoint(Path(output_dir) / name if output_dir else Path(name))
        self._checkpointer.load(self.train_group(adapter_name), path, load_optimizer=load_optimizer)
        return str(path)

    def resume_from_checkpoint(
        self, checkpoint_dir: str, *, adapter_name: str | None = None, resume_only_model: bool = False
    ) -> dict[str, int]:
        """Restore weights and, unless ``resume_only_model``, optimizer, scheduler, RNG, step
        counters and the accumulation window (gradients a save found waiting for a step).
        Returns ``{'cur_step', 'optim_step', 'consumed_train_samples', 'gradient_accumulation_steps'}``:
        give ``consumed_train_samples`` to the DataLoader's ``resume_from_checkpoint``."""
        group = self.train_group(adapter_name)
        return self._checkpointer.resume(group, Path(checkpoint_dir), resume_only_model=resume_only_model)

    def restore_state(self, checkpoint_dir: str, *, adapter_name: str | None = None) -> Restored:
        """Bring the adapter back to a checkpoint ``save`` wrote, leaving the process's random
        state alone: how a server brings a released run back. With ``save_optimizer=True`` it
        holds the optimizer and scheduler state (loaded into the adapter's own, if set), the
        step counters and the accumulation window (gradients waiting for a step included), and
        training continues exactly; from weights alone the optimizer starts afresh at the step
        they were saved at. Returns that step and whether the optimizer is fresh."""
        return self._checkpointer.restore(self.train_group(adapter_name), Path(checkpoint_dir))


def adapter_source(config_or_dir: PeftConfig | str) -> tuple[PeftConfig, Path | None]:
    """An adapter's peft config, and the directory to load its weights from (None: new weights):
    ``config_or_dir`` is a peft config, or a saved adapter's directory (``ms://``, ``hf://`` or local)."""
    weights_dir = None
    if isinstance(config_or_dir, str):
        weights_dir = Path(resolve_model(config_or_dir))
        config_or_dir = PeftConfig.from_pretrained(str(weights_dir))
    if not isinstance(config_or_dir, PeftConfig):
        raise ConfigurationError(f'expected a peft LoraConfig or an adapter directory; got {config_or_dir!r}')
    return config_or_dir, weights_dir


__all__ = ['LoraConfig', 'TransformersModel']
