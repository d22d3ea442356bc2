"""The DataLoader hands out batches of rows in a resumable order."""

from twinkle.dataloader.base import DataLoader
from twinkle.infra.ray import remote_class

# In ray mode, DataLoader(..., remote_group='model'): each rank yields its data shard; a batch is their concatenation.
remote_class(DataLoader, {'__iter__': ('all', 'flatten')})

__all__ = ['DataLoader']
