"""Saving and loading a model's adapters where its weights may be spread over a device mesh.

``files.py`` holds the files (the PEFT adapter, the training state, the atomic swap); this
module decides who writes and who reads them: FSDP2 shards are gathered into whole tensors on
every rank, rank 0 writes while the others wait, and every rank reads the whole checkpoint and
keeps its own shard of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict

import torch
from transformers import PreTrainedModel

from twinkle.errors import CheckpointError, ConfigurationError
from twinkle.model.checkpoint import files as ckpt
from twinkle.model.layout import ModelParallel
from twinkle.model.output.value_head import load_value_head, save_value_head
from twinkle.model.train_group import BOUNDARY_OPERATIONS, FULL, TrainGroup, Window

#: The trainer state ``resume_from_checkpoint`` returns.
RESUMED_COUNTERS = ('cur_step', 'optim_step', 'consumed_train_samples', 'gradient_accumulation_steps')


class Restored(TypedDict):
    """What ``Checkpointer.restore`` brought back: the optimizer steps the adapter stands at, and
    whether its optimizer starts afresh (the checkpoint held weights alone, ``save_optimizer=False``)."""

    optim_step: int
    fresh_optimizer: bool


class Tokenizer(Protocol):
    """What a checkpoint needs of a tokenizer: it saves itself beside the weights."""

    def save_pretrained(self, save_directory: str) -> Any: ...


@dataclass(frozen=True)
class _Save:
    """What one save writes: the weights (whole tensors by name when the model's are shards,
    else None) and, with ``save_optimizer``, the training state."""

    weights: dict[str, torch.Tensor] | None
    save_optimizer: bool
    consumed_train_samples: int | None
    optimizer_state: dict[str, Any] | None
    window: Window | None


def existing_checkpoint(path: Path) -> Path:
    """``path``, once a save of it that crashed mid-swap is put right (``checkpoint.recover``);
    ``CheckpointError`` unless it is a directory."""
    ckpt.recover(path)
    if not path.is_dir():
        raise CheckpointError(f'checkpoint {str(path)!r} does not exist or is not a directory')
    return path


class Checkpointer:
    """Writes and reads checkpoints of one model's adapters (or of the full model) over ``parallel``.
    ``optimizer_ready(group)`` puts a group's optimizer state back on the device before it is
    saved or loaded (``Stepper.optimizer_ready``: the offloader may have moved it)."""

    def __init__(
        self,
        model: PreTrainedModel,
        model_id: str | None,
        parallel: ModelParallel,
        optimizer_ready: Callable[[TrainGroup], None],
    ):
        self.model = model
        self.model_id = model_id
        self.parallel = parallel
        self.optimizer_ready = optimizer_ready

    def save(
        self, group: TrainGroup, destination: Path, tokenizer: Tokenizer, *, save_optimizer: bool, consumed: int | None
    ) -> None:
        """The group's checkpoint at ``destination`` (see ``TransformersModel.write_checkpoint``);
        every rank calls it."""
        weights = self.parallel.gather_weights(self.model, None if group.name == FULL else group.params)
        optimizer_state = None
        if save_optimizer and group.optimizer is not None:
            self.optimizer_ready(group)
            optimizer_state = self.parallel.gather_optimizer_state(group.optimizer)
        window = self.parallel.gather_window(group) if save_optimizer else None
        save = _Save(weights, save_optimizer, consumed, optimizer_state, window)
        self.parallel.on_main(lambda: self._write(group, destination, tokenizer, save))

    def _write(self, group: TrainGroup, destination: Path, tokenizer: Tokenizer, save: _Save) -> None:
        with ckpt.atomic_directory(destination) as staging:
            self._write_weights(group, staging, save)
            tokenizer.save_pretrained(str(staging))
            ckpt.write_json(staging / ckpt.WEIGHTS_STEP, {'optim_step': group.window.optim_step})
            if save.save_optimizer:
                ckpt.save_training_state(group, staging, save.consumed_train_samples, save.optimizer_state, save.window)

    def load_adapter_weights(self, group: TrainGroup, directory: Path) -> None:
        """A saved adapter's weights (and value head) into the adapter just added with its config."""
        ckpt.load_adapter(self.model, group.name, directory)
        if group.spec.value_head is not None:
            load_value_head(group.spec.value_head, directory)

    def _write_weights(self, group: TrainGroup, staging: Path, save: _Save) -> None:
        """The weights' files into ``staging``: the full model, or the adapter (and its value head)
        in peft's format. A backend whose weights are not a Hugging Face model's overrides it."""
        if group.name == FULL:
            self.model.save_pretrained(str(staging), state_dict=save.weights, safe_serialization=True)
        else:
            ckpt.save_adapter(self.model, group, self.model_id, staging, save.weights)
            if group.spec.value_head is not None:
                save_value_head(group.spec.value_head, staging)

    def load(self, group: TrainGroup, directory: Path, *, load_optimizer: bool) -> None:
        """The adapter's weights and, with ``load_optimizer``, its optimizer and scheduler state
        from ``directory`` (an ``existing_checkpoint``)."""
        self._load_weights(group, directory)
        if load_optimizer:
            self.optimizer_ready(group)
            ckpt.load_optimizer_state(group, directory, self.parallel.shard_optimizer_state)

    def resume(self, group: TrainGroup, directory: Path, *, resume_only_model: bool) -> dict[str, int]:
        """``load`` of the weights, then unless ``resume_only_model`` the optimizer, scheduler,
        random state, counters and accumulation window; returns the checkpoint's ``RESUMED_COUNTERS``."""
        self._load_weights(group, existing_checkpoint(directory))
        state = ckpt.read_trainer_state(directory)
        if not resume_only_model:
            self.optimizer_ready(group)
            ckpt.load_optimizer_state(group, directory, self.parallel.shard_optimizer_state)
            ckpt.set_rng_state(torch.load(directory / ckpt.RNG_STATE, weights_only=False))
            group.window.restore_counters(state, accumulation_steps=state['gradient_accumulation_steps'])
            self._restore_window(group, directory)
        return {key: int(state[key]) for key in RESUMED_COUNTERS}

    def restore(self, group: TrainGroup, directory: Path) -> Restored:
        """Bring the group back to a checkpoint, leaving the process's random state alone (a
        server's run, whose process serves others): the weights and, where ``save`` kept them
        (``save_optimizer=True``), the optimizer and scheduler state (into the group's own, if it
        has one), the step counters and the accumulation window. From weights alone the
        optimizer starts afresh at the step the weights were saved at, with an empty window."""
        directory = existing_checkpoint(directory)
        self._load_weights(group, directory)
        if not (directory / ckpt.TRAINER_STATE).is_file():
            step = ckpt.read_weights_step(directory)
            cur_step = step * group.window.gradient_accumulation_steps  # a boundary, every operation of it done
            group.window.restore_counters(
                {
                    'cur_step': cur_step,
                    'optim_step': step,
                    'consumed_train_samples': group.window.consumed_train_samples,
                }
            )
            group.close_window()
            group.window.mark_done(list(BOUNDARY_OPERATIONS))
            return {'optim_step': step, 'fresh_optimizer': True}
        if group.optimizer is not None:
            self.optimizer_ready(group)
            ckpt.load_optimizer_state(group, directory, self.parallel.shard_optimizer_state)
        group.window.restore_counters(ckpt.read_trainer_state(directory))
        self._restore_window(group, directory)
        return {'optim_step': group.window.optim_step, 'fresh_optimizer': False}

    def _restore_window(self, group: TrainGroup, directory: Path) -> None:
        """The checkpoint's accumulation window on this rank (none kept: an empty one)."""
        window = ckpt.read_window(directory)
        group.close_window()
        if window is not None:
            self.parallel.place_window(group, window)

    def _load_weights(self, group: TrainGroup, directory: Path) -> None:
        if group.name == FULL:
            raise ConfigurationError(
                'to continue full-parameter training, build TransformersModel(model_id=<checkpoint dir>) instead'
            )
        if group.spec.value_head is not None:  # whole on every rank: the model's shards never hold it
            load_value_head(group.spec.value_head, directory)
        if not self.parallel.sharded:
            ckpt.load_adapter(self.model, group.name, directory)
            return
        trained = {id(p) for p in group.params}
        named = {name: p for name, p in self.model.named_parameters() if id(p) in trained}
        self.parallel.load_weights(named, ckpt.read_adapter(self.model, group.name, directory, list(named)))


__all__ = ['RESUMED_COUNTERS', 'Checkpointer', 'Restored', 'Tokenizer', 'existing_checkpoint']
