"""A model's output layer run fused: each label token's log-probability (and entropy) from the
last hidden states, in chunks of tokens, without the ``[batch, seq, vocab]`` logits.

``fused_token_logprobs`` does the arithmetic for one head and one LoRA; this module applies it to
a model's own head (``get_output_embeddings()``), each row through the LoRA its adapter puts on the
head (``MultiLoraLinear``), or the base head alone. ``ModelRunner`` uses it for a loss whose
``output_reads`` is not ``'logits'`` on a model built with ``fused_output=True``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from twinkle.errors import ConfigurationError
from twinkle.model.lora.adapter import RowAssignment
from twinkle.model.lora.multi import MultiLoraLinear
from twinkle.model.output.fused import DEFAULT_CHUNK_SIZE, HeadLora, fused_token_logprobs

#: What the fused layer computes: the labels' logprobs, and the entropy too.
FusedReads = Literal['logps', 'logps+entropy']
#: Outputs from which ``fused_output`` is on when not chosen. At Qwen3's 151,936 (``wide-qwen3``) the fused
#: layer ran an SFT and a GRPO step at x1.49 and x1.47 of a raw PyTorch + PEFT loop's tokens/s, in x0.21 and
#: x0.32 of its memory; at 4,096 from x0.83 (``small-qwen3``) to x1.47 (``tiny-qwen3.5``), no steady gain
#: (``benchmarks/sft_speed.py``, 2026-11-28).
FUSED_BY_DEFAULT_FROM = 32_768


#: Config fields of models whose logits are more than the head's projection of the last hidden
#: states (Gemma's soft cap, Cohere's scale, Granite's divisor, Falcon-H1's and MiniCPM3's
#: multipliers): the fused layer would train on other numbers, so such a model runs unfused.
LOGIT_TRANSFORMS = ('final_logit_softcapping', 'logit_scale', 'logits_scaling', 'lm_head_multiplier')


def fusable(model: nn.Module) -> bool:
    """Whether the model's head can run fused: its logits are the head's projection of the last
    hidden state (no ``LOGIT_TRANSFORMS``, the final norm inside ``hidden_states[-1]``), the head a
    plain linear layer (or one wrapped for LoRA) whose weight is a whole tensor on this process,
    with no LoRA dropout on the head (the fused layer applies none; the model's train or eval mode
    must be set first)."""
    if not _plain_logits(getattr(model, 'config', None)):
        return False
    head = _head(model)
    if isinstance(head, MultiLoraLinear):
        if any(adapter.active_dropout for adapter in map(head.adapter, head.adapters)):
            return False
        head = head.base_layer
    if not isinstance(head, nn.Linear):
        return False
    return type(head.weight.data) is torch.Tensor  # not a DTensor shard (FSDP2, tensor parallel)


def head_outputs(
    model: nn.Module,
    hidden_BSH: torch.Tensor,
    labels_BS: torch.Tensor,
    reads: FusedReads,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> dict[str, torch.Tensor]:
    """``logps``, ``hits`` and (for ``'logps+entropy'``) ``entropy``, each ``[B, S]``, of the
    model's head over ``hidden_BSH`` (the last hidden states, after the final norm): rows that share
    an adapter go through one ``fused_token_logprobs`` call with that adapter's head LoRA."""
    head = _head(model)
    assert head is not None  # fusable(model) was checked
    layer = head if isinstance(head, MultiLoraLinear) else None
    base = head.base_layer if isinstance(head, MultiLoraLinear) else head
    if not isinstance(base, nn.Linear):
        raise ConfigurationError(f'the fused output layer needs a linear head; this model has {type(base).__name__}')
    with_entropy = reads == 'logps+entropy'
    rows, hidden = hidden_BSH.shape[0], hidden_BSH.shape[-1]
    device = hidden_BSH.device.type
    # Under autocast the head runs in autocast's dtype, as the unfused head would; the fused
    # function's backward recomputes the logits, so it gets its tensors cast already, not autocast.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    weight = _cast(base.weight, dtype)  # once: every group of rows shares the cast head
    bias = None if base.bias is None else _cast(base.bias, dtype)
    parts: list[tuple[torch.Tensor | None, dict[str, torch.Tensor]]] = []
    for lora, idx in _row_groups(layer, rows):
        x_BSH, y_BS = (hidden_BSH, labels_BS) if idx is None else (hidden_BSH[idx], labels_BS[idx])
        with torch.autocast(device, enabled=False):
            out = fused_token_logprobs(
                _cast(x_BSH.reshape(-1, hidden), dtype),
                weight,
                y_BS.reshape(-1),
                bias=bias,
                lora=None if lora is None else HeadLora(_cast(lora.a, dtype), _cast(lora.b, dtype), lora.scale),
                chunk_size=chunk_size,
                with_entropy=with_entropy,
            )
        found = {'logps': out.logps, 'hits': out.hits} | ({'entropy': out.entropy} if out.entropy is not None else {})
        parts.append((idx, {key: value.reshape(y_BS.shape) for key, value in found.items()}))
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    return {key: _scatter_rows(labels_BS, [(idx, found[key]) for idx, found in parts]) for key in parts[0][1]}


def _plain_logits(config: object) -> bool:
    """Whether a model of ``config`` (or of its text config) computes its logits as the head's
    projection of ``hidden_states[-1]`` and nothing more."""
    for part in (config, getattr(config, 'text_config', None)):
        if part is None:
            continue
        if any(getattr(part, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
            return False
        if getattr(part, 'tie_last_hidden_states', True) is False:  # hidden_states[-1] before the final norm
            return False
    return True


def fuses_by_default(model: nn.Module) -> bool:
    """``fused_output``'s default: on for a head of at least ``FUSED_BY_DEFAULT_FROM`` outputs, a real
    model's vocabulary, where the logits are what fills a step's memory and time."""
    weight = getattr(_head(model), 'weight', None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] >= FUSED_BY_DEFAULT_FROM


def _head(model: nn.Module) -> nn.Module | None:
    """The model's output layer (``PreTrainedModel.get_output_embeddings``), None without one."""
    get = getattr(model, 'get_output_embeddings', None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def _row_groups(layer: MultiLoraLinear | None, rows: int) -> list[tuple[HeadLora | None, torch.Tensor | None]]:
    """The head LoRA of each group of rows, with the rows (None: every row)."""
    assignment = layer.assignment if layer is not None else None
    if layer is None or assignment is None or not assignment.rows:
        return [(None, None)]
    assignment = assignment.over(rows)
    groups: list[tuple[HeadLora | None, torch.Tensor | None]] = []
    for name, idx in assignment.rows.items():
        lora = _head_lora(layer, name)
        if idx is None:
            return [(lora, None)]
        groups.append((lora, idx))
    base_rows = _unassigned(assignment, rows)
    if base_rows is not None:
        groups.append((None, base_rows))
    return groups


def _head_lora(layer: MultiLoraLinear, name: str) -> HeadLora | None:
    """Adapter ``name``'s LoRA on the head, or None where it does not adapt the head."""
    if name not in layer.adapters:
        return None
    adapter = layer.adapter(name)
    return HeadLora(adapter.lora_A.weight, adapter.lora_B.weight, float(adapter.scaling))


def _unassigned(assignment: RowAssignment, rows: int) -> torch.Tensor | None:
    """The rows no adapter takes (the base model's), or None when there are none."""
    names = assignment.names
    if names is None:
        return None
    free = [i for i in range(rows) if names[i] is None]
    return torch.tensor(free, dtype=torch.long) if free else None


def _scatter_rows(like_BS: torch.Tensor, parts: list[tuple[torch.Tensor | None, torch.Tensor]]) -> torch.Tensor:
    """Rows of several groups back in the batch's order (differentiable)."""
    first = parts[0][1]
    out = first.new_zeros(like_BS.shape)
    for idx, values in parts:
        assert idx is not None  # a group of every row is returned whole
        out = out.index_copy(0, idx.to(out.device), values)
    return out


__all__ = ['FUSED_BY_DEFAULT_FROM', 'FusedReads', 'fusable', 'fuses_by_default', 'head_outputs']
