"""Per-adapter training state: what one tenant's adapter (or the full model) owns.

A ``TrainGroup`` composes three parts, each changed by one owner:

- ``AdapterSpec`` (``group.spec``): what the user configured (config, loss, template,
  processor, metrics, value head); ``TransformersModel`` and its ``set_*`` calls.
- ``Accumulation`` (``group.window``): the accumulation window's counters and boundary logic
  that the stepper (``optim/stepping.py``) steps by; a backward counts itself in.
- ``PendingStep`` (``group.pending``): what the runner keeps between ``forward_backward`` and
  the step (the pending forward, the loss items, the normalisation and the clip's norm).

The group itself holds its parameters, optimizer, schedule and figures.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from twinkle.errors import CheckpointError, DataError
from twinkle.loss import CrossEntropyLoss, Loss, LossOutput
from twinkle.metric import Accuracy, GRPOMetric, LossMetric, Metric, TrainMetric
from twinkle.model.output.value_head import ValueHead
from twinkle.processor import InputProcessor
from twinkle.template import Template
from twinkle.wire import RESERVED_FIGURES

#: The group that trains every parameter of a model without adapters.
FULL = ''
#: A collated batch on the model's device: ``input_ids``, ``labels``, ``attention_mask``... by name.
Batch = dict[str, torch.Tensor]
#: What a forward gives its loss and metrics: ``logits`` and, on a mixture of experts,
#: ``router_logits``; the loss and the metrics add theirs (``ref_logps``, ``expert_tokens``...).
Outputs = dict[str, torch.Tensor]
#: Sums a step's gradients over data-parallel ranks; returns the step's item count over all ranks.
GradientReducer = Callable[[list[torch.nn.Parameter], torch.Tensor | int], torch.Tensor | int]
#: The operations ``Accumulation.at_boundary`` lets run once per accumulation boundary.
BOUNDARY_OPERATIONS = ('clip', 'step', 'zero_grad', 'lr_step')


@dataclass
class StepLog:
    """Each optimizer step's figures, kept until taken (``take``): the step number, the mean loss
    of the ``forward_backward`` calls since the step before, the learning rate it stepped with,
    the gradient norm before clipping and the tokens per second of its calls. Apart from the
    metrics, which ``calculate_metric`` reads and resets: a service records these per step
    whatever its tenant reads. Holds the last ``MAX_STEPS`` steps when nobody takes them."""

    MAX_STEPS = 1000

    loss_sum: float = 0.0
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0
    grad_norm: float | None = None
    #: Figures the trainer logged for the coming step (``log``: rewards, say).
    logged: dict[str, float] = field(default_factory=dict)
    #: The loss's own statistics over the step's calls (a policy loss's KL to the reference, clip
    #: fraction, entropy, ``kl_sample_train_v1``/``v2``, importance weights), recorded with the step.
    loss_stats: GRPOMetric = field(default_factory=GRPOMetric)
    steps: deque[dict[str, float]] = field(default_factory=lambda: deque(maxlen=StepLog.MAX_STEPS))

    def log(self, figures: dict[str, float]) -> None:
        """Figures of the trainer's own (a mean reward...) recorded with the next step:
        ``DataError`` unless each is a finite number under a name the log does not record itself
        (``RESERVED_FIGURES``)."""
        if not isinstance(figures, dict) or not all(isinstance(k, str) for k in figures):
            raise DataError(f'figures must be a dict of names to numbers; got {type(figures).__name__}')
        numbers = {}
        for name, value in figures.items():
            if name in RESERVED_FIGURES:
                raise DataError(f'{name!r} is a figure the model records itself; the model records {RESERVED_FIGURES}')
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DataError(f'figure {name!r} must be a finite number; got {value!r:.60}')
            numbers[name] = float(value)
        self.logged.update(numbers)

    def on_call(self, loss: float, tokens: int, elapsed_s: float) -> None:
        self.loss_sum, self.calls = self.loss_sum + loss, self.calls + 1
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + elapsed_s

    def on_loss(self, loss: LossOutput) -> None:
        self.loss_stats.add(loss.metrics)

    def on_step(self, step: int, lr: float | None, elapsed_s: float) -> None:
        figures = {**self.loss_stats.calculate(), **self.logged, 'step': float(step)}
        self.loss_stats.reset()
        if self.calls:
            figures['loss'] = self.loss_sum / self.calls
        if lr is not None:
            figures['lr'] = lr
        if self.grad_norm is not None:
            figures['grad_norm'] = self.grad_norm
        if self.seconds + elapsed_s > 0:
            figures['tokens_per_s'] = self.tokens / (self.seconds + elapsed_s)
        self.steps.append(figures)
        self.loss_sum, self.calls, self.tokens, self.seconds, self.grad_norm = 0.0, 0, 0, 0.0, None
        self.logged = {}

    def take(self) -> list[dict[str, float]]:
        taken = list(self.steps)
        self.steps.clear()
        return taken

    def open_figures(self) -> dict[str, Any]:
        """The figures of the calls since the last step, which the coming step records (a saved
        ``Window`` keeps them)."""
        return {
            'loss_sum': self.loss_sum, 'calls': self.calls, 'tokens': self.tokens, 'seconds': self.seconds,
            'grad_norm': self.grad_norm, 'logged': dict(self.logged), 'loss_stats': self.loss_stats.state(),
        }  # fmt: skip

    def reopen(self, figures: Mapping[str, Any]) -> None:
        """Take up ``open_figures`` again (a restored ``Window``); the steps already taken stay as they are."""
        self.loss_sum, self.calls = float(figures['loss_sum']), int(figures['calls'])
        self.tokens, self.seconds = int(figures['tokens']), float(figures['seconds'])
        norm = figures['grad_norm']
        self.grad_norm = None if norm is None else float(norm)
        self.logged = {str(name): float(value) for name, value in dict(figures['logged']).items()}
        self.loss_stats.reset()
        if 'loss_stats' in figures:  # windows saved before the step log kept them have none
            self.loss_stats.merge(dict(figures['loss_stats']))


@dataclass
class Pending:
    """The last forward of a group, waiting for ``calculate_loss`` and ``backward``."""

    batch: Batch
    outputs: Outputs
    training: bool
    rows: int  # sequences in the batch (a packed batch holds them all in one tensor row)
    loss: LossOutput | None = None
    # Loss inputs the rows carried (``passes.carried``): calculate_loss uses them unless given.
    carried: dict[str, Any] = field(default_factory=dict)


@dataclass
class Window:
    """A group's accumulation window as a checkpoint keeps it: what its next optimizer step would
    use, so that a run brought back continues exactly whatever its loop left pending.

    ``grads``: the gradients accumulated since the last step, whole tensors on the CPU by their
    index in ``TrainGroup.params`` (a parameter without one is absent); under a mesh, what one
    process holding every rank's rows would hold (``ModelParallel.gather_window``). ``items``: the
    loss items they are divided by at the step; ``normalized``: whether they were divided
    already (``clip_grad_norm`` ran, the step did not), and ``grad_norm`` the norm it found (a
    step skips a norm that is not finite). ``done``: the ``BOUNDARY_OPERATIONS`` done at the
    group's micro step, so none runs twice. ``figures``: the step log's figures of the calls
    since the last step (``StepLog.open_figures``)."""

    grads: dict[int, torch.Tensor]
    items: torch.Tensor
    normalized: bool = False
    grad_norm: float | None = None
    done: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class AdapterSpec:
    """What the user configured for an adapter (or ``FULL``): its config, loss, template,
    processor, metrics and value head. ``TransformersModel`` builds it and its ``set_*`` calls
    replace its parts; nothing else writes it."""

    name: str
    config: Any = None  # the adapter's PeftConfig; None for FULL
    # A critic's scalar head (``output/value_head.py``): its parameters are among the group's
    # ``params``; None for a policy.
    value_head: ValueHead | None = None
    loss: Loss = field(default_factory=CrossEntropyLoss)
    template: Template | None = None
    processor: InputProcessor = field(default_factory=InputProcessor)
    # Whether ``set_processor`` chose ``processor``: if not, ``forward_backward`` may pack the rows
    # instead (``ModelRunner.processor``).
    processor_set: bool = False
    train_metrics: list[Metric] = field(default_factory=lambda: [LossMetric(), Accuracy()])
    eval_metrics: list[Metric] = field(default_factory=lambda: [LossMetric(), Accuracy()])


@dataclass
class Accumulation:
    """A group's accumulation window and step counters, which the stepper (``optim/stepping.py``)
    steps by: every ``gradient_accumulation_steps``-th backward is a boundary where each of the
    ``BOUNDARY_OPERATIONS`` runs once (``at_boundary``). Its fields change through its methods
    only: a backward counts itself in (``count_backward``), a step (``count_step``), a checkpoint
    restores them (``restore_counters``, ``mark_done``)."""

    gradient_accumulation_steps: int = 1
    micro_step: int = 0  # backward calls so far
    optim_step: int = 0  # optimizer steps taken
    consumed_train_samples: int = 0
    _done_at: int = -1
    _done: set[str] = field(default_factory=set)

    def at_boundary(self, operation: str) -> bool:
        """True once per accumulation boundary for each of clip / step / zero_grad / lr_step:
        every ``gradient_accumulation_steps``-th backward, and only the first call there."""
        if self.micro_step == 0 or self.micro_step % self.gradient_accumulation_steps:
            return False
        if self._done_at != self.micro_step:
            self._done_at, self._done = self.micro_step, set()
        if operation in self._done:
            return False
        self._done.add(operation)
        return True

    def at_open_boundary(self) -> bool:
        """Whether the group is at an accumulation boundary where neither ``clip`` nor ``step``
        has run yet (``at_boundary`` without marking anything done)."""
        if self.micro_step == 0 or self.micro_step % self.gradient_accumulation_steps:
            return False
        return self._done_at != self.micro_step or not self._done & {'clip', 'step'}

    def count_backward(self, rows: int) -> None:
        """One micro step: a backward of ``rows`` sequences (over every rank)."""
        self.micro_step += 1
        self.consumed_train_samples += rows

    def count_step(self) -> int:
        """One optimizer step taken; returns the step's number."""
        self.optim_step += 1
        return self.optim_step

    def boundary_done(self) -> list[str]:
        """The ``BOUNDARY_OPERATIONS`` done at the current micro step (none between boundaries)."""
        return sorted(self._done) if self._done_at == self.micro_step else []

    def mark_done(self, operations: list[str]) -> None:
        """Mark ``operations`` done at the current micro step (a restored window's ``done``)."""
        unknown = sorted(set(operations) - set(BOUNDARY_OPERATIONS))
        if unknown:
            raise CheckpointError(f'unknown boundary operations {unknown}; they are {list(BOUNDARY_OPERATIONS)}')
        self._done_at, self._done = (self.micro_step, set(operations)) if operations else (-1, set())

    def restore_counters(self, state: Mapping[str, int], accumulation_steps: int | None = None) -> None:
        """The step counters of a trainer state a checkpoint holds (``cur_step``, ``optim_step``,
        ``consumed_train_samples``; ``checkpoint.read_trainer_state``) and, when given, its
        ``gradient_accumulation_steps``."""
        if accumulation_steps is not None:
            self.gradient_accumulation_steps = accumulation_steps
        self.micro_step, self.optim_step = state['cur_step'], state['optim_step']
        self.consumed_train_samples = state['consumed_train_samples']


@dataclass
class PendingStep:
    """What the runner keeps between ``forward_backward`` and the step: the last forward waiting
    for its loss and backward, the loss items its gradients will be divided by, whether they were
    divided already and the norm ``clip_grad_norm`` found. The runner and the passes add to it
    (``forward``, ``add_items``); the stepper divides (``normalize``), books a clip (``clipped``)
    and closes it (``close``); a restored ``Window`` reopens it (``reopen``)."""

    forward: Pending | None = None
    # Loss items (tokens for a token-mean loss) accumulated since the window opened (the last
    # step or zero_grad): the gradient is divided by this once, before clipping or stepping.
    items: torch.Tensor | int = 0
    normalized: bool = False
    grad_norm: float | None = None  # from clip_grad_norm, before clipping
    # Called as the window closes: a backend whose gradients live outside ``param.grad`` (megatron's
    # grad buffers under its distributed optimizer) drops them there too.
    on_close: Callable[[], None] | None = None

    def when_closed(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` as each window closes (megatron's ``DistributedOptimizerStepper.watch``)."""
        self.on_close = hook

    def add_items(self, items: torch.Tensor) -> None:
        """A backward's loss items, added to what the step divides by."""
        self.items = self.items + items.detach()

    def clipped(self, norm: float | None) -> None:
        """The gradient norm a clip found (None: forgotten, once a step used or skipped it)."""
        self.grad_norm = norm

    def normalize(self, params: list[torch.nn.Parameter], reduce: GradientReducer | None = None) -> None:
        """Divide the summed gradient of ``params`` by the number of loss items of the whole step.

        ``reduce(params, items)``, under data parallelism, first sums the gradients over the
        ranks and returns the item count over all ranks (``ModelParallel.reduce_gradients``)."""
        if self.normalized:
            return
        self.normalized = True
        items = self.items if reduce is None else reduce(params, self.items)
        if isinstance(items, torch.Tensor) or items > 1:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                divisor = torch.clamp(torch.as_tensor(items, device=grads[0].device), min=1)
                # A sharded (DTensor) gradient divides by a number, not by a plain tensor.
                torch._foreach_div_(grads, divisor if type(grads[0]) is torch.Tensor else float(divisor))

    def mark_normalized(self) -> None:
        """The gradients were divided elsewhere (megatron's ``finalize_model_grads``)."""
        self.normalized = True

    def close(self, params: list[torch.nn.Parameter]) -> None:
        """Drop the gradients of ``params`` and reset the item count and normalisation."""
        for param in params:
            param.grad = None
        if self.on_close is not None:
            self.on_close()
        self.items = 0
        self.normalized = False

    def reopen(self, items: torch.Tensor, normalized: bool, grad_norm: float | None) -> None:
        """Take up a restored ``Window``'s item count, normalisation and norm (``place_window``)."""
        self.items, self.normalized, self.grad_norm = items, normalized, grad_norm


@dataclass
class TrainGroup:
    """An adapter (or ``FULL``): what the user configured (``spec``), the parameters it trains,
    its accumulation window (``window``, the stepper's), what the runner left pending for the
    step (``pending``), its own optimizer and schedule, and its figures. Nothing here is shared
    between groups."""

    spec: AdapterSpec
    params: list[torch.nn.Parameter]
    window: Accumulation = field(default_factory=Accumulation)
    pending: PendingStep = field(default_factory=PendingStep)
    optimizer: Optimizer | None = None
    scheduler: LRScheduler | None = None
    stats: TrainMetric = field(default_factory=TrainMetric)
    step_log: StepLog = field(default_factory=StepLog)

    @property
    def name(self) -> str:
        return self.spec.name

    def normalize_grads(self, reduce: GradientReducer | None = None) -> None:
        """``PendingStep.normalize`` of the group's parameters."""
        self.pending.normalize(self.params, reduce)

    def close_window(self) -> None:
        """End the accumulation window: its gradients are dropped and its item count and
        normalisation reset, so the next ``forward_backward`` starts the next window afresh. A
        step closes it (``Stepper.step``), whether it stepped or skipped a gradient that was not
        finite, and so does ``zero_grad``: a loop that never calls ``zero_grad`` (``step()``
        alone) steps each window on its own gradient, divided by its own item count."""
        self.pending.close(self.params)

    def rebind(self, mapping: Mapping[int, torch.nn.Parameter]) -> None:
        """Point the group at new parameters (by the old ones' ``id``), as a wrapper replaced them."""
        self.params = [mapping[id(p)] for p in self.params]

    def current_lr(self) -> float | None:
        return None if self.optimizer is None else float(self.optimizer.param_groups[0]['lr'])
