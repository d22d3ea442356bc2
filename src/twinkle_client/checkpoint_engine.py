"""``CheckpointEngineManager`` for a run on a server: the local API's weight sync, by name.

On a server whose model has a sampler group of its own (``sampler:`` in its config), a run's
sampler sees the run's weights as of its last sync; ``sync_weights()`` makes that now: the
server saves the adapter's tensors for sampling (only the adapter crosses to the sampler) and
the next samples carry the new ``weight_version`` (the run's optimizer step). On a server
without one the sampler reads the trainer's weights directly and a sync changes nothing it
samples, so the same loop runs against both.

Example::

    manager = CheckpointEngineManager(model, sampler)   # twinkle_client model and sampler
    for batch in dataloader:
        manager.sync_weights()
        responses = sampler.sample(batch, params)
        ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from twinkle.errors import ConfigurationError, DataError
from twinkle_client.client import PREFIX
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import TorchSampler


@dataclass
class SyncResult:
    """What one ``sync_weights`` made: the weights' version, where they are, how long it took."""

    weight_version: int
    path: str
    seconds: float


class CheckpointEngineManager:
    """Keeps a server-side sampler's view of a run equal to the run's weights, on request."""

    def __init__(self, model: MultiLoraTransformersModel, sampler: TorchSampler | None = None):
        if not isinstance(model, MultiLoraTransformersModel):
            raise ConfigurationError(f'model must be a twinkle_client MultiLoraTransformersModel; got {model!r}')
        self.model, self.sampler = model, sampler

    def sync_weights(self, merge_and_sync: bool = True, *, adapter_name: str | None = None) -> SyncResult:
        """Save the run's adapter for its sampler. ``merge_and_sync`` is kept for parity with
        the local manager: the server always sends the adapter alone, never merged weights."""
        started = time.perf_counter()
        run_id = self.model._run(adapter_name)
        answer = self.model.client.call(f'{PREFIX}/runs/{run_id}/sync_sampler', {})
        version = answer.get('weight_version') if isinstance(answer, dict) else None
        if not isinstance(answer, dict) or not isinstance(version, int):
            raise DataError(f'the server answered a sampler sync with {answer!r}')
        return SyncResult(version, str(answer['path']), time.perf_counter() - started)


__all__ = ['CheckpointEngineManager', 'SyncResult']
