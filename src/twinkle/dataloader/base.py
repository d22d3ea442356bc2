"""Batches of rows, in a seeded order that a resumed run reproduces.

A batch is a list of rows (dicts); the model collates them. Each pass over the loader is one
epoch; the order of epoch ``e`` is a permutation seeded with ``data_seed + e``, independent of
the global random state, so skipping ``consumed_train_samples`` after a restart lands on exactly
the rows the interrupted run would have seen next.

With a device mesh of several data ranks (torchrun), ``batch_size`` is the global batch: every
rank walks the same order and takes its contiguous slice of each batch, so the ranks together
see exactly what one process with the whole batch would. The state (``consumed_train_samples``)
counts global samples, and is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from twinkle.dataloader.stream import StreamBatches
from twinkle.dataset import Dataset
from twinkle.dataset.streaming import IterableDataset, MixedStream, PackedStream, Stream
from twinkle.errors import ConfigurationError, DataError, StateError
from twinkle.infra import distributed
from twinkle.infra.mesh import DeviceMesh
from twinkle.infra.runtime import get_runtime


class DataLoader:
    """Example::

        dataloader = DataLoader(dataset, batch_size=8, shuffle=True)
        for batch in dataloader:          # one epoch
            model.forward_backward(inputs=batch)
        state = dataloader.get_state()    # {'consumed_train_samples': ..., 'epoch': ...}

    ``min_batch_size``: a last batch smaller than this is dropped (``drop_last=True`` is
    ``min_batch_size=batch_size``). ``dataset`` may also be a function that builds the dataset.

    ``device_mesh`` (default: the runtime's ``global_device_mesh``): with ``dp_world_size``
    data ranks, ``batch_size`` is the global batch and must divide by ``dp_world_size``; this
    process gets rows ``[r * b, (r + 1) * b)`` of each batch, ``r`` its data rank and
    ``b = batch_size / dp_world_size``. A last batch is split as evenly as it goes, and dropped
    when it has fewer rows than data ranks (every rank must take part in each step).
    """

    def __init__(
        self,
        dataset: Dataset | Sequence[dict[str, Any]] | Callable[[], Dataset],
        *,
        batch_size: int,
        min_batch_size: int | None = None,
        shuffle: bool = False,
        data_seed: int = 0,
        drop_last: bool = False,
        device_mesh: DeviceMesh | None = None,
        num_workers: int = 0,
    ):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ConfigurationError(f'batch_size must be a positive integer; got {batch_size!r}')
        self.device_mesh = device_mesh if device_mesh is not None else get_runtime().global_device_mesh
        self.data_world_size, self.data_rank = _data_position(self.device_mesh, batch_size)
        self.batch_size = batch_size
        #: Batches of a stream (an ``IterableDataset``), read by ``num_workers`` processes; None for a table.
        self.stream: StreamBatches | None = None
        self.dataset: Dataset | Sequence[dict[str, Any]] | Stream
        if isinstance(dataset, (IterableDataset, MixedStream, PackedStream)):
            if shuffle:
                raise ConfigurationError('a stream (IterableDataset) is read in order: shuffle=True needs a Dataset')
            self.dataset = dataset
            local = batch_size // self.data_world_size
            if min_batch_size is not None and not 0 < min_batch_size <= batch_size:
                raise ConfigurationError(
                    f'min_batch_size must be in [1, batch_size={batch_size}]; got {min_batch_size!r}'
                )
            # Each shard's batches: a last one with fewer rows than this rank's share of the minimum is dropped.
            min_rows = local if drop_last else -(-(min_batch_size or 1) // self.data_world_size)
            self.stream = StreamBatches(
                dataset,
                local_batch=local,
                data_world=self.data_world_size,
                data_rank=self.data_rank,
                num_workers=num_workers,
                min_rows=min_rows,
            )
            return
        if num_workers:
            raise ConfigurationError(
                'num_workers reads a stream (IterableDataset) in worker processes; a Dataset is in memory already'
            )
        if drop_last:
            min_batch_size = batch_size
        if min_batch_size is not None and not 0 < min_batch_size <= batch_size:
            raise ConfigurationError(f'min_batch_size must be in [1, batch_size={batch_size}]; got {min_batch_size!r}')
        if callable(dataset) and not isinstance(dataset, (Dataset, Sequence)):
            dataset = dataset()
        self.dataset = dataset
        if len(self._rows) == 0:
            raise DataError('the dataset is empty: there is nothing to load')
        self.batch_size = batch_size
        self.min_batch_size = min_batch_size or 1
        if len(self._rows) < self.min_batch_size:
            raise DataError(
                f'the dataset has {len(self._rows)} rows, fewer than min_batch_size={self.min_batch_size} '
                '(drop_last=True means min_batch_size=batch_size): every epoch would be empty'
            )
        if len(self._rows) < self.data_world_size:
            raise DataError(
                f'the dataset has {len(self._rows)} rows, fewer than the {self.data_world_size} data ranks: '
                'every rank needs at least one row per batch'
            )
        self.shuffle = shuffle
        self.data_seed = data_seed
        self.epoch = 0
        self._offset = 0  # samples of the current epoch already handed out
        self._consumed = 0

    @property
    def _rows(self) -> Any:
        """The rows as they are now (a ``Dataset`` may be mapped or encoded after the loader is made)."""
        return self.dataset.dataset if isinstance(self.dataset, Dataset) else self.dataset

    @property
    def samples_per_epoch(self) -> int:
        total, tail = len(self._rows), len(self._rows) % self.batch_size
        return total - tail if 0 < tail < max(self.min_batch_size, self.data_world_size) else total

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.stream is not None:
            raise TypeError('a stream (IterableDataset) has no length: count steps instead')
        return -(-self.samples_per_epoch // self.batch_size)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self._rows)))
        generator = torch.Generator().manual_seed(self.data_seed + epoch)
        return torch.randperm(len(self._rows), generator=generator).tolist()

    def _fetch(self, indices: list[int]) -> list[dict[str, Any]]:
        getitems = getattr(self._rows, '__getitems__', None)
        return list(getitems(indices)) if getitems else [self._rows[i] for i in indices]

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """The rest of the current epoch (all of it, unless a run was resumed or interrupted).

        The position moves on as each batch is handed out, and to the next epoch with the last
        batch, so ``get_state()`` is right even when the caller stops pulling batches early
        (``zip(range(steps), loader)``) and the next ``iter`` starts a full epoch."""
        if self.stream is not None:
            yield from self.stream
            return
        end = self.samples_per_epoch
        if self._offset >= end:  # the rows were cut down (filter, encode) under a half-read epoch
            self.epoch, self._offset = self.epoch + 1, 0
        order = self._order(self.epoch)
        while self._offset < end:
            indices = order[self._offset : min(self._offset + self.batch_size, end)]
            self._offset += len(indices)
            self._consumed += len(indices)
            if self._offset == end:
                self.epoch, self._offset = self.epoch + 1, 0
            yield self._fetch(self._local(indices))
            if self._offset == 0:
                return

    def _local(self, indices: list[int]) -> list[int]:
        """This data rank's contiguous share of a global batch (the first ranks get one more row
        of a last batch that does not divide evenly)."""
        if self.data_world_size == 1:
            return indices
        share, extra = divmod(len(indices), self.data_world_size)
        start = self.data_rank * share + min(self.data_rank, extra)
        return indices[start : start + share + (self.data_rank < extra)]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration."""
        self.epoch, self._offset = epoch, 0

    def get_state(self) -> dict[str, Any]:
        """Where the loader is: ``consumed_train_samples`` and ``epoch`` (and, for a stream,
        every shard's position: ``load_state`` resumes from it exactly)."""
        if self.stream is not None:
            return self.stream.get_state()
        return {'consumed_train_samples': self._consumed, 'epoch': self.epoch}

    def skip_consumed_samples(self, consumed_train_samples: int) -> None:
        """Position the loader as if ``consumed_train_samples`` had been handed out from the start."""
        if consumed_train_samples < 0:
            raise ConfigurationError(f'consumed_train_samples must be >= 0; got {consumed_train_samples}')
        if self.stream is not None:
            raise StateError("a stream resumes from its shards' positions: loader.load_state(loader.get_state())")
        if self.samples_per_epoch == 0:
            raise DataError(f'the dataset has {len(self._rows)} rows, fewer than min_batch_size={self.min_batch_size}')
        self.epoch, self._offset = divmod(consumed_train_samples, self.samples_per_epoch)
        self._consumed = consumed_train_samples

    def resume_from_checkpoint(self, consumed_train_samples: int) -> None:
        """Alias of ``skip_consumed_samples``, for ``model.resume_from_checkpoint``'s result."""
        self.skip_consumed_samples(consumed_train_samples)

    def load_state(self, state: dict[str, Any]) -> None:
        """Resume from ``get_state()``: a stream seeks each shard to its saved position, a table
        skips ``consumed_train_samples``."""
        if self.stream is not None:
            self.stream.load_state(state)
        else:
            self.skip_consumed_samples(int(state['consumed_train_samples']))


def _data_position(mesh: DeviceMesh | None, batch_size: int) -> tuple[int, int]:
    """``(data world size, this process's data rank)`` under ``mesh``; checks the global batch divides."""
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise ConfigurationError(f'device_mesh must be a twinkle DeviceMesh; got {type(mesh).__name__}')
    if mesh is None or mesh.dp_world_size == 1:
        return 1, 0
    if batch_size % mesh.dp_world_size:
        raise ConfigurationError(
            f'batch_size={batch_size} is the global batch and must divide evenly over the {mesh.dp_world_size} '
            f'data ranks of {mesh!r}; use a multiple of {mesh.dp_world_size}, e.g. '
            f'{max(1, batch_size // mesh.dp_world_size) * mesh.dp_world_size}'
        )
    return mesh.dp_world_size, distributed.data_rank(mesh)
