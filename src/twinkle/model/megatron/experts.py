"""Per-row LoRA on megatron-core's routed experts (``SequentialMLP``), in peft's ``target_parameters`` layout.

transformers 5 holds a Qwen3-MoE layer's experts as two 3-D stacks, ``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]; peft adapts them with
``LoraConfig(target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])`` (its
``ParamWrapper``): one rank-r pair per expert, kept as ``lora_A`` [r * E, in] and ``lora_B``
[out, r * E], expert e's pair ``A_e = lora_A.view(E, r, in)[e]``, ``B_e = lora_B.view(out, r, E)[:, :, e]``
(``twinkle.model.lora.experts`` says more). megatron holds expert e as an MLP of its own,
``mlp.experts.local_experts.k`` (k = e - the first expert this rank holds), whose ``linear_fc1`` is
[gate; up] and ``linear_fc2`` is down. Here each local expert's two linears are wrapped
(``MultiLoraExpertLinear``) and hold, per adapter, that expert's (A_e, B_e): saving restacks them into
peft's two tensors, so the files load in plain peft on the Hugging Face model and back.

**Which adapter a token uses.** megatron's token dispatcher reorders the tokens by expert (and
under expert or tensor parallel gathers every rank's tokens first), so an expert's linear cannot
tell a token's row. A forward hook on the MoE layer's router, which runs after routing and before
the real dispatch, dispatches each token's adapter ordinal (a [tokens, 1] tensor, -1 for the base
model) through the dispatcher's own three steps with the same routing map. The dispatcher keeps
state between its steps (the routing map, the permutation); the real dispatch that follows sets all
of it again, so the hidden states are dispatched exactly as without adapters. The ordinals come out
in the order the experts will see their tokens; split by ``tokens_per_expert`` as ``SequentialMLP``
splits its input, they tell each expert's linears which adapter each of its tokens takes. This asks
nothing of megatron but the dispatcher's public steps, for the two dispatchers whose steps take any
tensor and keep no state the real dispatch does not set again: ``allgather`` (checked here: EP=2, TP=2
with sequence parallel) and ``alltoall`` (megatron's choice on GPUs; read against its source, not run
here: it builds a CUDA stream). ``flex`` (DeepEP, bf16 of the hidden width), ``moe_shared_expert_overlap``
and ``moe_permute_fusion`` (Transformer Engine's kernels) are refused by name. In a mixed pass the
padding rows (``McoreCausalLM`` pads under expert parallel) carry None in the assignment, hence ordinal
-1: they are routed like any token (the router sees no mask) and go through the base alone; with one
adapter for the whole batch they take it, and their outputs are dropped either way.

**Expert tensor parallel** (the experts' linears split over ``expert_tensor_parallel_size`` ranks,
which get every token, and whose outputs megatron's combine sums): ``linear_fc1``'s A is whole on each
rank and B its slice of the gate rows then of the up rows; ``linear_fc2``'s A its slice of the input
columns and B whole. The delta of the row-parallel ``linear_fc2`` is linear in the rank's partial
``x_r A_r^T``, so each rank adds its part and the combine sums them; the whole weight (fc1's A,
fc2's B) sees only its rank's share of the gradient, which ``copy_to_tensor_model_parallel_region``
on the weight sums over the expert tensor-parallel ranks in the backward. No extra forward
communication.

Not covered: peft refuses ``lora_dropout`` on ``target_parameters``, so these adapters do too;
grouped-GEMM and Transformer Engine experts (``TEGroupedMLP``) are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from twinkle.errors import ConfigurationError, StateError
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.adapter import LoraSpec, RowAssignment, initialise
from twinkle.model.lora.experts import EXPERT_PARAMETERS, expert_stacks, peft_stack_prefix

#: Hugging Face expert stack -> the linear of a megatron expert holding it.
LINEARS = {'gate_up_proj': 'linear_fc1', 'down_proj': 'linear_fc2'}


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer of this rank: its global index, its experts, the share of them it holds."""

    path: str  # the megatron MoELayer ('decoder.layers.0.mlp')
    layer: int
    num_experts: int
    first: int  # the global index of local expert 0
    local: int
    hidden: int
    ffn: int  # the whole expert width (moe_ffn_hidden_size)

    @property
    def hf_path(self) -> str:
        return f'model.layers.{self.layer}.mlp.experts'

    def whole_shapes(self, stack: str, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """peft's (lora_A, lora_B) shapes of ``stack``: [r * E, in] and [out, r * E]."""
        in_features, out_features = (self.hidden, 2 * self.ffn) if stack == 'gate_up_proj' else (self.ffn, self.hidden)
        return (r * self.num_experts, in_features), (out_features, r * self.num_experts)


class ExpertLoraPair(nn.Module):
    """One expert's (A, B) of one stack for one adapter, this rank's shards (see the module docstring)."""

    def __init__(self, lora_A: torch.Tensor, lora_B: torch.Tensor, spec: LoraSpec, column: bool) -> None:
        super().__init__()
        self.lora_A = _linear(lora_A)
        self.lora_B = _linear(lora_B)
        self.scaling = spec.scaling
        self.column = column

    def forward(self, x: torch.Tensor, group: Any) -> torch.Tensor:
        """The delta for the tokens ``x``; ``group``: the expert tensor-parallel group (the base layer's)."""
        weight_A, weight_B = self.lora_A.weight, self.lora_B.weight
        if group is not None and group.size() > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region as summed_grad

            if self.column:
                weight_A = summed_grad(weight_A, group=group)
            else:
                weight_B = summed_grad(weight_B, group=group)
        h = nn.functional.linear(x.to(weight_A.dtype), weight_A)
        return nn.functional.linear(h, weight_B) * self.scaling


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device='meta')
    layer.weight = nn.Parameter(weight)
    return layer


class MultiLoraExpertLinear(multi_lora.MultiLoraLinear):
    """A frozen ``linear_fc1`` or ``linear_fc2`` of one local expert plus named adapters; token i of
    its input takes adapter ``ordinals[token_adapters[i]]`` (set by the router hook for this forward)."""

    def __init__(self, base: nn.Module, layer: ExpertLayer, expert: int, stack: str) -> None:
        nn.Module.__init__(self)
        self.base_layer = base.requires_grad_(False)  # type: ignore[assignment]
        self.adapters = nn.ModuleDict()
        self.assignment: RowAssignment | None = None
        self.moe = layer
        self.expert = expert  # global index
        self.stack = stack
        self.ordinals: list[str] = []
        self.token_adapters: torch.Tensor | None = None

    def add_adapter(self, name: str, spec: LoraSpec, generator: torch.Generator | None = None) -> Any:
        raise ConfigurationError(
            f'adapter {name!r}: a megatron expert takes adapters from twinkle.model.megatron.lora.add_adapter'
        )

    def pair(self, name: str) -> ExpertLoraPair:
        return cast(ExpertLoraPair, self.adapters[name])

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        """``x`` [tokens of this expert, local in] -> (output, bias), each token's adapter delta added."""
        out, bias = self.base_layer(x, *args, **kwargs)
        tokens = self.token_adapters
        if tokens is None:
            raise StateError('an adapted megatron expert ran without its MoE layer routing the adapters first')
        if tokens.numel() != x.shape[0]:
            raise StateError(f'expert {self.expert} got {x.shape[0]} tokens but {tokens.numel()} adapter ordinals')
        group = self.base_layer.tp_group
        for ordinal, name in enumerate(self.ordinals):
            if name not in self.adapters:
                continue
            rows = (tokens == ordinal).nonzero().flatten()
            if not rows.numel():
                continue
            if rows.numel() == x.shape[0]:
                out = out + self.pair(name)(x, group).to(out.dtype)
            else:
                out = out.index_add(0, rows, self.pair(name)(x.index_select(0, rows), group).to(out.dtype))
        return out, bias

    def merged_stacks(self, name: str) -> dict[str, torch.Tensor]:
        raise StateError('merging an expert adapter into megatron weights is not supported; save the adapter')

    def extra_repr(self) -> str:
        return f'adapters={list(self.adapters.keys())}, expert={self.expert}, stack={self.stack!r}'


# ---- where the experts are ----------------------------------------------------------------------


def expert_layers(model: nn.Module, decoder_layers: Mapping[str, int]) -> dict[str, ExpertLayer]:
    """This rank's MoE layers by megatron path, given its decoder layers (path -> global index)."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    found: dict[str, ExpertLayer] = {}
    for layer_path, index in decoder_layers.items():
        path = f'{layer_path}.mlp'
        moe = model.get_submodule(path)
        if not isinstance(moe, MoELayer):
            continue
        if not isinstance(moe.experts, SequentialMLP):
            raise ConfigurationError(
                f'{path}.experts is a {type(moe.experts).__name__}: LoRA on megatron experts needs SequentialMLP '
                '(the local layer spec without grouped GEMM, moe_grouped_gemm=False)'
            )
        config = moe.config
        _check_dispatch(path, config)
        local = moe.experts.num_local_experts
        first = moe.experts.ep_group.rank() * local
        found[path] = ExpertLayer(
            path, index, config.num_moe_experts, first, local, config.hidden_size, config.moe_ffn_hidden_size
        )
    return found


#: The token dispatchers the adapter ordinals go through (see the module docstring).
DISPATCHERS = ('allgather', 'alltoall')


def _check_dispatch(path: str, config: Any) -> None:
    """``ConfigurationError`` unless ``config`` dispatches tokens in a way the ordinals can follow."""
    dispatcher = getattr(config, 'moe_token_dispatcher_type', 'allgather')
    if dispatcher not in DISPATCHERS:
        raise ConfigurationError(
            f'{path}: LoRA on megatron experts follows the tokens through the {list(DISPATCHERS)} token '
            f'dispatchers; this model uses moe_token_dispatcher_type={dispatcher!r}'
        )
    fused = [flag for flag in ('moe_shared_expert_overlap', 'moe_permute_fusion') if getattr(config, flag, False)]
    if fused:
        raise ConfigurationError(
            f'{path}: LoRA on megatron experts needs {fused} off (they dispatch through fused kernels the '
            'adapter ordinals cannot follow)'
        )


def select_stacks(layers: list[ExpertLayer], spec: LoraSpec) -> list[tuple[ExpertLayer, str]]:
    """The (layer, stack) pairs ``spec.target_parameters`` names over the model's MoE layers
    (every stage's), in peft's order: layer by layer, gate_up_proj before down_proj. Each entry
    must name some stack."""
    if not spec.target_parameters:
        return []
    if spec.dropout:
        raise ConfigurationError(
            f'lora_dropout={spec.dropout} with target_parameters: peft refuses dropout on expert stacks (its '
            'ParamWrapper), so an adapter with it could not load there; use lora_dropout=0.0'
        )
    chosen = [(layer, stack) for layer in layers for stack in expert_stacks(spec, layer.hf_path, False)]
    for target in spec.target_parameters:
        single = LoraSpec(1, 1.0, target_parameters=(target,))
        if not any(expert_stacks(single, layer.hf_path, False) for layer in layers):
            accepted = [f'mlp.experts.{stack}' for stack in EXPERT_PARAMETERS] if layers else 'none: no experts'
            raise ConfigurationError(f'target_parameters entry {target!r} matches no expert stack; stacks: {accepted}')
    return chosen


def draw(
    layer: ExpertLayer, stack: str, spec: LoraSpec, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's whole (lora_A [r * E, in], lora_B [out, r * E]) of ``stack``, drawn as peft draws them."""
    shape_A, shape_B = layer.whole_shapes(stack, spec.r)
    lora_A, lora_B = torch.empty(shape_A), torch.empty(shape_B)
    nn.init.kaiming_uniform_(lora_A, a=math.sqrt(5), generator=generator)
    nn.init.kaiming_uniform_(lora_B, a=math.sqrt(5), generator=generator)
    initialise(lora_A, lora_B, spec, generator)
    return lora_A, lora_B


def expert_pair(
    whole_A: torch.Tensor, whole_B: torch.Tensor, expert: int, experts: int, stack: str, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s (A_e, B_e) from peft's tensors, this expert tensor-parallel rank's shards."""
    r = whole_A.shape[0] // experts
    lora_A = whole_A.view(experts, r, -1)[expert]
    lora_B = whole_B.view(-1, r, experts)[:, :, expert]
    size, rank = (group.size(), group.rank()) if group is not None else (1, 0)
    if stack == 'gate_up_proj':  # column-parallel: B's rows, its slice of gate then its slice of up
        gate, up = lora_B.chunk(2, dim=0)
        lora_B = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    else:  # row-parallel: A's input columns
        lora_A = lora_A.chunk(size, dim=1)[rank]
    return lora_A.clone(), lora_B.clone()


def whole_pair(lora_A: torch.Tensor, lora_B: torch.Tensor, stack: str, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's whole (A_e, B_e) from every expert tensor-parallel rank's shards (collective over them)."""
    size = group.size() if group is not None else 1
    if size == 1:
        return lora_A, lora_B
    if stack == 'gate_up_proj':
        pieces = _all_gather(lora_B, group)
        halves = [piece.chunk(2, dim=0) for piece in pieces]
        return lora_A, torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(_all_gather(lora_A, group), dim=1), lora_B


def _all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def add(
    model: nn.Module,
    name: str,
    spec: LoraSpec,
    layers: Mapping[str, ExpertLayer],
    chosen: list[tuple[ExpertLayer, str]],
    generator: torch.Generator | None,
) -> list[str]:
    """Draw adapter ``name`` of every chosen (layer of any stage, stack) in peft's order and give
    each local expert its pair; returns this rank's adapted expert linear paths."""
    by_index = {layer.layer: layer for layer in layers.values()}
    paths: list[str] = []
    for whole_layer, stack in chosen:
        whole = draw(whole_layer, stack, spec, generator)
        layer = by_index.get(whole_layer.layer)
        if layer is None:  # another stage's layer: drawn all the same, so the numbers follow peft's order
            continue
        moe: Any = model.get_submodule(layer.path)
        install_router_hook(moe)
        for k in range(layer.local):
            expert = moe.experts.local_experts[k]
            linear = _wrap(expert, LINEARS[stack], layer, layer.first + k, stack)
            group: Any = linear.base_layer.tp_group
            pair = ExpertLoraPair(
                *expert_pair(*whole, layer.first + k, layer.num_experts, stack, group),
                spec,
                stack == 'gate_up_proj',
            )
            linear.adapters[name] = _mark(pair, linear.base_layer.weight, group.size() if group is not None else 1)
            paths.append(f'{layer.path}.experts.local_experts.{k}.{LINEARS[stack]}')
    return paths


def _wrap(expert: nn.Module, leaf: str, layer: ExpertLayer, index: int, stack: str) -> MultiLoraExpertLinear:
    module = getattr(expert, leaf)
    if isinstance(module, MultiLoraExpertLinear):
        return module
    wrapped = MultiLoraExpertLinear(module, layer, index, stack)
    setattr(expert, leaf, wrapped)
    return wrapped


def _mark(pair: ExpertLoraPair, weight: torch.Tensor, etp_size: int) -> ExpertLoraPair:
    """Place the pair with the base weight and mark its parameters as megatron marks expert weights:
    ``allreduce = False`` (reduced over the expert data-parallel group), the shard
    ``tensor_model_parallel`` (fc1's B rows, fc2's A columns), the whole one not."""
    dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    pair.to(device=weight.device, dtype=dtype)
    sharded, dim = ('lora_B', 0) if pair.column else ('lora_A', 1)
    for which in ('lora_A', 'lora_B'):
        param = getattr(pair, which).weight
        param.allreduce = False
        param.tensor_model_parallel = which == sharded and etp_size > 1
        param.partition_dim = dim if which == sharded else -1
        param.partition_stride = 1
    return pair


# ---- routing each token's adapter ---------------------------------------------------------------


def install_router_hook(moe: Any) -> None:
    """Once per MoE layer: the forward hook on its router that routes each token's adapter."""
    if getattr(moe, '_twinkle_adapter_hook', None) is None:
        moe._twinkle_adapter_hook = moe.router.register_forward_hook(
            lambda _m, args, out: _route_adapters(moe, args, out)
        )


def _adapted_linears(moe: Any) -> list[MultiLoraExpertLinear]:
    return [
        linear
        for expert in moe.experts.local_experts
        for linear in (expert.linear_fc1, expert.linear_fc2)
        if isinstance(linear, MultiLoraExpertLinear)
    ]


def _route_adapters(moe: Any, args: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Each token's adapter ordinal through the dispatcher (the module docstring says why), split
    over the local experts' adapted linears. Runs on every rank of the layer whenever it holds any
    adapter (the dispatch is collective), whatever this rank's rows use."""
    linears = [linear for linear in _adapted_linears(moe) if linear.adapters]
    if not linears:
        return
    assignment = linears[0].assignment
    if assignment is None:
        raise StateError(
            'a megatron expert with adapters ran outside row_adapters(model, names): wrap the forward in it'
        )
    hidden = args[0]  # [s, b, h]: a row of the batch is dim 1
    probs, routing_map = output
    # The same names on every rank (adapters are added collectively), so an ordinal means one adapter.
    ordinals = sorted({name for linear in linears for name in linear.adapters})
    token_adapters = _ordinals(assignment, ordinals, hidden.shape[:2], hidden.device)
    dispatcher = moe.token_dispatcher
    with torch.no_grad():
        routed, routed_probs = dispatcher.dispatch_preprocess(token_adapters, routing_map, probs.detach())
        routed, routed_probs = dispatcher.token_dispatch(routed, routed_probs)
        routed, tokens_per_expert, _ = dispatcher.dispatch_postprocess(routed, routed_probs)
    per_expert = routed.reshape(-1).round().long().split(tokens_per_expert.tolist())
    if len(per_expert) != moe.experts.num_local_experts:
        raise StateError(f'the dispatcher gave {len(per_expert)} experts, {moe.experts.num_local_experts} are held')
    for k, tokens in enumerate(per_expert):
        expert = moe.experts.local_experts[k]
        for linear in (expert.linear_fc1, expert.linear_fc2):
            if isinstance(linear, MultiLoraExpertLinear):
                linear.ordinals, linear.token_adapters = ordinals, tokens


def _ordinals(assignment: RowAssignment, ordinals: list[str], shape: torch.Size, device: torch.device) -> torch.Tensor:
    """[s, b, 1] float: each token's adapter ordinal (its row's), -1 for the base model."""
    positions, rows = shape
    values = torch.full((positions, rows, 1), -1.0, device=device)
    for name, idx in assignment.over(rows).rows_on(device).items():
        if name in ordinals:
            values[:, slice(None) if idx is None else idx] = float(ordinals.index(name))
    return values


# ---- peft's tensors -----------------------------------------------------------------------------


def peft_key(layer: int, stacks: list[str], stack: str, which: str) -> str:
    """peft's key of one tensor ('base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight':
    peft nests one ParamWrapper per stack, the first stack innermost)."""
    nested = peft_stack_prefix(stacks, stack)
    return f'{multi_lora.PEFT_PREFIX}model.layers.{layer}.mlp.experts.{nested}{which}.weight'


def _adapted(model: nn.Module, name: str) -> dict[tuple[str, str], list[MultiLoraExpertLinear]]:
    """This rank's linears holding adapter ``name``, by (MoE layer path, stack), local experts in order."""
    found: dict[tuple[str, str], list[MultiLoraExpertLinear]] = {}
    for module in model.modules():
        if isinstance(module, MultiLoraExpertLinear) and name in module.adapters:
            found.setdefault((module.moe.path, module.stack), []).append(module)
    return {key: sorted(linears, key=lambda m: m.expert) for key, linears in found.items()}


def _stacks_by_layer(adapted: Mapping[tuple[str, str], list[MultiLoraExpertLinear]]) -> dict[str, list[str]]:
    stacks: dict[str, list[str]] = {}
    for path, stack in adapted:
        stacks.setdefault(path, []).append(stack)
    return stacks


def peft_state(model: nn.Module, name: str, grads: bool = False) -> dict[str, torch.Tensor]:
    """This stage's expert tensors of adapter ``name`` keyed and laid out as peft saves them, whole
    (gathered over expert tensor parallel and expert parallel); ``grads``: their gradients. Collective
    over the expert groups."""
    from megatron.core import parallel_state as ps

    adapted = _adapted(model, name)
    stacks = _stacks_by_layer(adapted)
    ep_group = ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1 else None
    state: dict[str, torch.Tensor] = {}
    for (path, stack), linears in sorted(adapted.items(), key=lambda item: (item[1][0].moe.layer, item[0][1])):
        pairs = [linear.pair(name) for linear in linears]
        group = linears[0].base_layer.tp_group
        wholes = [
            whole_pair(_value(p.lora_A.weight, grads), _value(p.lora_B.weight, grads), stack, group) for p in pairs
        ]
        stacked_A, stacked_B = torch.stack([a for a, _ in wholes]), torch.stack([b for _, b in wholes])
        if ep_group is not None:
            stacked_A, stacked_B = (torch.cat(_all_gather(t, ep_group)) for t in (stacked_A, stacked_B))
        experts, r = stacked_A.shape[0], stacked_A.shape[1]
        layer = linears[0].moe.layer
        state[peft_key(layer, stacks[path], stack, 'lora_A')] = stacked_A.reshape(experts * r, -1).cpu().clone()
        state[peft_key(layer, stacks[path], stack, 'lora_B')] = (
            stacked_B.permute(1, 2, 0).reshape(-1, r * experts).cpu().clone()
        )
    return state


def _value(param: torch.Tensor, grad: bool) -> torch.Tensor:
    if not grad:
        return param.detach()
    return torch.zeros_like(param) if param.grad is None else param.grad.detach()


def peft_shapes(model: nn.Module, name: str) -> dict[str, tuple[int, ...]]:
    """The keys and whole shapes of this rank's expert tensors of adapter ``name``."""
    adapted = _adapted(model, name)
    stacks = _stacks_by_layer(adapted)
    shapes: dict[str, tuple[int, ...]] = {}
    for (path, stack), linears in adapted.items():
        moe, r = linears[0].moe, linears[0].pair(name).lora_A.weight.shape[0]
        shape_A, shape_B = moe.whole_shapes(stack, r)
        shapes[peft_key(moe.layer, stacks[path], stack, 'lora_A')] = shape_A
        shapes[peft_key(moe.layer, stacks[path], stack, 'lora_B')] = shape_B
    return shapes


def load_peft_state(model: nn.Module, name: str, state: Mapping[str, torch.Tensor]) -> None:
    """Copy peft's whole expert tensors into adapter ``name``, each local expert its pair (the
    keys and shapes were checked by the caller)."""
    adapted = _adapted(model, name)
    stacks = _stacks_by_layer(adapted)
    with torch.no_grad():
        for (path, stack), linears in adapted.items():
            layer = linears[0].moe.layer
            whole_A = state[peft_key(layer, stacks[path], stack, 'lora_A')]
            whole_B = state[peft_key(layer, stacks[path], stack, 'lora_B')]
            for linear in linears:
                pair = linear.pair(name)
                lora_A, lora_B = expert_pair(
                    whole_A, whole_B, linear.expert, linear.moe.num_experts, stack, linear.base_layer.tp_group
                )
                pair.lora_A.weight.copy_(lora_A)
                pair.lora_B.weight.copy_(lora_B)


__all__ = [
    'ExpertLayer',
    'ExpertLoraPair',
    'MultiLoraExpertLinear',
    'add',
    'expert_layers',
    'load_peft_state',
    'peft_shapes',
    'peft_state',
    'select_stacks',
]
