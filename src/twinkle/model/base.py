"""The model interface the user's training loop calls.

Every method takes ``adapter_name``: the adapter (a LoRA added with ``add_adapter_to_model``)
the call is about. Left out, it means the only adapter there is, or the full model when no
adapter was added; with several adapters it must be given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinkle.data_format import InputFeature, ModelOutput, Trajectory

Inputs = Sequence[InputFeature | Trajectory] | InputFeature | Trajectory


@dataclass
class AdapterCall:
    """One adapter's share of a mixed pass (``forward_backward_mixed``): what its own
    ``forward_backward(inputs=..., adapter_name=..., **loss_inputs)`` call would take."""

    adapter_name: str
    inputs: Inputs
    loss_inputs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepCall:
    """One adapter's ``clip_grad_and_step(max_grad_norm, adapter_name=...)`` in
    ``clip_grad_and_step_many``; ``math.inf`` for no clipping."""

    adapter_name: str
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class OptimizerStep:
    """What one adapter's ``clip_grad_and_step`` did: the gradient norm before clipping (None
    between accumulation boundaries) and whether the optimizer stepped (a step with a NaN or
    infinite gradient norm is skipped)."""

    grad_norm: float | None
    stepped: bool


class TwinkleModel(ABC):
    @abstractmethod
    def forward(self, *, inputs: Inputs, adapter_name: str | None = None) -> ModelOutput: ...

    @abstractmethod
    def forward_only(self, *, inputs: Inputs, adapter_name: str | None = None) -> ModelOutput: ...

    @abstractmethod
    def calculate_loss(self, *, adapter_name: str | None = None, **loss_inputs: Any) -> float: ...

    @abstractmethod
    def backward(self, *, adapter_name: str | None = None) -> None: ...

    @abstractmethod
    def forward_backward(
        self, *, inputs: Inputs, adapter_name: str | None = None, **loss_inputs: Any
    ) -> ModelOutput: ...

    @abstractmethod
    def clip_grad_norm(self, max_grad_norm: float = 1.0, *, adapter_name: str | None = None) -> float | None: ...

    @abstractmethod
    def step(self, *, adapter_name: str | None = None) -> bool: ...

    @abstractmethod
    def zero_grad(self, *, adapter_name: str | None = None) -> None: ...

    @abstractmethod
    def lr_step(self, *, adapter_name: str | None = None) -> None: ...

    def clip_grad_and_step(self, max_grad_norm: float = 1.0, *, adapter_name: str | None = None) -> float | None:
        """``clip_grad_norm``, ``step``, ``zero_grad``, ``lr_step``: call it after every
        ``forward_backward``; it acts on every ``gradient_accumulation_steps``-th call and
        returns the gradient norm then (``None`` in between)."""
        norm = self.clip_grad_norm(max_grad_norm, adapter_name=adapter_name)
        self.step(adapter_name=adapter_name)
        self.zero_grad(adapter_name=adapter_name)
        self.lr_step(adapter_name=adapter_name)
        return norm

    def clip_grad_and_step_many(self, calls: Sequence[StepCall]) -> list[OptimizerStep]:
        """``clip_grad_and_step`` of several adapters, one result per call, in order. A model may
        step them together (``TransformersModel`` does); the numbers are those of the calls made
        one by one."""
        results = []
        for call in calls:
            norm = self.clip_grad_norm(call.max_grad_norm, adapter_name=call.adapter_name)
            stepped = self.step(adapter_name=call.adapter_name)
            self.zero_grad(adapter_name=call.adapter_name)
            self.lr_step(adapter_name=call.adapter_name)
            results.append(OptimizerStep(norm, stepped))
        return results

    def save(
        self,
        name: str | None = None,
        output_dir: str = 'output',
        *,
        adapter_name: str | None = None,
        save_optimizer: bool = False,
        consumed_train_samples: int | None = None,
    ) -> str:
        """Write a checkpoint of the adapter to ``output_dir/name`` (by default
        ``checkpoint-<optimizer steps>``), atomically, and return its path (``write_checkpoint``
        says what it holds). With ``save_optimizer=True`` it also holds what
        ``resume_from_checkpoint`` needs, ``consumed_train_samples`` (default: the adapter's
        count) among it."""
        name = name or f'checkpoint-{self.optimizer_steps(adapter_name=adapter_name)}'
        destination = Path(output_dir) / name
        self.write_checkpoint(
            destination,
            adapter_name=adapter_name,
            save_optimizer=save_optimizer,
            consumed_train_samples=consumed_train_samples,
        )
        return str(destination)

    @abstractmethod
    def optimizer_steps(self, *, adapter_name: str | None = None) -> int:
        """The optimizer steps the adapter has taken."""

    @abstractmethod
    def write_checkpoint(
        self, destination: Path, *, adapter_name: str | None, save_optimizer: bool, consumed_train_samples: int | None
    ) -> None:
        """Write the adapter's checkpoint to ``destination`` (see ``save``)."""

    @abstractmethod
    def load(
        self, name: str, output_dir: str | None = None, *, adapter_name: str | None = None, load_optimizer: bool = False
    ) -> str: ...
