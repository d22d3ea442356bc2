"""megatron-core 0.19.2 on a machine without CUDA: the few call sites on twinkle's paths that assume a GPU.

``install()`` patches them, once per process, and does nothing where ``torch.cuda.is_available()``: the same
code then runs megatron unchanged on GPUs. It covers what building a ``GPTModel`` from the local layer spec
(dense and MoE), its forward and backward under tensor, pipeline and expert parallel (and sequence parallel),
and seeding megatron's RNG reach (paths under ``megatron/core/``, lines of 0.19.2):

- ``models/common/embeddings/rotary_pos_embedding.py:162``: ``RotaryEmbedding.get_emb`` moves ``inv_freq``
  to ``torch.cuda.current_device()`` at the first forward;
- ``utils.py:715``: ``GlobalMemoryBuffer.get_tensor`` (attention's score buffer, ``transformer/
  dot_product_attention.py:189``) allocates on ``torch.cuda.current_device()``;
- ``transformer/utils.py:39``: ``get_default_causal_mask`` (the causal mask ``fusions/fused_softmax.py:327``
  builds when no mask is given) allocates on ``device="cuda"``;
- ``transformer/moe/router.py:98``, ``:100``: ``Router.gating`` moves the router's weight (and bias) to
  ``torch.cuda.current_device()`` at each forward;
- ``tensor_parallel/mappings.py:95`` (``_gather_along_last_dim``: the logits gathered over tensor parallel,
  ``parallel_output=False``), ``:145``, ``:152`` (``_gather_along_first_dim``: the MoE all-gather token
  dispatcher, sequence parallel) and ``:185`` (``_reduce_scatter_along_first_dim``, their way back) allocate
  their outputs on ``torch.cuda.current_device()``;
- ``tensor_parallel/layers.py:647``: the linears' backward under sequence parallel gathers its input into a
  buffer on ``torch.cuda.current_device()``;
- ``tensor_parallel/random.py:303-306`` and ``:490``: ``model_parallel_cuda_manual_seed`` and
  ``CudaRNGStatesTracker.add`` seed CUDA generators, and ``fork()`` (``:318-345``; dropout in tensor-parallel
  regions, ``tensor_parallel/layers.py:177``) swaps them. Replaced by the same seeds over the CPU generator;
- ``transformer/torch_norm.py:50``: ``WrappedTorchNorm`` refuses sequence parallel (which megatron requires to
  train an MoE layer under tensor parallel, ``transformer/moe/moe_layer.py:629``); allowed, its weights marked
  as Transformer Engine's and Apex's norms mark theirs (``allow_sequence_parallel_norms``).

The first six, and the DDP buffers and optimizer tensors below, are the same mistake, a CUDA device named where the
tensors' own would do. Each of those modules gets its own view of ``torch`` (``_CpuTorch``) in which the current
CUDA device is the CPU, a ``device='cuda'`` given to a tensor factory means the CPU and ``torch.cuda.synchronize``
waits for nothing; ``torch`` itself, and every other module, are left alone. Adding a module to
``CPU_TORCH_MODULES`` covers its call sites the same way.

Megatron's ``DistributedDataParallel`` and distributed optimizer (``MegatronModel(distributed_optimizer=True)``):

- ``distributed/param_and_grad_buffer.py:1180``, ``:1186``: the param and grad buffers are allocated on
  ``torch.cuda.current_device()``; ``:632``: ``finish_grad_sync`` takes ``torch.cuda.current_stream()`` to wait
  for CUDA-graph events (none on the CPU: the CPU view's stream waits for nothing);
- ``optimizer/optimizer.py:315`` (a flag all-reduced on ``device='cuda'``) and ``:1249`` (``FP32Optimizer``'s
  scale); ``optimizer/clip_grads.py:108``, ``:112`` (the norm and the overflow buffer on ``device='cuda'``),
  ``:180``, ``:231``; ``optimizer/distrib_optimizer.py:998``: ``DistributedOptimizer.load_state_dict`` allocates
  placeholder moments on ``torch.cuda.current_device()`` (a resume);
- type names: ``optimizer/distrib_optimizer.py:466`` (``_build_model_and_main_param_groups``) takes a float32
  parameter only if its ``type()`` is ``'torch.cuda.FloatTensor'``, and ``optimizer/clip_grads.py:174``
  (``clip_grad_by_total_norm_fp32``) asserts it of every gradient: both run with CPU tensors naming their type as
  the CUDA one would (``_cuda_type_names``), nothing else changed.

Not covered, as twinkle's paths do not reach them (megatron-cpu.md lists them): the pipeline schedules and
their p2p (``pipeline_parallel/schedules.py:749``, ``:2292``; ``p2p_communication.py:334``, ``:342``, ``:419``),
weights allocated on the GPU (``tensor_parallel/layers.py:305``, ``:1000``... only without
``use_cpu_initialization``, which ``convert.transformer_config`` sets on the CPU).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

#: The megatron modules whose ``torch`` global becomes ``_CpuTorch`` on the CPU, and the call sites that need it.
CPU_TORCH_MODULES: dict[str, str] = {
    'megatron.core.models.common.embeddings.rotary_pos_embedding': 'RotaryEmbedding.get_emb (line 162)',
    'megatron.core.utils': 'GlobalMemoryBuffer.get_tensor (line 715)',
    'megatron.core.transformer.utils': 'get_default_causal_mask (line 39)',
    'megatron.core.transformer.moe.router': 'Router.gating (lines 98, 100)',
    'megatron.core.tensor_parallel.mappings': 'the gathers and reduce-scatters over tensor parallel (lines 95-185)',
    'megatron.core.tensor_parallel.layers': "the linears' backward under sequence parallel (line 647)",
    'megatron.core.distributed.param_and_grad_buffer': 'the DDP buffers (lines 1180, 1186) and their stream (632)',
    'megatron.core.optimizer.optimizer': "a grad-norm group flag (line 315), FP32Optimizer's scale (1249)",
    'megatron.core.optimizer.clip_grads': 'the norm and its overflow buffers (lines 108, 112, 180, 231)',
    'megatron.core.optimizer.distrib_optimizer': "load_state_dict's placeholder moments (line 998)",
}
# The tensor factories whose device='cuda' means the CPU inside those modules.
_FACTORIES = ('empty', 'ones', 'zeros', 'full', 'tensor', 'arange')
_installed = False


def install() -> bool:
    """Patch megatron's CUDA-only call sites for the CPU; True if this call patched them.

    Idempotent; a no-op (False) on a machine with CUDA, where megatron runs as it is."""
    global _installed
    if _installed or torch.cuda.is_available():
        return False
    for name in CPU_TORCH_MODULES:
        module = importlib.import_module(name)
        if not isinstance(getattr(module, 'torch', None), _CpuTorch):
            setattr(module, 'torch', _CpuTorch())  # noqa: B010  # the module's global, read by its functions
    _install_cpu_rng()
    _install_cuda_type_names()
    allow_sequence_parallel_norms()
    _installed = True
    return True


def _cpu_device(device: object) -> object:
    """The device a factory gets: a CUDA device (``'cuda'``, ``'cuda:0'``, an index) becomes the CPU."""
    if isinstance(device, int) or (isinstance(device, (str, torch.device)) and torch.device(device).type == 'cuda'):
        return torch.device('cpu')
    return device


class _CpuCuda:
    """``torch.cuda`` as the patched modules see it: the current device is the CPU, synchronize waits for nothing."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device('cpu')

    @staticmethod
    def synchronize(device: object = None) -> None:
        return None

    @staticmethod
    def current_stream(device: object = None) -> _NoStream:
        return _NoStream()


class _NoStream:
    """The CPU's "current stream": work is done when a call returns, so there is nothing to wait for."""

    def wait_event(self, event: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        return None


class _CpuTorch:
    """``torch`` as the patched modules see it: ``torch`` itself except ``cuda`` and the CUDA device of factories."""

    cuda = _CpuCuda()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name in _FACTORIES:
            return _on_cpu(value)
        return value


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        if 'device' in kwargs:
            kwargs['device'] = _cpu_device(kwargs['device'])
        return factory(*args, **kwargs)

    return call


def _install_cpu_rng() -> None:
    """``model_parallel_cuda_manual_seed`` with megatron's seeds over the CPU generator.

    megatron keeps one generator state per name (data parallel, model parallel, expert parallel) and swaps the
    default generator to it inside ``fork()``; on the CPU the default generator is torch's CPU one. The seeds
    are megatron's (``tensor_parallel/random.py:476-497``), so dropout masks depend on the same ranks."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    def model_parallel_manual_seed(
        seed: int,
        te_rng_tracker: bool = False,
        inference_rng_tracker: bool = False,
        use_cudagraphable_rng: bool = False,
        tp_rank: int | None = None,
        ep_rank: int | None = None,
        etp_rank: int | None = None,
        force_reset_rng: bool = False,
    ) -> None:
        """megatron's signature; the tracker options name CUDA features and are ignored on the CPU."""
        from megatron.core import parallel_state as ps

        tracker = _cpu_rng_tracker_class(random)()
        random._CUDA_RNG_STATE_TRACKER = tracker
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
        ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
        etp_rank = ps.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
        torch.manual_seed(seed)
        tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
        tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)

    random.model_parallel_cuda_manual_seed = model_parallel_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = model_parallel_manual_seed


def _install_cuda_type_names() -> None:
    """The two places of megatron's distributed optimizer that accept a float32 tensor by its CUDA type name
    (``optimizer/distrib_optimizer.py:466``, ``optimizer/clip_grads.py:174``) run under ``_cuda_type_names``."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as optimizer_module

    optimizer_cls = distrib_optimizer.DistributedOptimizer
    build = optimizer_cls.__dict__['_build_model_and_main_param_groups'].__func__
    setattr(optimizer_cls, '_build_model_and_main_param_groups', classmethod(_cuda_type_names(build)))  # noqa: B010
    clip = _cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer_module.clip_grad_by_total_norm_fp32 = clip  # imported by name there (line 52), called at 410, 420


def _cuda_type_names(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with ``Tensor.type()`` (no argument) naming a CPU tensor's type as its CUDA twin's
    (``'torch.FloatTensor'`` -> ``'torch.cuda.FloatTensor'``) while it runs; restored after, even on error.
    ``Tensor.type`` is torch's own, patched for the call's duration: megatron's optimizer runs on one thread."""
    plain = torch.Tensor.type

    def cuda_named(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == 'cpu':
            return plain(self).replace('torch.', 'torch.cuda.', 1)
        return plain(self, dtype, non_blocking, **kwargs)

    def call(*args: Any, **kwargs: Any) -> Any:
        torch.Tensor.type = cuda_named  # type: ignore[assignment,method-assign]
        try:
            return function(*args, **kwargs)
        finally:
            torch.Tensor.type = plain  # type: ignore[method-assign]

    return call


def allow_sequence_parallel_norms() -> None:
    """megatron's torch norms under sequence parallel, marked for the gradient sum over tensor parallel.

    ``WrappedTorchNorm`` (``transformer/torch_norm.py:50``) refuses ``sequence_parallel``: torch's norms do not
    mark their weights ``sequence_parallel``, the attribute ``finalize_model_grads`` (``distributed/
    finalize_model_grads.py:452``) sums gradients over tensor parallel by (each rank's norm sees its slice of
    the sequence). The norm itself is per token, so it is right on a slice: built as without sequence parallel,
    its weights marked. Needed by MoE under tensor parallel, which megatron trains only with sequence parallel
    (``transformer/moe/moe_layer.py:629``); Transformer Engine's and Apex's norms mark their weights themselves.
    Not a CUDA call site: ``MegatronModel`` applies it on GPUs too when it builds with sequence parallel."""
    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm, '_twinkle_sequence_parallel', False):
        return  # patched already
    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = build(cls, plain, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new
    torch_norm.WrappedTorchNorm._twinkle_sequence_parallel = True


def _cpu_rng_tracker_class(random: ModuleType) -> type:
    """megatron's ``CudaRNGStatesTracker`` over the CPU generator (its base class is only importable here)."""

    class CpuRNGStatesTracker(random.CudaRNGStatesTracker):  # type: ignore[misc,name-defined]
        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f'rng state {name!r} or seed {seed} is already tracked')
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f'rng state {name!r} is not tracked; tracked: {sorted(self.states_)}')
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


__all__ = ['CPU_TORCH_MODULES', 'allow_sequence_parallel_norms', 'install']
