"""``MegatronModel``: ``TransformersModel``'s contract on megatron-core.

The model is megatron-core's ``GPTModel`` (this rank's pipeline stage, its tensor-parallel
slices), built from a Hugging Face Qwen3 checkpoint by ``twinkle.model.megatron.convert``. It
sits behind ``McoreCausalLM``, a module with a Hugging Face causal LM's forward (``input_ids,
attention_mask, position_ids`` in, ``logits`` out, whole on every rank), so the project's
machinery runs on it unchanged: ``ModelRunner`` (losses, metrics, reference logprobs),
``TrainGroup`` and ``Stepper`` (each adapter's optimizer, schedule and accumulation), the mixed
pass of several adapters (``multi_lora.row_adapters``, megatron's layers wrapped by
``twinkle.model.megatron.lora``). ``MegatronParallel`` (``layout.py``) does the reductions over
megatron's process groups, and ``MegatronCheckpointer`` writes Hugging Face files: peft adapters
that load on the Hugging Face model, or the full model.

Example (``torchrun --nproc_per_node=2``)::

    twinkle.initialize(mode='torchrun', global_device_mesh=DeviceMesh.from_sizes(tp_size=2))
    model = MegatronModel(model_id=assets.tiny_model())
    model.add_adapter_to_model('default', LoraConfig(r=8, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=1e-4)
    for batch in dataloader:
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftConfig
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from twinkle.errors import ConfigurationError, StateError, UnknownNameError
from twinkle.hub import resolve_model
from twinkle.infra import distributed
from twinkle.infra.mesh import DeviceMesh
from twinkle.infra.runtime import get_runtime
from twinkle.model.loading import Precision, default_precision, resolve_device
from twinkle.model.lora import multi as multi_lora
from twinkle.model.megatron import compat, convert, ddp, lora, state
from twinkle.model.megatron.checkpointer import HFCheckpoint, MegatronCheckpointer
from twinkle.model.megatron.layout import MegatronParallel, mark_tp_partial
from twinkle.model.megatron.pipeline import Stage, receive_hidden, share_logits, stage_logits
from twinkle.model.train_group import FULL
from twinkle.model.transformers import TransformersModel
from twinkle.utils.logger import get_logger

logger = get_logger()


class McoreCausalLM(nn.Module):
    """This rank's share of a megatron-core ``GPTModel`` with a Hugging Face causal LM's forward:
    ``logits`` ``[batch, positions, vocab]`` whole on every rank (gathered over tensor parallel,
    shared by the last pipeline stage)."""

    def __init__(
        self,
        gpt: nn.Module,
        config: PretrainedConfig,
        stage: Stage,
        dtype: torch.dtype,
        expert_group: Any = None,
        sequence_split: int = 1,
    ):
        super().__init__()
        self.gpt = gpt
        self.config = config
        self.stage = stage
        self.dtype = dtype
        #: The expert-parallel group when the experts are split over ranks (``ep_size`` > 1), else None.
        self.expert_group = expert_group
        #: Megatron's sequence parallel: the hidden states between layers are split over this many
        #: tensor-parallel ranks along the sequence (1: not split).
        self.sequence_split = sequence_split
        #: The build of megatron's groups this model's layers and stages belong to.
        self.generation = state.generation()

    def get_input_embeddings(self) -> nn.Module | None:
        """Megatron's vocabulary-parallel embedding (the runner then checks ids against ``config.vocab_size``)."""
        return getattr(self.gpt, 'embedding', None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **_: Any,
    ) -> CausalLMOutputWithPast:
        if self.generation != state.generation():
            raise StateError(
                'megatron-core was laid out again for another MegatronModel in this process (other tp/pp/ep '
                "sizes), which destroyed this model's process groups: one layout per process"
            )
        rows, length = input_ids.shape
        most_rows, most_positions = self._padded_shape(rows, length, input_ids.device)
        if (most_rows, most_positions) == (rows, length):
            return CausalLMOutputWithPast(logits=self._logits(input_ids, attention_mask, position_ids))
        grow = (0, most_positions - length, 0, most_rows - rows)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        padded_positions = None if position_ids is None else nn.functional.pad(position_ids, grow, value=1)
        with self._padding_rows_on_the_base(most_rows - rows):
            logits = self._logits(nn.functional.pad(input_ids, grow), nn.functional.pad(mask, grow), padded_positions)
        return CausalLMOutputWithPast(logits=logits[:rows, :length])

    def _padding_rows_on_the_base(self, extra: int) -> contextlib.AbstractContextManager[object]:
        """Rows added as padding go through the base model alone, when the adapters are assigned per
        row (a mixed pass): the assignment grows by ``extra`` rows of None for this forward."""
        layers = multi_lora.multi_lora_layers(self.gpt)
        assignment = next((layer.assignment for layer in layers.values() if layer.assignment is not None), None)
        if not extra or assignment is None or assignment.names is None:
            return contextlib.nullcontext()
        return multi_lora.row_adapters(self.gpt, [*assignment.names, *([None] * extra)])

    def _padded_shape(self, rows: int, length: int, device: torch.device) -> tuple[int, int]:
        """The batch's shape as megatron takes it, padding masked out and dropped afterwards:

        - expert parallel: the all-gather token dispatcher needs the same ``[positions, rows]`` on every
          rank of the group, which hold different rows: the group's largest (each token is routed on
          its own, so the padding changes no real token's experts);
        - sequence parallel: the positions a multiple of the ranks splitting them."""
        if self.expert_group is not None:
            shape = torch.tensor([rows, length], device=device)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.expert_group)
            rows, length = (int(n) for n in shape.tolist())
        split = self.sequence_split
        return rows, -(-length // split) * split

    def _logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        rows, length = input_ids.shape
        mask = attention_mask_4d(input_ids, attention_mask, position_ids)
        positions = torch.arange(length, device=input_ids.device).expand(rows, length)
        stage = self.stage
        if not stage.first:
            shape = (length // self.sequence_split, rows, self.config.hidden_size)
            hidden = receive_hidden(shape, self.dtype, stage, input_ids.device)
            self.gpt.set_input_tensor(hidden)  # type: ignore[operator]
        out = self.gpt(input_ids if stage.first else None, positions, mask)
        if stage.size == 1:
            logits = out
        elif stage.is_last:
            logits = share_logits(out, stage)
        else:
            logits = stage_logits(out.to(self.dtype), (rows, length, self.config.vocab_size), stage)
        return cast(torch.Tensor, logits)


def attention_mask_4d(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None
) -> torch.Tensor:
    """Megatron's mask, ``[batch, 1, query, key]``, True where attention is blocked: the future,
    padding keys, and on packed rows (``position_ids`` restarting at 0) the other sequences.

    Rotary embeddings are relative, so megatron's positions ``0..n-1`` give a packed sequence the
    attention scores its own positions would: only the mask must keep the sequences apart."""
    rows, length = input_ids.shape
    device = input_ids.device
    blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1).expand(rows, length, length)
    if attention_mask is not None:
        blocked = blocked | (attention_mask[:, None, :] == 0)
    if position_ids is not None:
        segment = (position_ids == 0).cumsum(-1)
        blocked = blocked | (segment[:, :, None] != segment[:, None, :])
    return blocked[:, None]


class MegatronModel(TransformersModel):
    """A Qwen3 causal LM (``model_id``: ``ms://``, ``hf://`` or a directory in Hugging Face
    format; or ``config`` with random weights) on megatron-core, spread over ``device_mesh``'s
    ``tp_size`` (tensor parallel), ``pp_size`` (pipeline stages), ``dp_size`` (data parallel) and
    ``ep_size`` (experts of a mixture of experts), with ``TransformersModel``'s methods.

    Every rank of a tensor- or pipeline-parallel group reads the same rows (``DeviceMesh.data_rank``)
    and gets the same outputs; losses, metrics and updates are those of one process.
    ``fsdp_size`` and ``ulysses_size`` are ``TransformersModel``'s: megatron refuses them.

    ``sequence_parallel`` (under tensor parallel): megatron's sequence parallel, the hidden states
    between layers split along the sequence over the tensor-parallel ranks (less activation memory).
    A mixture of experts trains under tensor parallel only so (megatron's ``moe_layer.py`` refuses it
    otherwise): None turns it on there and leaves it off elsewhere.

    ``distributed_optimizer`` (full-parameter training, ``dp_size`` > 1): megatron's
    ``DistributedDataParallel`` and distributed optimizer (ZeRO-1, ``twinkle.model.megatron.ddp``): each
    data-parallel rank holds the optimizer state of 1/dp of the weights, the gradients are reduce-scattered
    and the updated weights all-gathered; the numbers are those without it. ``set_optimizer`` then takes
    ``AdamW`` or ``Adam`` (megatron builds them). Adapters keep the project's own per-adapter
    reduction, and are refused here: adapters come and go while the model trains, each with its own
    optimizer and step, while megatron's DDP wraps one fixed set of parameters, built once, into its buffers.
    """

    def __init__(
        self,
        model_id: str | None = None,
        config: PretrainedConfig | None = None,
        *,
        device_mesh: DeviceMesh | None = None,
        device: str | torch.device | None = None,
        mixed_precision: Precision | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        sequence_parallel: bool | None = None,
        distributed_optimizer: bool = False,
    ):
        if model_id is None and config is None:
            raise ConfigurationError('MegatronModel needs model_id= (a checkpoint) or config= (random weights)')
        require_megatron()
        mesh = device_mesh if device_mesh is not None else get_runtime().global_device_mesh
        compat.install()
        # Building draws nothing from the process's random generator (megatron seeds its own and its
        # init draws per layer held): adapters drawn next get the same numbers whatever the layout.
        with torch.random.fork_rng(devices=[]):
            self._build(model_id, config, mesh, device, mixed_precision, dtype, seed, sequence_parallel)
        #: megatron's ``DistributedDataParallel`` around the ``GPTModel`` (``distributed_optimizer=True``), else None.
        self.ddp: Any = self._distribute() if distributed_optimizer else None

    def _build(
        self,
        model_id: str | None,
        config: PretrainedConfig | None,
        mesh: DeviceMesh | None,
        device: str | torch.device | None,
        mixed_precision: Precision | None,
        dtype: torch.dtype | None,
        seed: int,
        sequence_parallel: bool | None,
    ) -> None:
        state.initialize(mesh, seed=seed)
        self.model_id = model_id
        self._parallel = MegatronParallel(mesh)
        device = resolve_device(device, self._parallel.default_device() if self._parallel.enabled else None)
        mixed_precision = mixed_precision or default_precision(device)
        if mixed_precision not in ('no', 'bf16'):
            raise ConfigurationError(f"mixed_precision must be one of ['no', 'bf16']; got {mixed_precision!r}")
        if mixed_precision == 'bf16' and device.type != 'cuda':
            # Its linear layers' backward re-enters autocast for CUDA alone (custom_bwd(device_type='cuda'),
            # megatron/core/tensor_parallel/layers.py:74): on the CPU it would multiply bf16 by float32.
            raise ConfigurationError(
                f"MegatronModel runs mixed_precision='bf16' on CUDA only (megatron-core's backward re-enters "
                f"autocast for CUDA alone); on {device.type!r} use mixed_precision='no'"
            )
        dtype = dtype or torch.float32
        hf_config, weights = _source(model_id, config, seed)
        self._parallel.tied_across_stages = bool(getattr(hf_config, 'tie_word_embeddings', False)) and (
            self._parallel.pp_size > 1
        )
        if self._parallel.tied_across_stages and device.type != 'cuda':
            raise ConfigurationError(
                f'tied input and output embeddings under pp_size={self._parallel.pp_size} on {device.type!r}: '
                'megatron-core moves the copy the last stage holds to CUDA as it builds it '
                '(models/common/language_module/language_module.py:307); use pp_size=1 here, or a GPU'
            )
        _warn_without_router_loss(hf_config)
        if mixed_precision == 'bf16' and bool(getattr(hf_config, 'num_experts', None)):
            # Seen on an H200 (benchmarks/results/gpu_check_h200_moe.jsonl): the router's forward runs
            # under autocast, its backward (transformer/moe/moe_utils.py:1369) multiplies bf16 by float32.
            raise ConfigurationError(
                "a mixture of experts on MegatronModel trains with mixed_precision='no': megatron-core's "
                'router backward does not run under bf16 autocast (transformer/moe/moe_utils.py:1369)'
            )
        split = _sequence_split(hf_config, self._parallel.tp_size, sequence_parallel)
        if split > 1:  # not a CUDA call site: megatron's torch norms refuse sequence parallel on GPUs too
            compat.allow_sequence_parallel_norms()
        gpt = convert.build_model(hf_config, dtype=dtype, sequence_parallel=split > 1)
        convert.load_hf_state_dict(gpt, weights)
        mark_tp_partial(gpt)
        #: The megatron model behind its causal-LM front (``model`` is the same module).
        self.mcore = McoreCausalLM(gpt, hf_config, _stage(), dtype, _expert_group(), split).to(device)
        # The runner, metrics and checkpoints read a causal LM's forward and config, which McoreCausalLM has.
        self.model = self.mcore  # type: ignore[assignment]
        self._assemble(device, mixed_precision, None, MegatronCheckpointer)

    @property
    def _megatron_parallel(self) -> MegatronParallel:
        assert isinstance(self._parallel, MegatronParallel)  # _build made it
        return self._parallel

    def _distribute(self) -> Any:
        """megatron's DDP and distributed optimizer for the full model (``distributed_optimizer=True``)."""
        parallel = self._megatron_parallel
        if parallel.dp_size < 2:
            raise ConfigurationError(
                f'distributed_optimizer=True shards the optimizer state over the data-parallel ranks, and this mesh '
                f'has dp_size={parallel.dp_size} (tp_size={parallel.tp_size}, pp_size={parallel.pp_size}): '
                'give it dp_size >= 2, or leave distributed_optimizer=False'
            )
        if self.mcore.dtype != torch.float32:
            # Its float32 main weights are copies taken when the optimizer is built: weights loaded after
            # set_optimizer would be overwritten by the next step (optimizer/distrib_optimizer.py:401).
            raise ConfigurationError(
                f'distributed_optimizer=True holds the weights in float32 here; got dtype={self.mcore.dtype}: '
                "leave dtype unset (bf16 compute comes from mixed_precision='bf16')"
            )
        wrapped = ddp.wrap(self.mcore.gpt)
        stepper = ddp.DistributedOptimizerStepper(self._parallel, wrapped)
        stepper.watch(self.groups[FULL])
        self._stepper = stepper
        parallel.distributed_optimizer = True
        return wrapped

    # ---- adapters -----------------------------------------------------------------------------
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: LoraConfig | str,
        *,
        gradient_accumulation_steps: int = 1,
        value_head: bool = False,
    ) -> None:
        """Add a LoRA adapter on megatron's parallel layers (``twinkle.model.megatron.lora``): a
        peft ``LoraConfig`` with Hugging Face target names (``q_proj`` ... ``down_proj``,
        ``'all-linear'``), or a saved adapter directory (peft's files, from this model or from
        the Hugging Face one). Every rank calls it."""
        if self.ddp is not None:
            raise ConfigurationError(
                f"adapter {adapter_name!r}: this MegatronModel trains the full model under megatron's distributed "
                'optimizer (distributed_optimizer=True), which wraps its fixed set of weights; adapters keep the '
                'per-adapter reduction: build the model with distributed_optimizer=False to add adapters'
            )
        super().add_adapter_to_model(
            adapter_name, config_or_dir, gradient_accumulation_steps=gradient_accumulation_steps, value_head=value_head
        )

    def _check_value_head(self, adapter_name: str, value_head: bool) -> None:
        if value_head:
            raise ConfigurationError(
                f'adapter {adapter_name!r}: MegatronModel has no value heads yet: train a critic on TransformersModel'
            )

    def _inject_adapter(self, adapter_name: str, config: PeftConfig) -> list[nn.Parameter]:
        """The adapter's layers on megatron's parallel linears and experts (``lora``); this stage's parameters."""
        if not isinstance(config, LoraConfig):
            raise ConfigurationError(f'expected a peft LoraConfig or an adapter directory; got {config!r}')
        lora.add_adapter(self.mcore.gpt, adapter_name, multi_lora.spec_from_peft(config, self.model))
        return self._stage_adapter_parameters(adapter_name)

    def _stage_adapter_parameters(self, adapter_name: str) -> list[nn.Parameter]:
        """The adapter's parameters on this rank; ``ConfigurationError`` (the adapter removed) on
        every rank when a pipeline stage holds none of its layers: that stage's loss would not
        depend on it, and its backward would not meet the sends of the stages after it."""
        try:
            params = multi_lora.adapter_parameters(self.model, adapter_name)
        except UnknownNameError:  # this stage holds none of the adapter's layers
            params = []
        empty = [
            stage for stage, count in distributed.all_gather_object((self.mcore.stage.rank, len(params))) if not count
        ]
        if empty:
            with contextlib.suppress(UnknownNameError):  # a stage without its layers may hold no trace of it
                multi_lora.remove_adapter(self.model, adapter_name)
            raise ConfigurationError(
                f'adapter {adapter_name!r}: its target_modules leave pipeline stage(s) {sorted(set(empty))} of '
                f'{self.mcore.stage.size} without a LoRA layer; under pp_size > 1 every stage needs one (target '
                'layers of every stage, or fewer stages)'
            )
        return params

    def shard_base(self) -> None:
        """Nothing to do: megatron's layers hold their slices from the start."""


def require_megatron() -> None:
    """``ConfigurationError`` saying how to install megatron-core where it is missing."""
    if importlib.util.find_spec('megatron') is None or importlib.util.find_spec('megatron.core') is None:
        raise ConfigurationError(
            "MegatronModel needs megatron-core, which is not installed: pip install 'twinkle-train[megatron]' "
            f'(megatron-core 0.19 needs Python >= 3.12; this is {sys.version.split()[0]}), or make setup-megatron'
        )


def _source(
    model_id: str | None, config: PretrainedConfig | None, seed: int
) -> tuple[PretrainedConfig, Mapping[str, torch.Tensor]]:
    """The Hugging Face config and whole weights to slice: the checkpoint's (read lazily), or a
    model built from ``config`` with ``seed`` (the same on every rank, whatever the layout)."""
    if model_id is not None:
        directory = Path(resolve_model(model_id))
        return AutoConfig.from_pretrained(str(directory)), HFCheckpoint(directory)
    from transformers import AutoModelForCausalLM

    assert config is not None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    return config, built.state_dict()


def _warn_without_router_loss(hf_config: PretrainedConfig) -> None:
    """Say once that a mixture of experts trains without its router's load-balancing loss here
    (``TransformersModel`` adds it with the config's ``router_aux_loss_coef``)."""
    coef = float(getattr(hf_config, 'router_aux_loss_coef', 0.0) or 0.0)
    if getattr(hf_config, 'num_experts', 0) and coef and not getattr(hf_config, 'output_router_logits', False):
        logger.warning(
            f"MegatronModel trains this mixture of experts without the router's load-balancing loss "
            f'(router_aux_loss_coef={coef} is not applied; TransformersModel applies it)'
        )


def _sequence_split(hf_config: PretrainedConfig, tp_size: int, sequence_parallel: bool | None) -> int:
    """Over how many ranks megatron's sequence parallel splits the sequence (1: it is off)."""
    moe = bool(getattr(hf_config, 'num_experts', 0))
    if tp_size == 1:
        return 1
    if moe and sequence_parallel is False:
        raise ConfigurationError(
            f"a mixture of experts under tensor parallel (tp_size={tp_size}) trains with megatron's sequence "
            'parallel only (megatron-core transformer/moe/moe_layer.py refuses it otherwise): leave '
            'sequence_parallel=None or True, or split the experts with ep_size instead of tp_size'
        )
    return tp_size if (sequence_parallel if sequence_parallel is not None else moe) else 1


def _expert_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_group() if ps.get_expert_model_parallel_world_size() > 1 else None


def _stage() -> Stage:
    from megatron.core import parallel_state as ps

    size = ps.get_pipeline_model_parallel_world_size()
    if size == 1:
        return Stage.single()
    rank = ps.get_pipeline_model_parallel_rank()
    return Stage(
        rank=rank,
        size=size,
        previous=ps.get_pipeline_model_parallel_prev_rank() if rank > 0 else None,
        next=ps.get_pipeline_model_parallel_next_rank() if rank < size - 1 else None,
        last=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )


__all__ = ['McoreCausalLM', 'MegatronModel', 'attention_mask_4d']
