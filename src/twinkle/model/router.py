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

from dataclasses import dataclass

import torch

from twinkle.errors import ConfigurationError


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
