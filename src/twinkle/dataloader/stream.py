"""Batches from a stream (``IterableDataset``): each data rank, and each of its worker
processes, reads its own shard, and the position of every shard travels with the batches.

With ``d`` data ranks and ``w`` workers there are ``d * max(w, 1)`` shards; rank ``r``'s worker
``k`` reads shard ``r * w + k`` (raw row ``i`` of the stream belongs to shard ``i % (d * w)``), so
no row is read by two of them and none is missed. Each batch carries the position its shard
reached when the batch was made; the loader keeps, per shard, the position of the last batch it
handed out. ``get_state()`` holds those positions (every rank's, under torchrun), and
``load_state`` in a new run makes each shard seek to its own: the batches that follow are the
ones the interrupted run would have got next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from twinkle.dataset.streaming import Stream
from twinkle.errors import ConfigurationError, StateError
from twinkle.infra import distributed


class StreamBatches:
    """This data rank's batches of ``local_batch`` rows from ``dataset``, one pass per epoch."""

    def __init__(self, dataset: Stream, *, local_batch: int, data_world: int, data_rank: int, num_workers: int = 0):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigurationError(f'num_workers must be an integer >= 0; got {num_workers!r}')
        self.workers = num_workers
        self.local_batch, self.data_world, self.data_rank = local_batch, data_world, data_rank
        lanes = max(num_workers, 1)
        self.shards = [dataset.shard(data_world * lanes, data_rank * lanes + k) for k in range(lanes)]
        self.states: list[dict[str, Any] | None] = [None] * lanes  # None: from the start
        # The lane whose batch comes next: workers take turns, and a resumed run keeps the turn.
        self.next_lane = 0
        self.epoch = 0
        self.consumed = 0  # global rows (every rank's) handed out

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """The rest of this epoch's batches; the next ``iter`` starts the next epoch."""
        if self.workers == 0:
            batches: Any = _ShardBatches(self.shards, self.states, self.local_batch, self.next_lane)
        else:
            batches = torch.utils.data.DataLoader(
                _ShardBatches(self.shards, self.states, self.local_batch, self.next_lane),
                batch_size=None,
                num_workers=self.workers,
                persistent_workers=False,
            )
        for rows, lane, state in batches:
            self.states[lane], self.next_lane = state, (lane + 1) % len(self.shards)
            self.consumed += len(rows) * self.data_world
            yield rows
        self.epoch, self.next_lane = self.epoch + 1, 0
        self.states = [None] * len(self.shards)

    def get_state(self) -> dict[str, Any]:
        """The global rows consumed, the epoch, and every shard's position (all ranks' under torchrun)."""
        mine = {f'{self.data_rank}.{lane}': state for lane, state in enumerate(self.states)}
        streams: dict[str, Any] = {}
        for part in distributed.all_gather_object(mine) if distributed.is_initialized() else [mine]:
            streams.update(part)
        state = {'consumed_train_samples': self.consumed, 'epoch': self.epoch, 'streams': streams}
        return {**state, 'next_lane': self.next_lane}

    def load_state(self, state: dict[str, Any]) -> None:
        """Resume from ``get_state()`` of a run with the same data ranks and workers."""
        streams = state.get('streams')
        if not isinstance(streams, dict):
            raise StateError("a stream resumes from DataLoader.get_state() (it holds each shard's position)")
        lanes = [f'{self.data_rank}.{lane}' for lane in range(len(self.shards))]
        layout = {f'{rank}.{lane}' for rank in range(self.data_world) for lane in range(len(self.shards))}
        if not set(lanes) <= set(streams) <= layout:
            raise StateError(
                f'this state has the shards {sorted(streams)}; this run reads {self.data_world} data rank(s) x '
                f'{len(self.shards)} worker shard(s): resume with the same data ranks and num_workers'
            )
        self.states = [streams[lane] for lane in lanes]
        self.epoch = int(state.get('epoch', 0))
        self.consumed = int(state.get('consumed_train_samples', 0))
        self.next_lane = int(state.get('next_lane', 0))


class _ShardBatches(torch.utils.data.IterableDataset):
    """(rows, shard lane, the shard's state after them): in the main process its one lane, in
    DataLoader worker ``i`` lane ``(i + first_lane) % workers`` (worker 0's batch comes first)."""

    def __init__(self, shards: list[Stream], states: list[dict[str, Any] | None], local_batch: int, first_lane: int):
        self.shards, self.states, self.local_batch, self.first_lane = shards, list(states), local_batch, first_lane

    def __iter__(self) -> Iterator[tuple[list[dict[str, Any]], int, dict[str, Any]]]:
        info = torch.utils.data.get_worker_info()
        lanes = [(info.id + self.first_lane) % info.num_workers] if info is not None else list(range(len(self.shards)))
        for lane in lanes:
            shard = self.shards[lane]
            state = self.states[lane]
            if state is None:
                shard.restart()
            else:
                shard.load_state_dict(state)
            rows: list[dict[str, Any]] = []
            for row in shard:
                rows.append(row)
                if len(rows) == self.local_batch:
                    yield rows, lane, shard.state_dict()
                    rows = []
            if rows:
                yield rows, lane, shard.state_dict()
