"""Per-row LoRA: one frozen base model, many named adapters, each row of a batch through its own.

peft applies one active adapter to the whole batch. Here every targeted ``nn.Linear`` becomes a
``MultiLoraLinear`` that keeps any number of adapters (own rank, alpha and target layers) and
adds, for each adapter present in the batch, its delta to that adapter's rows only::

    y = base(x);  y[rows_a] += dropout(x[rows_a]) @ A_a^T @ B_a^T * alpha_a / r_a   (Hu et al. 2021, eq. 3)

When each adapter's rows are contiguous (a mixed pass lays them out so), each run's delta is
added into its rows of one copy of the output (``lora_delta.add_run_deltas``); otherwise an
adapter's rows are gathered, multiplied and scatter-added back. Either way an adapter's gradient
comes only from its own rows, and a row's numbers do not depend on its neighbours.
Which row uses which adapter is set for the whole model by the ``row_adapters`` context.

Example::

    inject(model, {'alice': LoraSpec(r=8, alpha=16), 'bob': LoraSpec(r=4, alpha=8, target_modules=('q_proj',))})
    optimizers = {name: torch.optim.AdamW(adapter_parameters(model, name)) for name in ('alice', 'bob')}
    with row_adapters(model, ['alice', 'bob', None]):  # row 2 sees the base model only
        loss = model(input_ids).logits.sum()
        loss.backward()  # inside the context when gradient checkpointing recomputes layers
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from twinkle.errors import ConfigurationError, DataError, StateError, UnknownNameError, one_of
from twinkle.model.lora.adapter import LoraAdapter, LoraSpec, RowAssignment, check_name, check_spec
from twinkle.model.lora.delta import Run, add_run_deltas
from twinkle.model.lora.experts import (
    EXPERT_PARAMETERS,
    MultiLoraExperts,
    expert_stacks,
    is_fused_experts,
    peft_stack_prefix,
)
from twinkle.model.parallel.experts import ExpertShard

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus named LoRA adapters, applied per row by ``row_adapters``.

    The wrapped layer is ``base_layer``, as peft names it, so base-weight names map the same way."""

    def __init__(self, base: nn.Module):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ConfigurationError(f'MultiLoraLinear wraps an nn.Linear, got {type(base).__name__}')
        self.base_layer = base.requires_grad_(False)
        self.adapters = nn.ModuleDict()
        self.assignment: RowAssignment | None = None

    def add_adapter(self, name: str, spec: LoraSpec, generator: torch.Generator | None = None) -> LoraAdapter:
        check_name(name)
        if name in self.adapters:
            raise ConfigurationError(f'Adapter {name!r} already exists in this layer; remove it first')
        adapter = LoraAdapter(self.base_layer, spec, generator)
        self.adapters[name] = adapter
        return adapter

    def adapter(self, name: str) -> LoraAdapter:
        """Adapter ``name`` of this layer (the module dict holds only what ``add_adapter`` put there)."""
        return cast(LoraAdapter, self.adapters[name])

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise UnknownNameError('adapter', name, self.adapters.keys())
        del self.adapters[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, ..., in] -> [B, ..., out]; row b goes through ``assignment.names[b]`` (or
        [B * T, in], the batch flattened to tokens: token i through row i // T's adapter)."""
        assignment = self.assignment
        if assignment is None:
            raise StateError('MultiLoraLinear ran outside row_adapters(model, names): wrap the forward in it')
        assignment = assignment.over(x.shape[0])
        out: torch.Tensor = self.base_layer(x)
        if assignment.runs is not None:
            return self._by_runs(x, out, assignment.runs)
        for name, idx in assignment.rows_on(x.device).items():
            if name not in self.adapters:  # this adapter does not target this layer: base only
                continue
            adapter = self.adapters[name]
            if idx is None:  # the whole batch: no gather needed
                delta: torch.Tensor = adapter(x)
                out = out + delta.to(out.dtype)
            else:
                delta = adapter(x.index_select(0, idx))
                out = out.index_add(0, idx, delta.to(out.dtype))
        return out

    def _by_runs(self, x: torch.Tensor, out: torch.Tensor, runs: list[tuple[str | None, int, int]]) -> torch.Tensor:
        """Each run's delta added to its rows of one copy of the output (``add_run_deltas``)."""
        plan, weights = [], []
        for name, start, end in runs:
            if name is None or name not in self.adapters:
                continue
            adapter = self.adapter(name)
            plan.append(Run(start, end, adapter.scaling, adapter.active_dropout))
            weights += [adapter.lora_A.weight, adapter.lora_B.weight]
        return add_run_deltas(out, x, plan, weights) if plan else out

    def merged_stacks(self, name: str) -> dict[str, torch.Tensor]:
        """The layer's weight with adapter ``name`` merged in, by parameter name."""
        weight = self.base_layer.weight
        return {'weight': weight + self.adapter(name).delta_weight().to(weight.dtype)}

    def extra_repr(self) -> str:
        return f'adapters={list(self.adapters.keys())}'


#: A layer that holds adapters: a wrapped linear layer, or a wrapped experts module.
AdapterLayer = MultiLoraLinear | MultiLoraExperts


def multi_lora_layers(model: nn.Module) -> dict[str, AdapterLayer]:
    """Every layer holding adapters (``MultiLoraLinear``, ``MultiLoraExperts``) by its dotted path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, MultiLoraLinear | MultiLoraExperts)}


def adapter_names(model: nn.Module) -> list[str]:
    """The adapters held by any layer of ``model``, sorted."""
    return sorted({name for layer in multi_lora_layers(model).values() for name in layer.adapters})


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear | MultiLoraLinear]:
    """Candidate layers by path, in module order: plain linears and wrapped ones (not what is inside them)."""
    layers: dict[str, nn.Linear | MultiLoraLinear] = {}
    inside: str | None = None  # the wrapped layer whose children are being skipped
    for path, module in model.named_modules():
        if inside is not None and path.startswith(inside):
            continue
        if isinstance(module, MultiLoraLinear):
            layers[path], inside = module, f'{path}.'
        elif isinstance(module, MultiLoraExperts):
            inside = f'{path}.'
        elif isinstance(module, nn.Linear) and path:
            layers[path] = module
    return layers


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, 'get_output_embeddings', None)
    head = get() if callable(get) else None
    return head.base_layer if isinstance(head, MultiLoraLinear) else head


#: Submodules that hold a vision-language model's vision tower and its projector (Qwen-VL's
#: ``model.visual``, LLaVA's ``vision_tower`` and ``multi_modal_projector``, ...).
VISION_MODULES = frozenset({'visual', 'vision_tower', 'vision_model', 'multi_modal_projector', 'mm_projector'})


def is_vision_path(path: str) -> bool:
    """Whether a module path lies in a vision tower or its projector (``VISION_MODULES``)."""
    return not VISION_MODULES.isdisjoint(path.split('.'))


def has_vision_tower(model: nn.Module) -> bool:
    """Whether ``model`` holds a vision tower (a module named in ``VISION_MODULES``)."""
    return any(path.rsplit('.', 1)[-1] in VISION_MODULES for path, _ in model.named_modules())


def resolve_targets(model: nn.Module, target_modules: tuple[str, ...] | str) -> list[str]:
    r"""Paths of the linear layers ``target_modules`` names (see ``LoraSpec``), in module order.

    ``'all-linear'`` is every linear layer of the language model: not the output head, and on a
    vision-language model not the vision tower or its merger (``VISION_MODULES``), which stay
    frozen as the pretrained encoder they are (peft's own 'all-linear' adapts those too). To adapt
    the tower, name its layers: a pattern (``r'model\.visual\..*'``, or ``r'.*(q_proj|...|qkv)'``
    for both) or leaf names (``['qkv', 'proj', 'linear_fc1', 'linear_fc2']`` on Qwen's tower); the
    saved adapter lists the exact layers, so plain peft loads it the same either way."""
    layers = _linear_layers(model)
    if target_modules == 'all-linear':
        head = _output_head(model)
        paths = [
            p
            for p, m in layers.items()
            if m is not head and getattr(m, 'base_layer', None) is not head and not is_vision_path(p)
        ]
        if not paths:
            raise ConfigurationError('target_modules="all-linear" found no linear layer besides the output head')
        return paths
    if isinstance(target_modules, str):
        paths = [p for p in layers if re.fullmatch(target_modules, p)]
        if not paths:
            raise ConfigurationError(f'target_modules pattern {target_modules!r} matches no linear layer path')
        return paths
    if not target_modules:
        raise ConfigurationError(
            'target_modules is empty: give layer names, a pattern or "all-linear" (or target_parameters for experts)'
        )
    for target in target_modules:
        if not any(p == target or p.endswith(f'.{target}') for p in layers):
            leaves = sorted({p.rsplit('.', 1)[-1] for p in layers})
            raise ConfigurationError(f'target_modules entry {target!r} matches no linear layer; leaves: {leaves}')
    return [p for p in layers if any(p == t or p.endswith(f'.{t}') for t in target_modules)]


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The fused-experts modules of ``model`` (plain or wrapped) by path."""
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if isinstance(module, MultiLoraExperts) or (is_fused_experts(module) and not path.endswith('.base_layer')):
            found[path] = module
    return found


def resolve_expert_targets(model: nn.Module, spec: LoraSpec) -> dict[str, list[str]]:
    """The expert stacks ``spec`` adapts, by experts module path: all of them under 'all-linear',
    else those ``spec.target_parameters`` names (each entry must name some)."""
    modules = experts_modules(model)
    all_linear = spec.target_modules == 'all-linear'
    targets = {path: expert_stacks(spec, path, all_linear) for path in modules}
    for target in spec.target_parameters:
        if not any(expert_stacks(LoraSpec(1, 1.0, target_parameters=(target,)), path, False) for path in modules):
            stacks = expert_target_parameters(model) or 'none: the model has no fused experts'
            raise ConfigurationError(f'target_parameters entry {target!r} matches no expert stack; stacks: {stacks}')
    return {path: stacks for path, stacks in targets.items() if stacks}


def _wrap(model: nn.Module, path: str, kind: type[AdapterLayer]) -> AdapterLayer:
    module = model.get_submodule(path)
    if isinstance(module, kind):
        return module
    parent_path, _, leaf = path.rpartition('.')
    wrapped = kind(module)
    setattr(model.get_submodule(parent_path), leaf, wrapped)
    return wrapped


def shard_experts(model: nn.Module, ep_size: int, ep_rank: int, group: Any) -> int:
    """Expert parallel: every fused-experts module keeps experts ``ep_rank``'s share of them
    (``ExpertShard``), wrapped as a ``MultiLoraExperts`` that stays so without adapters too.
    Returns how many modules were sharded (0 on a dense model)."""
    paths = list(experts_modules(model))
    for path in paths:
        layer = cast(MultiLoraExperts, _wrap(model, path, MultiLoraExperts))
        layer.shard_experts(ExpertShard(layer.shard.num_experts, ep_size, ep_rank, group))
    return len(paths)


def freeze_base(model: nn.Module) -> None:
    """Every parameter that is not an adapter's stops requiring gradients."""
    adapter_params = {id(p) for layer in multi_lora_layers(model).values() for p in layer.adapters.parameters()}
    for param in model.parameters():
        if id(param) not in adapter_params:
            param.requires_grad_(False)


def add_adapter(model: nn.Module, name: str, spec: LoraSpec, generator: torch.Generator | None = None) -> list[str]:
    """Add adapter ``name`` to the layers ``spec.target_modules`` names, wrapping them as needed,
    and freeze the base model. Returns the adapted layer paths. Nothing changes on error."""
    check_name(name)
    check_spec(spec)
    if name in adapter_names(model):
        raise ConfigurationError(f'Adapter {name!r} already exists; remove_adapter(model, {name!r}) first')
    experts = resolve_expert_targets(model, spec)
    paths = [] if experts and not spec.target_modules else resolve_targets(model, spec.target_modules)
    for path in paths:
        cast(MultiLoraLinear, _wrap(model, path, MultiLoraLinear)).add_adapter(name, spec, generator)
    for path, stacks in experts.items():
        cast(MultiLoraExperts, _wrap(model, path, MultiLoraExperts)).add_adapter(name, spec, stacks, generator)
    freeze_base(model)
    return [*paths, *experts]


def inject(
    model: nn.Module, specs: Mapping[str, LoraSpec], generator: torch.Generator | None = None
) -> dict[str, list[str]]:
    """``add_adapter`` for each named spec; returns each adapter's layer paths."""
    return {name: add_adapter(model, name, spec, generator) for name, spec in specs.items()}


def remove_adapter(model: nn.Module, name: str) -> None:
    """Drop adapter ``name`` from every layer; layers left with no adapter become what they were again."""
    layers = multi_lora_layers(model)
    holders = {path: layer for path, layer in layers.items() if name in layer.adapters}
    if not holders:
        raise UnknownNameError('adapter', name, adapter_names(model))
    for path, layer in holders.items():
        layer.remove_adapter(name)
        if not layer.adapters and not (isinstance(layer, MultiLoraExperts) and layer.shard.ep_size > 1):
            parent_path, _, leaf = path.rpartition('.')
            setattr(model.get_submodule(parent_path), leaf, layer.base_layer)


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The parameters of adapter ``name`` (A then B, layer by layer), e.g. for its own optimizer."""
    return list(adapter_named_parameters(model, name).values())


def adapter_named_parameters(model: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """Adapter ``name``'s parameters by their names in ``model.named_parameters()``
    ('<layer path>.adapters.<name>.lora_A.weight' and '.lora_B.weight'; on an experts module
    '<path>.adapters.<name>.<stack>.lora_A.weight')."""
    params = {
        f'{path}.adapters.{name}.{pname}': param
        for path, layer in multi_lora_layers(model).items()
        if name in layer.adapters
        for pname, param in layer.adapters[name].named_parameters()
    }
    if not params:
        raise UnknownNameError('adapter', name, adapter_names(model))
    return params


def assign_rows(model: nn.Module, names: Sequence[str | None] | str | None) -> RowAssignment:
    """From now on, row ``i`` of every batch through ``model`` uses adapter ``names[i]``
    (``None``: the base model only); a single name (or None) applies to every row. The
    assignment stays until the next call, so a backward that recomputes layers (gradient
    checkpointing) sees the rows its forward saw."""
    if not (names is None or isinstance(names, Sequence)):
        raise DataError(f'row_adapters takes one adapter name (or None) per row, or one for all; got {names!r}')
    known = set(adapter_names(model))
    for name in [names] if names is None or isinstance(names, str) else names:
        if name is not None and name not in known:
            raise UnknownNameError('adapter', name, known)
    layers = multi_lora_layers(model).values()
    assignment = RowAssignment.from_names(names)
    assignment.place({param.device for layer in layers for param in itertools.islice(layer.parameters(), 1)})
    for layer in layers:
        layer.assignment = assignment
    return assignment


@contextmanager
def row_adapters(model: nn.Module, names: Sequence[str | None] | str | None) -> Iterator[RowAssignment]:
    """``assign_rows`` within the block; the assignment before it is restored on exit."""
    layers = multi_lora_layers(model)
    previous = {path: layer.assignment for path, layer in layers.items()}
    try:
        yield assign_rows(model, names)
    finally:
        for path, before in previous.items():
            layers[path].assignment = before


# ---- peft interoperability ----------------------------------------------------------------------
#: Prefix of every key in a peft adapter file (``adapter_model.safetensors``).
PEFT_PREFIX = 'base_model.model.'


def peft_key(param_name: str, name: str) -> str:
    """The key peft files use for one of adapter ``name``'s linear-layer parameters (a name from
    ``adapter_named_parameters``): '<path>.adapters.<name>.lora_A.weight' -> 'base_model.model.<path>.lora_A.weight'."""
    path, marker, rest = param_name.partition(f'.adapters.{name}.')
    if not marker:
        raise ConfigurationError(f'{param_name!r} is not a parameter of adapter {name!r}')
    return f'{PEFT_PREFIX}{path}.{rest}'


def peft_keys(model: nn.Module, name: str) -> dict[str, str]:
    """Adapter ``name``'s parameter names -> the keys peft files use for them. Expert stacks are
    keyed as peft's nested ``ParamWrapper`` s save them ('<path>.base_layer.lora_A.weight' for the
    inner stack)."""
    keys: dict[str, str] = {}
    for path, layer in multi_lora_layers(model).items():
        if name not in layer.adapters:
            continue
        prefix = f'{path}.adapters.{name}.'
        if isinstance(layer, MultiLoraLinear):
            keys |= {f'{prefix}{p}': peft_key(f'{prefix}{p}', name) for p, _ in layer.adapters[name].named_parameters()}
            continue
        stacks = list(layer.adapter_stacks(name))
        for stack, adapter in layer.adapter_stacks(name).items():
            nested = peft_stack_prefix(stacks, stack)
            keys |= {f'{prefix}{stack}.{p}': f'{PEFT_PREFIX}{path}.{nested}{p}' for p, _ in adapter.named_parameters()}
    if not keys:
        raise UnknownNameError('adapter', name, adapter_names(model))
    return keys


def peft_state_dict(
    model: nn.Module, name: str, weights: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s tensors keyed as peft saves them (``PeftModel.from_pretrained`` loads
    them); ``weights`` replaces the model's own tensors by parameter name (gathered shards)."""
    params = adapter_named_parameters(model, name)
    return {key: (weights or {}).get(pname, params[pname]) for pname, key in peft_keys(model, name).items()}


def load_peft_state_dict(model: nn.Module, name: str, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a peft adapter file's tensors into adapter ``name``. Every parameter must be there
    with its shape; keys for layers the adapter does not have are an error too."""
    named = adapter_named_parameters(model, name)
    params = {key: named[pname] for pname, key in peft_keys(model, name).items()}
    state = {_without_adapter_name(key, name): tensor for key, tensor in state.items()}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ConfigurationError(
            f'the weights do not fit adapter {name!r}: {len(missing)} missing (e.g. {missing[:1]}), '
            f'{len(unexpected)} unexpected (e.g. {unexpected[:1]})'
        )
    with torch.no_grad():
        for key, param in params.items():
            if param.shape != state[key].shape:
                raise ConfigurationError(f'weight {key!r} has shape {tuple(state[key].shape)}; expected {param.shape}')
            param.copy_(state[key])


def _without_adapter_name(key: str, name: str) -> str:
    """Keys saved with the adapter's name in them ('.lora_A.<name>.weight') as peft files hold them."""
    return key.replace(f'.lora_A.{name}.', '.lora_A.').replace(f'.lora_B.{name}.', '.lora_B.')


#: ``LoraConfig`` fields left at a value other than this are features these layers do not have.
_UNSUPPORTED_LORA = {
    'bias': 'none',
    'fan_in_fan_out': False,
    'modules_to_save': None,
    'layers_to_transform': None,
    'use_dora': False,
    'exclude_modules': None,
    'rank_pattern': {},
    'alpha_pattern': {},
}


def spec_from_peft(config: Any, model: nn.Module) -> LoraSpec:
    """The ``LoraSpec`` of a peft ``LoraConfig``; other PEFT methods and LoRA options these
    layers do not implement are refused by name."""
    if type(config).__name__ != 'LoraConfig':
        raise ConfigurationError(f'only LoRA adapters are supported; got a {type(config).__name__}')
    for field_name, default in _UNSUPPORTED_LORA.items():
        value = getattr(config, field_name, default)
        if value != default and not (default is None and not value):
            raise ConfigurationError(f'LoraConfig({field_name}={value!r}) is not supported; leave it at {default!r}')
    init = {True: 'kaiming', 'gaussian': 'gaussian', False: 'random'}.get(config.init_lora_weights)
    if init is None:
        raise one_of('LoraConfig init_lora_weights', config.init_lora_weights, [True, False, 'gaussian'])
    target_parameters = tuple(sorted(getattr(config, 'target_parameters', None) or ()))
    linear_targets = () if config.target_modules is None and target_parameters else config.target_modules
    return LoraSpec(
        r=config.r,
        alpha=config.lora_alpha,
        target_modules=_peft_targets(linear_targets, model),
        target_parameters=target_parameters,
        dropout=config.lora_dropout,
        init=init,
        use_rslora=config.use_rslora,
    )


def _peft_targets(targets: Any, model: nn.Module) -> tuple[str, ...] | str:
    """peft's ``target_modules``: a list, a pattern, 'all-linear', or None for the model type's default."""
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        model_type = getattr(getattr(model, 'config', None), 'model_type', None)
        if model_type not in DEFAULTS:
            raise ConfigurationError(f'give LoraConfig(target_modules=...): no default is known for {model_type!r}')
        return tuple(DEFAULTS[model_type])
    if isinstance(targets, str):
        return targets
    return tuple(sorted(targets))


#: Module names LoRA attaches to for each block kind (attention, MLP), by the parent module's name.
ATTENTION_PARENTS = ('self_attn', 'attn', 'attention', 'linear_attn')
MLP_PARENTS = ('mlp', 'feed_forward', 'experts', 'shared_expert')


def lora_targets(model: PreTrainedModel, attn: bool, mlp: bool, unembed: bool) -> list[str]:
    """Leaf names of the linear layers under attention blocks, MLP blocks, and the output head
    (a layer another adapter already wraps counts by the wrapper's name)."""
    # transformers leaves get_output_embeddings unannotated: it returns the output head module.
    head = cast(Callable[[], torch.nn.Module | None], model.get_output_embeddings)()
    head_leaf = next(name for name, module in model.named_modules() if module is head).split('.')[-1]
    names: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or 'lora_' in name:
            continue
        *parents, leaf = name.split('.')
        if leaf == 'base_layer':
            *parents, leaf = parents
        in_attention = any(p in ATTENTION_PARENTS for p in parents)
        in_mlp = any(p in MLP_PARENTS for p in parents)
        if unembed if leaf == head_leaf else (attn and in_attention) or (mlp and in_mlp):
            names.add(leaf)
    return sorted(names)


def adapter_expert_stacks(model: nn.Module, name: str) -> list[str]:
    """The expert stacks adapter ``name`` adapts, as peft's ``target_parameters`` names them
    ('<experts module path>.<stack>')."""
    return [
        f'{path}.{stack}'
        for path, layer in multi_lora_layers(model).items()
        if isinstance(layer, MultiLoraExperts) and name in layer.adapters
        for stack in layer.adapter_stacks(name)
    ]


def expert_target_parameters(model: nn.Module) -> list[str]:
    """peft ``target_parameters`` naming every expert stack of ``model`` ('mlp.experts.gate_up_proj',
    ...: the experts module's last two path parts and the stack); [] for a dense model."""
    names = {
        f'{".".join(path.split(".")[-2:])}.{stack}': None
        for path in experts_modules(model)
        for stack in EXPERT_PARAMETERS
    }
    return list(names)


def adapter_linear_paths(model: nn.Module, name: str) -> list[str]:
    """The paths of the linear layers adapter ``name`` adapts."""
    return [
        path
        for path, layer in multi_lora_layers(model).items()
        if isinstance(layer, MultiLoraLinear) and name in layer.adapters
    ]
