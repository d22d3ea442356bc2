"""Ulysses sequence parallel (``ulysses_size``): the ranks of a Ulysses group share one data shard
and each runs a contiguous slice of every sequence through the model.

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models", arXiv:2309.14509). Everything but attention
works on one position at a time, so a rank holds ``1/u`` of every activation. Attention needs the
whole sequence: its queries, keys and values go through an all-to-all that scatters the heads and
gathers the sequence (each rank then holds ``H/u`` heads of all positions), sdpa runs over the
whole sequence with the mask one process would use, and the reverse all-to-all brings each rank
its positions back with every head. The backward of an all-to-all is the reverse all-to-all.

How it keeps one process's numbers (``ModelParallel`` sums losses and item counts over ranks):

- The batch is the one process's batch. Only the model's input is cut: it is padded to a multiple
  of ``u`` (pad positions continue the last sequence's ``position_ids`` and are never attended to
  by a real token, the mask is causal) and each rank takes its slice of ``input_ids`` and
  ``position_ids``, so RoPE sees every token's true position. Labels are never cut (they are
  pre-shifted: the label at position ``t`` is token ``t + 1``, so nothing crosses a slice border).
- The mask is built once per forward over the whole padded sequence by transformers' own
  ``create_causal_mask`` for sdpa (padding, and the block-diagonal mask of packed rows from
  ``position_ids``), and handed to the model as its mask mapping: every attention layer gets it.
- Qwen3.5's linear-attention layers (gated deltanet) carry a state along the sequence: each rank
  all-gathers the layer's input, runs the layer over the whole sequence, keeps its slice of the
  output (the backward sums the ranks' input gradients and keeps its slice: a reduce-scatter).
  Exact, at the price of running those layers ``u`` times.
- The logits (and a value head's hidden state) are all-gathered, so every rank computes the
  loss, its metrics and the outputs the user sees on the whole sequence, exactly as one process
  does: exact for every loss, including those not additive over tokens (a sequence's mean in
  GRPO, GSPO's sequence ratio, DPO's sigmoid of sequence sums), with their per-sequence and
  per-token inputs untouched. The gather's backward hands each rank its slice of the gradient;
  each rank's parameter gradients are those of its positions, and summed over the ranks (as FSDP2
  or the data-parallel reduction does) they are the whole gradient. The first rank of a group
  counts the loss, its items and its metrics; the others add a loss of value 0 whose gradient is
  the loss's (``own_share``). The price: ``[seq, vocab]`` logits on every rank, not ``1/u`` of them.

The all-to-all and all-gather are ``torch.distributed``'s (gloo on the CPU, NCCL on GPUs: the
same calls).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask, sdpa_mask

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError
from twinkle.infra import distributed
from twinkle.infra.mesh import DeviceMesh
from twinkle.loss import LossOutput

#: The attention implementation a Ulysses model runs (registered with transformers below).
ATTENTION = 'ulysses_sdpa'
#: Layer kinds (``config.layer_types``) Ulysses handles: full attention through the all-to-all,
#: linear attention whole on every rank. Sliding-window and chunked layers would need masks of their own.
LAYER_TYPES = ('full_attention', 'linear_attention')
#: Where an attention module finds its Ulysses group.
_GROUP_ATTR = '_twinkle_ulysses'


class Ulysses:
    """This rank's Ulysses group: its ranks, its slice, and what the model needs of it.

    Every rank builds one (``dist.new_group`` is collective: all groups in the same order)."""

    def __init__(self, mesh: DeviceMesh):
        me = distributed.rank()
        groups = sorted({tuple(mesh.ranks_along('ulysses', rank)) for rank in range(mesh.world_size)})
        self.group: Any = None
        for ranks in groups:
            group = dist.new_group(list(ranks))
            if me in ranks:
                self.group, self.ranks = group, list(ranks)
        self.size = mesh.ulysses_size
        self.index = self.ranks.index(me)

    @property
    def lead(self) -> bool:
        """Whether this rank counts its group's loss, items and metrics (the group's first)."""
        return self.index == 0

    # ---- set-up ---------------------------------------------------------------------------------
    def attach(self, model: PreTrainedModel, moe: bool) -> None:
        """Check the model can be split this way, then route its attention through the all-to-all
        and gather around its linear-attention layers."""
        config = model.config.get_text_config()  # a composite config (vision-language) keeps its text part apart
        check_model(config, self.size, moe)
        register()
        for module in model.modules():
            if hasattr(module, 'num_key_value_groups') and hasattr(module, 'head_dim'):
                setattr(module, _GROUP_ATTR, self)
            if type(module).__name__.endswith('GatedDeltaNet'):
                module.register_forward_pre_hook(self._gather_input, with_kwargs=True)
                module.register_forward_hook(self._keep_slice)
        model.set_attn_implementation(ATTENTION)

    # ---- a forward --------------------------------------------------------------------------------
    def split(self, inputs: Mapping[str, torch.Tensor], config: Any) -> dict[str, Any]:
        """The model inputs of this rank's slice: ``input_ids`` and ``position_ids`` cut, and the
        mask mapping of the whole (padded) sequence that every layer reads."""
        ids = inputs['input_ids']
        rows, width = ids.shape
        padded = -(-width // self.size) * self.size
        extra = padded - width
        positions = inputs.get('position_ids')
        if positions is None:
            positions = torch.arange(width, device=ids.device).expand(rows, width)
        mask = inputs.get('attention_mask')
        if extra:
            # Pad positions continue the last sequence: a real token never attends to them (causal).
            steps = torch.arange(1, extra + 1, device=ids.device)
            positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
            ids = F.pad(ids, (0, extra))
            mask = None if mask is None else F.pad(mask, (0, extra))
        shape = torch.empty(rows, padded, 0, device=ids.device)
        full = create_causal_mask(config=_SdpaConfig(config), inputs_embeds=shape, attention_mask=mask, cache=None,
                                  position_ids=positions)  # fmt: skip
        recurrent = None if mask is None or bool(mask.all()) else mask
        piece = slice(self.index * (padded // self.size), (self.index + 1) * (padded // self.size))
        return {
            'input_ids': ids[:, piece],
            'position_ids': positions[:, piece],
            'attention_mask': {'full_attention': full, 'linear_attention': recurrent},
        }

    def local_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``[rows, positions]`` labels, padded as ``split`` pads the tokens
        (the padding trained on nothing): what the fused output layer scores on this rank."""
        extra = -(-labels.shape[1] // self.size) * self.size - labels.shape[1]
        return _own_slice(F.pad(labels, (0, extra), value=IGNORE_INDEX), self)

    def gather(self, local: torch.Tensor, width: int) -> torch.Tensor:
        """The whole sequence's ``[rows, positions, ...]`` from every rank's slice, cut back to
        ``width`` (the padding dropped); its backward hands this rank its slice of the gradient
        (every rank computes the same loss of it: see ``own_share``)."""
        whole: torch.Tensor = _apply(_GatherReplicated, local, self)
        return whole[:, :width]

    def own_share(self, loss: LossOutput) -> LossOutput:
        """The group's loss counted once: the lead's as it is, the others' of value 0 and no items,
        with the same gradient (each rank's gradient is that of its own positions)."""
        if self.lead:
            return loss
        value = loss.loss - loss.loss.detach()
        return LossOutput(value, torch.zeros_like(loss.num_items), loss.metrics)

    # ---- linear attention: the whole sequence on every rank ---------------------------------------
    def _gather_input(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (_apply(_GatherSplit, args[0], self), *args[1:]), kwargs
        return args, {**kwargs, 'hidden_states': _apply(_GatherSplit, kwargs['hidden_states'], self)}

    def _keep_slice(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return _own_slice(output, self)


# ---- the attention function -----------------------------------------------------------------------
def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa over the whole sequence from each rank's slice: ``[rows, heads, slice, dim]`` in,
    ``[rows, slice, heads, dim]`` out (as transformers' sdpa returns it). ``attention_mask`` is the
    whole sequence's (``Ulysses.split``), None for a plain causal mask."""
    ulysses: Ulysses = getattr(module, _GROUP_ATTR)
    groups = query.shape[1] // key.shape[1]
    if key.shape[1] % ulysses.size:  # too few key/value heads to scatter: repeat them (as GQA would)
        key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
        groups = 1
    query, key, value = (_apply(_SeqToHeads, t, ulysses) for t in (query, key, value))
    # enable_gqa: each key/value head serves its queries without a repeated copy held for backward.
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=attention_mask is None, enable_gqa=groups > 1,
    )  # fmt: skip
    out = _apply(_HeadsToSeq, out, ulysses)
    return out.transpose(1, 2).contiguous(), None


def _ulysses_mask(*args: Any, **kwargs: Any) -> Any:
    """Masks for ``ATTENTION`` as for sdpa (the model gets the whole sequence's mask from ``split``)."""
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make ``ATTENTION`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION, ulysses_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _ulysses_mask)


class _SdpaConfig:
    """A model config read as if its attention were sdpa: ``create_causal_mask`` picks its mask
    builder by ``_attn_implementation``, the rest it reads from the config."""

    _attn_implementation = 'sdpa'

    def __init__(self, config: Any):
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def check_model(config: Any, size: int, moe: bool) -> None:
    """ConfigurationError unless ``size`` ranks can split the model's attention heads."""
    if moe:
        raise ConfigurationError(
            f'ulysses_size={size}: a mixture of experts is not supported with Ulysses sequence parallel (its router '
            'loss and routing replay are per sequence); use dp_size, fsdp_size or ep_size'
        )
    heads = int(config.num_attention_heads)
    if heads % size:
        fits = [d for d in range(2, heads + 1) if heads % d == 0]
        raise ConfigurationError(
            f'ulysses_size={size} must divide the attention heads ({heads}) of {config.model_type}: '
            f'ulysses_size can be one of {fits}'
        )
    kinds = sorted(set(getattr(config, 'layer_types', None) or ['full_attention']) - set(LAYER_TYPES))
    if kinds or (getattr(config, 'sliding_window', None) and getattr(config, 'use_sliding_window', False)):
        raise ConfigurationError(
            f'ulysses_size={size}: {config.model_type} has layers of kinds {kinds or ["sliding_attention"]}; '
            f'Ulysses sequence parallel handles {list(LAYER_TYPES)}'
        )


def _repeat_heads(tensor: torch.Tensor, times: int) -> torch.Tensor:
    """``[rows, heads, seq, dim]`` with each head repeated ``times`` in place (transformers' ``repeat_kv``)."""
    return tensor if times == 1 else tensor.repeat_interleave(times, dim=1)


# ---- collectives with their backward --------------------------------------------------------------
def _seq_to_heads(x: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """``[B, H, L, D]`` (this rank's positions, every head) -> ``[B, H/u, u*L, D]`` (every position,
    this rank's heads): chunk ``j`` of the heads goes to rank ``j``, rank ``i`` sends slice ``i``."""
    u = ulysses.size
    rows, heads, length, dim = x.shape
    send = x.reshape(rows, u, heads // u, length, dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=ulysses.group)
    return received.permute(1, 2, 0, 3, 4).reshape(rows, heads // u, u * length, dim)


def _heads_to_seq(y: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``: ``[B, H/u, u*L, D]`` -> ``[B, H, L, D]``."""
    u = ulysses.size
    rows, heads, width, dim = y.shape
    send = y.reshape(rows, heads, u, width // u, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=ulysses.group)
    return received.transpose(0, 1).reshape(rows, u * heads, width // u, dim)


def _all_gather(local: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """Every rank's ``[rows, slice, ...]`` concatenated along the sequence, in rank order."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(ulysses.size)]
    dist.all_gather(parts, local, group=ulysses.group)
    return torch.cat(parts, dim=1)


def _own_slice(whole: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    length = whole.shape[1] // ulysses.size
    return whole.narrow(1, ulysses.index * length, length)


def _apply(function: type[torch.autograd.Function], tensor: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
    """``function`` (one of the collectives below) on ``tensor``, recorded for autograd."""
    out: torch.Tensor = function.apply(tensor, ulysses)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
        ctx.ulysses = ulysses
        return _seq_to_heads(x, ulysses)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad.contiguous(), ctx.ulysses), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
        ctx.ulysses = ulysses
        return _heads_to_seq(y, ulysses)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad.contiguous(), ctx.ulysses), None


class _GatherReplicated(torch.autograd.Function):
    """All-gather whose consumers compute the same thing on every rank: the backward keeps this
    rank's slice of the gradient (summing the ranks' equal gradients would count it ``u`` times)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
        ctx.ulysses = ulysses
        return _all_gather(local, ulysses)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _own_slice(grad, ctx.ulysses).contiguous(), None


class _GatherSplit(torch.autograd.Function):
    """All-gather whose consumer keeps only this rank's slice of what it computes: the gradient of
    a position's input is the sum over the ranks of theirs (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ulysses: Ulysses) -> torch.Tensor:
        ctx.ulysses = ulysses
        return _all_gather(local, ulysses)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.ulysses.group)
        return _own_slice(summed, ctx.ulysses).contiguous(), None


__all__ = ['ATTENTION', 'Ulysses', 'check_model', 'register', 'ulysses_attention']
