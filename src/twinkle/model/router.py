"""A mixture of experts' router: its load-balancing loss and the experts' load.

transformers' MoE models return each layer's router logits when asked
(``output_router_logits=True``), and their own ``load_balancing_loss_func`` turns them into the
auxiliary loss of Switch Transformers (Fedus et al. 2021, eq. 4): the number of experts times
the sum over experts of (share of tokens routed there) x (mean router probability there),
which is 1 when the load is even. Here the logits are kept per row ([layers, rows, positions,
experts]), so a mixed pass gives each adapter the loss of its own rows, as a pass of its own
would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from twinkle.errors import ConfigurationError, DataError, StateError


@dataclass(frozen=True)
class Router:
    """What a model's router needs: its experts, the experts a token goes to, and the loss
    coefficient (0: the auxiliary loss is not added)."""

    num_experts: int
    top_k: int
    aux_loss_coef: float


def model_router(config: object, aux_loss_coef: float | None = None) -> Router | None:
    """The router of a model with this transformers ``config``, None for a dense model;
    ``aux_loss_coef`` overrides the config's ``router_aux_loss_coef``."""
    get_text_config = getattr(config, 'get_text_config', None)
    config = get_text_config() if callable(get_text_config) else config  # Qwen3.5-MoE's is composite
    experts = getattr(config, 'num_experts', None) or getattr(config, 'num_local_experts', None)
    top_k = getattr(config, 'num_experts_per_tok', None)
    if not experts or not top_k or not hasattr(config, 'output_router_logits'):
        if aux_loss_coef:
            raise ConfigurationError(
                f'router_aux_loss_coef={aux_loss_coef} needs a mixture of experts; this model is dense'
            )
        return None
    coef = getattr(config, 'router_aux_loss_coef', 0.0) if aux_loss_coef is None else aux_loss_coef
    if not coef >= 0:
        raise ConfigurationError(f'router_aux_loss_coef must be a number >= 0; got {coef!r}')
    return Router(int(experts), int(top_k), float(coef))


def per_row(router_logits: tuple[torch.Tensor, ...], rows: int) -> torch.Tensor:
    """Each layer's [rows * positions, experts] logits as one [layers, rows, positions, experts]."""
    return torch.stack([logits.reshape(rows, -1, logits.shape[-1]) for logits in router_logits])


def aux_loss(router: Router, logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The load-balancing loss of these rows (``logits`` [layers, rows, positions, experts]),
    padding left out by ``attention_mask`` [rows, positions]."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layers = tuple(layer.reshape(-1, router.num_experts) for layer in logits)
    return torch.as_tensor(load_balancing_loss_func(layers, router.num_experts, router.top_k, attention_mask))


def expert_tokens(router: Router, logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Tokens routed to each expert of each layer ([layers, experts]; a token counts once for
    each of its top-k experts), padding left out."""
    layers = logits.shape[0]
    chosen = logits.topk(router.top_k, dim=-1).indices  # [layers, rows, positions, k]
    if attention_mask is not None:
        chosen = chosen[attention_mask.bool()[None, :, :, None].expand_as(chosen)]
    chosen = chosen.reshape(layers, -1)
    counts = torch.zeros(layers, router.num_experts, dtype=torch.long, device=logits.device)
    return counts.scatter_add_(1, chosen, torch.ones_like(chosen))


# ---- routing replay -------------------------------------------------------------------------------
# A sampler and a trainer that run the same weights still differ in float rounding (another
# batch shape, a KV cache, another kernel, bf16), and where two experts' router scores are close
# the top-k can flip: the token then goes through other experts and its logprob moves far more
# than rounding would move it on a dense model. Routing replay (the reference's "router replay";
# Ma et al. 2025, "Rollout Routing Replay") records which experts the sampler chose for every
# token of every MoE layer and makes the trainer's forward choose the same. The experts' weights
# are still the trainer's own router probabilities at those experts (normalised as the router
# normalises), so the router keeps its gradient.

#: No recorded routing at this token and layer: the trainer's router chooses.
NOT_RECORDED = -1


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of ``model``'s MoE layers, in layer order: the ``gate`` of every block that
    holds fused experts (wrapped with adapters or not)."""
    from twinkle.model.lora.experts import MultiLoraExperts, is_fused_experts

    gates = []
    for module in model.modules():
        experts, gate = getattr(module, 'experts', None), getattr(module, 'gate', None)
        fused = isinstance(experts, MultiLoraExperts) or (experts is not None and is_fused_experts(experts))
        if fused and isinstance(gate, torch.nn.Module):
            gates.append(gate)
    return gates


def _router_output(gate: torch.nn.Module, output: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A transformers top-k router's ``(logits [N, E], weights [N, K], experts [N, K])``."""
    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output)):
        raise ConfigurationError(
            f'{type(gate).__name__} does not return (logits, weights, experts) as transformers 5 top-k routers do; '
            'routing cannot be recorded or replayed on this model'
        )
    return output[0], output[1], output[2]


def routed_weights(gate: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The weights a top-k router gives ``experts`` [N, K]: the softmax over all experts at those
    experts, normalised over the K when the router does (``norm_topk_prob``, on unless it says)."""
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if getattr(gate, 'norm_topk_prob', True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


class RoutingRecorder:
    """Records the experts every MoE layer's router chooses, call by call.

    >>> with RoutingRecorder(model) as recorder:  # doctest: +SKIP
    ...     model(input_ids=ids)
    ...     experts = recorder.take()  # [layers, N, K] for the call's N tokens
    """

    def __init__(self, model: torch.nn.Module):
        self.gates = moe_gates(model)
        if not self.gates:
            raise ConfigurationError(f'{type(model).__name__} has no mixture-of-experts router to record')
        self._calls: list[torch.Tensor] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RoutingRecorder:
        for gate in self.gates:
            self._handles.append(gate.register_forward_hook(self._record))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _record(self, gate: torch.nn.Module, inputs: object, output: object) -> None:
        self._calls.append(_router_output(gate, output)[2].detach())

    def take(self) -> torch.Tensor:
        """The experts of the forward since the last ``take``: [layers, N, K]."""
        if len(self._calls) != len(self.gates):
            raise StateError(f'{len(self._calls)} router calls recorded for {len(self.gates)} MoE layers')
        calls, self._calls = self._calls, []
        return torch.stack(calls)


@contextmanager
def replay_routing(model: torch.nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the MoE layers of ``model`` route each token to the experts recorded in
    ``experts`` ([rows, positions, layers, K], as the batch's tokens; ``NOT_RECORDED`` where the
    router is to choose). ``None``: nothing changes."""
    if experts is None:
        yield
        return
    gates = moe_gates(model)
    if experts.shape[2] != len(gates):
        raise DataError(f'routed_experts holds {experts.shape[2]} MoE layers per token; the model has {len(gates)}')
    flat = experts.reshape(-1, *experts.shape[2:])  # [tokens, layers, K]
    # Prepended: hooks that look at a router's output (a ``RoutingRecorder``) see the replayed routing.
    hooks = [(gate, _replay_hook(flat[:, layer])) for layer, gate in enumerate(gates)]
    handles = [gate.register_forward_hook(hook, prepend=True) for gate, hook in hooks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


#: A top-k router's output: ``(logits [N, E], weights [N, K], experts [N, K])``.
RouterOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _replay_hook(recorded: torch.Tensor) -> Callable[[torch.nn.Module, object, object], RouterOutput]:
    def hook(gate: torch.nn.Module, inputs: object, output: object) -> RouterOutput:
        logits, weights, chosen = _router_output(gate, output)
        if recorded.shape != chosen.shape:
            raise DataError(
                f'routed_experts gives {tuple(recorded.shape)} (tokens, top-k) to a layer that routes '
                f'{tuple(chosen.shape)}: record the routing of these very rows'
            )
        if not torch.allclose(routed_weights(gate, logits, chosen), weights, rtol=1e-4, atol=1e-6):
            raise ConfigurationError(f'{type(gate).__name__} weighs its experts in a way routing replay does not know')
        replayed = recorded.to(chosen.device)
        if replayed.numel() and (int(replayed.max()) >= logits.shape[-1] or int(replayed.min()) < NOT_RECORDED):
            raise DataError(f'routed_experts names experts outside [0, {logits.shape[-1]}) (or -1: not recorded)')
        here = (replayed != NOT_RECORDED).all(dim=-1, keepdim=True)
        experts = torch.where(here, replayed, chosen)
        return logits, routed_weights(gate, logits, experts), experts

    return hook
