"""megatron's process groups (``parallel_state``) from a twinkle ``DeviceMesh``.

``initialize(mesh, seed)`` starts ``torch.distributed`` where it is not up yet (gloo on the CPU, nccl on CUDA:
the torchrun launch through ``twinkle.infra.distributed``, or a world of one process over an in-process store),
then megatron's tensor, pipeline, context and expert parallel groups with the mesh's sizes, and seeds megatron's
RNG tracker.

Both lay ranks out row-major with tensor parallel fastest: twinkle's grid is ``(fsdp, pp, dp, cp, tp)`` and
megatron's default order ``'tp-cp-ep-dp-pp'`` numbers ``tp + TP * (cp + CP * (dp + DP * pp))``, the same ranks
when ``fsdp_size == 1`` (``initialize`` checks this rank's groups against the mesh). megatron has no FSDP
dimension (its data parallel is ``dp``) and no Ulysses sequence parallel (its context parallel is ``cp``): a mesh
with either is refused. ``ep_size`` folds into the data-parallel ranks of a stage, as twinkle's mesh does.

Called again with the same sizes it does nothing; with other sizes it destroys megatron's groups and builds the
new ones (``parallel_state.destroy_model_parallel``, which megatron's own tests use between layouts): models built
under the old layout must not be used after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from twinkle.errors import ConfigurationError
from twinkle.infra import distributed
from twinkle.infra.mesh import DeviceMesh
from twinkle.model.megatron import compat


@dataclass(frozen=True)
class Layout:
    """This process's place in megatron's groups: each parallel size and this rank's index along it."""

    tp_size: int
    pp_size: int
    cp_size: int
    ep_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    ep_rank: int
    dp_rank: int

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(tp, pp, cp, ep)``: what megatron's groups were built with."""
        return self.tp_size, self.pp_size, self.cp_size, self.ep_size


#: How many times megatron's groups were built in this process: a model built under one generation
#: holds its groups, which a later layout destroys (``generation``).
_generation = 0


def generation() -> int:
    """The current build of megatron's groups (``initialize`` with other sizes starts a new one)."""
    return _generation


def initialize(mesh: DeviceMesh | None = None, seed: int = 0) -> Layout:
    """Start megatron's process groups for ``mesh`` (None: one process, every size 1) and seed its RNG.

    Under torchrun the mesh must span every process (``WORLD_SIZE``); the default process group is started
    if it is not up yet. Returns this process's ``Layout``."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    compat.install()
    mesh = _check_mesh(mesh)
    _init_process_group(mesh)
    sizes = (mesh.tp_size, mesh.pp_size, mesh.cp_size, mesh.ep_size)
    if ps.model_parallel_is_initialized():
        if current_layout().sizes == sizes:
            return current_layout()
        ps.destroy_model_parallel()
    global _generation
    _generation += 1
    ps.initialize_model_parallel(
        tensor_model_parallel_size=mesh.tp_size,
        pipeline_model_parallel_size=mesh.pp_size,
        context_parallel_size=mesh.cp_size,
        expert_model_parallel_size=mesh.ep_size,
    )
    _check_layout(mesh)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> Layout:
    """The layout megatron's groups have now (after ``initialize``)."""
    from megatron.core import parallel_state as ps

    return Layout(
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        cp_size=ps.get_context_parallel_world_size(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def _check_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    """The mesh to lay megatron out on; refuses what megatron has no group for."""
    if mesh is None:
        if distributed.world_size() > 1:
            raise ConfigurationError(
                f'{distributed.world_size()} processes run this script but no DeviceMesh was given; pass one whose '
                f'sizes multiply to {distributed.world_size()} (e.g. DeviceMesh.from_sizes(tp_size=..., dp_size=...))'
            )
        return DeviceMesh(device_type='cuda' if torch.cuda.is_available() else 'cpu')
    if mesh.fsdp_size > 1:
        raise ConfigurationError(
            f'{mesh!r}: megatron has no FSDP dimension (fsdp_size={mesh.fsdp_size}); use '
            f'dp_size={mesh.fsdp_size * mesh.dp_size} (megatron data parallel, with its distributed optimizer)'
        )
    if mesh.ulysses_size > 1:
        raise ConfigurationError(
            f'{mesh!r}: Ulysses sequence parallel (ulysses_size={mesh.ulysses_size}) is the Transformers '
            "backend's; megatron splits sequences by context parallel: use cp_size instead"
        )
    return mesh


def _init_process_group(mesh: DeviceMesh) -> None:
    """torchrun's process group (twinkle's helper), or a world of one process over an in-process store."""
    if distributed.is_initialized():
        if dist.get_world_size() != mesh.world_size:
            raise ConfigurationError(
                f'{mesh!r} spans {mesh.world_size} processes but the process group has {dist.get_world_size()}'
            )
        return
    if mesh.world_size > 1:
        distributed.init_process_group(mesh)
        return
    if distributed.world_size() != 1:
        raise ConfigurationError(
            f'{mesh!r} spans 1 process but {distributed.world_size()} run this script; give a mesh of '
            f'world size {distributed.world_size()}'
        )
    if mesh.device_type == 'cuda':
        torch.cuda.set_device(distributed.device(mesh))
    # megatron needs its groups even alone; an in-process store needs no port.
    store = dist.HashStore()  # type: ignore[attr-defined]  # torch.distributed re-exports it without __all__
    dist.init_process_group(distributed.BACKENDS[mesh.device_type], store=store, rank=0, world_size=1)


def _check_layout(mesh: DeviceMesh) -> None:
    """This rank's megatron groups hold the ranks twinkle's mesh puts along the same dimensions."""
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    groups = {
        'tp': ps.get_tensor_model_parallel_group(),
        'pp': ps.get_pipeline_model_parallel_group(),
        'cp': ps.get_context_parallel_group(),
        'dp': ps.get_data_parallel_group(),
    }
    for dim, group in groups.items():
        megatron_ranks = sorted(dist.get_process_group_ranks(group))
        if megatron_ranks != mesh.ranks_along(dim, rank):
            raise ConfigurationError(
                f'rank {rank}: megatron put ranks {megatron_ranks} along {dim} but {mesh!r} puts '
                f'{mesh.ranks_along(dim, rank)} there; megatron-core lays ranks out in another order than this '
                "version's 'tp-cp-ep-dp-pp'"
            )


__all__ = ['Layout', 'current_layout', 'generation', 'initialize']
