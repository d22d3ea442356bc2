from __future__ import annotations

from typing import Any

from twinkle.metric.base import METRICS, Metric


@METRICS.register
class TrainMetric(Metric):
    """Optimizer-side figures: ``lr``, ``grad_norm`` (before clipping) of the last step,
    ``steps`` taken, ``tokens``: input tokens trained on since the last reset, and ``tokens_per_s``:
    those tokens over the seconds spent in the model's forward, backward and step calls (data
    loading excluded)."""

    def __init__(self) -> None:
        self.lr: float | None = None
        self.grad_norm: float | None = None
        self.steps = 0
        self.reset()

    def reads_logits(self) -> bool:
        return False

    def accumulate(
        self,
        *,
        num_tokens: int = 0,
        elapsed_s: float = 0.0,
        lr: float | None = None,
        grad_norm: float | None = None,
        stepped: bool = False,
    ) -> None:
        self.tokens += num_tokens
        self.seconds += elapsed_s
        if lr is not None:
            self.lr = lr
        if grad_norm is not None:
            self.grad_norm = grad_norm
        self.steps += int(stepped)

    def calculate(self) -> dict[str, float]:
        result: dict[str, float] = {'steps': float(self.steps), 'tokens': float(self.tokens)}
        if self.lr is not None:
            result['lr'] = self.lr
        if self.grad_norm is not None:
            result['grad_norm'] = self.grad_norm
        if self.seconds > 0:
            result['tokens_per_s'] = self.tokens / self.seconds
        return result

    def reset(self) -> None:
        self.tokens = 0
        self.seconds = 0.0

    def state(self) -> dict[str, Any]:
        return {'tokens': self.tokens, 'seconds': self.seconds}

    def merge(self, state: dict[str, Any]) -> None:
        """Ranks work side by side: their tokens add up over the slowest one's seconds. ``lr``,
        ``grad_norm`` and ``steps`` are the same on every rank (the gradient is reduced first)."""
        self.tokens += state['tokens']
        self.seconds = max(self.seconds, state['seconds'])
