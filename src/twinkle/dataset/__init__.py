"""Datasets: load, map, filter, encode, mix; stream from files (``IterableDataset``); pack (``PackingDataset``)."""

from twinkle.dataset.base import Dataset, DatasetMeta
from twinkle.dataset.packing import PackingDataset
from twinkle.dataset.streaming import IterableDataset, MixedStream, PackedStream

__all__ = ['Dataset', 'DatasetMeta', 'IterableDataset', 'MixedStream', 'PackedStream', 'PackingDataset']
