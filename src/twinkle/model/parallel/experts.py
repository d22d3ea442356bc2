"""Expert parallel: a mixture of experts' experts split across ranks, tokens sent to them.

Under a mesh with ``ep_size`` > 1 every block of ``ep_size`` consecutive ranks shares one copy of
each MoE layer's experts: rank ``i`` of the block keeps experts ``[i * E / ep, (i + 1) * E / ep)``
of the fused stacks and drops the rest, so the expert weights, most of an MoE model, take
``1 / ep`` of the memory. Each rank still runs its own slice of the batch through the rest of
the model (whole, or FSDP2 shards). In each MoE layer every (token, expert) pair the router
chose is sent to the rank holding that expert, computed there, and sent back (two
``all_to_all`` exchanges, the second's gradient flowing back through the first), where the
router's weight multiplies it; the gradients of the experts' adapters are thus computed on the
rank holding the expert, from the tokens of every rank (Lepikhin et al. 2020, GShard).

LoRA adapters on the experts are small and stay whole on every rank: a rank's gradient is
non-zero only for its own experts' pairs, so the data-parallel all-reduce at the step (a sum
over ranks) gives every rank every expert's gradient, and all ranks take the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from twinkle.errors import ConfigurationError

#: ``compute(x [M, H], experts [M], adapters [M])``: each row through its (global) expert and
#: adapter ordinal (-1: the base only); rows come back in the order given.
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertShard:
    """Which experts this rank holds, and the process group of the ranks sharing them out."""

    num_experts: int
    ep_size: int
    ep_rank: int
    group: dist.ProcessGroup | None = None  # None: one process holding every expert

    def __post_init__(self) -> None:
        if self.num_experts % self.ep_size:
            raise ConfigurationError(
                f"ep_size={self.ep_size} must divide the model's {self.num_experts} experts; "
                f'accepted: {[n for n in range(1, self.num_experts + 1) if self.num_experts % n == 0]}'
            )

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        """The global index of this rank's first expert."""
        return self.ep_rank * self.per_rank

    def local(self, stack: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole [E, ...] stack (a copy: the whole stack can be freed)."""
        return stack[self.first : self.first + self.per_rank].detach().clone()

    def run(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        token_adapters: torch.Tensor,
        compute: ExpertCompute,
    ) -> torch.Tensor:
        """An MoE layer's output for ``hidden`` [N, H]: each token's chosen experts (``top_k_index``
        [N, K]; ``num_experts`` or more: none) run where they are held, weighted by ``top_k_weights``
        and summed. ``token_adapters`` [N] is each token's adapter ordinal (-1: none)."""
        chosen = top_k_index < self.num_experts  # some routers mark tokens sent nowhere with E
        token, slot = chosen.nonzero(as_tuple=True)
        experts = top_k_index[token, slot]
        adapters = token_adapters[token]
        if self.group is None:
            y = compute(hidden[token], experts, adapters)
        else:
            # Sorted by the rank holding each expert, as all_to_all sends consecutive blocks.
            order = torch.argsort(torch.div(experts, self.per_rank, rounding_mode='floor'), stable=True)
            token, slot, experts, adapters = token[order], slot[order], experts[order], adapters[order]
            y = self._exchange(self.group, hidden[token], experts, adapters, compute)
        weighted = y * top_k_weights[token, slot, None].to(y.dtype)
        return torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))

    def _exchange(
        self,
        group: dist.ProcessGroup,
        x: torch.Tensor,
        experts: torch.Tensor,
        adapters: torch.Tensor,
        compute: ExpertCompute,
    ) -> torch.Tensor:
        """Rows ``x`` (sorted by destination rank) to the ranks holding their experts and back."""
        owner = torch.div(experts, self.per_rank, rounding_mode='floor')
        send = torch.bincount(owner, minlength=self.ep_size)
        recv = funcol.all_to_all_single(send, None, None, group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        meta = torch.stack([experts, adapters], dim=1)
        meta_in = funcol.all_to_all_single(meta, recv_sizes, send_sizes, group)
        x_in = funcol.all_to_all_single_autograd(x, recv_sizes, send_sizes, group)
        meta_in = _wait_tensor(meta_in)
        y_in = compute(x_in, meta_in[:, 0], meta_in[:, 1])
        return funcol.all_to_all_single_autograd(y_in, send_sizes, recv_sizes, group)


#: ``funcol.wait_tensor``: the tensor an async collective gave, once it has arrived (torch leaves it unannotated).
_wait_tensor = cast(Callable[[torch.Tensor], torch.Tensor], funcol.wait_tensor)


def expert_groups(ep_size: int) -> tuple[int, dist.ProcessGroup]:
    """This rank's place in its block of ``ep_size`` consecutive ranks, and the block's process
    group (every rank creates every block's group, as ``new_group`` requires)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, ep_size):
        group = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            mine = group
    if mine is None:  # ep_size divides the world (DeviceMesh checks it)
        raise ConfigurationError(f'ep_size={ep_size} does not divide the {world} ranks')
    return rank % ep_size, mine
