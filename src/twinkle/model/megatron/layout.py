"""How a ``MegatronModel`` spreads over its device mesh: megatron-core's tensor, pipeline and
expert parallel groups, and data parallel between them.

The project's loss semantics hold as for ``TransformersModel`` (``twinkle.model.layout``): each
rank's loss is a sum with an item count, and the step divides the gradient summed over the data
shards by the item count over the data shards. What changes is who holds what:

- Tensor parallel peers (``tp``) and pipeline stages (``pp``) read the same rows and compute the
  same loss (the logits are gathered over ``tp`` and shared by the last stage). Sums over ranks
  (losses, item counts, metrics) take one *representative* per data shard: the rank at
  ``tp = 0, pp = 0``; the others contribute zeros.
- Gradients: each rank holds the gradients of its own slices (megatron's layers are exact per
  slice: a column-parallel weight's rows, a row-parallel weight's columns; replicated weights get
  the whole gradient on every tensor-parallel rank). They are summed over the data-parallel group
  only (megatron's, the ranks holding the same slices); experts (``allreduce = False``, megatron's
  mark) over the expert data-parallel group.
- The gradient norm sums each slice once: tensor-parallel weights over the ``tp`` group,
  replicated ones from ``tp`` rank 0 only, every stage's over ``pp``, experts over ``ep``.

Adapters are not wrapped in megatron's ``DistributedDataParallel``: as for ``TransformersModel``,
several adapters come and go while the model trains, each with its own optimizer and step, and
each adapter's gradients are reduced at its own step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from twinkle.errors import ConfigurationError, StateError
from twinkle.infra import distributed
from twinkle.infra.mesh import DeviceMesh
from twinkle.metric import Metric
from twinkle.model.layout import BUCKET_BYTES, ModelParallel
from twinkle.model.train_group import TrainGroup, Window


def _parallel_state() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def is_expert(param: torch.Tensor) -> bool:
    """A mixture of experts' expert weight: megatron marks them ``allreduce = False``."""
    return not getattr(param, 'allreduce', True)


def mark_tp_partial(model: torch.nn.Module) -> None:
    """Mark the weights whose gradient each tensor-parallel rank holds only its share of: the
    query and key norms, shared by every head while each rank holds some of the heads, and under
    sequence parallel every weight megatron marks ``sequence_parallel`` (norms, the router), which
    sees this rank's slice of the sequence (megatron's ``finalize_model_grads`` sums both,
    ``_allreduce_non_tensor_model_parallel_grads``)."""
    for name, param in model.named_parameters():
        if 'q_layernorm' in name or 'k_layernorm' in name or getattr(param, 'sequence_parallel', False):
            param.twinkle_tp_partial = True  # type: ignore[attr-defined]


def is_tp_partial(param: torch.Tensor) -> bool:
    """Whether ``param``'s gradient is summed over the tensor-parallel ranks (``mark_tp_partial``,
    or megatron's ``sequence_parallel`` mark, which LoRA weights under sequence parallel carry too)."""
    return bool(getattr(param, 'twinkle_tp_partial', False) or getattr(param, 'sequence_parallel', False))


def is_sliced(param: torch.Tensor) -> bool:
    """A weight split over the tensor-parallel ranks (megatron's ``tensor_model_parallel``)."""
    return bool(getattr(param, 'tensor_model_parallel', False))


class MegatronParallel(ModelParallel):
    """The parallel layout of a megatron-core model: megatron's process groups (set up by
    ``twinkle.model.megatron.state.initialize`` first) and the reductions over them."""

    def __init__(self, mesh: DeviceMesh | None):
        # ModelParallel's state for one process, then this mesh: its checks are not for tp, pp
        # and ep, which are this layout's own (state.initialize checked them).
        super().__init__(None)
        self.mesh = mesh
        self.enabled = mesh is not None and mesh.world_size > 1
        ps = _parallel_state()
        self.tp_size: int = ps.get_tensor_model_parallel_world_size()
        self.pp_size: int = ps.get_pipeline_model_parallel_world_size()
        self.tp_rank: int = ps.get_tensor_model_parallel_rank()
        self.pp_rank: int = ps.get_pipeline_model_parallel_rank()
        self.dp_size: int = ps.get_data_parallel_world_size()
        self.ep_size: int = ps.get_expert_model_parallel_world_size()
        #: Set by the model: its input embedding is tied to its output layer, on different stages.
        self.tied_across_stages = False
        #: Set by the model: the full model steps under megatron's DDP and distributed optimizer, whose
        #: buffers (not ``param.grad``) hold the window's gradients.
        self.distributed_optimizer = False
        #: Whether this rank's sums stand for its data shard (see the module docstring).
        self.representative = self.tp_rank == 0 and self.pp_rank == 0
        self._representatives = self._gather_representatives()

    def _gather_representatives(self) -> list[bool]:
        if not self.enabled:
            return [True]
        return distributed.all_gather_object(self.representative)

    # ---- what the model and stepper ask -------------------------------------------------------
    @property
    def fsdp(self) -> bool:
        return False

    @property
    def ep(self) -> bool:
        return False  # megatron places the experts itself; nothing for ModelParallel.shard_experts to do

    @property
    def lockstep(self) -> bool:
        """Expert parallel: megatron's token dispatch is a collective of the data ranks holding one
        layer's experts, so they run each forward and backward together. Pipeline stages hand one
        forward's tensors to each other in order: a mixed pass makes one forward there too."""
        return self.enabled and (self.ep_size > 1 or self.pp_size > 1)

    @property
    def model_parallel(self) -> bool:
        """Whether ranks hold parts of the model (``tp`` or ``pp`` > 1)."""
        return self.tp_size > 1 or self.pp_size > 1 or self.ep_size > 1

    def holds_shards(self, params: Iterable[torch.Tensor]) -> bool:
        # Slices of weights step one adapter at a time: the fused multi-adapter step knows no slices.
        return self.model_parallel

    def describe(self) -> str:
        if not self.enabled:
            return 'megatron-core, one process'
        return (
            f'megatron-core over {self.mesh!r}: tp={self.tp_size}, pp={self.pp_size}, dp={self.dp_size}, '
            f'ep={self.ep_size}; rank {distributed.rank()} is tp {self.tp_rank}, pp {self.pp_rank}'
        )

    def prepare(self, model: torch.nn.Module, groups: Iterable[TrainGroup]) -> None:
        """Before the first forward: every data-parallel replica of a slice starts from the first's."""
        if not self.enabled or self.prepared:
            return
        for group in groups:
            self._broadcast_replicas(group.params)
        self.prepared = True

    def shard_base(self, model: torch.nn.Module, groups: Iterable[TrainGroup]) -> None:
        """Nothing to shard: megatron's layers hold their slices from the start."""

    def shard_experts(self, model: torch.nn.Module) -> None:
        """Nothing to do: megatron builds each rank's experts (``ep_size``)."""

    def check_trainable(self, full: bool) -> None:
        """Every layout trains adapters; every weight too, except an input embedding tied to the
        output layer across pipeline stages (``tied_across_stages``): the two stages' copies would
        need their gradients summed over megatron's embedding group, which this layout does not do."""
        if full and self.tied_across_stages:
            raise ConfigurationError(
                f'full-parameter training with tied input and output embeddings under pp_size={self.pp_size}: '
                'the first and last stages each hold a copy, kept equal by nothing here; train LoRA adapters '
                '(add_adapter_to_model), or use pp_size=1'
            )

    def check_can_add_adapter(self, adapter_name: str) -> None:
        """Adapters come and go at any time: nothing is sharded around them."""

    def adapter_added(self, group: TrainGroup) -> None:
        if self.enabled and self.prepared:
            self._broadcast_replicas(group.params)

    def _broadcast_replicas(self, params: list[torch.nn.Parameter]) -> None:
        ps = _parallel_state()
        if self.dp_size == 1:
            return
        dense, experts = [p for p in params if not is_expert(p)], [p for p in params if is_expert(p)]
        with torch.no_grad():
            for tensors, group in (
                (dense, ps.get_data_parallel_group()),
                (experts, ps.get_expert_data_parallel_group()),
            ):
                src = dist.get_global_rank(group, 0)
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=src, group=group)

    # ---- reductions ---------------------------------------------------------------------------
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the data shards (one representative each), in place, on every rank."""
        if not self.enabled:
            return tensor
        if not self.representative:
            tensor.zero_()
        return distributed.all_reduce_sum(tensor)

    def reduce_gradients(self, params: list[torch.nn.Parameter], items: torch.Tensor | int) -> torch.Tensor | int:
        """The step's gradients summed over the data-parallel replicas of each slice; returns the
        step's item count over the data shards."""
        if not self.enabled:
            return items
        device = params[0].device if params else torch.device('cpu')
        total = self.sum_(torch.as_tensor(items, dtype=torch.float64, device=device).clone().reshape(1))[0]
        ps = _parallel_state()
        partial = [p for p in params if is_tp_partial(p) and p.grad is not None]
        if self.tp_size > 1 and partial:
            _all_reduce_grads(partial, ps.get_tensor_model_parallel_group())
        for experts, group, size in (
            (False, ps.get_data_parallel_group(), self.dp_size),
            (True, ps.get_expert_data_parallel_group(), dist.get_world_size(ps.get_expert_data_parallel_group())),
        ):
            chosen = [p for p in params if is_expert(p) == experts]
            if size > 1 and chosen:
                _all_reduce_grads(chosen, group)
        return total

    def merge_metrics(self, metrics: list[Metric]) -> None:
        """Every rank's metrics hold the figures of all data shards (each representative's merged once)."""
        if not self.enabled:
            return
        states = [metric.state() for metric in metrics]
        gathered = distributed.all_gather_object(states)
        me = distributed.rank()
        if not self.representative:
            for metric in metrics:
                metric.reset()
        for rank, others in enumerate(gathered):
            if rank == me and self.representative:
                continue
            if not self._representatives[rank]:
                continue
            if len(others) != len(metrics):
                raise StateError(f'ranks hold different numbers of metrics: {len(others)} and {len(metrics)}')
            for metric, state in zip(metrics, others, strict=True):
                if state is not None:
                    metric.merge(state)

    def clip_grad_norm_(self, params: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
        """The norm of the whole gradient, each slice counted once (see the module docstring),
        and every slice scaled by the same clip coefficient."""
        if norm_type != 2.0:
            raise StateError(f'MegatronModel clips by the 2-norm; got norm_type={norm_type}')
        with_grad = [p for p in params if p.grad is not None]
        device = with_grad[0].device if with_grad else torch.device('cpu')
        squares = torch.zeros(2, dtype=torch.float64, device=device)  # [dense, experts]
        for p in with_grad:
            if p.grad is not None and (is_sliced(p) or self.tp_rank == 0):
                squares[int(is_expert(p))] += torch.linalg.vector_norm(p.grad.detach(), 2.0, dtype=torch.float64) ** 2
        if self.enabled:
            ps = _parallel_state()
            dense = squares[:1].clone()
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
            experts = squares[1:].clone()
            dist.all_reduce(experts, group=ps.get_expert_tensor_model_pipeline_parallel_group())
            squares = torch.cat([dense, experts])
        total = squares.sum().sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach=True)
        return total

    # ---- checkpoints --------------------------------------------------------------------------
    @property
    def coordinates(self) -> str:
        """This rank's slice of the model: its tensor-parallel, pipeline and expert ranks."""
        ps = _parallel_state()
        return f'tp{self.tp_rank}-pp{self.pp_rank}-ep{ps.get_expert_model_parallel_rank()}'

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state; under tensor, pipeline or expert parallel every slice's (each
        rank holds the moments of its own slices), keyed by ``coordinates``."""
        state = optimizer.state_dict()
        if not self.model_parallel:
            return state
        # To rank 0 alone, which writes the checkpoint: every rank holding every slice's state would
        # multiply the memory of a save by the number of ranks.
        mine = (self.coordinates, _to_cpu(state))
        gathered: list[Any] | None = [None] * dist.get_world_size() if distributed.is_main() else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:
            return {}
        # The first rank of each slice's data-parallel replicas (its data-parallel rank 0): the one holding
        # the distributed optimizer's gathered state; the replicas' states are equal otherwise.
        slices: dict[str, Any] = {}
        for coordinates, slice_state in gathered:
            slices.setdefault(coordinates, slice_state)
        return {'megatron_slices': slices, 'layout': self._layout()}

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's own optimizer state from a checkpoint's (the layout must be the one it was saved at)."""
        slices = state.get('megatron_slices')
        if slices is None:
            if self.model_parallel:
                raise StateError(f'the checkpoint holds one optimizer state; this model is split ({self._layout()})')
            return state
        if state.get('layout') != self._layout():
            raise StateError(
                f'the optimizer state was saved at {state.get("layout")}; this model is {self._layout()}: '
                'resume at the layout it was saved at, or load the weights alone (resume_only_model=True)'
            )
        own: dict[str, Any] = slices[self.coordinates]
        return own

    def gather_window(self, group: TrainGroup) -> Window:
        """The accumulation window (``ModelParallel.gather_window``); split models save at a step
        boundary, where the window is empty: gradients of slices are not gathered."""
        if not self.model_parallel and not self.distributed_optimizer:
            return super().gather_window(group)
        window = group.window
        if self.distributed_optimizer and bool(group.pending.items):
            raise StateError(
                f'the full model holds gradients of {int(group.pending.items)} loss items waiting for a step '
                f'(micro step {window.micro_step}, gradient_accumulation_steps={window.gradient_accumulation_steps}) '
                "in megatron's grad buffers (distributed_optimizer=True), which a checkpoint does not keep: save at a "
                'step boundary, after clip_grad_and_step'
            )
        pending = any(p.grad is not None for p in group.params) and not group.pending.normalized
        if pending:
            raise StateError(
                f'adapter {group.name!r} holds gradients waiting for a step; under tensor or pipeline parallel '
                'save with save_optimizer=True after clip_grad_and_step'
            )
        items = torch.zeros(())
        figures = group.step_log.open_figures()
        return Window({}, items, False, group.pending.grad_norm, group.window.boundary_done(), figures)

    def _layout(self) -> str:
        return f'tp={self.tp_size}, pp={self.pp_size}, ep={self.ep_size}'


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _all_reduce_grads(params: list[torch.nn.Parameter], group: Any) -> None:
    """Sum the gradients of ``params`` over ``group`` in flat buckets (zeros where a rank has none:
    every rank of the group takes part with the same tensors, in order)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in [*grads, None]:
        if grad is not None and size + grad.numel() * grad.element_size() <= BUCKET_BYTES:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            continue
        if bucket:
            flat = _flatten_dense_tensors(bucket)  # type: ignore[no-untyped-call]
            dist.all_reduce(flat, group=group)
            for tensor, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):  # type: ignore[no-untyped-call]
                tensor.copy_(reduced)
        bucket, size = ([grad], grad.numel() * grad.element_size()) if grad is not None else ([], 0)
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad


__all__ = ['MegatronParallel', 'is_expert', 'is_sliced', 'is_tp_partial', 'mark_tp_partial']
