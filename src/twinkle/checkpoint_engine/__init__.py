"""Weight sync from a trainer to a sampler."""

from twinkle.checkpoint_engine.manager import CheckpointEngineManager, StagedWeights, SyncResult

__all__ = ['CheckpointEngineManager', 'StagedWeights', 'SyncResult']
