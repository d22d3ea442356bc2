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

from collections.abc import Iterable, Iterator
from typing import Any, TypeAlias

import torch.utils.data

from twinkle.dataset.streaming import Stream
from twinkle.errors import ConfigurationError, StateError
from twinkle.infra import distributed

#: One shard's batch: its rows, the shard's lane, the shard's state after them, and its counts.
ShardBatch: TypeAlias = tuple[list[dict[str, Any]], int, dict[str, Any], dict[str, int]]


class StreamBatches:
    """This data rank's batches of ``local_batch`` rows from ``dataset``, one pass per epoch."""

    def __init__(
        self,
        dataset: Stream,
        *,
        local_batch: int,
        data_world: int,
        data_rank: int,
        num_workers: int = 0,
        min_rows: int = 1,
    ):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigurationError(f'num_workers must be an integer >= 0; got {num_workers!r}')
        self.workers = num_workers
        self.local_batch, self.data_world, self.data_rank = local_batch, data_world, data_rank
        self.min_rows = min_rows  # a shard's last batch with fewer rows is dropped
        #: What this rank's shards counted this epoch (rows read, bad lines skipped, rows dropped).
        self.counts: dict[str, int] = {}
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
            batches: Iterable[ShardBatch] = _ShardBatches(self.shards, self.states, self.local_batch, self.next_lane)
        else:
            batches = torch.utils.data.DataLoader(
                _ShardBatches(self.shards, self.states, self.local_batch, self.next_lane),
                batch_size=None,
                num_workers=self.workers,
                persistent_workers=False,
            )
        lane_counts: list[dict[str, int]] = [{} for _ in self.shards]
        for rows, lane, state, counts in batches:
            lane_counts[lane] = counts
            self.counts = _summed(lane_counts)
            if len(rows) < self.min_rows:
                continue
            if not self._every_rank_has_a_batch(True):
                return  # another data rank's shard ran out: every rank stops at the same step
            self.states[lane], self.next_lane = state, (lane + 1) % len(self.shards)
            self.consumed += len(rows) * self.data_world
            yield rows
        if not self._every_rank_has_a_batch(False):
            self.epoch, self.next_lane = self.epoch + 1, 0
            self.states = [None] * len(self.shards)

    def _every_rank_has_a_batch(self, mine: bool) -> bool:
        """Whether every data rank has a next batch (each rank says whether it has; one small
        all-reduce under torchrun). Shards of a stream hold different numbers of rows, and a rank
        that trained one step more than the others would wait for them in its collectives."""
        if self.data_world == 1 or not distributed.is_initialized():
            return mine
        missing = distributed.all_reduce_sum(torch.tensor([0.0 if mine else 1.0]))
        return bool(missing.item() == 0)

    def get_state(self) -> dict[str, Any]:
        """The global rows consumed, the epoch, and every shard's position (all ranks' under torchrun)."""
        mine = {f'{self.data_rank}.{lane}': state for lane, state in enumerate(self.states)}
        streams: dict[str, Any] = {}
        for part in distributed.all_gather_object(mine) if distributed.is_initialized() else [mine]:
            streams.update(part)
        state = {'consumed_train_samples': self.consumed, 'epoch': self.epoch, 'streams': streams}
        return {**state, 'next_lane': self.next_lane, 'counts': dict(self.counts)}

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


class _ShardBatches(torch.utils.data.IterableDataset[ShardBatch]):
    """(rows, shard lane, the shard's state after them): in the main process its one lane, in
    DataLoader worker ``i`` lane ``(i + first_lane) % workers`` (worker 0's batch comes first)."""

    def __init__(self, shards: list[Stream], states: list[dict[str, Any] | None], local_batch: int, first_lane: int):
        self.shards, self.states, self.local_batch, self.first_lane = shards, list(states), local_batch, first_lane

    def __iter__(self) -> Iterator[ShardBatch]:
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
                    yield rows, lane, shard.state_dict(), dict(shard.counts)
                    rows = []
            yield rows, lane, shard.state_dict(), dict(shard.counts)  # the rest (maybe none): the counts too


def _summed(parts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total
