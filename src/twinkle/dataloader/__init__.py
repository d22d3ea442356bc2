"""The DataLoader hands out batches of rows in a resumable order."""

from twinkle.dataloader.base import DataLoader

__all__ = ['DataLoader']
