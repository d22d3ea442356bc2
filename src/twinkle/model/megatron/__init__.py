"""The Megatron backend: megatron-core's ``GPTModel`` with twinkle's model contract (``pip install
'twinkle-train[megatron]'``, Python 3.12; ``make setup-megatron``).

- ``compat``: megatron-core's CUDA-only call sites on twinkle's paths, patched for the CPU (a no-op on GPUs);
- ``state``: megatron's process groups from a twinkle ``DeviceMesh``;
- ``convert``: Hugging Face Qwen3 and Qwen3-MoE to and from ``GPTModel``, sharded for this rank;
- ``lora``: multi-LoRA on megatron's tensor-parallel linear layers; ``lora_files``: its weights in peft's files;
- ``layout``, ``pipeline``, ``checkpointer``: how ``MegatronModel`` (``model``) spreads over the mesh and saves.
- ``ddp``: megatron's DistributedDataParallel and distributed optimizer, for the full model (``distributed_optimizer``).

Only this package imports megatron-core, and only inside functions: ``import twinkle.model.megatron`` works
where megatron-core is not installed.
"""

from __future__ import annotations

from twinkle.infra.ray import remote_class
from twinkle.model.megatron.model import MegatronModel

# In ray mode, MegatronModel(..., device_mesh=mesh, remote_group='model') is one actor per rank of the
# mesh, each a torchrun process in all but name (megatron's groups over gloo or nccl): the ranks of a
# tensor- or pipeline-parallel group read the same data shard and return the same result, so the
# collects see one result per shard. The same table as TransformersModel's (twinkle.model).
remote_class(
    MegatronModel,
    {
        'forward_backward': ('slice_dp', 'mean'),
        'forward': ('slice_dp', 'flatten'),
        'forward_only': ('slice_dp', 'flatten'),
        'calculate_loss': ('slice_dp', 'mean'),
    },
)

__all__ = ['MegatronModel']
