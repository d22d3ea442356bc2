"""Datasets: load, map, filter, encode, mix; or stream from files (``IterableDataset``)."""

from twinkle.dataset.base import Dataset, DatasetMeta
from twinkle.dataset.streaming import IterableDataset

__all__ = ['Dataset', 'DatasetMeta', 'IterableDataset']
