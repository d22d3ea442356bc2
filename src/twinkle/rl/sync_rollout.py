"""The synchronous loop behind ``AsyncRollouts``' interface: one loop, with or without threads.

``SyncRollouts`` takes the same ``produce(session)`` and answers the trainer's side of
``AsyncRollouts`` (``running``, ``next_batch``, ``fill``, ``publish``, ``publish_unchanged``,
``stats``), but on the trainer's own thread: ``next_batch`` loads the last published weights into
the sampler, then produces ``batch_size`` items in order, each on those weights (staleness 0). A
loop written for ``AsyncRollouts`` is then the synchronous loop (sync, sample, train, repeat)
with one line changed, which is what an async run is measured against: ``AsyncRollouts`` with
``max_staleness=0`` gives its numbers too, but through threads.

>>> rollouts = SyncRollouts(lambda session: session.index * 10, batch_size=2)
>>> with rollouts.running(0):
...     first = rollouts.next_batch()
...     rollouts.publish(1)
...     second = rollouts.next_batch()
>>> [(item.value, item.version, item.staleness) for item in first + second]
[(0, 0, 0), (10, 0, 0), (20, 1, 0), (30, 1, 0)]
>>> rollouts.stats.produced, rollouts.stats.trained
(4, 4)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic

from twinkle.errors import ConfigurationError, StateError
from twinkle.rl.async_rollout import AsyncRolloutStats, Session, Stamped, T


class SyncRollouts(Generic[T]):
    """``produce(session)`` on the trainer's thread, ``batch_size`` items per ``next_batch``; see
    the module docstring."""

    max_staleness = 0

    def __init__(self, produce: Callable[[Session], T], *, batch_size: int):
        if batch_size < 1:
            raise ConfigurationError(f'batch_size must be at least 1, got {batch_size}')
        self.produce = produce
        self.batch_size = batch_size
        self.stats = AsyncRolloutStats()
        self.version = 0
        self._pending: Callable[[], object] | None = None
        self._running = False
        self._planned = 0

    @contextmanager
    def running(self, version: int, apply: Callable[[], object] | None = None) -> Iterator[SyncRollouts[T]]:
        """The trainer is at weights ``version``; ``apply`` loads them into the sampler before the first batch."""
        self.version, self._pending, self._running = version, apply, True
        try:
            yield self
        finally:
            self._running = False

    def next_batch(self, timeout: float | None = None) -> list[Stamped[T]]:
        """Load the published weights (if any are new), then produce the next ``batch_size`` items on them."""
        if not self._running:
            raise StateError('these rollouts are not running: use running()')
        if self._pending is not None:
            started = time.perf_counter()
            self._pending()
            self.stats.apply_s += time.perf_counter() - started
            self.stats.applied += 1
            self._pending = None
        batch = []
        for _ in range(self.batch_size):
            session = Session(self._planned, lambda: self.version, lambda: None)
            batch.append(Stamped(self.produce(session), self.version, index=self._planned))
            self._planned += 1
        self.stats.produced += len(batch)
        self.stats.trained += len(batch)
        self.stats.staleness[0] += len(batch)
        return batch

    def fill(self, timeout: float | None = None) -> None:
        """Nothing to wait for: a batch is produced when it is asked for."""

    def publish(self, version: int, apply: Callable[[], object] | None = None) -> None:
        """The trainer's weights are now ``version``; ``apply`` loads them at the next ``next_batch``."""
        if version < self.version:
            raise ConfigurationError(f'published version {version} is older than the current {self.version}')
        self.version, self._pending = version, apply

    def publish_unchanged(self) -> None:
        """The step left the weights as they were: the sampler keeps them."""
