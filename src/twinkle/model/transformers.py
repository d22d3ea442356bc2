"""``TransformersModel``: a Hugging Face causal LM with named LoRA adapters, each trained on its
own optimizer, schedule, loss and accumulation count, behind the methods the user's loop calls."""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
from peft import LoraConfig, PeftConfig
from torch.optim import Optimizer
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from twinkle.data_format import InputFeature, ModelOutput
from twinkle.errors import ConfigurationError, DataError, StateError, UnknownNameError, one_of
from twinkle.hub import resolve_model
from twinkle.infra.mesh import DeviceMesh
from twinkle.infra.runtime import get_runtime
from twinkle.loss import LOSSES, Loss, LossOutput
from twinkle.metric import METRICS, ExpertLoad, Metric, TrainMetric
from twinkle.model import checkpoint as ckpt
from twinkle.model import mixed_pass, multi_lora, multi_step, router
from twinkle.model.base import AdapterCall, Inputs, StepCall, StepResult, TwinkleModel
from twinkle.model.group import FULL, Pending, TrainGroup
from twinkle.model.offload import OptimizerOffloader
from twinkle.model.optim import build_optimizer, build_scheduler, set_hyperparams
from twinkle.model.parallel import ModelParallel
from twinkle.model.passes import (
    accumulate,
    carried,
    check_finite,
    check_positive,
    check_trainable,
    chunks,
    loss_sums,
    record_call,
    with_logps,
)
from twinkle.processor import PROCESSORS, InputProcessor
from twinkle.template import TEMPLATES, Template
from twinkle.utils.logger import get_logger
from twinkle.wire import FEATURE_FIELDS, RESERVED_FIGURES

#: Row fields that hold one value per token, as ``input_ids`` does (the wire checks the same).
ALIGNED_FIELDS = tuple(field for field in FEATURE_FIELDS if field != 'input_ids')
logger = get_logger()
_ADAPTER_NAME = re.compile(r'^[A-Za-z0-9_:-]+$')
DEFAULT_OPTIMIZER = {'optimizer_cls': 'AdamW', 'lr': 1e-5}


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
    torchrun processes (see ``twinkle.model.parallel``): data parallel over ``dp`` (not
    ``DistributedDataParallel``: each adapter's summed gradients and item counts are all-reduced
    at its step), FSDP2 sharding over ``fsdp`` (``fully_shard`` at the first forward, so adapters
    come first). Each rank runs its slice of the global batch; losses, metrics and updates are
    those of one process running the whole batch.
    """

    def __init__(
        self,
        model_id: str | None = None,
        model_cls: type[PreTrainedModel] | None = None,
        config: PretrainedConfig | None = None,
        *,
        device: str | torch.device | None = None,
        mixed_precision: Literal['no', 'bf16'] | None = None,
        dtype: torch.dtype | None = None,
        attn_implementation: str = 'sdpa',
        gradient_checkpointing: bool = False,
        device_mesh: DeviceMesh | None = None,
        router_aux_loss_coef: float | None = None,
        **from_pretrained_kwargs: Any,
    ):
        if model_id is None and config is None:
            raise ConfigurationError('TransformersModel needs a model_id or a config')
        self.model_id = model_id
        self._parallel = ModelParallel(device_mesh if device_mesh is not None else get_runtime().global_device_mesh)
        self.device = _resolve_device(device, self._parallel)
        self.mixed_precision = mixed_precision or _default_precision(self.device)
        if self.mixed_precision not in ('no', 'bf16'):
            raise one_of('mixed_precision', self.mixed_precision, ['no', 'bf16'])
        cls = model_cls or AutoModelForCausalLM
        kwargs: dict[str, Any] = {'dtype': dtype or torch.float32, 'attn_implementation': attn_implementation}
        self.model: PreTrainedModel
        if model_id is not None:
            self.model = cls.from_pretrained(resolve_model(model_id), **kwargs, **from_pretrained_kwargs)
        elif model_cls is None:
            self.model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:  # a model class has no public from_config; _from_config is what the Auto class calls
            self.model = model_cls._from_config(config, **kwargs)
        self.model.to(self.device)  # type: ignore[arg-type]  # transformers wraps to() in functools.wraps: self is not bound
        self._parallel.shard_experts(self.model)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
            self.model.enable_input_require_grads()
        params = [p for p in self.model.parameters() if p.requires_grad]
        #: A mixture of experts' router (None for a dense model): its load-balancing loss joins the
        #: training loss with ``router.aux_loss_coef`` (the config's ``router_aux_loss_coef``
        #: unless given), and the experts' load is a metric (``ExpertLoad``).
        self.router = router.model_router(self.model.config, router_aux_loss_coef)
        self.groups: dict[str, TrainGroup] = {FULL: self._with_router_metric(TrainGroup(name=FULL, params=params))}
        self._template: Template | None = None
        # Moves idle adapters' optimizer state off the device (to CPU memory, then disk); the
        # server sets one. None: every optimizer state stays where its parameters are.
        self.offloader: OptimizerOffloader | None = None
        self._mode: bool | None = None  # the train/eval mode _run last set on every module
        #: Most padded tokens one forward of a mixed pass holds: calls past it get forwards of
        #: their own (``mixed_pass.length_buckets``). None: no cap. See ``forward_token_cap``.
        self.mixed_forward_tokens: int | None = mixed_pass.forward_token_cap(self.device)

    # ---- adapters and components ---------------------------------------------------------------
    def add_adapter_to_model(
        self, adapter_name: str, config_or_dir: LoraConfig | str, *, gradient_accumulation_steps: int = 1
    ) -> None:
        """Add a LoRA adapter named ``adapter_name``; from then on the base weights are frozen.
        ``config_or_dir`` is a peft ``LoraConfig``, or a saved adapter directory whose config and
        weights are loaded. The layers are this project's (``twinkle.model.multi_lora``): every
        adapter stays in the model, and one forward pass can run each row through its own."""
        if not isinstance(adapter_name, str) or not _ADAPTER_NAME.match(adapter_name):
            raise ConfigurationError(
                f'adapter name {adapter_name!r} must be non-empty letters, digits, "_", "-" or ":"'
            )
        if adapter_name in self.groups:
            raise ConfigurationError(f'adapter {adapter_name!r} already exists; adapters: {self.adapter_names}')
        check_positive('gradient_accumulation_steps', gradient_accumulation_steps)
        self._parallel.check_can_add_adapter(adapter_name)
        weights_dir = None
        if isinstance(config_or_dir, str):
            weights_dir = Path(resolve_model(config_or_dir))
            config_or_dir = PeftConfig.from_pretrained(str(weights_dir))
        if not isinstance(config_or_dir, PeftConfig):
            raise ConfigurationError(f'expected a peft LoraConfig or an adapter directory; got {config_or_dir!r}')
        spec = multi_lora.spec_from_peft(config_or_dir, self.model)
        multi_lora.add_adapter(self.model, adapter_name, spec)
        self.groups.pop(FULL, None)
        self.groups[adapter_name] = self._with_router_metric(
            TrainGroup(
                name=adapter_name,
                params=multi_lora.adapter_parameters(self.model, adapter_name),
                gradient_accumulation_steps=gradient_accumulation_steps,
                config=config_or_dir,
            )
        )
        if weights_dir is not None:
            try:
                ckpt.load_adapter(self.model, adapter_name, weights_dir)
            except BaseException:
                self.remove_adapter(adapter_name)
                raise
        self._parallel.adapter_added(self.groups[adapter_name])
        self._mode = None  # the new LoRA modules start in train mode whatever the rest is in

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
        self._group(adapter_name)
        multi_lora.remove_adapter(self.model, adapter_name)
        del self.groups[adapter_name]
        if self.offloader is not None:
            self.offloader.forget(adapter_name)

    @property
    def adapter_names(self) -> list[str]:
        return [name for name in self.groups if name != FULL]

    def set_optimizer(
        self, optimizer_cls: str | type = 'AdamW', *, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """Any ``torch.optim`` optimizer by name or class; ``kwargs`` go to its constructor
        (``lr`` defaults to 1e-5). Parameters of fewer than 2 dimensions (biases, norms) get no
        weight decay."""
        group = self._group(adapter_name)
        kwargs.setdefault('lr', DEFAULT_OPTIMIZER['lr'])
        if self.offloader is not None:
            self.offloader.forget(group.name)  # the old optimizer's state, wherever it was
        group.optimizer = build_optimizer(optimizer_cls, _param_groups(group.params), kwargs)
        group.scheduler = None

    def set_lr_scheduler(self, scheduler_cls: str | type, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        """A ``torch.optim.lr_scheduler`` scheduler, ``CosineWarmupScheduler`` or
        ``LinearWarmupScheduler``; stepped once per optimizer step."""
        group = self._group(adapter_name)
        if group.optimizer is None:
            raise StateError(f'set_optimizer(...) before set_lr_scheduler(...) for adapter {group.name!r}')
        group.scheduler = build_scheduler(scheduler_cls, group.optimizer, kwargs)

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
        group = self._group(adapter_name)
        if group.optimizer is None:
            raise StateError(f'set_optimizer(...) before set_optimizer_hyperparams(...) for adapter {group.name!r}')
        values = {'lr': lr, 'betas': betas, 'eps': eps, 'weight_decay': weight_decay}
        set_hyperparams(group.optimizer, values)

    def set_loss(self, loss_cls: str | type[Loss] | Loss, *, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._group(adapter_name).loss = LOSSES.build(loss_cls, Loss, **kwargs)

    def set_template(
        self, template_cls: str | type[Template] | Template, *, adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """The template that encodes trajectories given to this adapter; ``model_id`` defaults
        to the model's own."""
        if not isinstance(template_cls, Template):
            kwargs.setdefault('model_id', self.model_id)
        self._group(adapter_name).template = TEMPLATES.build(template_cls, Template, **kwargs)

    def set_processor(
        self,
        processor_cls: str | type[InputProcessor] | InputProcessor,
        *,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self._group(adapter_name).processor = PROCESSORS.build(processor_cls, InputProcessor, **kwargs)

    def add_metric(
        self,
        metric: str | type[Metric] | Metric,
        *,
        is_training: bool = True,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Add a metric fed ``accumulate(inputs=, outputs=, loss=)`` after every loss."""
        group = self._group(adapter_name)
        built = METRICS.build(metric, Metric, **kwargs)
        if isinstance(built, TrainMetric):
            raise ConfigurationError('TrainMetric is always on: calculate_metric() reports lr, grad_norm, tokens_per_s')
        (group.train_metrics if is_training else group.eval_metrics).append(built)

    # ---- forward and backward -------------------------------------------------------------------
    def forward(self, *, inputs: Inputs, adapter_name: str | None = None) -> ModelOutput:
        """A training-mode forward pass; ``calculate_loss`` and ``backward`` continue it."""
        group = self._group(adapter_name)
        features = self._features(group, inputs)
        batch, outputs = self._run(group, features, training=True)
        group.pending = Pending(batch, outputs, training=True, rows=len(features), carried=carried(features))
        return with_logps(outputs['logits'], batch)

    def forward_only(
        self, *, inputs: Inputs, adapter_name: str | None = None, disable_lora: bool = False
    ) -> ModelOutput:
        """An evaluation-mode forward pass without gradients (``disable_lora=True``: the base
        model alone). ``calculate_loss`` afterwards feeds the evaluation metrics."""
        group = self._group(adapter_name)
        features = self._features(group, inputs)
        with torch.no_grad():
            batch, outputs = self._run(group, features, training=False, lora=not disable_lora)
        group.pending = Pending(batch, outputs, training=False, rows=len(features), carried=carried(features))
        return with_logps(outputs['logits'], batch)

    def calculate_loss(self, *, adapter_name: str | None = None, **loss_inputs: Any) -> float:
        """The loss of the last forward pass (its mean over the items the loss counts)."""
        group = self._group(adapter_name)
        if group.pending is None:
            raise StateError(f'calculate_loss() needs a forward()/forward_only() first (adapter {group.name!r})')
        pending = group.pending
        loss_inputs = {**pending.carried, **loss_inputs}
        pending.loss = self._loss(group, pending.batch, pending.outputs, pending.training, loss_inputs)
        sums = torch.stack([pending.loss.loss.detach().float(), pending.loss.num_items.float()])
        total, items = self._parallel.sum_(sums)
        return float(total / items.clamp(min=1))

    def backward(self, *, adapter_name: str | None = None) -> None:
        group = self._group(adapter_name)
        pending = group.pending
        if pending is None or pending.loss is None or not pending.training:
            raise StateError(f'backward() needs forward() then calculate_loss() first (adapter {group.name!r})')
        check_finite(group, pending.loss, self._parallel.sum_)
        self._backward(group, pending.loss)
        group.micro_step += 1
        group.consumed_train_samples += pending.rows
        group.pending = None

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
        group = self._group(adapter_name)
        features = self._features(group, inputs)
        started, sums = time.perf_counter(), []
        for rows, chunk_inputs in chunks(features, micro_batch_size, loss_inputs):
            batch, outputs = self._run(group, rows, training=True)
            loss = self._loss_value(group, batch, outputs, chunk_inputs)
            check_finite(group, loss, self._parallel.sum_)  # before the metrics and the gradients see it
            accumulate(group, batch, outputs, loss, training=True)
            self._backward(group, loss)
            sums.append(loss_sums(loss, batch, len(rows)))
        call_sums = self._parallel.sum_(torch.stack(sums).sum(0)).tolist()
        return record_call(group, features, call_sums, time.perf_counter() - started)

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
        return mixed_pass.forward_backward_mixed(self, calls, forward_only)

    def batch_key(self, adapter_name: str | None = None) -> tuple | None:
        """Adapters whose keys are equal can share a ``forward_backward_mixed`` pass (the same
        collation); None: this adapter's rows cannot be mixed with others (packed rows)."""
        return mixed_pass.batch_key(self, adapter_name)

    # ---- optimizer ------------------------------------------------------------------------------
    def clip_grad_norm(
        self, max_grad_norm: float = 1.0, norm_type: float = 2.0, *, adapter_name: str | None = None
    ) -> float | None:
        """At an accumulation boundary: normalise the summed gradient, clip it to
        ``max_grad_norm`` and return its norm before clipping; ``None`` elsewhere."""
        group = self._group(adapter_name)
        if not group.at_boundary('clip'):
            return None
        started = time.perf_counter()
        group.normalize_grads(self._parallel.reduce_gradients)
        norm = torch.nn.utils.clip_grad_norm_(group.params, max_grad_norm, norm_type=norm_type)
        return self._clipped(group, norm, time.perf_counter() - started)

    def step(self, *, adapter_name: str | None = None) -> bool:
        """At an accumulation boundary, take an optimizer step; returns whether it did. A step
        whose gradient norm (from ``clip_grad_norm``) is NaN or infinite is skipped."""
        group = self._group(adapter_name)
        if not group.at_boundary('step'):
            return False
        started = time.perf_counter()
        if not self._ready_to_step(group):
            return False
        cast(Optimizer, group.optimizer).step()  # _ready_to_step made one
        self._stepped(group, time.perf_counter() - started)
        return True

    def clip_grad_and_step_many(self, calls: Sequence[StepCall]) -> list[StepResult]:
        """``clip_grad_and_step`` of several adapters, one result per call, in order. The adapters
        at an accumulation boundary whose optimizers allow it (``multi_step.fusable``: Adam or
        AdamW after their first step) are clipped and stepped together, with multi-tensor
        kernels over all their tensors; their numbers are those of one-by-one calls, bit for bit."""
        groups = [self._group(call.adapter_name) for call in calls]
        if len({group.name for group in groups}) < len(groups):
            raise ConfigurationError(f'each adapter may step once per call; got {[g.name for g in groups]}')
        results: dict[int, StepResult] = {}
        ready = [i for i, group in enumerate(groups) if group.at_open_boundary() and group.optimizer is not None]
        ready = [i for i in ready if not self._parallel.holds_shards(groups[i].params)]
        if self._parallel.enabled:  # the same gradients on every rank first, so that every rank decides alike
            for i in ready:
                groups[i].normalize_grads(self._parallel.reduce_gradients)
        if ready:
            size = self._hot_optimizers(len(ready))
            for chunk in (ready[start : start + size] for start in range(0, len(ready), size)):
                for i in chunk:
                    self._optimizer_ready(groups[i])
                together = [i for i in chunk if multi_step.fusable(groups[i].optimizer)]
                if len(together) > 1:
                    stepped = self._step_together([groups[i] for i in together], [calls[i] for i in together])
                    results.update(zip(together, stepped, strict=True))
        for i, call in enumerate(calls):
            if i not in results:
                results[i] = super().clip_grad_and_step_many([call])[0]
        return [results[i] for i in range(len(calls))]

    def zero_grad(self, *, adapter_name: str | None = None) -> None:
        group = self._group(adapter_name)
        if group.at_boundary('zero_grad'):
            for param in group.params:
                param.grad = None
            group.reset_accumulation()

    def lr_step(self, *, adapter_name: str | None = None) -> None:
        group = self._group(adapter_name)
        if group.at_boundary('lr_step') and group.scheduler is not None:
            group.scheduler.step()

    # ---- metrics and configuration -------------------------------------------------------------
    def calculate_metric(self, is_training: bool = True, *, adapter_name: str | None = None) -> dict[str, float]:
        """Metrics since the last call, then reset: ``loss``, ``accuracy`` (token accuracy),
        and for training ``lr``, ``grad_norm``, ``tokens_per_s`` and ``steps``. Under a mesh,
        every rank reports the figures of all ranks together."""
        group = self._group(adapter_name)
        metrics = group.train_metrics if is_training else group.eval_metrics
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
        if not isinstance(figures, dict) or not all(isinstance(k, str) for k in figures):
            raise DataError(f'figures must be a dict of names to numbers; got {type(figures).__name__}')
        numbers = {}
        for name, value in figures.items():
            if name in RESERVED_FIGURES:
                raise DataError(f'{name!r} is a figure the model records itself; the model records {RESERVED_FIGURES}')
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DataError(f'figure {name!r} must be a finite number; got {value!r:.60}')
            numbers[name] = float(value)
        self._group(adapter_name).step_log.log(numbers)

    def take_step_logs(self) -> dict[str, list[dict[str, float]]]:
        """Each adapter's optimizer steps since the last call (``StepLog``): step, loss, lr,
        grad_norm, tokens_per_s. Unlike ``calculate_metric`` it leaves the metrics alone."""
        return {name: steps for name, group in self.groups.items() if (steps := group.step_log.take())}

    def get_train_configs(self, *, adapter_name: str | None = None) -> str:
        group = self._group(adapter_name)
        trainable = sum(p.numel() for p in group.params)
        total = sum(p.numel() for p in self.model.parameters())
        lines = [
            f'model: {self.model_id}',
            f'adapter: {group.name or "(full model)"}',
            f'trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%)',
            f'gradient_accumulation_steps: {group.gradient_accumulation_steps}',
            f'optimizer: {_describe(group.optimizer)}',
            f'lr scheduler: {type(group.scheduler).__name__ if group.scheduler else None}',
            f'loss: {type(group.loss).__name__}',
            f'mixed precision: {self.mixed_precision}, device: {self.device}',
            f'parallel: {self._parallel.describe()}',
        ]
        if group.config is not None:
            lines.append(f'adapter config: {group.config.to_dict()}')
        return '\n'.join(lines)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(
        self,
        name: str | None = None,
        output_dir: str = 'output',
        *,
        adapter_name: str | None = None,
        save_optimizer: bool = False,
        consumed_train_samples: int | None = None,
    ) -> str:
        """Write ``output_dir/name`` atomically and return its path: the adapter as PEFT files
        (``PeftModel.from_pretrained`` loads it) or, without adapters, the full model in Hugging
        Face format; the tokenizer; with ``save_optimizer=True`` also the optimizer, scheduler,
        RNG and trainer state that ``resume_from_checkpoint`` needs.

        Under a mesh every rank calls it: FSDP2 shards are gathered into whole tensors, rank 0
        writes, and the others wait until it is done."""
        group = self._group(adapter_name)
        name = name or f'checkpoint-{group.optim_step}'
        destination = Path(output_dir) / name
        weights = self._parallel.gather_weights(self.model, None if group.name == FULL else group.params)
        optimizer_state = None
        if save_optimizer and group.optimizer is not None:
            self._optimizer_ready(group)
            optimizer_state = self._parallel.gather_optimizer_state(group.optimizer)

        def write() -> None:
            with ckpt.atomic_directory(destination) as staging:
                if group.name == FULL:
                    self.model.save_pretrained(str(staging), state_dict=weights, safe_serialization=True)
                else:
                    ckpt.save_adapter(self.model, group, self.model_id, staging, weights)
                self._template_for(group).tokenizer.save_pretrained(str(staging))
                ckpt.write_json(staging / ckpt.WEIGHTS_STEP, {'optim_step': group.optim_step})
                if save_optimizer:
                    ckpt.save_training_state(group, staging, consumed_train_samples, optimizer_state)

        self._parallel.on_main(write)
        return str(destination)

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
        path = Path(output_dir) / name if output_dir else Path(name)
        ckpt.recover(path)  # a save of this name that crashed mid-swap
        if not path.is_dir():
            raise ckpt.CheckpointError(f'checkpoint {str(path)!r} does not exist or is not a directory')
        group = self._group(adapter_name)
        self._load_weights(group, path)
        if load_optimizer:
            self._optimizer_ready(group)
            ckpt.load_optimizer_state(group, path, self._parallel.shard_optimizer_state)
        return str(path)

    def resume_from_checkpoint(
        self, checkpoint_dir: str, *, adapter_name: str | None = None, resume_only_model: bool = False
    ) -> dict[str, int]:
        """Restore weights and, unless ``resume_only_model``, optimizer, scheduler, RNG and step
        counters. Returns ``{'cur_step', 'optim_step', 'consumed_train_samples',
        'gradient_accumulation_steps'}``: give ``consumed_train_samples`` to the DataLoader's
        ``resume_from_checkpoint``."""
        path = Path(checkpoint_dir)
        group = self._group(adapter_name)
        self.load(str(path), adapter_name=group.name, load_optimizer=False)
        state = ckpt.read_trainer_state(path)
        if not resume_only_model:
            self._optimizer_ready(group)
            ckpt.load_optimizer_state(group, path, self._parallel.shard_optimizer_state)
            ckpt.set_rng_state(torch.load(path / ckpt.RNG_STATE, weights_only=False))
            group.gradient_accumulation_steps = state['gradient_accumulation_steps']
            self.restore_counters(state, adapter_name=group.name)
        return {
            key: state[key]
            for key in ('cur_step', 'optim_step', 'consumed_train_samples', 'gradient_accumulation_steps')
        }

    def restore_counters(self, state: Mapping[str, int], *, adapter_name: str | None = None) -> None:
        """Set the adapter's step counters from a trainer state ``save`` wrote (``cur_step``,
        ``optim_step``, ``consumed_train_samples``; ``checkpoint.read_trainer_state`` reads it),
        leaving the process's random state alone: how a server brings a released adapter back."""
        group = self._group(adapter_name)
        group.micro_step, group.optim_step = state['cur_step'], state['optim_step']
        group.consumed_train_samples = state['consumed_train_samples']

    # ---- internals ------------------------------------------------------------------------------
    def _group(self, adapter_name: str | None) -> TrainGroup:
        if adapter_name is None:
            if len(self.groups) == 1:
                return next(iter(self.groups.values()))
            raise ConfigurationError(f'this model has several adapters; pass adapter_name= one of {self.adapter_names}')
        try:
            return self.groups[adapter_name]
        except KeyError:
            valid = self.adapter_names or ['(none: no adapter was added)']
            raise UnknownNameError('adapter', adapter_name, valid) from None

    def _clipped(self, group: TrainGroup, norm: torch.Tensor, elapsed_s: float) -> float:
        """Book a clip: the norm before clipping is the group's ``last_grad_norm``, returned."""
        group.last_grad_norm = self._parallel.norm_value(norm)
        group.stats.accumulate(grad_norm=group.last_grad_norm, elapsed_s=elapsed_s)
        group.step_log.grad_norm = group.last_grad_norm
        return group.last_grad_norm

    def _ready_to_step(self, group: TrainGroup) -> bool:
        """Before a step: normalised gradients and an optimizer whose state is on the device
        (AdamW with the default ``lr`` if none was set); False, the step skipped, when the
        gradient norm is NaN or infinite."""
        group.normalize_grads(self._parallel.reduce_gradients)
        if group.last_grad_norm is not None and not math.isfinite(group.last_grad_norm):
            logger.warning(f'adapter {group.name!r}: gradient norm is {group.last_grad_norm}; step skipped')
            group.last_grad_norm = None
            return False
        if group.optimizer is None:
            logger.info(f'adapter {group.name!r} has no optimizer: using AdamW(lr={DEFAULT_OPTIMIZER["lr"]})')
            self.set_optimizer('AdamW', adapter_name=group.name)
        self._optimizer_ready(group)
        return True

    def _stepped(self, group: TrainGroup, elapsed_s: float) -> None:
        group.optim_step += 1
        group.last_grad_norm = None
        lr = group.current_lr()
        group.stats.accumulate(elapsed_s=elapsed_s, lr=lr, stepped=True)
        group.step_log.on_step(group.optim_step, lr, elapsed_s)

    def _step_together(self, groups: list[TrainGroup], calls: list[StepCall]) -> list[StepResult]:
        """``clip_grad_and_step`` of groups at an open boundary with ``fusable`` optimizers on
        the device, as one clip and one optimizer update; each group books an equal share of the time."""
        started = time.perf_counter()
        for group in groups:
            group.at_boundary('clip')
            group.normalize_grads(self._parallel.reduce_gradients)
        norms = multi_step.clip_together([g.params for g in groups], [c.max_grad_norm for c in calls])
        share = (time.perf_counter() - started) / len(groups)
        grad_norms = [self._clipped(group, norm, share) for group, norm in zip(groups, norms, strict=True)]
        started = time.perf_counter()
        stepping = [group for group in groups if group.at_boundary('step') and self._ready_to_step(group)]
        multi_step.step_together([cast(Optimizer, group.optimizer) for group in stepping])
        share = (time.perf_counter() - started) / max(len(stepping), 1)
        for group in stepping:
            self._stepped(group, share)
        for group in groups:
            self.zero_grad(adapter_name=group.name)
            self.lr_step(adapter_name=group.name)
        return [StepResult(norm, group in stepping) for norm, group in zip(grad_norms, groups, strict=True)]

    def _hot_optimizers(self, wanted: int) -> int:
        """How many optimizers may be on the device at once to step together (the offloader's limit)."""
        capacity = None if self.offloader is None else self.offloader.hot_capacity
        return max(1, wanted if capacity is None else min(wanted, capacity))

    def _optimizer_ready(self, group: TrainGroup) -> None:
        """The group's optimizer state back on the device, if the offloader moved it away."""
        if self.offloader is not None and group.optimizer is not None:
            self.offloader.touch(group.name, group.optimizer)

    def _template_for(self, group: TrainGroup) -> Template:
        if group.template is not None:
            return group.template
        if self._template is None:
            if self.model_id is None:
                raise StateError('this model was built from a config: call set_template(...) first')
            self._template = Template(self.model_id)
        return self._template

    def _features(self, group: TrainGroup, inputs: Inputs) -> list[InputFeature]:
        rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
        if not rows:
            raise DataError('inputs is empty: pass at least one row')
        if all('input_ids' in row for row in rows):
            features = cast(list[InputFeature], rows)  # every row is encoded
        else:
            features = self._template_for(group).batch_encode(rows)
            if not features:
                raise DataError('every input row was dropped by the template (truncation_strategy="delete")')
        self._check_tokens(features)
        return features

    def _check_tokens(self, features: Sequence[InputFeature]) -> None:
        embeddings = self.model.get_input_embeddings()
        vocab = (
            embeddings.num_embeddings if isinstance(embeddings, torch.nn.Embedding) else self.model.config.vocab_size
        )
        for index, feature in enumerate(features):
            ids = feature['input_ids']
            if len(ids) == 0:
                raise DataError(f'input row {index} has no tokens')
            for key in ALIGNED_FIELDS:
                values = cast(Sequence[int] | None, feature.get(key))
                if values is not None and len(values) != len(ids):
                    raise DataError(
                        f'input row {index}: {key} has {len(values)} values; '
                        f'it must be as long as input_ids ({len(ids)})'
                    )
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab:
                bad = low if low < 0 else high
                raise DataError(f'input row {index} has token id {bad}, outside the vocabulary [0, {vocab})')

    def _run(
        self, group: TrainGroup, rows: Sequence[InputFeature], training: bool, lora: bool = True
    ) -> tuple[dict, dict]:
        """The group's rows through the model (``lora=False``: the base model alone)."""
        self._parallel.check_trainable(training and group.name == FULL)
        self._parallel.prepare(self.model, self.groups.values())  # the first forward: sync, then shard
        self._set_mode(training)
        pad = self._template_for(group).pad_token_id
        batch = {k: v.to(self.device, non_blocking=True) for k, v in group.processor(rows, pad).items()}
        multi_lora.assign_rows(self.model, group.name if lora and group.name != FULL else None)
        return batch, self._outputs(batch)

    def _set_mode(self, training: bool) -> None:
        if self._mode is not training:
            # Every module, not the top one alone: new LoRA modules start in train mode while the
            # model around them is still in from_pretrained's eval mode (no dropout).
            self.model.train(training)
            self._mode = training

    def _logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._outputs(batch, router_logits=False)['logits']

    def _outputs(self, batch: dict[str, torch.Tensor], router_logits: bool = True) -> dict[str, torch.Tensor]:
        """The batch's ``logits`` and, on a mixture of experts, its ``router_logits`` per row
        ([layers, rows, positions, experts])."""
        model_inputs = {k: batch[k] for k in ('input_ids', 'attention_mask', 'position_ids') if k in batch}
        with self._autocast(), router.replay_routing(self.model, batch.get('routed_experts')):
            if self.router is None or not router_logits:
                return {'logits': self.model(**model_inputs, use_cache=False).logits}
            out = self.model(**model_inputs, use_cache=False, output_router_logits=True)
        return {'logits': out.logits, 'router_logits': router.per_row(out.router_logits, len(batch['input_ids']))}

    def _with_router_metric(self, group: TrainGroup) -> TrainGroup:
        if self.router is not None:
            group.train_metrics.append(ExpertLoad())
            group.eval_metrics.append(ExpertLoad())
        return group

    def _router_loss(self, batch: dict, outputs: dict, loss: LossOutput) -> LossOutput:
        """The experts' load into ``outputs`` for the metrics and, where the loss trains (its
        router logits carry gradients: not ``forward_only``), the router's load-balancing loss of
        these rows added to ``loss``, x its items: the step divides by them, so the optimizer sees
        the mean loss plus coef x aux, as transformers adds it. A summed loss (no items: Tinker's)
        gets coef x aux per real token, what that sum of per-token losses would get."""
        if self.router is None or 'router_logits' not in outputs:
            return loss
        logits, mask = outputs['router_logits'], batch.get('attention_mask')
        outputs['expert_tokens'] = router.expert_tokens(self.router, logits.detach(), mask)
        if not logits.requires_grad or not self.router.aux_loss_coef:
            return loss
        aux = router.aux_loss(self.router, logits, mask)
        outputs['router_aux_loss'] = aux.detach()
        tokens = mask.sum() if mask is not None else torch.tensor(batch['input_ids'].numel())
        items = torch.where(loss.num_items > 0, loss.num_items.detach(), tokens.to(loss.num_items.device))
        return LossOutput(loss.loss + self.router.aux_loss_coef * aux * items, loss.num_items, loss.metrics)

    def _reference_logps(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Label-token logprobs under the base model with every adapter switched off: the KL
        reference of GRPO and DPO, at the cost of one forward pass and no extra weights."""
        # The base model, then back to the rows the training forward used: gradient
        # checkpointing recomputes those layers during backward.
        with torch.no_grad(), multi_lora.row_adapters(self.model, None):
            logits = self._logits(batch)
        return with_logps(logits, batch).logps

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.mixed_precision == 'bf16':
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _loss(self, group: TrainGroup, batch: dict, outputs: dict, training: bool, loss_inputs: dict) -> LossOutput:
        loss = self._loss_value(group, batch, outputs, loss_inputs)
        accumulate(group, batch, outputs, loss, training)
        return loss

    def _loss_value(self, group: TrainGroup, batch: dict, outputs: dict, loss_inputs: dict) -> LossOutput:
        if group.loss.needs_reference and 'ref_logps' not in loss_inputs and group.name != FULL:
            outputs['ref_logps'] = self._reference_logps(batch)
        return self._router_loss(batch, outputs, group.loss(batch, outputs, **loss_inputs))

    def _backward(self, group: TrainGroup, loss: LossOutput) -> None:
        check_trainable(group, loss)
        loss.loss.backward()
        group.pending_items = group.pending_items + loss.num_items.detach()

    def _load_weights(self, group: TrainGroup, directory: Path) -> None:
        if group.name == FULL:
            raise ConfigurationError(
                'to continue full-parameter training, build TransformersModel(model_id=<checkpoint dir>) instead'
            )
        if not self._parallel.sharded:
            ckpt.load_adapter(self.model, group.name, directory)
            return
        trained = {id(p) for p in group.params}
        named = {name: p for name, p in self.model.named_parameters() if id(p) in trained}
        self._parallel.load_weights(named, ckpt.read_adapter(self.model, group.name, directory, list(named)))


# ---- helpers ------------------------------------------------------------------------------------
def _resolve_device(device: str | torch.device | None, parallel: ModelParallel) -> torch.device:
    """The given device, else the mesh's for this rank, else CUDA when there is one."""
    mesh_device = parallel.default_device()
    if device is None:
        return mesh_device or torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    device = torch.device(device)
    if mesh_device is not None and device.type != mesh_device.type:
        raise ConfigurationError(
            f'device={str(device)!r} does not match the mesh device_type={mesh_device.type!r}; '
            f'leave device out to use {str(mesh_device)!r}'
        )
    return device


def _default_precision(device: torch.device) -> str:
    return 'bf16' if device.type == 'cuda' and torch.cuda.is_bf16_supported() else 'no'


def _param_groups(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups: list[dict[str, Any]] = [{'params': decay}]
    if no_decay:
        groups.append({'params': no_decay, 'weight_decay': 0.0})
    return groups


def _describe(optimizer: torch.optim.Optimizer | None) -> str:
    if optimizer is None:
        return 'None'
    hyper = {k: v for k, v in optimizer.defaults.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return f'{type(optimizer).__name__}({hyper})'


__all__ = ['LoraConfig', 'TransformersModel']
