"""How a ``TransformersModel`` spreads over its device mesh: data parallel or FSDP2 sharding, and expert parallel.

The loss semantics stay those of one process holding the whole global batch: each rank's loss
is a *sum* with an item count, the gradient at the step is (the sum over ranks of the summed
gradients) / (the sum over ranks of the item counts), and so losses and updates match a single
process up to float rounding.

- No mesh, or a mesh of one rank: nothing happens here.
- ``dp_size > 1`` (``fsdp_size == 1``): data parallel. Every rank holds the whole model and runs
  its slice of the batch; nothing is communicated during backward. At the accumulation boundary
  (``TrainGroup.normalize_grads``) one small all-reduce sums the item counts (and which
  parameters have a gradient), then the adapter's gradients are all-reduced in flat buckets.
  This is ``DistributedDataParallel``'s arithmetic with ``no_sync`` on every micro-step but the
  last, without its wrapper: DDP would need re-wrapping whenever ``add_adapter_to_model`` adds
  parameters, ``find_unused_parameters`` because only the active adapter gets gradients, and a
  ``no_sync`` context threaded through every backward. Reducing per adapter, at its own step,
  keeps several adapters with different accumulation counts independent. What it gives up is
  overlap of communication with backward; for LoRA the gradients are small.
- ``fsdp_size > 1``: FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every decoder layer
  (the classes ``_no_split_modules`` names) and the root, over a 1-D ``fsdp`` mesh, or a 2-D
  ``(dp, fsdp)`` mesh (HSDP: replicate over ``dp``, shard over ``fsdp``). Sharding happens at the
  first forward, after the adapters are set up, so every adapter must be added before it. FSDP2
  reduces gradients during backward; it is told to *sum* (divide factor 1, sum-only collectives,
  which gloo also supports), and the step divides by the global item count as above. On CPU it
  runs over gloo (torch 2.13: reduce-scatter and all-gather work there).

- ``ulysses_size > 1`` (beside either): Ulysses sequence parallel. ``ulysses_size`` consecutive
  data ranks share a data shard and each runs a slice of every sequence; attention swaps heads
  and sequence by all-to-all (``twinkle.model.parallel.ulysses``). Losses, metrics and outputs are those of
  the whole sequence on every rank of the group; its first rank counts them (``own_share``).

- ``ep_size > 1`` (beside either): expert parallel. At load, each block of ``ep_size`` ranks
  splits every MoE layer's experts between its ranks and tokens travel to them by all-to-all
  (``twinkle.model.parallel.experts``); FSDP2 leaves those expert stacks alone. It trains
  adapters only (each rank holds a share of the base experts).

A server adds adapters while it trains, so it shards the base model first (``shard_base``, before
any adapter): the adapters added later stay whole on every rank (replicated, as under data
parallel), and their gradients are all-reduced at their step like data-parallel ones. FSDP2
saves the memory of the base weights, which is most of it for LoRA.

Checkpoints are written whole by rank 0 (FSDP2 gathers full tensors first) and read whole by
every rank; FSDP2 keeps only its shard of what it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from twinkle.errors import ConfigurationError, StateError
from twinkle.infra import distributed
from twinkle.infra.mesh import DeviceMesh
from twinkle.loss import LossOutput
from twinkle.metric import Metric
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.experts import EXPERT_PARAMETERS, MultiLoraExperts
from twinkle.model.parallel.experts import expert_groups
from twinkle.model.parallel.ulysses import Ulysses
from twinkle.model.train_group import TrainGroup, Window

# Mesh dimensions a TransformersModel can use; the others need tensor/pipeline/context parallel code.
SUPPORTED_DIMS = ('fsdp', 'dp', 'ep', 'ulysses')
# Gradients are all-reduced in flat buckets of at most this many bytes (as DDP's default 25 MiB).
BUCKET_BYTES = 25 * 2**20


class ModelParallel:
    """The parallel layout of one model and the collectives it needs; inert for one process."""

    def __init__(self, mesh: DeviceMesh | None):
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise ConfigurationError(f'device_mesh must be a twinkle DeviceMesh; got {type(mesh).__name__}')
        self.mesh = mesh
        self.enabled = mesh is not None and mesh.world_size > 1
        # Set at the first forward: trained weights broadcast from rank 0, FSDP2 applied.
        self.prepared = False
        # Set by shard_base: adapters come after the sharding, whole on every rank.
        self.replicated_adapters = False
        #: This rank's Ulysses group (``ulysses_size`` > 1), else None.
        self.sequence: Ulysses | None = None
        if self.enabled:
            _check_mesh(self._mesh)
            if self._mesh.ulysses_size > 1:
                self.sequence = Ulysses(self._mesh)

    @property
    def _mesh(self) -> DeviceMesh:
        """The mesh of an ``enabled`` layout (more than one process)."""
        if self.mesh is None:
            raise StateError('a model in one process has no device mesh')
        return self.mesh

    @property
    def fsdp(self) -> bool:
        return self.enabled and self._mesh.fsdp_size > 1

    @property
    def lockstep(self) -> bool:
        """Whether every rank must run each forward and backward in step with the others, rows or
        not (FSDP2's all-gathers): a mixed pass then makes one forward, a dummy one on a rank without rows."""
        return self.fsdp

    @property
    def ep(self) -> bool:
        """Whether the experts are split across ranks (``ep_size`` > 1)."""
        return self.enabled and self._mesh.ep_size > 1

    @property
    def sharded(self) -> bool:
        """Whether the weights are FSDP2 shards now (DTensors) rather than whole tensors."""
        return self.fsdp and self.prepared

    def holds_shards(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``params`` is an FSDP2 shard (an adapter beside a ``shard_base`` model is not)."""
        return self.sharded and any(isinstance(p, DTensor) for p in params)

    def default_device(self) -> torch.device | None:
        """The device this rank drives under the mesh (``cuda:LOCAL_RANK`` or the CPU); None without one."""
        return distributed.device(self._mesh) if self.enabled else None

    def describe(self) -> str:
        if not self.enabled:
            return 'one process'
        kind = 'FSDP2' if self.fsdp else 'data parallel'
        if self.ep:
            kind += f', experts split over {self._mesh.ep_size} ranks,'
        if self.sequence is not None:
            kind += f', sequences split over {self.sequence.size} ranks (Ulysses),'
        return f'{kind} over {self.mesh!r}, rank {distributed.rank()}'

    # ---- set-up ---------------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, groups: Iterable[TrainGroup]) -> None:
        """Before the first forward: make every rank's trained weights rank 0's, then shard (FSDP2)."""
        if not self.enabled or self.prepared:
            return
        groups = list(groups)
        for group in groups:
            distributed.broadcast_tensors(group.params)
        if self.fsdp:
            _shard(model, groups, self._fsdp_mesh())
        self.prepared = True

    def shard_base(self, model: torch.nn.Module, groups: Iterable[TrainGroup]) -> None:
        """FSDP2: shard the base model now, before any adapter, with no broadcast (every rank
        loaded the same checkpoint). Adapters added afterwards stay whole on every rank and are
        reduced as data-parallel ones. Nothing to do without FSDP2 (data parallel, one process)."""
        if not self.fsdp:
            return
        if self.prepared:
            raise StateError('the model is prepared already (a forward ran): shard_base comes before it')
        _shard(model, list(groups), self._fsdp_mesh())
        self.prepared = self.replicated_adapters = True

    def shard_experts(self, model: torch.nn.Module) -> None:
        """Expert parallel: each rank keeps its share of every MoE layer's experts, at load
        (``twinkle.model.parallel.experts``). Nothing to do without an ``ep`` dimension."""
        if not self.ep:
            return
        ep_size = self._mesh.ep_size
        ep_rank, group = expert_groups(ep_size)
        if not multi_lora.shard_experts(model, ep_size, ep_rank, group):
            raise ConfigurationError(
                f'ep_size={ep_size} splits the experts of a mixture of experts; {type(model).__name__} has no '
                'fused experts: use dp_size or fsdp_size'
            )

    def split_sequences(self, model: torch.nn.Module, moe: bool) -> None:
        """Ulysses: route the model's attention through the all-to-all (``twinkle.model.parallel.ulysses``),
        at load. Nothing to do without a ``ulysses`` size."""
        if self.sequence is not None:
            self.sequence.attach(model, moe)  # type: ignore[arg-type]  # a PreTrainedModel

    @property
    def row_share(self) -> float:
        """1.0 where this rank counts its rows and tokens; 0.0 on a Ulysses group's other ranks
        (they hold the same rows)."""
        return 1.0 if self.sequence is None or self.sequence.lead else 0.0

    def own_share(self, loss: LossOutput) -> LossOutput:
        """The loss as this rank counts it (``Ulysses.own_share``; unchanged without Ulysses)."""
        return loss if self.sequence is None else self.sequence.own_share(loss)

    def check_trainable(self, full: bool) -> None:
        """Expert parallel trains adapters: each rank holds a share of the experts' base weights."""
        if full and self.ep:
            raise ConfigurationError(
                f'expert parallel (ep_size={self._mesh.ep_size}) trains LoRA adapters, not every weight: each rank '
                'holds only its share of the experts; add an adapter (add_adapter_to_model) or drop ep_size'
            )

    def check_can_add_adapter(self, adapter_name: str) -> None:
        if self.sharded and not self.replicated_adapters:
            raise StateError(
                f'adapter {adapter_name!r} comes after the first forward, when FSDP2 (fsdp_size='
                f'{self._mesh.fsdp_size}) has already sharded the model: add every adapter before training'
            )

    def adapter_added(self, group: TrainGroup) -> None:
        """A new adapter after the first forward (data parallel): start every rank from rank 0's weights."""
        if self.enabled and self.prepared:
            distributed.broadcast_tensors(group.params)

    def _fsdp_mesh(self) -> Any:
        """The torch mesh FSDP2 wants: ``(fsdp,)``, or ``(dp, fsdp)`` for HSDP (replicate, then shard).

        Rank ``r`` sits at ``(fsdp, dp) = divmod(r, dp_size)`` on the twinkle grid (the other
        dimensions are 1), so the ``(dp, fsdp)`` grid is the transpose."""
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

        mesh = self._mesh
        grid = torch.arange(mesh.world_size).reshape(mesh.fsdp_size, mesh.dp_size)
        if mesh.dp_size == 1:
            return TorchDeviceMesh(mesh.device_type, grid.flatten(), mesh_dim_names=('fsdp',))
        return TorchDeviceMesh(mesh.device_type, grid.T.contiguous(), mesh_dim_names=('dp', 'fsdp'))

    # ---- reductions -----------------------------------------------------------------------------
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place (a loss sum and its count, say)."""
        return distributed.all_reduce_sum(tensor) if self.enabled else tensor

    def reduce_gradients(self, params: list[torch.nn.Parameter], items: torch.Tensor | int) -> torch.Tensor | int:
        """Sum the step's gradients over the ranks; returns the step's item count over all ranks.

        Whole parameters (data parallel, or adapters beside a ``shard_base`` model): one
        all-reduce of ``[items, has_grad per parameter]``, then the gradients (zeros where a rank
        got none but another did). FSDP2 summed the gradients of its shards in backward."""
        if not self.enabled:
            return items
        device = params[0].device if params else torch.device('cpu')
        whole = [p for p in params if not isinstance(p, DTensor)]
        flags = [float(p.grad is not None) for p in whole]
        head = torch.tensor([0.0, *flags], dtype=torch.float64, device=device)
        head[0] += torch.as_tensor(items, dtype=torch.float64, device=device)
        self.sum_(head)
        if whole:
            _all_reduce_grads(whole, (head[1:] > 0).tolist())
        return head[0]

    def merge_metrics(self, metrics: list[Metric]) -> None:
        """Give every rank's metrics the figures of all ranks (each rank's ``state()`` merged in)."""
        if not self.enabled:
            return
        states = [metric.state() for metric in metrics]
        gathered = distributed.all_gather_object(states)
        if any(len(other) != len(states) for other in gathered):
            raise StateError(f'ranks hold different numbers of metrics: {[len(other) for other in gathered]}')
        me = distributed.rank()
        for rank, others in enumerate(gathered):
            for metric, state in zip(metrics, others, strict=True):
                if rank != me and state is not None:
                    metric.merge(state)

    def clip_grad_norm_(self, params: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the (reduced) gradients of ``params`` to ``max_norm``; their total norm before clipping.
        Here torch's own: every rank holds whole gradients or FSDP2 shards (DTensors know their
        whole); a layout whose ranks hold parts of one tensor adds its collective."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def norm_value(self, norm: torch.Tensor) -> float:
        """A gradient norm as a float (FSDP2's is a DTensor: the full value needs a collective)."""
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    # ---- checkpoints ----------------------------------------------------------------------------
    def on_main(self, fn: Any) -> Any:
        """Run ``fn`` (a checkpoint write) on rank 0 while the others wait at a barrier."""
        return distributed.run_on_main(fn) if self.enabled else fn()

    def gather_weights(
        self, model: torch.nn.Module, params: list[torch.nn.Parameter] | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Whole CPU copies of ``params`` (every parameter and buffer when None), by name, on rank 0.

        Only when sharded (every rank takes part); otherwise None: each rank holds whole weights."""
        if not self.sharded:
            return None
        if params is None:
            items: Iterable[tuple[str, torch.Tensor]] = model.state_dict().items()
        else:
            wanted = {id(p) for p in params}
            items = ((name, p) for name, p in model.named_parameters() if id(p) in wanted)
        main, weights = distributed.is_main(), {}
        for name, value in items:
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            if main:
                weights[name] = whole.detach().cpu()
        return weights

    def load_weights(self, named: dict[str, torch.nn.Parameter], weights: dict[str, torch.Tensor]) -> None:
        """Copy whole tensors into parameters; a sharded parameter keeps only its own shard."""
        with torch.no_grad():
            for name, value in weights.items():
                param = named[name]
                if isinstance(param, DTensor):
                    param.to_local().copy_(_shard_like(param, value).to_local())
                else:
                    param.copy_(value.to(param.device, param.dtype))

    def gather_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with whole tensors (FSDP2 shards gathered; every rank takes part)."""
        state = optimizer.state_dict()
        if not self.sharded:
            return state
        whole = {}
        for index in sorted(state['state']):
            values = state['state'][index].items()
            whole[index] = {k: v.full_tensor().cpu() if isinstance(v, DTensor) else v for k, v in values}
        return {**state, 'state': whole}

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """A whole-tensor optimizer state dict made to fit sharded parameters (unchanged when unsharded)."""
        return _place_optimizer_state(optimizer, state) if self.sharded else state

    def gather_window(self, group: TrainGroup) -> Window:
        """The group's accumulation window as one process holding every rank's rows would have it
        (every rank takes part; rank 0's is the one to write): the gradients summed over the
        ranks with their item count, unless they were normalised already (then every rank holds
        the reduced gradient); an FSDP2 shard's gradient, summed in its backward, gathered whole."""
        params, normalized = group.params, group.pending.normalized
        items = torch.as_tensor(group.pending.items).detach().clone()
        grads: dict[int, torch.Tensor] = {}
        if not self.enabled:
            grads = {i: p.grad.detach().cpu().clone() for i, p in enumerate(params) if p.grad is not None}
        else:
            device = params[0].device if params else torch.device('cpu')
            head = torch.tensor([0.0, *(float(p.grad is not None) for p in params)], dtype=torch.float64, device=device)
            if not normalized:
                head[0] += items.to(device=device, dtype=torch.float64)
            self.sum_(head)
            held = [i for i, has in enumerate((head[1:] > 0).tolist()) if has]
            local = {i: _grad_or_zeros(params[i]) for i in held}
            summed = [local[i] for i in held if not normalized and not isinstance(params[i], DTensor)]
            _all_reduce_(summed)  # copies: the live gradients stay this rank's share
            for i in held:  # every rank in the same order: full_tensor is a collective
                grad = local[i]
                grads[i] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().cpu()
            if not normalized:
                items = head[0].detach().cpu()
        figures = group.step_log.open_figures()
        return Window(grads, items.cpu(), normalized, group.pending.grad_norm, group.window.boundary_done(), figures)

    def place_window(self, group: TrainGroup, window: Window) -> None:
        """Open ``window`` (``gather_window``'s) on this rank: its gradients and item count go to
        rank 0 and the other ranks start empty, so the step's reduction sums them to the window's
        again; a normalised window's gradients and FSDP2 shards' (summed in backward) go to every
        rank, each keeping its own shard. The counters must be restored first (``done`` marks the
        current micro step)."""
        params = group.params
        unknown = sorted(i for i in window.grads if not 0 <= i < len(params))
        if unknown:
            raise StateError(
                f'the saved window holds gradients of parameters {unknown}; adapter {group.name!r} has {len(params)}'
            )
        holds = not self.enabled or distributed.is_main() or window.normalized
        for i, param in enumerate(params):
            grad = window.grads.get(i)
            if grad is not None and tuple(grad.shape) != tuple(param.shape):
                raise StateError(
                    f'the saved gradient {i} of adapter {group.name!r} has shape {tuple(grad.shape)}; its parameter '
                    f'has {tuple(param.shape)}'
                )
            if grad is None or not (holds or isinstance(param, DTensor)):
                param.grad = None
            elif isinstance(param, DTensor):
                param.grad = _shard_like(param, grad)
            else:
                param.grad = grad.to(device=param.device, dtype=param.dtype).clone()
        items = window.items.clone() if holds else torch.zeros_like(window.items)
        group.pending.reopen(items, window.normalized, window.grad_norm)
        group.window.mark_done(window.done)
        if window.figures:
            group.step_log.reopen(window.figures)


# ---- helpers ------------------------------------------------------------------------------------
def _check_mesh(mesh: DeviceMesh) -> None:
    extra = {dim: size for dim, size in mesh.sizes.items() if dim not in SUPPORTED_DIMS and size > 1}
    if extra:
        raise ConfigurationError(
            f'TransformersModel parallelises over {list(SUPPORTED_DIMS)} only; {mesh!r} also asks for {extra}: '
            'build the mesh with fsdp_size, dp_size, ep_size and ulysses_size'
        )
    if not distributed.is_initialized():
        raise StateError(
            f'{mesh!r} spans {mesh.world_size} processes but no process group is up: launch with torchrun '
            f'--nproc_per_node={mesh.world_size} and call twinkle.initialize(mode="local", global_device_mesh=mesh)'
        )
    if distributed.world_size() != mesh.world_size:
        raise ConfigurationError(
            f'{mesh!r} spans {mesh.world_size} processes but the process group has {distributed.world_size()}'
        )


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one: those whose class ``_no_split_modules`` names."""
    base = model
    names = set(getattr(base, '_no_split_modules', None) or ())
    layers = [module for module in base.modules() if type(module).__name__ in names]
    if not layers:
        raise ConfigurationError(
            f'FSDP2 shards the decoder layers that {type(base).__name__}._no_split_modules names '
            f'({sorted(names)}) and found none: set model.model._no_split_modules to their class names'
        )
    return layers


def _shard(model: torch.nn.Module, groups: list[TrainGroup], mesh: Any) -> None:
    """``fully_shard`` the layers and the root, then point every group (and optimizer) at the new parameters."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    names = {id(p): name for name, p in model.named_parameters()}
    # Expert-parallel stacks differ between ranks (each holds its own experts): not FSDP's to shard.
    held = [m for m in model.modules() if isinstance(m, MultiLoraExperts) and m.shard.ep_size > 1]
    ignored = {getattr(m.base_layer, stack) for m in held for stack in EXPERT_PARAMETERS}
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the step divides by the global item count
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    sharded = dict(model.named_parameters())
    for group in groups:
        mapping = {id(p): sharded[names[id(p)]] for p in group.params}
        _move_grads(group, mapping)
        group.rebind(mapping)
        if group.optimizer is not None:
            _move_optimizer(group.optimizer, mapping)


def _move_grads(group: TrainGroup, mapping: dict[int, torch.nn.Parameter]) -> None:
    """Give the shards the gradients their whole parameters held (a window ``resume_from_checkpoint``
    opened before the first forward: rank 0 holds the sum of every rank's, the others none), as
    FSDP2 holds them: each rank its shard of the sum over the ranks (of the one gradient every
    rank holds, if normalised already)."""
    params = group.params
    if not params:
        return
    flags = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64, device=params[0].device)
    distributed.all_reduce_sum(flags)
    for param, has in zip(params, (flags > 0).tolist(), strict=True):
        shard = mapping[id(param)]
        if not has or not isinstance(shard, DTensor):  # left whole (an expert-parallel stack): its own
            continue
        grad = _grad_or_zeros(param)
        if not group.pending.normalized:
            grad = distributed.all_reduce_sum(grad)
        shard.grad = _shard_like(shard, grad)
        param.grad = None


def _move_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, torch.nn.Parameter]) -> None:
    """Point an optimizer built on whole parameters at their shards, its state (if any) sharded too."""
    saved = optimizer.state_dict()
    for param_group in optimizer.param_groups:
        param_group['params'] = [mapping[id(p)] for p in param_group['params']]
    optimizer.state.clear()
    if saved['state']:
        optimizer.load_state_dict(_place_optimizer_state(optimizer, saved))


def _place_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    params = [p for param_group in optimizer.param_groups for p in param_group['params']]

    def place(param: torch.Tensor, value: Any) -> Any:
        whole = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
        if isinstance(param, DTensor) and whole and value.shape == param.shape:
            return _shard_like(param, value)
        return value

    placed = {index: {k: place(params[index], v) for k, v in kept.items()} for index, kept in state['state'].items()}
    return {**state, 'state': placed}


def _shard_like(param: DTensor, whole: torch.Tensor) -> DTensor:
    """``whole`` cut as ``param`` is; every rank holds ``whole``, so no data moves between ranks."""
    if tuple(whole.shape) != tuple(param.shape):
        shapes = f'{tuple(whole.shape)} into a parameter of shape {tuple(param.shape)}'
        raise StateError(f'cannot load a tensor of shape {shapes}')
    whole = whole.to(device=param.device, dtype=param.dtype)
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)


def _all_reduce_grads(params: list[torch.nn.Parameter], has_grad: list[bool]) -> None:
    grads = []
    for param, has in zip(params, has_grad, strict=True):
        if not has:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    _all_reduce_(grads)


def _grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    """A copy of the parameter's gradient (zeros where this rank has none but another has)."""
    return torch.zeros_like(param) if param.grad is None else param.grad.detach().clone()


def _all_reduce_(grads: list[torch.Tensor]) -> None:
    """Sum ``grads`` over the ranks in place, in flat buckets."""
    for bucket in _buckets(grads):
        flat = distributed.all_reduce_sum(torch.cat([g.reshape(-1) for g in bucket]))
        offset = 0
        for grad in bucket:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Consecutive gradients of one dtype, at most ``BUCKET_BYTES`` a bucket (one tensor may exceed it)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if bucket and (grad.dtype != bucket[0].dtype or size + nbytes > BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        yield bucket
