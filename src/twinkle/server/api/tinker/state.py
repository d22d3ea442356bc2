"""``TinkerState``: what the Tinker routes keep between requests, beside the service's store and
scheduler: the settings, the per-model ``seq_id`` order, and the request ids answered so far
(so a retried ``(model_id, seq_id)`` gets the id it got the first time)."""

from __future__ import annotations

from collections import OrderedDict

from twinkle.server.config import TinkerSettings
from twinkle.server.execution.scheduling.sequencer import Sequencer


class TinkerState:
    """Built once per service as ``TinkerState(config.tinker)``."""

    def __init__(self, settings: TinkerSettings):
        self.settings = settings
        self.sequencer = Sequencer(settings.seq_gap_timeout_s)
        #: (tenant, model id, seq id) -> request id, for retries; the oldest are forgotten past a cap.
        self.requests: OrderedDict[tuple[str, str, int], str] = OrderedDict()


__all__ = ['TinkerState']
