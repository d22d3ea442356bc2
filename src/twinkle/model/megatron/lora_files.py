"""An adapter of ``twinkle.model.megatron.lora`` in peft's files: its whole tensors keyed as peft
saves them for the Hugging Face model, gathered from every rank's slices (tensor parallel) and
stages (pipeline parallel), and sliced back when they are loaded.

Example::

    state = peft_state_dict(gpt, 'alice')  # whole tensors on every rank, peft's keys
    load_peft_state_dict(gpt, 'bob', state)  # each rank copies its slices
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twinkle.errors import ConfigurationError, UnknownNameError
from twinkle.model.lora import multi as multi_lora
from twinkle.model.megatron import experts
from twinkle.model.megatron.lora import PROJECTIONS, Layout, Projection, adapted_layers, over_stages


def _key(layer: int, projection: str, which: str) -> str:
    """peft's key for one tensor: 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'."""
    path = Projection(layer, projection, 0, 0).hf_path
    return f'{multi_lora.PEFT_PREFIX}{path}.{which}.weight'


def _gather(tensor: torch.Tensor, dim: int, layout: Layout, group: Any) -> torch.Tensor:
    """The whole tensor from every tensor-parallel rank's slice along ``dim``."""
    if layout.tp_size == 1:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(layout.tp_size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def peft_state_dict(model: nn.Module, name: str, grads: bool = False) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s whole tensors (CPU) keyed as peft saves them for the Hugging Face model,
    gathered over tensor parallel (all-gather) and pipeline stages: every rank gets the whole
    dict. ``grads``: the tensors' gradients instead (zeros where none yet), keyed alike, to
    compare parallel layouts. Collective over the model's parallel group: every rank calls it."""
    local: dict[str, torch.Tensor] = {}
    for layer in adapted_layers(model, name):
        layout, group = layer.layout, layer.base_layer.tp_group
        for projection, pair in layer.parallel_adapter(name).pairs().items():
            tensor_A, tensor_B = (_value(p, grads) for p in (pair.lora_A.weight, pair.lora_B.weight))
            column = layout.parallel == 'column'
            lora_A = tensor_A if column else _gather(tensor_A, 1, layout, group)
            lora_B = _gather(tensor_B, 0, layout, group) if column else tensor_B
            local[_key(layer.layer, projection, 'lora_A')] = lora_A.cpu().clone()
            local[_key(layer.layer, projection, 'lora_B')] = lora_B.cpu().clone()
    local |= experts.peft_state(model, name, grads)
    state = {key: tensor for stage in over_stages(local) for key, tensor in stage.items()}
    if not state:
        raise UnknownNameError('adapter', name, multi_lora.adapter_names(model))
    return dict(sorted(state.items(), key=lambda item: _key_order(item[0])))


def _value(param: torch.Tensor, grad: bool) -> torch.Tensor:
    if not grad:
        return param.detach()
    return torch.zeros_like(param) if param.grad is None else param.grad.detach()


def _key_order(key: str) -> tuple[int, int, int, str]:
    """Keys in peft's order: layer, projection (the experts after the layer's projections, peft's
    nested wrappers inside out), then lora_A before lora_B."""
    match = re.search(r'layers\.(\d+)\.\w+\.(\w+)\.((?:base_layer\.)*)(lora_[AB])', key)
    if match is None:
        return -1, -1, 0, key
    if match[2] == 'experts':
        return int(match[1]), len(PROJECTIONS), -match[3].count('base_layer'), match[4]
    return int(match[1]), list(PROJECTIONS).index(match[2]), 0, match[4]


def load_peft_state_dict(model: nn.Module, name: str, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a peft adapter file's whole tensors into adapter ``name``, each rank its slices. Every
    tensor of this rank's layers must be there with its shape, and a key no stage's layer has is an
    error too; nothing is copied then. Collective over the pipeline stages: every rank calls it."""
    state = {_without_adapter_name(key, name): tensor for key, tensor in state.items()}
    pairs = {
        (_key(layer.layer, projection, 'lora_A'), _key(layer.layer, projection, 'lora_B')): (pair, layer.layout)
        for layer in adapted_layers(model, name)
        for projection, pair in layer.parallel_adapter(name).pairs().items()
    }
    expert_shapes = experts.peft_shapes(model, name)
    local = sorted([key for keys in pairs for key in keys] + list(expert_shapes))
    known = {key for stage in over_stages(local) for key in stage}
    if not known:
        raise UnknownNameError('adapter', name, multi_lora.adapter_names(model))
    missing, unexpected = sorted(set(local) - set(state)), sorted(set(state) - known)
    if missing or unexpected:
        raise ConfigurationError(
            f'the weights do not fit adapter {name!r}: {len(missing)} missing (e.g. {missing[:1]}), '
            f'{len(unexpected)} unexpected (e.g. {unexpected[:1]})'
        )
    for keys, (pair, layout) in pairs.items():
        for key, shape in zip(keys, layout.whole_shapes(pair.lora_A.weight, pair.lora_B.weight), strict=True):
            if state[key].shape != shape:
                raise ConfigurationError(f'weight {key!r} has shape {tuple(state[key].shape)}; expected {tuple(shape)}')
    for key, expert_shape in expert_shapes.items():
        if tuple(state[key].shape) != expert_shape:
            raise ConfigurationError(f'weight {key!r} has shape {tuple(state[key].shape)}; expected {expert_shape}')
    experts.load_peft_state(model, name, state)
    with torch.no_grad():
        for (key_A, key_B), (pair, layout) in pairs.items():
            lora_A, lora_B = layout.shard(state[key_A], state[key_B])
            pair.lora_A.weight.copy_(lora_A)
            pair.lora_B.weight.copy_(lora_B)


def _without_adapter_name(key: str, name: str) -> str:
    """Keys saved with the adapter's name in them ('.lora_A.<name>.weight') as peft files hold them."""
    return key.replace(f'.lora_A.{name}.', '.lora_A.').replace(f'.lora_B.{name}.', '.lora_B.')


__all__ = ['load_peft_state_dict', 'peft_state_dict']
