"""Datasets: load, map, filter, encode, mix."""

from twinkle.dataset.base import Dataset, DatasetMeta

__all__ = ['Dataset', 'DatasetMeta']
