"""Hugging Face Qwen3 and Qwen3-MoE to and from megatron-core's ``GPTModel``, sharded for this rank.

``transformer_config`` and ``layer_spec`` describe the model to megatron, ``build_model`` builds this rank's
pipeline stage (its tensor-parallel shard, its experts), ``load_hf_state_dict`` fills it from full Hugging Face
tensors and ``export_hf_state_dict`` gathers the full Hugging Face tensors back, on every rank.

Why not mcore-bridge (1.6.5): ``import mcore_bridge`` fails without Transformer Engine (``mcore_bridge/
patcher.py:32`` imports ``transformer_engine``, run at import by ``apply_patch``, ``patcher.py:327``), its model
config sets ``use_transformer_engine=True`` (``register.py:129``) and it writes Transformer Engine's fused
layer-norm names (``gpt_bridge.py:1727``, ``:1747``) and allocates on ``device='cuda'`` (``gpt_bridge.py:388``,
``:562``, ``:698``, ``:1067``, ``:1735``). Faking Transformer Engine to run it on the CPU would be larger than
the whole mapping for Qwen3, which is this module.

The layouts (megatron-core 0.19.2, the local layer spec; read from its source):

- ``linear_qkv`` (column parallel) holds, per query group ``g`` (a key/value head), ``[q heads of g; k_g; v_g]``
  (``transformer/attention.py:1861-1901`` views its output as ``[ng, (np/ng + 2) * hn]`` and splits it so);
  each tensor-parallel rank holds ``ng / tp`` consecutive groups, a contiguous slice of rows;
- ``linear_fc1`` of the gated MLP holds ``[gate; up]`` per rank: rank ``r`` has ``[gate_r; up_r]``, each the
  ``r``-th of ``tp`` row slices (``transformer/mlp.py:322-330`` chunks the local output in two);
- ``linear_proj`` and ``linear_fc2`` are row parallel (a slice of columns); ``word_embeddings`` (vocab parallel)
  and ``output_layer`` (column parallel) a slice of vocabulary rows; norms are whole on every rank;
- the local MoE spec builds ``SequentialMLP`` (``models/backends.py:133-142``): ``experts.local_experts.k`` is
  expert ``ep_rank * E / ep + k``, an MLP sharded like the dense one over the expert tensor-parallel group;
  the router's weight is ``mlp.router.weight``, whole.
- Layers are numbered per stage (``decoder.layers.l``); ``layer_number - 1`` is the layer's global index.

Experts: transformers 5 holds each MoE layer's experts as 3-D stacks (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``[gate; up]`` per expert, and ``mlp.experts.down_proj`` ``[E, H, I]``); hub checkpoints hold
them one by one (``mlp.experts.j.gate_proj.weight``...). Loading takes either; exporting gives the stacks
(``fused_experts=False``: one by one).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle.errors import CheckpointError, ConfigurationError, one_of

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec
    from transformers import PretrainedConfig

#: The Hugging Face architectures converted, by ``model_type``.
ARCHITECTURES: dict[str, str] = {'qwen3': 'Qwen3ForCausalLM', 'qwen3_moe': 'Qwen3MoeForCausalLM'}

_LAYER = re.compile(r'decoder\.layers\.(\d+)\.(.+)')
_EXPERT = re.compile(r'mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight')
_HF_EXPERT = re.compile(r'model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight')
_HF_STACK = re.compile(r'model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)')
# Per-layer tensors that are whole on every rank: megatron name -> Hugging Face name (after model.layers.L.).
_WHOLE = {
    'input_layernorm.weight': 'input_layernorm.weight',
    'self_attention.q_layernorm.weight': 'self_attn.q_norm.weight',
    'self_attention.k_layernorm.weight': 'self_attn.k_norm.weight',
    'pre_mlp_layernorm.weight': 'post_attention_layernorm.weight',
    'mlp.router.weight': 'mlp.gate.weight',
}


def _family(hf_config: PretrainedConfig) -> str:
    """``'qwen3'`` or ``'qwen3_moe'``; anything else is refused, naming what is converted."""
    model_type = getattr(hf_config, 'model_type', None)
    if model_type not in ARCHITECTURES:
        raise one_of('architecture for the Megatron backend', model_type, ARCHITECTURES)
    return str(model_type)


def _is_moe(hf_config: PretrainedConfig) -> bool:
    return _family(hf_config) == 'qwen3_moe'


def _rope_theta(hf_config: PretrainedConfig) -> float:
    """RoPE's base: transformers 5 keeps it in ``rope_parameters``, earlier versions in ``rope_theta``."""
    params = getattr(hf_config, 'rope_parameters', None) or getattr(hf_config, 'rope_scaling', None) or {}
    rope_type = params.get('rope_type', params.get('type', 'default'))
    if rope_type != 'default':
        raise ConfigurationError(
            f'RoPE scaling {rope_type!r} is not converted to megatron; only rope_type "default" is supported'
        )
    return float(params.get('rope_theta', getattr(hf_config, 'rope_theta', 10000.0)))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_sizes(
    hf_config: PretrainedConfig, *, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1, cp_size: int = 1
) -> None:
    """Refuse parallel sizes that do not divide the model, naming the sizes that would."""
    family = _family(hf_config)
    c = hf_config
    split_by_tp = {
        'num_attention_heads': c.num_attention_heads,
        'num_key_value_heads': c.num_key_value_heads,
        'vocab_size': c.vocab_size,
        'moe_intermediate_size' if family == 'qwen3_moe' else 'intermediate_size': (
            c.moe_intermediate_size if family == 'qwen3_moe' else c.intermediate_size
        ),
    }
    bad = {name: value for name, value in split_by_tp.items() if value % tp_size}
    if bad:
        fitting = _divisors(math.gcd(*split_by_tp.values()))
        raise ConfigurationError(
            f'tp_size={tp_size} does not divide {", ".join(f"{k}={v}" for k, v in bad.items())} of this '
            f'{ARCHITECTURES[family]}; tp sizes that divide {", ".join(split_by_tp)} are {fitting}'
        )
    if c.num_hidden_layers % pp_size:
        raise ConfigurationError(
            f'pp_size={pp_size} does not divide num_hidden_layers={c.num_hidden_layers}; pp sizes that do are '
            f'{_divisors(c.num_hidden_layers)}'
        )
    if ep_size > 1 and family != 'qwen3_moe':
        raise ConfigurationError(f'ep_size={ep_size} but a {ARCHITECTURES[family]} has no experts; use ep_size=1')
    if family == 'qwen3_moe' and c.num_experts % ep_size:
        raise ConfigurationError(
            f'ep_size={ep_size} does not divide num_experts={c.num_experts}; ep sizes that do are '
            f'{_divisors(c.num_experts)}'
        )
    if cp_size > 1:
        # transformer/dot_product_attention.py:58 asserts context_parallel_size == 1.
        raise ConfigurationError(
            f'cp_size={cp_size}: context parallel needs Transformer Engine attention, which the local layer spec '
            'used without a GPU does not have (megatron-core DotProductAttention refuses it); use cp_size=1'
        )


def _check_supported(hf_config: PretrainedConfig) -> None:
    """Refuse the variants of Qwen3 whose layers the mapping does not cover."""
    c = hf_config
    unsupported = {
        'attention_bias': getattr(c, 'attention_bias', False),
        'use_sliding_window': getattr(c, 'use_sliding_window', False),
        'mlp_only_layers': list(getattr(c, 'mlp_only_layers', None) or []),
    }
    if _is_moe(c) and getattr(c, 'decoder_sparse_step', 1) != 1:
        unsupported['decoder_sparse_step'] = c.decoder_sparse_step
    given = {k: v for k, v in unsupported.items() if v}
    if given:
        raise ConfigurationError(f'{ARCHITECTURES[_family(c)]} with {given} is not converted to megatron')
    if getattr(c, 'hidden_act', 'silu') != 'silu':
        raise one_of('hidden_act for the Megatron backend', c.hidden_act, ['silu'])


def transformer_config(
    hf_config: PretrainedConfig,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    ep_size: int = 1,
    cp_size: int = 1,
    dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
) -> TransformerConfig:
    """megatron's ``TransformerConfig`` for a Qwen3 or Qwen3-MoE config at these parallel sizes.

    Qwen3: grouped-query attention with its own head width (``kv_channels``), RMSNorm on queries and keys
    (``qk_layernorm``), SwiGLU (``gated_linear_unit`` with silu), RMSNorm, RoPE, no biases, no dropout.
    Qwen3-MoE's router takes a softmax over all experts, the top k, and renormalises them when
    ``norm_topk_prob``: megatron's default order (top k of the logits, then a softmax over those) gives the
    same weights; without ``norm_topk_prob`` it is ``moe_router_pre_softmax``. The load-balancing loss is on
    only where the Hugging Face model adds it to its loss (``output_router_logits``)."""
    from megatron.core.transformer import TransformerConfig

    _check_supported(hf_config)
    check_sizes(hf_config, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, cp_size=cp_size)
    c = hf_config
    moe: dict[str, Any] = {}
    if _is_moe(c):
        aux = bool(getattr(c, 'output_router_logits', False))
        moe = {
            'num_moe_experts': c.num_experts,
            'moe_router_topk': c.num_experts_per_tok,
            'moe_ffn_hidden_size': c.moe_intermediate_size,
            'moe_router_pre_softmax': not c.norm_topk_prob,
            'moe_router_load_balancing_type': 'aux_loss' if aux else 'none',
            'moe_aux_loss_coeff': float(c.router_aux_loss_coef) if aux else 0.0,
            # The all-to-all dispatcher makes a CUDA stream as it is built (transformer/moe/token_dispatcher.py:469);
            # the all-gather one runs on the CPU (and is megatron's default).
            'moe_token_dispatcher_type': 'alltoall' if torch.cuda.is_available() else 'allgather',
        }
    config: TransformerConfig = TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=getattr(c, 'head_dim', None) or c.hidden_size // c.num_attention_heads,
        ffn_hidden_size=c.moe_intermediate_size if _is_moe(c) else c.intermediate_size,
        normalization='RMSNorm',
        layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(c, 'attention_dropout', 0.0)),
        init_method_std=c.initializer_range,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=tp_size,
        context_parallel_size=cp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        **moe,
    )
    return config


def layer_spec(hf_config: PretrainedConfig) -> ModuleSpec:
    """The local (Transformer Engine-free) layer spec: dense, or with ``SequentialMLP`` experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    experts = hf_config.num_experts if _is_moe(hf_config) else None
    spec: ModuleSpec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=True, normalization='RMSNorm')
    return spec


def build_model(
    hf_config: PretrainedConfig, *, dtype: torch.dtype = torch.float32, sequence_parallel: bool = False
) -> GPTModel:
    """This rank's ``GPTModel``: its pipeline stage, tensor-parallel shard and experts, after ``state.initialize``.

    Weights are megatron's random init (load them with ``load_hf_state_dict``). ``parallel_output=False``: the
    last stage's logits come back whole (gathered over tensor parallel), ``[batch, seq, vocab]``.

    ``sequence_parallel`` (under tensor parallel): each rank's hidden states between layers and stages are its
    slice of the sequence (``[seq / tp, batch, hidden]``; seq must divide by tp), and every norm's gradient is
    this rank's part, to be summed over tensor parallel (its weights carry ``sequence_parallel=True``, as
    megatron's ``finalize_model_grads`` expects). megatron trains an MoE model under tensor parallel only so
    (``transformer/moe/moe_layer.py:629``); in eval mode it runs without."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from twinkle.model.megatron import compat

    compat.install()
    sizes = {
        'tp_size': ps.get_tensor_model_parallel_world_size(),
        'pp_size': ps.get_pipeline_model_parallel_world_size(),
        'ep_size': ps.get_expert_model_parallel_world_size(),
        'cp_size': ps.get_context_parallel_world_size(),
    }
    config = transformer_config(hf_config, dtype=dtype, sequence_parallel=sequence_parallel, **sizes)
    model: GPTModel = GPTModel(
        config,
        layer_spec(hf_config),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type='rope',
        rotary_base=_rope_theta(hf_config),  # megatron annotates an int; it computes in float
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


# ---------------------------------------------------------------------------------------------------- loading


def _split_experts(hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf_state`` with transformers 5's expert stacks as per-expert tensors (views, nothing copied)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        match = _HF_STACK.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        layer, kind = match.groups()
        for j, expert in enumerate(tensor.unbind(0)):
            prefix = f'model.layers.{layer}.mlp.experts.{j}'
            if kind == 'down_proj':
                out[f'{prefix}.down_proj.weight'] = expert
            else:
                gate, up = expert.chunk(2, dim=0)
                out[f'{prefix}.gate_proj.weight'], out[f'{prefix}.up_proj.weight'] = gate, up
    return out


class _Shards:
    """This rank's coordinates, and the Hugging Face names the model needs."""

    def __init__(self, model: GPTModel) -> None:
        from megatron.core import parallel_state as ps

        self.config = model.config
        self.tp_rank: int = ps.get_tensor_model_parallel_rank()
        self.tp_size: int = ps.get_tensor_model_parallel_world_size()
        self.etp_rank: int = ps.get_expert_tensor_parallel_rank()
        self.etp_size: int = ps.get_expert_tensor_parallel_world_size()
        self.ep_rank: int = ps.get_expert_model_parallel_rank()
        self.ep_size: int = ps.get_expert_model_parallel_world_size()
        self.layer_index: dict[int, int] = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
        self.tied = bool(model.share_embeddings_and_output_weights)

    @property
    def local_experts(self) -> int:
        experts: int = self.config.num_moe_experts
        return experts // self.ep_size

    def qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The whole ``linear_qkv`` weight: per query group, its query heads, then its key, then its value."""
        groups, width = self.config.num_query_groups, self.config.kv_channels
        per_group = [t.reshape(groups, -1, t.shape[-1]) for t in (q, k, v)]
        assert per_group[1].shape[1] == width
        return torch.cat(per_group, dim=1).reshape(-1, q.shape[-1])

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        groups, width = self.config.num_query_groups, self.config.kv_channels
        q_width = self.config.num_attention_heads // groups * width
        q, k, v = torch.split(qkv.reshape(groups, q_width + 2 * width, -1), [q_width, width, width], dim=1)
        return q.reshape(-1, qkv.shape[-1]), k.reshape(-1, qkv.shape[-1]), v.reshape(-1, qkv.shape[-1])


def _fc1(gate: torch.Tensor, up: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)


def _layer_shard(s: _Shards, layer: int, rest: str, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """This rank's piece of megatron's ``decoder.layers.<layer>.<rest>`` from the whole Hugging Face tensors."""
    p = f'model.layers.{layer}.'
    if rest in _WHOLE:
        return hf[p + _WHOLE[rest]]
    if rest == 'self_attention.linear_qkv.weight':
        whole = s.qkv(*(hf[f'{p}self_attn.{n}_proj.weight'] for n in 'qkv'))
        return whole.chunk(s.tp_size, dim=0)[s.tp_rank]
    if rest == 'self_attention.linear_proj.weight':
        return hf[p + 'self_attn.o_proj.weight'].chunk(s.tp_size, dim=1)[s.tp_rank]
    if rest == 'mlp.linear_fc1.weight':
        return _fc1(hf[p + 'mlp.gate_proj.weight'], hf[p + 'mlp.up_proj.weight'], s.tp_rank, s.tp_size)
    if rest == 'mlp.linear_fc2.weight':
        return hf[p + 'mlp.down_proj.weight'].chunk(s.tp_size, dim=1)[s.tp_rank]
    match = _EXPERT.fullmatch(rest)
    if match is None:
        raise CheckpointError(f'megatron parameter decoder.layers.*.{rest} has no Hugging Face counterpart')
    expert = s.ep_rank * s.local_experts + int(match.group(1))
    e = f'{p}mlp.experts.{expert}.'
    if match.group(2) == 'linear_fc1':
        return _fc1(hf[e + 'gate_proj.weight'], hf[e + 'up_proj.weight'], s.etp_rank, s.etp_size)
    return hf[e + 'down_proj.weight'].chunk(s.etp_size, dim=1)[s.etp_rank]


def _shard(s: _Shards, name: str, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
    match = _LAYER.fullmatch(name)
    if match is not None:
        return _layer_shard(s, s.layer_index[int(match.group(1))], match.group(2), hf)
    if name == 'embedding.word_embeddings.weight':
        return hf['model.embed_tokens.weight'].chunk(s.tp_size, dim=0)[s.tp_rank]
    if name == 'output_layer.weight':
        head = 'model.embed_tokens.weight' if s.tied and 'lm_head.weight' not in hf else 'lm_head.weight'
        return hf[head].chunk(s.tp_size, dim=0)[s.tp_rank]
    if name == 'decoder.final_layernorm.weight':
        return hf['model.norm.weight']
    raise CheckpointError(f'megatron parameter {name} has no Hugging Face counterpart')


def hf_names(hf_config: PretrainedConfig) -> set[str]:
    """Every tensor name of the Hugging Face model, experts one by one (``mlp.experts.j.gate_proj.weight``)."""
    experts = hf_config.num_experts if _is_moe(hf_config) else 0
    return _hf_names(hf_config.num_hidden_layers, experts, bool(hf_config.tie_word_embeddings))


def _hf_names(layers: int, experts: int, tied: bool) -> set[str]:
    names = {'model.embed_tokens.weight', 'model.norm.weight'} | (set() if tied else {'lm_head.weight'})
    for layer in range(layers):
        p = f'model.layers.{layer}.'
        names |= {p + hf for hf in _WHOLE.values() if experts or hf != 'mlp.gate.weight'}
        names |= {f'{p}self_attn.{n}_proj.weight' for n in 'qkvo'}
        if experts:
            names |= {f'{p}mlp.experts.{j}.{n}_proj.weight' for j in range(experts) for n in ('gate', 'up', 'down')}
        else:
            names |= {f'{p}mlp.{n}_proj.weight' for n in ('gate', 'up', 'down')}
    return names


def load_hf_state_dict(model: GPTModel, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's shard of the whole Hugging Face tensors ``hf_state`` into ``model``, exactly.

    ``hf_state`` holds every tensor of the Hugging Face model (a ``state_dict()``, or the safetensors of a hub
    checkpoint, experts stacked or one by one); each rank reads its stage's layers, its tensor-parallel slices
    and its experts. A missing or unknown name, or a shape that does not fit, is a ``CheckpointError``."""
    hf = _split_experts(hf_state)
    s = _Shards(model)
    expected = _hf_names(s.config.num_layers, s.config.num_moe_experts or 0, s.tied)
    missing, unknown = sorted(expected - hf.keys()), sorted(hf.keys() - expected - {'lm_head.weight'})
    if missing or unknown:
        raise CheckpointError(
            'the Hugging Face tensors do not match the model: '
            f'missing {missing[:8]}{"..." if len(missing) > 8 else ""}, unknown {unknown[:8]}'
            f'{"..." if len(unknown) > 8 else ""}'
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = _shard(s, name, hf)
            if value.shape != param.shape:
                raise CheckpointError(
                    f'{name}: this rank holds {tuple(param.shape)} but the Hugging Face tensors give '
                    f'{tuple(value.shape)}; was the model built from the same config?'
                )
            param.copy_(value)


# -------------------------------------------------------------------------------------------------- exporting


def _gather(tensor: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
    """The whole tensor from its ``size`` slices along ``dim`` over ``group``."""
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gather_fc1(tensor: torch.Tensor, group: Any, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` whole from the ranks' ``[gate_r; up_r]``."""
    if size == 1:
        gate, up = tensor.chunk(2, dim=0)
        return gate, up
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    halves = [part.chunk(2, dim=0) for part in parts]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def _export_layer(
    s: _Shards, layer: int, rest: str, value: torch.Tensor, groups: dict[str, Any]
) -> dict[str, torch.Tensor]:
    p = f'model.layers.{layer}.'
    tp, tp_size = groups['tp'], s.tp_size
    if rest in _WHOLE:
        return {p + _WHOLE[rest]: value}
    if rest == 'self_attention.linear_qkv.weight':
        q, k, v = s.split_qkv(_gather(value, 0, tp, tp_size))
        return {f'{p}self_attn.q_proj.weight': q, f'{p}self_attn.k_proj.weight': k, f'{p}self_attn.v_proj.weight': v}
    if rest == 'self_attention.linear_proj.weight':
        return {p + 'self_attn.o_proj.weight': _gather(value, 1, tp, tp_size)}
    if rest == 'mlp.linear_fc1.weight':
        gate, up = _gather_fc1(value, tp, tp_size)
        return {p + 'mlp.gate_proj.weight': gate, p + 'mlp.up_proj.weight': up}
    if rest == 'mlp.linear_fc2.weight':
        return {p + 'mlp.down_proj.weight': _gather(value, 1, tp, tp_size)}
    match = _EXPERT.fullmatch(rest)
    if match is None:
        raise CheckpointError(f'megatron parameter decoder.layers.*.{rest} has no Hugging Face counterpart')
    e = f'{p}mlp.experts.{s.ep_rank * s.local_experts + int(match.group(1))}.'
    if match.group(2) == 'linear_fc1':
        gate, up = _gather_fc1(value, groups['etp'], s.etp_size)
        return {e + 'gate_proj.weight': gate, e + 'up_proj.weight': up}
    return {e + 'down_proj.weight': _gather(value, 1, groups['etp'], s.etp_size)}


def _export_param(s: _Shards, name: str, value: torch.Tensor, groups: dict[str, Any]) -> dict[str, torch.Tensor]:
    match = _LAYER.fullmatch(name)
    if match is not None:
        return _export_layer(s, s.layer_index[int(match.group(1))], match.group(2), value, groups)
    if name == 'embedding.word_embeddings.weight':
        return {'model.embed_tokens.weight': _gather(value, 0, groups['tp'], s.tp_size)}
    if name == 'output_layer.weight':
        # With tied embeddings a last stage without the embedding holds a synchronised copy: not exported.
        return {} if s.tied else {'lm_head.weight': _gather(value, 0, groups['tp'], s.tp_size)}
    if name == 'decoder.final_layernorm.weight':
        return {'model.norm.weight': value}
    raise CheckpointError(f'megatron parameter {name} has no Hugging Face counterpart')


def _merge_over(group: Any, size: int, pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union of every rank's ``pieces`` over ``group`` (CPU tensors, through pickled objects)."""
    if size == 1:
        return pieces
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, pieces, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged


def _stack_experts(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors into transformers 5's stacks (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj``)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in hf.items():
        match = _HF_EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        layer, expert, kind = int(match.group(1)), int(match.group(2)), match.group(3)
        experts.setdefault(layer, {}).setdefault(expert, {})[kind] = tensor
    for layer, by_expert in experts.items():
        order = [by_expert[j] for j in sorted(by_expert)]
        p = f'model.layers.{layer}.mlp.experts.'
        out[p + 'gate_up_proj'] = torch.stack([torch.cat([e['gate_proj'], e['up_proj']]) for e in order])
        out[p + 'down_proj'] = torch.stack([e['down_proj'] for e in order])
    return out


def export_hf_state_dict(model: GPTModel, *, fused_experts: bool = True) -> dict[str, torch.Tensor]:
    """The whole Hugging Face tensors of ``model``, on every rank, on the CPU (a collective: every rank calls it).

    Gathered over tensor parallel (and expert tensor parallel), then merged over expert parallel and the
    pipeline stages. Names are ``Qwen3ForCausalLM``'s / ``Qwen3MoeForCausalLM``'s ``state_dict()`` names
    (experts stacked as transformers 5 holds them; ``fused_experts=False``: one by one, as hub checkpoints
    do); with tied embeddings only ``model.embed_tokens.weight``, as ``save_pretrained`` writes."""
    from megatron.core import parallel_state as ps

    s = _Shards(model)
    groups = {
        'tp': ps.get_tensor_model_parallel_group(),
        'etp': ps.get_expert_tensor_parallel_group(check_initialized=False),
    }
    dense: dict[str, torch.Tensor] = {}
    expert: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            for hf_name, tensor in _export_param(s, name, param.detach(), groups).items():
                target = expert if _HF_EXPERT.fullmatch(hf_name) else dense
                target[hf_name] = tensor.cpu().clone()
    expert = _merge_over(ps.get_expert_model_parallel_group(), s.ep_size, expert)
    merged = _merge_over(
        ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size(), dense | expert
    )
    return _stack_experts(merged) if fused_experts else merged


__all__ = [
    'ARCHITECTURES',
    'build_model',
    'check_sizes',
    'export_hf_state_dict',
    'hf_names',
    'layer_spec',
    'load_hf_state_dict',
    'transformer_config',
]
