"""Per-row LoRA on a mixture of experts' fused weight stacks.

An MoE block in transformers holds its experts as 3-D parameters, not ``nn.Linear`` layers: in
Qwen3-MoE and Qwen3.5-MoE ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj``
[E, H, I], each expert's matrix laid out as ``nn.Linear`` holds it ([out, in]). peft adapts such
a parameter with ``target_parameters``: one rank-r pair per expert, kept as
``lora_A`` [r * E, in] and ``lora_B`` [out, r * E], expert e's pair being::

    A_e = lora_A.view(E, r, in)[e]        B_e = lora_B.view(out, r, E)[:, :, e]
    W_e' = W_e + scaling * B_e @ A_e      (scaling = alpha / r)

``MultiLoraExperts`` wraps the experts module and holds any number of such adapters. Its forward
routes as the base module does and, for each expert, adds to each token the delta of the adapter
its row uses (the ``row_adapters`` assignment, over the block's flattened tokens), computed as
``scaling * (x @ A_e^T) @ B_e^T`` without forming W_e'. An adapter's gradient thus comes from its
own rows alone, and the numbers are peft's (``peft_key`` names the tensors as peft's nested
``ParamWrapper`` s save them, so the files load in plain peft).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from twinkle.errors import ConfigurationError, StateError, UnknownNameError
from twinkle.model.lora.adapter import LoraAdapter, LoraSpec, RowAssignment, check_name
from twinkle.model.parallel.experts import ExpertShard

#: The fused stacks an experts module may hold, in the order its forward applies them.
EXPERT_PARAMETERS = ('gate_up_proj', 'down_proj')


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds its experts as fused 3-D stacks these adapters know how to run:
    SwiGLU experts with ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], no biases."""
    stacks = [getattr(module, name, None) for name in EXPERT_PARAMETERS]
    if not all(isinstance(p, nn.Parameter) and p.ndim == 3 for p in stacks):
        return False
    gate_up, down = cast(list[nn.Parameter], stacks)
    return (
        gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]  # [E, 2I, H] and [E, H, I]: the layout forward runs
        and gate_up.shape[2] == down.shape[1]
        and callable(getattr(module, 'act_fn', None))
        and not getattr(module, 'is_transposed', False)
        and not any(getattr(module, f'{name}_bias', None) is not None for name in EXPERT_PARAMETERS)
    )


class ExpertLoraAdapter(LoraAdapter):
    """One adapter of one fused stack [E, out, in]: a rank-r pair per expert, in peft's layout."""

    def __init__(
        self, stack: torch.Tensor, spec: LoraSpec, generator: torch.Generator | None = None, experts: int | None = None
    ) -> None:
        """``experts``: how many the model has (more than ``stack`` holds under expert parallel)."""
        nn.Module.__init__(self)
        held, out_features, in_features = stack.shape
        experts = held if experts is None else experts
        self._build(in_features, out_features, stack, spec, generator, experts=experts)
        self.experts, self.r = experts, spec.r

    def pair(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_e [r, in], B_e [out, r]) of expert ``expert``."""
        weight_A, weight_B = self.lora_A.weight, self.lora_B.weight
        return weight_A.view(self.experts, self.r, -1)[expert], weight_B.view(-1, self.r, self.experts)[:, :, expert]

    def expert_delta(self, x_N_I: torch.Tensor, expert: int) -> torch.Tensor:
        """The delta expert ``expert``'s adapter adds to its output for the tokens ``x_N_I``."""
        lora_A, lora_B = self.pair(expert)
        x_N_I = nn.functional.dropout(x_N_I.to(lora_A.dtype), self.active_dropout)
        return nn.functional.linear(nn.functional.linear(x_N_I, lora_A), lora_B) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """The [E, out, in] stack merging the adapter adds to the base stack (peft's einsum)."""
        weight_B = self.lora_B.weight.view(-1, self.r, self.experts)
        weight_A = self.lora_A.weight.view(self.experts, self.r, -1)
        return torch.einsum('ore,eri->eoi', weight_B, weight_A) * self.scaling


class MultiLoraExperts(nn.Module):
    """A frozen fused-experts module plus named adapters on its stacks, applied per row.

    ``adapters[name][stack]`` is adapter ``name``'s ``ExpertLoraAdapter`` of stack ``stack`` (one
    of ``EXPERT_PARAMETERS``); an adapter may adapt one stack or both."""

    def __init__(self, base: nn.Module):
        super().__init__()
        if not is_fused_experts(base):
            raise ConfigurationError(
                f'{type(base).__name__} is not a fused-experts module with {list(EXPERT_PARAMETERS)} stacks'
            )
        self.base_layer = base.requires_grad_(False)
        self.adapters = nn.ModuleDict()
        self.assignment: RowAssignment | None = None
        #: The experts this process holds: all of them, until ``shard_experts`` keeps its share.
        self.shard = ExpertShard(num_experts=self.stack('gate_up_proj').shape[0], ep_size=1, ep_rank=0)

    def shard_experts(self, shard: ExpertShard) -> None:
        """Keep only ``shard``'s experts of the base stacks (expert parallel), before any adapter."""
        if self.adapters or self.shard.ep_size > 1:
            raise StateError('experts are sharded once, before any adapter is added')
        if shard.num_experts != self.shard.num_experts:
            raise ConfigurationError(f'{shard.num_experts} experts in the shard, {self.shard.num_experts} in the layer')
        for name in EXPERT_PARAMETERS:
            setattr(self.base_layer, name, nn.Parameter(shard.local(self.stack(name)), requires_grad=False))
        self.shard = shard

    def stack(self, name: str) -> torch.Tensor:
        return cast(torch.Tensor, getattr(self.base_layer, name))

    def add_adapter(
        self, name: str, spec: LoraSpec, stacks: list[str], generator: torch.Generator | None = None
    ) -> None:
        check_name(name)
        if name in self.adapters:
            raise ConfigurationError(f'Adapter {name!r} already exists in this layer; remove it first')
        # Drawn in the stacks' declaration order, as peft wraps them.
        self.adapters[name] = nn.ModuleDict(
            {
                s: ExpertLoraAdapter(self.stack(s), spec, generator, experts=self.shard.num_experts)
                for s in EXPERT_PARAMETERS
                if s in stacks
            }
        )

    def adapter_stacks(self, name: str) -> dict[str, ExpertLoraAdapter]:
        """Adapter ``name``'s adapters by stack."""
        return {stack: cast(ExpertLoraAdapter, a) for stack, a in cast(nn.ModuleDict, self.adapters[name]).items()}

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise UnknownNameError('adapter', name, self.adapters.keys())
        del self.adapters[name]

    def merged_stacks(self, name: str) -> dict[str, torch.Tensor]:
        """Each stack adapter ``name`` adapts, with its delta merged in."""
        if self.shard.ep_size > 1:
            raise StateError(
                f'this rank holds {self.shard.per_rank} of {self.shard.num_experts} experts (ep_size='
                f'{self.shard.ep_size}): merged expert weights need every expert; sync the adapter instead'
            )
        return {
            stack: self.stack(stack) + adapter.delta_weight().to(self.stack(stack).dtype)
            for stack, adapter in self.adapter_stacks(name).items()
        }

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The base module's computation on ``hidden_states`` [N, H] (the batch's tokens), each
        token's experts adding the delta of the adapter its row uses; under expert parallel the
        tokens go to the ranks holding their experts (``ExpertShard.run``)."""
        if self.assignment is None:
            raise StateError('MultiLoraExperts ran outside row_adapters(model, names): wrap the forward in it')
        assignment = self.assignment.over(hidden_states.shape[0])
        rows = assignment.rows_on(hidden_states.device)
        present = [(name, idx) for name, idx in rows.items() if name in self.adapters]
        if not present and self.shard.group is None:
            return cast(torch.Tensor, self.base_layer(hidden_states, top_k_index, top_k_weights))
        # Each token's adapter as its ordinal in `self.adapters`, the same on every rank (-1: none).
        ordinals = {name: ordinal for ordinal, name in enumerate(self.adapters)}
        token_adapters = torch.full((hidden_states.shape[0],), -1, dtype=torch.long, device=hidden_states.device)
        for name, idx in present:
            token_adapters[slice(None) if idx is None else idx] = ordinals[name]
        return self.shard.run(hidden_states, top_k_index, top_k_weights, token_adapters, self._compute)

    def _compute(self, x: torch.Tensor, experts: torch.Tensor, adapters: torch.Tensor) -> torch.Tensor:
        """Row i of ``x`` [M, H] through expert ``experts[i]`` (global index, held here) with the
        delta of adapter ordinal ``adapters[i]`` (-1: none); unweighted, in the rows' order."""
        held = [self.adapter_stacks(name) for name in self.adapters]
        out = x.new_zeros(x.shape[0], self.stack('down_proj').shape[1])
        for expert in torch.unique(experts).tolist():
            rows = (experts == expert).nonzero().flatten()
            by_adapter = adapters[rows]
            selections = [(a, (by_adapter == k).nonzero().flatten()) for k, a in enumerate(held)]
            out.index_copy_(0, rows, self._expert(expert, x.index_select(0, rows), selections).to(out.dtype))
        return out

    def _expert(
        self, expert: int, x: torch.Tensor, selections: list[tuple[dict[str, ExpertLoraAdapter], torch.Tensor]]
    ) -> torch.Tensor:
        """Expert ``expert``'s SwiGLU on its tokens ``x``, each adapter's delta on its ``selections`` rows."""
        gate, up = self._project('gate_up_proj', expert, x, selections).chunk(2, dim=-1)
        act_fn = cast(Callable[[torch.Tensor], torch.Tensor], self.base_layer.act_fn)
        hidden = act_fn(gate) * up
        return self._project('down_proj', expert, hidden, selections)

    def _project(
        self,
        stack: str,
        expert: int,
        x: torch.Tensor,
        selections: list[tuple[dict[str, ExpertLoraAdapter], torch.Tensor]],
    ) -> torch.Tensor:
        y = nn.functional.linear(x, self.stack(stack)[expert - self.shard.first])
        for adapters, rows in selections:
            adapter = adapters.get(stack)
            if adapter is None or not rows.numel():
                continue
            if rows.numel() == x.shape[0]:
                y = y + adapter.expert_delta(x, expert).to(y.dtype)
            else:
                y = y.index_add(0, rows, adapter.expert_delta(x.index_select(0, rows), expert).to(y.dtype))
        return y

    def extra_repr(self) -> str:
        return f'adapters={list(self.adapters.keys())}'


def expert_stacks(spec: LoraSpec, path: str, all_linear: bool) -> list[str]:
    """The stacks of the experts module at ``path`` that ``spec`` adapts: those
    ``target_parameters`` names ('<path suffix>.<stack>', or the stack), or every one under
    'all-linear' when it names none."""
    if all_linear and not spec.target_parameters:
        return list(EXPERT_PARAMETERS)
    return [
        stack
        for stack in EXPERT_PARAMETERS
        if any(f'{path}.{stack}' == t or f'{path}.{stack}'.endswith(f'.{t}') for t in spec.target_parameters)
    ]


def peft_stack_prefix(stacks: list[str], stack: str) -> str:
    """Where peft saves adapter tensors of ``stack`` of an experts module whose adapter adapts
    ``stacks``: peft wraps the module once per stack, in declaration order, so the first stack's
    wrapper is innermost ('base_layer.' once per wrapper around it)."""
    ordered = [s for s in EXPERT_PARAMETERS if s in stacks]
    return 'base_layer.' * (len(ordered) - 1 - ordered.index(stack))
