"""Packed rows through linear-attention layers (Qwen3.5's gated deltanet), exactly.

A packed row holds several sequences (``position_ids`` restart at each); attention keeps them apart
by the mask transformers builds from the positions. A gated deltanet carries a causal convolution
and a recurrent state along the row instead, and transformers keeps packed sequences apart there
only when flash attention's ``cu_seq_lens`` reach fla's kernels: its torch fallback (the CPU's,
and a GPU's without fla) runs each sequence's state on into the next one. Measured on
``tiny-qwen3.5`` before this module: packed against padded, the loss 0.0076 apart and gradients
up to 1.38.

Here each such layer runs once per packed sequence: ``attach`` wraps the layers' forward, and
``ModelRunner`` hands the model ``model_kwargs``: where the sequences of each row start, as a keyword
the model passes down to its layers as it does flash attention's ``cu_seq_lens`` (so a layer
recomputed under gradient checkpointing gets it again). A row with one sequence runs as before.
"""

from __future__ import annotations

import functools
import itertools
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

#: The keyword a model's forward passes down to its layers: each row's sequence starts after its first.
STARTS_KWARG = 'twinkle_sequence_starts'
#: Set on a model whose layers ``attach`` wrapped.
_ATTACHED = '_twinkle_packed_recurrence'


def is_recurrent(module: nn.Module) -> bool:
    """Whether ``module`` is a linear-attention layer with a state along the sequence."""
    return type(module).__name__.endswith('GatedDeltaNet')


def attach(model: nn.Module) -> bool:
    """Wrap the forward of every linear-attention layer of ``model`` (idempotent); whether it has any."""
    layers = [module for module in model.modules() if is_recurrent(module)]
    for layer in layers:
        if not getattr(layer, _ATTACHED, False):
            layer.forward = types.MethodType(_forward_per_sequence, layer)
            setattr(layer, _ATTACHED, True)
    setattr(model, _ATTACHED, bool(layers))
    return bool(layers)


def model_kwargs(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The keyword arguments of ``model``'s forward on ``batch`` that keep its packed rows' sequences
    apart in the linear-attention layers: none without such layers or without a packed row."""
    starts = _sequence_starts(batch) if getattr(model, _ATTACHED, False) else None
    return {} if starts is None else {STARTS_KWARG: starts}


def _sequence_starts(batch: Mapping[str, torch.Tensor]) -> list[list[int]] | None:
    """Per row, where its sequences after the first start: a position not after the one before it,
    both real tokens (padding is left to the layer's mask). None when no row holds two."""
    positions = batch.get('position_ids')
    if positions is None or positions.ndim != 2:
        return None
    back = positions[:, 1:] <= positions[:, :-1]
    mask = batch.get('attention_mask')
    if mask is not None and mask.ndim == 2:
        back &= (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
    if not bool(back.any()):
        return None
    return [(row.nonzero()[:, 0] + 1).tolist() for row in back]


def _forward_per_sequence(layer: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The layer's own forward, once per packed sequence of each row when the model was given the starts.

    Bound to the layer as a method (not a closure over its bound forward), so a copy of the model
    (``copy.deepcopy`` rebinds methods) runs its own layer."""
    forward: Callable[..., torch.Tensor] = functools.partial(type(layer).forward, layer)
    starts = kwargs.pop(STARTS_KWARG, None)
    hidden = kwargs.get('hidden_states', args[0] if args else None)
    if starts is None or kwargs.get('cache') is not None or hidden is None or len(starts) != hidden.shape[0]:
        return forward(*args, **kwargs)
    mask = kwargs.get('attention_mask')
    rest = args[1:]
    kwargs.pop('hidden_states', None)
    rows = []
    for row, row_starts in enumerate(starts):
        # The last sequence runs to the row's end: a Ulysses group pads the row it gathered.
        bounds = [0, *row_starts, hidden.shape[1]]
        pieces = []
        for start, stop in itertools.pairwise(bounds):
            piece_mask = mask[row : row + 1, start:stop] if isinstance(mask, torch.Tensor) else mask
            piece = hidden[row : row + 1, start:stop]
            pieces.append(forward(piece, *rest, **{**kwargs, 'attention_mask': piece_mask}))
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


__all__ = ['STARTS_KWARG', 'attach', 'is_recurrent', 'model_kwargs']
