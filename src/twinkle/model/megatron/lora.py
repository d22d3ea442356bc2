"""Per-row LoRA on megatron-core's tensor-parallel linears, saved and loaded as peft's Hugging Face adapters.

megatron fuses what Hugging Face keeps apart: ``linear_qkv`` holds, query group after query group,
the group's query heads, then its key head, then its value head; ``linear_fc1`` holds [gate; up]
(each tensor-parallel rank its slice of gate, then its slice of up). peft adapts the Hugging Face
projections one by one, so an adapter here keeps one (A, B) pair per Hugging Face projection
(q_proj, k_proj and v_proj apart) and adds each pair's delta into that projection's positions of
the fused output. Saving is then a relabel and a gather, and any peft adapter loads exactly.

Under tensor parallel each rank holds its shard of every pair, split as Megatron-LM splits the
layer it adapts (Shoeybi et al. 2019, section 3)::

    column-parallel (q, k, v, gate, up): x whole, A [r, in] whole, B this rank's output rows
        h = x @ A^T                 copy_to_tensor_model_parallel_region: the backward sums dh
        y_local += s * h @ B_local^T    over the ranks, whose rows each gave part of it
    row-parallel (o, down): x this rank's input slice, A its input columns, B [out, r] whole
        h = all_reduce(x_local @ A_local^T)    reduce_from_tensor_model_parallel_region
        y += s * h @ B^T            after the base layer's own all-reduce

so every rank computes exactly what one process computes, the all-reduces carrying r numbers per
token. megatron's activations are [s, b, h], sequence first: a row of the batch is dim 1.

Under megatron's sequence parallel the adapters gather a column-parallel layer's input and
reduce-scatter a row-parallel one's output as the base layer does, and their whole weights carry
megatron's ``sequence_parallel`` mark (their gradients are summed over tensor parallel).

megatron's routed experts take adapters through peft's ``target_parameters``
('mlp.experts.gate_up_proj', 'mlp.experts.down_proj'): ``twinkle.model.megatron.experts``.
Refused by name: 'all-linear' on a mixture of experts (peft 0.21 on transformers 5 turns it into the
attention projections, the router's weight and the expert stacks with gate_up_proj at twice the
rank; the router is not adapted here, so the targets must be named); a tensor-parallel size that
does not divide the query groups.

Example (every rank of the model's parallel group runs the same lines)::

    add_adapter(gpt, 'alice', LoraSpec(r=8, alpha=16, target_modules=('q_proj', 'v_proj')))
    with multi_lora.row_adapters(gpt, ['alice', None]):
        logits = gpt(input_ids, position_ids, None)

The adapter's weights in peft's files: ``twinkle.model.megatron.lora_files``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from twinkle.errors import ConfigurationError, StateError
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.adapter import LoraSpec, RowAssignment, check_name, check_spec, initialise
from twinkle.model.megatron import experts

#: Hugging Face projection -> (its block in a decoder layer, the megatron module holding it), in the
#: order peft meets them in a Qwen3 decoder layer (and so draws their weights).
PROJECTIONS: dict[str, tuple[str, str]] = {
    'q_proj': ('self_attn', 'self_attention.linear_qkv'),
    'k_proj': ('self_attn', 'self_attention.linear_qkv'),
    'v_proj': ('self_attn', 'self_attention.linear_qkv'),
    'o_proj': ('self_attn', 'self_attention.linear_proj'),
    'gate_proj': ('mlp', 'mlp.linear_fc1'),
    'up_proj': ('mlp', 'mlp.linear_fc1'),
    'down_proj': ('mlp', 'mlp.linear_fc2'),
}
#: The megatron modules LoRA attaches to, relative to a decoder layer.
MEGATRON_MODULES = tuple(dict.fromkeys(module for _, module in PROJECTIONS.values()))


@dataclass(frozen=True)
class Projection:
    """One Hugging Face projection of one decoder layer (``layer``: its global index, from 0), with
    its whole (unsharded) sizes."""

    layer: int
    name: str
    in_features: int
    out_features: int

    @property
    def hf_path(self) -> str:
        """Its module path in a Hugging Face causal LM ('model.layers.3.self_attn.q_proj')."""
        return f'model.layers.{self.layer}.{PROJECTIONS[self.name][0]}.{self.name}'

    @property
    def order(self) -> tuple[int, int]:
        return self.layer, list(PROJECTIONS).index(self.name)


@dataclass(frozen=True)
class Layout:
    """Where the projections of one megatron layer sit in this rank's shard of it.

    The local output is ``groups`` repeats of the parts laid side by side (``linear_qkv``: per
    local query group its query heads, key head, value head; else one group)."""

    # 'column': output rows split over tensor-parallel ranks; 'row': input columns split.
    parallel: str
    # (projection, width of its output in one group on this rank), in output order.
    parts: tuple[tuple[str, int], ...]
    groups: int
    tp_size: int
    tp_rank: int
    # megatron's sequence parallel: a column-parallel layer's input and a row-parallel layer's
    # output are this rank's slice of the sequence (dim 0), not the whole.
    sequence_parallel: bool = False

    def place(self, deltas: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The projections' [..., width] deltas laid into one [..., local output] tensor (zeros
        where a projection has no delta)."""
        if len(self.parts) == 1:
            return deltas[self.parts[0][0]]
        like = next(iter(deltas.values()))
        lead = like.shape[:-1]
        pieces = [
            deltas[name].reshape(*lead, self.groups, width)
            if name in deltas
            else like.new_zeros((*lead, self.groups, width))
            for name, width in self.parts
        ]
        return torch.cat(pieces, dim=-1).flatten(-2)

    def shard(self, lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of a projection's whole (A [r, in], B [out, r])."""
        if self.parallel == 'column':
            return lora_A.clone(), lora_B.chunk(self.tp_size, dim=0)[self.tp_rank].clone()
        return lora_A.chunk(self.tp_size, dim=1)[self.tp_rank].clone(), lora_B.clone()

    def whole_shapes(self, lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[torch.Size, torch.Size]:
        """The whole shapes of a projection whose shards are ``lora_A``, ``lora_B``."""
        r, in_local = lora_A.shape
        out_local = lora_B.shape[0]
        if self.parallel == 'column':
            return torch.Size((r, in_local)), torch.Size((out_local * self.tp_size, r))
        return torch.Size((r, in_local * self.tp_size)), torch.Size((out_local, r))


def _linear(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` [out, in] (no bias), as peft's lora_A / lora_B are."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device='meta')
    layer.weight = nn.Parameter(weight)
    return layer


class LoraPair(nn.Module):
    """One Hugging Face projection's ``lora_A`` and ``lora_B``, this rank's shards of them."""

    def __init__(self, lora_A: torch.Tensor, lora_B: torch.Tensor) -> None:
        super().__init__()
        self.lora_A = _linear(lora_A)
        self.lora_B = _linear(lora_B)


class ParallelLoraAdapter(nn.ModuleDict):
    """One adapter of one megatron layer: a ``LoraPair`` per Hugging Face projection it adapts,
    keyed by the projection's name ('q_proj'), so its parameters are named '<proj>.lora_A.weight'."""

    def __init__(self, pairs: Mapping[str, LoraPair], spec: LoraSpec, layout: Layout) -> None:
        super().__init__(pairs)
        self.layout = layout
        self.scaling = spec.scaling
        # A probability, not an nn.Dropout module (as LoraAdapter keeps it).
        self.dropout = spec.dropout

    def pairs(self) -> dict[str, LoraPair]:
        return {name: pair for name, pair in self.items() if isinstance(pair, LoraPair)}

    @property
    def active_dropout(self) -> float:
        """The dropout probability this forward applies: none in eval mode."""
        return self.dropout if self.training else 0.0

    def forward(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        """The delta [s, n, local out] for the rows ``x`` [s, n, local in]: each projection's input
        dropped on its own (peft drops each projection's input apart), the r-wide hidden states of
        every projection through one tensor-parallel collective."""
        pairs = self.pairs()
        x = x.to(next(iter(pairs.values())).lora_A.weight.dtype)
        if self.layout.sequence_parallel and self.layout.parallel == 'column':
            x = _whole_sequence(x, group)  # as the base layer gathers it; the backward sums over the ranks
        masks = self._dropout_masks(x, len(pairs), group)
        inputs = [x] * len(pairs) if masks is None else [x * mask for mask in masks]
        hidden = [
            nn.functional.linear(x_p, pair.lora_A.weight) for pair, x_p in zip(pairs.values(), inputs, strict=True)
        ]
        h = hidden[0] if len(hidden) == 1 else torch.cat(hidden, dim=-1)
        if self.layout.tp_size > 1:
            h = _tensor_parallel(self.layout, h, group)
        deltas = {
            name: nn.functional.linear(h_p, pair.lora_B.weight) * self.scaling
            for (name, pair), h_p in zip(pairs.items(), h.chunk(len(pairs), dim=-1), strict=True)
        }
        return self.layout.place(deltas)

    def _dropout_masks(self, x: torch.Tensor, count: int, group: Any) -> list[torch.Tensor] | None:
        """``count`` dropout masks for ``x``, scaled by 1 / (1 - p) as ``nn.Dropout`` scales them
        (None without dropout). A column-parallel layer's ranks all compute ``x @ A^T`` for the whole ``A``: they
        must drop the same inputs, or their copies of ``A`` would get different gradients, so the
        first rank's masks are broadcast over the tensor-parallel group."""
        p = self.active_dropout
        if not p:
            return None
        masks = torch.empty((count, *x.shape), dtype=x.dtype, device=x.device).bernoulli_(1 - p)
        if self.layout.parallel == 'column' and self.layout.tp_size > 1:
            dist.broadcast(masks, dist.get_global_rank(group, 0), group=group)
        return list(masks.div_(1 - p))

    def delta_weight(self) -> torch.Tensor:
        """What merging the adapter adds to this rank's shard of the layer's weight [local out, local in]."""
        deltas = {
            name: (pair.lora_B.weight @ pair.lora_A.weight * self.scaling).t() for name, pair in self.pairs().items()
        }
        return self.layout.place(deltas).t()


def _tensor_parallel(layout: Layout, h: torch.Tensor, group: Any) -> torch.Tensor:
    """Column-parallel: identity forward, all-reduced gradient; row-parallel: all-reduced sum of
    the ranks' partial products, gradient passed through (megatron's autograd-aware mappings).
    Under sequence parallel a column-parallel input was gathered already (its backward sums), and
    a row-parallel sum is reduce-scattered to this rank's slice of the sequence, as the base's output is."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    if layout.parallel == 'column':
        return (
            h if layout.sequence_parallel else cast(torch.Tensor, copy_to_tensor_model_parallel_region(h, group=group))
        )
    if layout.sequence_parallel:
        return cast(torch.Tensor, reduce_scatter_to_sequence_parallel_region(h, group=group))
    return cast(torch.Tensor, reduce_from_tensor_model_parallel_region(h, group=group))


def _whole_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's slice of the sequence gathered whole over tensor parallel; the gradient is
    reduce-scattered back (megatron's autograd-aware mapping)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return cast(torch.Tensor, gather_from_sequence_parallel_region(x, group=group))


class MultiLoraParallelLinear(multi_lora.MultiLoraLinear):
    """A frozen megatron ``ColumnParallelLinear`` or ``RowParallelLinear`` plus named adapters,
    applied per row (dim 1 of megatron's [s, b, h]) by ``multi_lora.row_adapters``. It keeps the
    wrapped layer's ``(output, bias)`` contract; the deltas join the output after the base
    layer's all-reduce and never touch the bias."""

    def __init__(self, base: nn.Module, layout: Layout, layer: int) -> None:
        nn.Module.__init__(self)
        # megatron's parallel linear: the parent annotates the nn.Linear it wraps.
        self.base_layer = base.requires_grad_(False)  # type: ignore[assignment]
        self.adapters = nn.ModuleDict()
        self.assignment: RowAssignment | None = None
        self.layout = layout
        # The global index (from 0) of the decoder layer this linear belongs to.
        self.layer = layer

    def add_adapter(self, name: str, spec: LoraSpec, generator: torch.Generator | None = None) -> Any:
        raise ConfigurationError(
            f'adapter {name!r}: a megatron layer takes adapters from twinkle.model.megatron.lora.add_adapter, '
            'which draws them over global layer numbers so that every parallel layout gets the same numbers'
        )

    def parallel_adapter(self, name: str) -> ParallelLoraAdapter:
        adapter = self.adapters[name]
        if not isinstance(adapter, ParallelLoraAdapter):
            raise StateError(f'adapter {name!r} of this layer is a {type(adapter).__name__}, not a ParallelLoraAdapter')
        return adapter

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        """``x`` [s, b, local in] -> (output [s, b, local out], bias); row b through
        ``assignment.names[b]``'s adapter."""
        assignment = self.assignment
        if assignment is None:
            raise StateError('MultiLoraParallelLinear ran outside row_adapters(model, names): wrap the forward in it')
        assignment = assignment.over(x.shape[1])
        out, bias = self.base_layer(x, *args, **kwargs)
        group = self.base_layer.tp_group
        for name, idx in assignment.rows_on(x.device).items():
            if name not in self.adapters:  # this adapter does not target this layer: base only
                continue
            adapter = self.parallel_adapter(name)
            if not len(adapter):  # a stage's placeholder (``add_adapter``)
                continue
            if idx is None:  # the whole batch: no gather needed
                out = out + adapter(x, group).to(out.dtype)
            else:
                out = out.index_add(1, idx, adapter(x.index_select(1, idx), group).to(out.dtype))
        return out, bias

    def merged_stacks(self, name: str) -> dict[str, torch.Tensor]:
        """This rank's shard of the layer's weight with adapter ``name`` merged in."""
        weight: torch.Tensor = self.base_layer.weight
        adapter = self.parallel_adapter(name)
        return {'weight': weight + adapter.delta_weight().to(weight.dtype) if len(adapter) else weight}

    def extra_repr(self) -> str:
        return f'adapters={list(self.adapters.keys())}, layer={self.layer}, parallel={self.layout.parallel!r}'


# ---- where the projections are ------------------------------------------------------------------


@dataclass(frozen=True)
class _Site:
    """A megatron linear of this rank's model that holds Hugging Face projections."""

    path: str
    layer: int
    layout: Layout
    projections: tuple[Projection, ...]


def _decoder_layers(model: nn.Module) -> dict[str, int]:
    """This rank's decoder layers: path -> global index from 0 (megatron's ``layer_number`` is
    global, counted from 1, pipeline offset included)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return {path: m.layer_number - 1 for path, m in model.named_modules() if isinstance(m, TransformerLayer)}


def _sites(model: nn.Module) -> dict[str, _Site]:
    """The linears of this rank's decoder layers LoRA attaches to, by path."""
    sites: dict[str, _Site] = {}
    for layer_path, layer in _decoder_layers(model).items():
        for module in MEGATRON_MODULES:
            path = f'{layer_path}.{module}'
            try:
                linear = model.get_submodule(path)
            except AttributeError:  # e.g. an MoE layer has no mlp.linear_fc1
                continue
            if isinstance(linear, MultiLoraParallelLinear):
                sites[path] = _Site(path, layer, linear.layout, _projections(linear.base_layer, module, layer))
            elif _is_parallel_linear(linear):
                sites[path] = _Site(path, layer, _layout(linear, module, path), _projections(linear, module, layer))
    return sites


def _is_parallel_linear(module: nn.Module) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, ColumnParallelLinear | RowParallelLinear)


def _attention_sizes(config: Any) -> tuple[int, int, int]:
    """(query heads, query groups, head width) of a megatron ``TransformerConfig``."""
    heads = config.num_attention_heads
    return heads, config.num_query_groups or heads, config.kv_channels


def _projections(linear: Any, module: str, layer: int) -> tuple[Projection, ...]:
    """The Hugging Face projections megatron's ``module`` holds, with their whole sizes."""
    config = linear.config
    if module == 'self_attention.linear_qkv':
        heads, groups, head_dim = _attention_sizes(config)
        hidden = linear.input_size
        return (
            Projection(layer, 'q_proj', hidden, heads * head_dim),
            Projection(layer, 'k_proj', hidden, groups * head_dim),
            Projection(layer, 'v_proj', hidden, groups * head_dim),
        )
    if module == 'mlp.linear_fc1':
        ffn = linear.output_size // 2
        hidden = linear.input_size
        return Projection(layer, 'gate_proj', hidden, ffn), Projection(layer, 'up_proj', hidden, ffn)
    name = 'o_proj' if module == 'self_attention.linear_proj' else 'down_proj'
    return (Projection(layer, name, linear.input_size, linear.output_size),)


def _layout(linear: Any, module: str, path: str) -> Layout:
    """How ``linear`` (at ``path``) lays out its projections on this rank; layouts these adapters
    cannot run exactly are refused by name."""
    config = linear.config
    tp_size, tp_rank = linear.tp_group.size(), linear.tp_group.rank()
    sequence_parallel = bool(getattr(linear, 'sequence_parallel', False)) and tp_size > 1
    if module in ('self_attention.linear_proj', 'mlp.linear_fc2'):
        if not linear.input_is_parallel:
            raise ConfigurationError(f'{path}: a row-parallel layer with input_is_parallel=False is not supported')
        name = 'o_proj' if module == 'self_attention.linear_proj' else 'down_proj'
        return Layout('row', ((name, linear.output_size),), 1, tp_size, tp_rank, sequence_parallel)
    if linear.gather_output:
        raise ConfigurationError(f'{path}: a column-parallel layer with gather_output=True is not supported')
    if module == 'mlp.linear_fc1':
        if not config.gated_linear_unit:
            raise ConfigurationError(
                f'{path}: LoRA on megatron maps linear_fc1 to gate_proj and up_proj, so it needs '
                'gated_linear_unit=True (a SwiGLU MLP, as Qwen3 has)'
            )
        width = linear.output_size_per_partition // 2
        return Layout('column', (('gate_proj', width), ('up_proj', width)), 1, tp_size, tp_rank, sequence_parallel)
    heads, groups, head_dim = _attention_sizes(config)
    if groups % tp_size:
        raise ConfigurationError(
            f'{path}: {groups} query groups do not split over tensor parallel size {tp_size}; '
            f'use a size dividing {groups}'
        )
    if getattr(config, 'attention_output_gate', False):
        raise ConfigurationError(f'{path}: LoRA on megatron does not support attention_output_gate=True')
    parts = (('q_proj', heads // groups * head_dim), ('k_proj', head_dim), ('v_proj', head_dim))
    return Layout('column', parts, groups // tp_size, tp_size, tp_rank, sequence_parallel)


def _pipeline_group() -> Any | None:
    """megatron's pipeline-parallel group when there are several stages, else None."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_pipeline_model_parallel_group()


def over_stages(local: Any) -> list[Any]:
    """``local`` of every pipeline stage, in stage order (just ``[local]`` without pipeline parallel)."""
    group = _pipeline_group()
    if group is None:
        return [local]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return gathered


def global_projections(model: nn.Module) -> tuple[list[Projection], list[experts.ExpertLayer]]:
    """Every Hugging Face projection of the whole model (every pipeline stage's), in peft's order
    (layer by layer: q, k, v, o, gate, up, down), and every MoE layer's experts, by layer.
    Collective over the pipeline stages."""
    local_experts = list(experts.expert_layers(model, _decoder_layers(model)).values())
    stages = over_stages(([p for site in _sites(model).values() for p in site.projections], local_experts))
    merged = {p.hf_path: p for projections, _ in stages for p in projections}
    moe = {layer.layer: layer for _, layers in stages for layer in layers}
    return sorted(merged.values(), key=lambda p: p.order), [moe[index] for index in sorted(moe)]


def select(projections: list[Projection], targets: tuple[str, ...] | str) -> list[Projection]:
    """The projections ``targets`` names, as peft reads ``target_modules``: 'all-linear', a
    pattern the whole Hugging Face module path must match, or leaf (or dotted suffix) names."""
    if targets == 'all-linear':
        return list(projections)
    accepted = _accepted(projections)
    help_text = (
        f"Hugging Face names {accepted}, 'all-linear', or a pattern over paths like 'model.layers.0.self_attn.q_proj'"
    )
    if isinstance(targets, str):
        chosen = [p for p in projections if re.fullmatch(targets, p.hf_path)]
        if not chosen:
            raise ConfigurationError(f'target_modules pattern {targets!r} matches no projection; give {help_text}')
        return chosen
    if not targets:
        raise ConfigurationError(f'target_modules is empty; give {help_text}')
    for target in targets:
        if not any(_names(p, target) for p in projections):
            raise ConfigurationError(
                f'target_modules entry {target!r} matches no projection of this megatron model; give {help_text}'
            )
    return [p for p in projections if any(_names(p, t) for t in targets)]


def _accepted(projections: list[Projection]) -> list[str]:
    """The projection names the model has, in peft's order."""
    return sorted({p.name for p in projections}, key=list(PROJECTIONS).index)


def _names(projection: Projection, target: str) -> bool:
    return projection.hf_path == target or projection.hf_path.endswith(f'.{target}')


# ---- adapters -----------------------------------------------------------------------------------


def draw(
    projection: Projection, spec: LoraSpec, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection's whole (A [r, in], B [out, r]) as peft draws them: nn.Linear's own draws for
    lora_A then lora_B, then ``initialise`` (A redrawn, B zero unless init='random'); from the
    global RNG without a ``generator``, so ``torch.manual_seed(s)`` gives peft's numbers."""
    lora_A = torch.empty(spec.r, projection.in_features)
    lora_B = torch.empty(projection.out_features, spec.r)
    nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5), generator=generator)
    nn.init.kaiming_uniform_(lora_B, a=math.sqrt(5), generator=generator)
    initialise(lora_A, lora_B, spec, generator)
    return lora_A, lora_B


def add_adapter(model: nn.Module, name: str, spec: LoraSpec, generator: torch.Generator | None = None) -> list[str]:
    """Add adapter ``name`` to the projections ``spec.target_modules`` names (Hugging Face names:
    q_proj ... down_proj, 'all-linear', or a pattern over Hugging Face paths) and the expert stacks
    ``spec.target_parameters`` names (peft's: 'mlp.experts.gate_up_proj', 'mlp.experts.down_proj'),
    wrapping megatron's linears as needed, and freeze the base model. Returns this rank's adapted layer paths.

    Every projection of every layer (all pipeline stages') is drawn in peft's order and each rank
    keeps its slice, so any tensor or pipeline layout holds the numbers one process holds. A
    pipeline stage holding none of the adapted layers keeps an empty adapter (no parameters), so
    the name is known on every stage.
    Collective over the pipeline stages: every rank calls it. Nothing changes on error."""
    check_name(name)
    check_spec(spec)
    if name in multi_lora.adapter_names(model):
        raise ConfigurationError(f'Adapter {name!r} already exists; remove_adapter(model, {name!r}) first')
    sites = _sites(model)
    if not sites:
        raise ConfigurationError('the model has no megatron decoder layer with parallel linears to adapt')
    by_path = {p.hf_path: site for site in sites.values() for p in site.projections}
    projections, moe_layers = global_projections(model)
    stacks = experts.select_stacks(moe_layers, spec)  # checked before anything changes
    if moe_layers and spec.target_modules == 'all-linear':
        raise ConfigurationError(
            "target_modules='all-linear' on a mixture of experts: peft (transformers 5) resolves it on the Hugging "
            "Face model to the attention projections plus target_parameters for the router ('mlp.gate.weight', "
            'which LoRA on megatron does not adapt) and the expert stacks (gate_up_proj at rank 2r); name them '
            f'instead: target_modules={_accepted(projections)}, target_parameters='
            "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']"
        )
    linear_targets = spec.target_modules if spec.target_modules or not stacks else None
    pairs: dict[str, dict[str, LoraPair]] = {}
    for projection in select(projections, linear_targets) if linear_targets is not None else []:
        lora_A, lora_B = draw(projection, spec, generator)
        site = by_path.get(projection.hf_path)
        if site is not None:
            pairs.setdefault(site.path, {})[projection.name] = LoraPair(*site.layout.shard(lora_A, lora_B))
    # peft draws target_parameters after every target module.
    local_moe = experts.expert_layers(model, _decoder_layers(model))
    expert_paths = experts.add(model, name, spec, local_moe, stacks, generator)
    if (
        not pairs and not expert_paths
    ):  # this stage holds none of its layers: an empty adapter, so row_adapters knows it
        pairs[next(iter(sites))] = {}
    for path, layer_pairs in pairs.items():
        site = sites[path]
        layer = _wrap(model, site)
        weight = layer.base_layer.weight
        dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        ordered = {n: layer_pairs[n] for n, _ in site.layout.parts if n in layer_pairs}
        adapter = ParallelLoraAdapter(ordered, spec, site.layout).to(device=weight.device, dtype=dtype)
        layer.adapters[name] = _mark_tensor_parallel(adapter)
    multi_lora.freeze_base(model)
    return [*pairs, *expert_paths]


def _mark_tensor_parallel(adapter: ParallelLoraAdapter) -> ParallelLoraAdapter:
    """Mark each parameter as megatron marks its own (``tensor_model_parallel``, ``partition_dim``,
    ``partition_stride``): sharded (B of a column-parallel layer, A of a row-parallel one) or the
    same on every tensor-parallel rank, so megatron's gradient norm and checkpoints count each once."""
    sharded, dim = ('lora_B', 0) if adapter.layout.parallel == 'column' else ('lora_A', 1)
    for pair in adapter.pairs().values():
        for which in ('lora_A', 'lora_B'):
            param = getattr(pair, which).weight
            param.tensor_model_parallel = which == sharded
            param.partition_dim = dim if which == sharded else -1
            param.partition_stride = 1
            # Under sequence parallel a whole (replicated) weight sees this rank's share only (a
            # column-parallel A its output slice's gradient, a row-parallel B its sequence slice):
            # marked as megatron marks such weights, for the gradient sum over tensor parallel.
            param.sequence_parallel = adapter.layout.sequence_parallel and which != sharded
    return adapter


def _wrap(model: nn.Module, site: _Site) -> MultiLoraParallelLinear:
    module = model.get_submodule(site.path)
    if isinstance(module, MultiLoraParallelLinear):
        return module
    parent_path, _, leaf = site.path.rpartition('.')
    wrapped = MultiLoraParallelLinear(module, site.layout, site.layer)
    setattr(model.get_submodule(parent_path), leaf, wrapped)
    return wrapped


def adapted_layers(model: nn.Module, name: str) -> list[MultiLoraParallelLinear]:
    """This rank's layers holding adapter ``name``."""
    return [
        layer
        for layer in multi_lora.multi_lora_layers(model).values()
        if isinstance(layer, MultiLoraParallelLinear) and name in layer.adapters
    ]


__all__ = [
    'PROJECTIONS',
    'Layout',
    'MultiLoraParallelLinear',
    'ParallelLoraAdapter',
    'Projection',
    'adapted_layers',
    'add_adapter',
    'over_stages',
]
