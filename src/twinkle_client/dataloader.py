"""The local DataLoader: batches are built on the client and sent with ``forward_backward``."""

from twinkle.dataloader import DataLoader

__all__ = ['DataLoader']
