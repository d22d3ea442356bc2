from __future__ import annotations

from typing import Any

import torch

from twinkle.loss.base import LossOutput
from twinkle.metric.base import METRICS, Metric


@METRICS.register
class ExpertLoad(Metric):
    """A mixture of experts' load since the last reset, from the tokens the model routed to each
    expert (``outputs['expert_tokens']``, [layers, experts]): ``expert_imbalance/layer_<i>`` is
    layer i's busiest expert's tokens over the mean (1: even), ``expert_imbalance`` the largest
    of them, and ``router_aux_loss`` the mean load-balancing loss where training adds it.
    ``tokens_per_expert`` holds the counts."""

    tokens_per_expert: torch.Tensor | None
    aux_total: torch.Tensor | float
    aux_calls: int

    def __init__(self) -> None:
        self.reset()

    def reads_logits(self) -> bool:
        return False

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        tokens = outputs.get('expert_tokens')
        if tokens is None:
            return
        self.tokens_per_expert = tokens if self.tokens_per_expert is None else self.tokens_per_expert + tokens
        aux = outputs.get('router_aux_loss')
        if aux is not None:
            self.aux_total, self.aux_calls = self.aux_total + aux.detach().float(), self.aux_calls + 1

    def calculate(self) -> dict[str, float]:
        if self.tokens_per_expert is None:
            return {}
        counts = self.tokens_per_expert.double().cpu()
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)
        result = {f'expert_imbalance/layer_{i}': float(value) for i, value in enumerate(imbalance)}
        result['expert_imbalance'] = float(imbalance.max())
        if self.aux_calls:
            result['router_aux_loss'] = float(self.aux_total) / self.aux_calls
        return result

    def reset(self) -> None:
        self.tokens_per_expert = None
        self.aux_total = 0.0
        self.aux_calls = 0

    def state(self) -> dict[str, Any]:
        tokens = None if self.tokens_per_expert is None else self.tokens_per_expert.cpu().tolist()
        return {'tokens': tokens, 'aux_total': float(self.aux_total), 'aux_calls': self.aux_calls}

    def merge(self, state: dict[str, Any]) -> None:
        if state['tokens'] is not None:
            tokens = torch.tensor(state['tokens'], dtype=torch.long)
            mine = self.tokens_per_expert
            self.tokens_per_expert = tokens if mine is None else mine.cpu() + tokens
        self.aux_total = float(self.aux_total) + state['aux_total']
        self.aux_calls += state['aux_calls']
