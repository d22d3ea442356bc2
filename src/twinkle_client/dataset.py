"""Datasets are prepared where the client runs (the server never reads the client's files) and
their encoded rows travel with each request: the local classes, under the client's names."""

from twinkle.dataset import Dataset, DatasetMeta

__all__ = ['Dataset', 'DatasetMeta']
