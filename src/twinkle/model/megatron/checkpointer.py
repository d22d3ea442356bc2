"""Checkpoints of a ``MegatronModel`` in Hugging Face's formats, whatever the layout.

The weights are gathered whole (over tensor-parallel slices, pipeline stages and experts) and
renamed to the Hugging Face model's names by ``convert`` (the full model) and ``lora`` (adapters,
in peft's keys), so a checkpoint written at TP=2 loads on the Hugging Face model with plain
peft, and on a ``MegatronModel`` of any layout. Rank 0 writes, atomically, as for
``TransformersModel`` (``twinkle.model.checkpoint.files``).

The optimizer state is each rank's own (moments of its slices): under tensor or pipeline
parallel every rank's is gathered and kept by its coordinates, and a resume needs the same
layout (``MegatronParallel.shard_optimizer_state`` checks it).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from twinkle.errors import CheckpointError, ConfigurationError, StateError
from twinkle.model.checkpoint import files as ckpt
from twinkle.model.checkpoint.checkpointer import Checkpointer, Tokenizer, _Save
from twinkle.model.megatron import convert, lora_files
from twinkle.model.train_group import FULL, TrainGroup


class HFCheckpoint(Mapping[str, torch.Tensor]):
    """A Hugging Face checkpoint's tensors by name, each read from its safetensors file when asked
    (a rank reads only its own stage's layers)."""

    def __init__(self, directory: Path):
        index = directory / 'model.safetensors.index.json'
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())['weight_map']
            self._files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / 'model.safetensors').is_file():
            path = directory / 'model.safetensors'
            with safe_open(str(path), 'pt') as handle:
                self._files = dict.fromkeys(handle.keys(), path)
        else:
            raise ConfigurationError(f'{directory.name} holds no safetensors weights (model.safetensors or its index)')

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._files[name]), 'pt') as handle:
            tensor: torch.Tensor = handle.get_tensor(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


class MegatronCheckpointer(Checkpointer):
    """``Checkpointer`` with megatron's weights gathered and renamed to Hugging Face's."""

    @property
    def gpt(self) -> nn.Module:
        """The megatron ``GPTModel`` behind the model's causal-LM front (``McoreCausalLM.gpt``)."""
        gpt = self.model.gpt
        if not isinstance(gpt, nn.Module):
            raise StateError(f'MegatronCheckpointer saves a McoreCausalLM; got {type(self.model).__name__}')
        return gpt

    def save(
        self, group: TrainGroup, destination: Path, tokenizer: Tokenizer, *, save_optimizer: bool, consumed: int | None
    ) -> None:
        gpt = self.gpt
        weights = (
            convert.export_hf_state_dict(gpt) if group.name == FULL else lora_files.peft_state_dict(gpt, group.name)
        )
        optimizer_state = None
        if save_optimizer and group.optimizer is not None:
            self.optimizer_ready(group)
            optimizer_state = self.parallel.gather_optimizer_state(group.optimizer)
        window = self.parallel.gather_window(group) if save_optimizer else None
        save = _Save(weights, save_optimizer, consumed, optimizer_state, window)
        self.parallel.on_main(lambda: self._write(group, destination, tokenizer, save))

    def _write_weights(self, group: TrainGroup, staging: Path, save: _Save) -> None:
        """The gathered Hugging Face weights (``save.weights``, whole on this rank) in safetensors:
        the full model with its config, or the adapter with its peft config."""
        weights = {k: v.detach().cpu().contiguous() for k, v in (save.weights or {}).items()}
        if group.name == FULL:
            save_file(weights, str(staging / 'model.safetensors'), metadata={'format': 'pt'})
            self.model.config.save_pretrained(str(staging))
            return
        save_file(weights, str(staging / ckpt.ADAPTER_WEIGHTS), metadata={'format': 'pt'})
        adapter_config = copy.copy(group.spec.config)
        adapter_config.base_model_name_or_path = self.model_id
        adapter_config.inference_mode = True
        adapter_config.save_pretrained(str(staging))

    def _load_weights(self, group: TrainGroup, directory: Path) -> None:
        if group.name == FULL:  # the full model in Hugging Face's files, as _write wrote it
            try:
                convert.load_hf_state_dict(self.gpt, HFCheckpoint(directory))
            except (ConfigurationError, KeyError, RuntimeError) as e:
                raise CheckpointError(f'{directory.name} does not fit this model: {e}') from e
            return
        self.load_adapter_weights(group, directory)

    def load_adapter_weights(self, group: TrainGroup, directory: Path) -> None:
        """An adapter's peft weights from ``directory`` into this rank's slices (every rank calls it)."""
        path = directory / ckpt.ADAPTER_WEIGHTS
        if not path.is_file():
            raise CheckpointError(f'{directory.name} has no {ckpt.ADAPTER_WEIGHTS}: it is not an adapter checkpoint')
        state: dict[str, Any] = load_file(str(path))
        try:
            lora_files.load_peft_state_dict(self.gpt, group.name, state)
        except (ConfigurationError, KeyError, RuntimeError) as e:
            raise CheckpointError(f'{directory.name} does not fit adapter {group.name!r}: {e}') from e


__all__ = ['HFCheckpoint', 'MegatronCheckpointer']
