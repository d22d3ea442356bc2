"""Rollout and training that overlap, with a bound on how stale a sample may be.

In a synchronous RL loop the sampler waits while the trainer steps, and the trainer waits
while the sampler generates. ``AsyncRollouts`` runs the sampling side (the caller's
``produce`` function: sample a prompt's group, score it) in background threads while the
caller's loop trains on what is ready::

    rollouts = AsyncRollouts(produce, batch_size=6, max_staleness=1)
    staged = manager.stage_weights()
    with rollouts.running(staged.version, apply=lambda: manager.apply_staged(staged)):
        for step in range(steps):
            batch = rollouts.next_batch()          # Stamped items, none staler than the bound
            ... forward_backward on [item.value for item in batch], clip_grad_and_step ...
            staged = manager.stage_weights()       # a copy of the new weights, at once
            rollouts.publish(staged.version, apply=lambda s=staged: manager.apply_staged(s))

**Versions.** Weights are numbered (``CheckpointEngineManager`` counts its syncs; a server run
counts its optimizer steps). ``publish(version, apply)`` tells the rollouts that the trainer's
weights are now ``version``; ``apply`` loads them into the sampler and runs on a rollout thread
when no generation is in flight (``partial=False``: every generation finishes on the weights it
started with) or between two chunks of a generation (``generate_partial``: an interrupted
generation continues on the new weights). The trainer never waits for it. Each item records the
version of the oldest weights that produced any of its tokens; its **staleness** when the
trainer takes it is the trainer's version minus that. A step that left the weights as they were
(nothing in the batch to train on, an optimizer step skipped) calls ``publish_unchanged()``
instead: no copy to stage, the version stays, and the next batch may start.

**The bound.** With ``max_staleness=k`` the rollout threads run at most ``k`` batches ahead of
the trainer (``batch_size * (k + 1)`` items planned, in flight or ready, as tinker-cookbook's
``max_steps_off_policy`` does), so in order of arrival no item is older than ``k``. An item that
arrives later than planned (one slow generation among several threads) can still be staler:
``stale='drop'`` drops it (counted in ``stats.dropped``; the next item takes its place),
``stale='reweight'`` keeps it with ``weight = decay ** (staleness - k)`` for the caller to scale
its loss by. ``max_staleness=0`` is the synchronous loop: an item for batch ``b`` starts only
after the trainer published the weights of step ``b``, so with seeded sampling an async run
gives the synchronous run's numbers exactly. ``fill()`` before each ``next_batch`` waits until
the plan is full, so every batch (after the first ``k``) is exactly ``k`` steps old (``k``
versions, less the steps between that published none): the bound's worst case, the same at
every run.

**Stale samples need the decoupled loss.** A policy loss whose clipped ratio is anchored at the
sampler's logprobs (GRPO's, PPO's) clips every token that the ``k`` updates since sampling already
moved by more than ``epsilon``, so a token's probability can grow by about ``(1 + epsilon) ** (1 /
k)`` a step at most; train stale samples with ``rollout_correction=`` (the clip against the
trainer's own policy, the sampler only in a truncated importance weight: Hilton et al. 2022's
decoupled PPO, as AReaL trains); ``docs/async_rl.md`` has the measurement.

The threads stop on ``close()`` (or leaving ``running``); an exception in ``produce`` or
``apply`` is raised in the trainer's thread at its next ``next_batch``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from twinkle.errors import ConfigurationError, DataError, StateError, TwinkleError, one_of

T = TypeVar('T')
Stale = Literal['drop', 'reweight']
STALE_POLICIES: tuple[str, ...] = ('drop', 'reweight')


@dataclass
class Stamped(Generic[T]):
    """One produced item as the trainer receives it."""

    value: T
    #: The oldest weight version any of its tokens came from.
    version: int
    #: The trainer's version when it took the item, minus ``version``.
    staleness: int = 0
    #: 1, or ``decay ** (staleness - max_staleness)`` for a stale item kept with ``stale='reweight'``.
    weight: float = 1.0
    #: The order in which the item was planned (0, 1, ...).
    index: int = 0


@dataclass
class AsyncRolloutStats:
    """What the rollouts did so far."""

    produced: int = 0
    trained: int = 0
    dropped: int = 0
    reweighted: int = 0
    #: Staleness of each item handed to the trainer: counts per value.
    staleness: Counter[int] = field(default_factory=Counter)
    #: Weight updates applied to the sampler, and the seconds spent applying them.
    applied: int = 0
    apply_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a metric sink: staleness mean/max and its histogram, drops."""
        total = sum(self.staleness.values())
        mean = sum(s * n for s, n in self.staleness.items()) / total if total else 0.0
        record = {
            'staleness_mean': mean,
            'staleness_max': float(max(self.staleness, default=0)),
            'dropped_stale': float(self.dropped),
            'reweighted_stale': float(self.reweighted),
            'apply_s': self.apply_s,
        }
        record.update({f'staleness/{s}': float(n) for s, n in sorted(self.staleness.items())})
        return record


def batch_staleness(batch: Sequence[Stamped[object]]) -> dict[str, float]:
    """A batch's staleness for a step's log: mean, max, and the share of its items at each value.

    >>> batch_staleness([Stamped('a', 3, staleness=0), Stamped('b', 2, staleness=1), Stamped('c', 2, staleness=1)])
    {'staleness/0': 0.333..., 'staleness/1': 0.666..., 'staleness_mean': 0.666..., 'staleness_max': 1.0}
    """
    if not batch:
        raise DataError('batch_staleness got an empty batch')
    counts = Counter(item.staleness for item in batch)
    figures = {f'staleness/{s}': n / len(batch) for s, n in sorted(counts.items())}
    figures['staleness_mean'] = sum(s * n for s, n in counts.items()) / len(batch)
    figures['staleness_max'] = float(max(counts))
    return figures


class Session:
    """What ``produce`` gets: its item's index and the sampling sections it opens."""

    def __init__(self, index: int, enter: Callable[[], int], leave: Callable[[], None]):
        self.index = index
        self._enter, self._leave = enter, leave
        self.versions: list[int] = []

    @contextmanager
    def sampling(self) -> Iterator[int]:
        """Hold the sampler's weights still while generating; yields their version. A pending
        weight update waits for every open section to close, and new sections wait for it."""
        version = self._enter()
        self.versions.append(version)
        try:
            yield version
        finally:
            self._leave()


class AsyncRollouts(Generic[T]):
    """Runs ``produce(session)`` on ``workers`` background threads, at most ``max_staleness``
    batches ahead of the trainer; see the module docstring."""

    def __init__(
        self,
        produce: Callable[[Session], T],
        *,
        batch_size: int,
        max_staleness: int = 1,
        stale: Stale = 'drop',
        decay: float = 0.5,
        workers: int = 1,
    ):
        _check_config(batch_size, max_staleness, stale, decay, workers)
        self.produce = produce
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.stale = stale
        self.decay = decay
        self.workers = workers
        self.stats = AsyncRolloutStats()
        self._lock = threading.Condition()
        self._ready: deque[Stamped[T]] = deque()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._stopping = False
        self._planned = 0  # items started (their index is the plan order)
        self._accepted = 0  # items handed to the trainer
        self._in_flight_items = 0
        self._open_sections = 0
        self._applying = False
        self._pending: tuple[int, Callable[[], object] | None] | None = None
        self._start_version = 0
        self._unchanged_steps = 0  # steps the trainer finished without new weights (publish_unchanged)
        self.trainer_version = 0
        self.sampler_version = 0

    # ---- the trainer's side ---------------------------------------------------------------------
    @contextmanager
    def running(self, version: int, apply: Callable[[], object] | None = None) -> Iterator[AsyncRollouts[T]]:
        """Start the threads with the trainer at weights ``version`` (``apply`` loads them into
        the sampler first, when the sampler does not have them yet); stop them on leaving."""
        self.start(version, apply)
        try:
            yield self
        finally:
            self.close()

    def start(self, version: int, apply: Callable[[], object] | None = None) -> None:
        if self._threads:
            raise StateError('these rollouts are already running: close() them first')
        self._start_version = self.trainer_version = self.sampler_version = version
        self._unchanged_steps = 0
        self._pending = (version, apply) if apply is not None else None
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._work, name=f'twinkle-rollout-{i}', daemon=True) for i in range(self.workers)
        ]
        for thread in self._threads:
            thread.start()

    def next_batch(self, timeout: float | None = None) -> list[Stamped[T]]:
        """The next ``batch_size`` items, in order of arrival, each no staler than the bound
        (or reweighted); blocks until they are ready."""
        batch: list[Stamped[T]] = []
        with self._lock:
            while len(batch) < self.batch_size:
                self._raise_error()
                if not self._threads:
                    raise StateError('these rollouts are not running: call start() or use running()')
                if not self._ready:
                    if not self._lock.wait(timeout):
                        raise StateError(f'no rollout arrived within {timeout} s')
                    continue
                item = self._ready.popleft()
                if self._admit(item):
                    batch.append(item)
            self._accepted += len(batch)
            self.stats.trained += len(batch)
            self._lock.notify_all()
        return batch

    def fill(self, timeout: float | None = None) -> None:
        """Wait until the rollouts are as far ahead as the bound lets them: every item the plan
        allows produced, none in flight. A loop that calls it before each ``next_batch`` trains
        every batch from step ``max_staleness + 1`` on exactly ``max_staleness`` steps after the
        weights that sampled it (as many versions, less the steps between that ended in
        ``publish_unchanged``): the bound's worst case, which a sampler much faster than the
        trainer meets at every step. With seeded sampling such a run is the same at every try
        (which items see which weights no longer depends on the threads' timing), so benchmarks
        and tests measure that case with it."""
        with self._lock:
            while self._may_start() or self._in_flight_items:
                self._raise_error()
                if not self._threads:
                    raise StateError('these rollouts are not running: call start() or use running()')
                if not self._lock.wait(timeout):
                    raise StateError(f'the rollouts did not fill their plan within {timeout} s')

    def publish(self, version: int, apply: Callable[[], object] | None = None) -> None:
        """The trainer's weights are now ``version``; ``apply`` (if any) loads them into the
        sampler on a rollout thread, as soon as no generation holds the old ones. Returns at
        once; a newer publish replaces an update not yet applied."""
        if version < self.trainer_version:
            raise ConfigurationError(f'published version {version} is older than the current {self.trainer_version}')
        with self._lock:
            self.trainer_version = version
            # Without ``apply`` the sampler already reads the trainer's weights (a server run without a
            # sampler group): the version still moves at the next boundary between generations.
            self._pending = (version, apply)
            self._lock.notify_all()

    def publish_unchanged(self) -> None:
        """The trainer finished a step without changing its weights (nothing in the batch to
        train on, or the optimizer skipped the step): the plan moves on one batch, as after a
        ``publish``, but the version and the sampler's weights stay, so the items sampled on them
        are no staler for it."""
        with self._lock:
            self._unchanged_steps += 1
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the threads (each finishes the item it is producing) and join them."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []

    # ---- the rollout threads --------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._may_start():
                    self._lock.wait()
                if self._stopping or self._error is not None:
                    return
                index = self._planned
                self._planned += 1
                self._in_flight_items += 1
            try:
                item = self._produce_one(index)
            except BaseException as error:  # handed to the trainer's thread
                with self._lock:
                    self._error = error
                    self._in_flight_items -= 1
                    self._lock.notify_all()
                return
            with self._lock:
                self._in_flight_items -= 1
                self._ready.append(item)
                self.stats.produced += 1
                self._lock.notify_all()

    def _produce_one(self, index: int) -> Stamped[T]:
        session = Session(index, self._enter_section, self._leave_section)
        value = self.produce(session)
        if not session.versions:
            raise StateError(
                'produce() sampled outside session.sampling(): wrap each sampler call in it, so the rollouts '
                'know which weights made the item'
            )
        return Stamped(value, min(session.versions), index=index)

    def _may_start(self) -> bool:
        """Whether one more item fits in the plan: at most ``max_staleness + 1`` batches past the
        ones the trainer has taken, counted from the version the trainer has published and the
        steps it finished without new weights."""
        if self._error is not None:
            return True
        steps = self.trainer_version - self._start_version + self._unchanged_steps
        # A dropped item gives its place in the plan to a new one.
        return self._planned - self.stats.dropped < self.batch_size * (steps + 1 + self.max_staleness)

    def _enter_section(self) -> int:
        with self._lock:
            while self._applying or (self._pending is not None and not self._stopping):
                if self._applying or self._open_sections:
                    self._lock.wait()
                else:
                    self._apply_pending()
            self._open_sections += 1
            return self.sampler_version

    def _leave_section(self) -> None:
        with self._lock:
            self._open_sections -= 1
            self._lock.notify_all()

    def _apply_pending(self) -> None:
        """Load the pending weights. Called with the lock held and no section open; the lock is
        let go while ``apply`` runs, so the trainer can take batches and publish meanwhile."""
        assert self._pending is not None
        version, apply = self._pending
        self._pending, self._applying = None, True
        self._lock.release()
        started = time.perf_counter()
        try:
            if apply is not None:
                apply()
        finally:
            self._lock.acquire()
            self._applying = False
            self._lock.notify_all()
        self.stats.applied += 1
        self.stats.apply_s += time.perf_counter() - started
        self.sampler_version = version

    def _admit(self, item: Stamped[T]) -> bool:
        item.staleness = self.trainer_version - item.version
        if item.staleness > self.max_staleness:
            if self.stale == 'drop':
                self.stats.dropped += 1
                self._lock.notify_all()
                return False
            item.weight = self.decay ** (item.staleness - self.max_staleness)
            self.stats.reweighted += 1
        self.stats.staleness[item.staleness] += 1
        return True

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, TwinkleError):
                raise error
            raise StateError(f'a rollout thread failed: {type(error).__name__}: {error}') from error


def _check_config(batch_size: int, max_staleness: int, stale: str, decay: float, workers: int) -> None:
    for name, value, least in (
        ('batch_size', batch_size, 1),
        ('max_staleness', max_staleness, 0),
        ('workers', workers, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigurationError(f'{name} must be an integer >= {least}; got {value!r}')
    if stale not in STALE_POLICIES:
        raise one_of('stale', stale, STALE_POLICIES)
    if not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
        raise ConfigurationError(f'decay must be in (0, 1]; got {decay!r}')
