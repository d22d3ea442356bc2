"""Each Tinker model's requests start in ``seq_id`` order, whatever order they arrive in.

A training client numbers its requests 1, 2, 3, ... (creating the model is 0). Single requests
arrive in order, but the chunks of one ``forward_backward`` are sent concurrently and arrive in
any order: the server accepts every request at once and starts it when all the lower numbers
have started. A number that never arrives must not hold the model for ever: requests that wait
longer than ``gap_timeout_s`` for a missing number fail, naming it.

>>> started = []
>>> sequencer = Sequencer(gap_timeout_s=60)
>>> for seq in (0, 2, 3, 1):
...     sequencer.add('m', seq, lambda seq=seq: started.append(seq), lambda message: None)
>>> started
[0, 1, 2, 3]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Start = Callable[[], None]
Fail = Callable[[str], None]


@dataclass
class _Waiting:
    arrived: float
    start: Start
    fail: Fail


@dataclass
class _Model:
    #: The number that starts next; None until the model's first request (after a restart too).
    next_seq: int | None = None
    waiting: dict[int, _Waiting] = field(default_factory=dict)


def _skipped(message: str) -> None:
    """The ``fail`` of a number refused before it was accepted (``skip``): nothing waits on it."""


class Sequencer:
    """Starts requests per model in ``seq_id`` order; thread-safe."""

    def __init__(self, gap_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.gap_timeout_s = gap_timeout_s
        self._clock = clock
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()

    def add(self, model_id: str, seq_id: int | None, start: Start, fail: Fail) -> None:
        """Start the request now if its turn has come, else when it does (or ``fail`` it)."""
        with self._lock:
            model = self._models.setdefault(model_id, _Model())
            if seq_id is None:
                ready = [start]  # an unnumbered request keeps its arrival order
            elif model.next_seq is not None and seq_id < model.next_seq:
                ready = [start]  # a number whose gap already timed out: run it in arrival order
            else:
                if model.next_seq is None:
                    model.next_seq = seq_id
                model.waiting[seq_id] = _Waiting(self._clock(), start, fail)
                ready = self._ready(model)
        for run in ready:
            run()

    def skip(self, model_id: str, seq_id: int) -> None:
        """Pass over a number whose request was refused before it was accepted (a 4xx the
        client does not retry), so the model's later requests do not wait for it. A number
        already waiting or started is left as it is."""
        with self._lock:
            model = self._models.get(model_id)
            if model is None or model.next_seq is None or seq_id < model.next_seq or seq_id in model.waiting:
                return
            model.waiting[seq_id] = _Waiting(self._clock(), lambda: None, _skipped)
            ready = self._ready(model)
        for run in ready:
            run()

    def expire(self) -> int:
        """Fail the requests that waited longer than ``gap_timeout_s`` for a missing number, and
        move the model past them; returns how many failed."""
        failed: list[tuple[Fail, str]] = []
        with self._lock:
            now = self._clock()
            for model_id, model in self._models.items():
                if model.waiting and now - min(w.arrived for w in model.waiting.values()) > self.gap_timeout_s:
                    missing = model.next_seq
                    message = (
                        f'request seq_id={missing} of model {model_id!r} never arrived within '
                        f'{self.gap_timeout_s:.0f} s, so the requests after it were not run'
                    )
                    failed += [(w.fail, message) for w in model.waiting.values()]
                    model.next_seq = max(model.waiting) + 1
                    model.waiting.clear()
        for fail, message in failed:
            fail(message)
        return len(failed)

    def drop(self, model_id: str, message: str) -> int:
        """Fail the model's requests waiting for their turn with ``message`` and forget the model
        (its client is gone); how many failed."""
        with self._lock:
            model = self._models.pop(model_id, None)
            waiting = [] if model is None else [w for w in model.waiting.values() if w.fail is not _skipped]
        for w in waiting:
            w.fail(message)
        return len(waiting)

    def forget(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)

    def _ready(self, model: _Model) -> list[Start]:
        ready = []
        while model.next_seq in model.waiting:
            ready.append(model.waiting.pop(model.next_seq).start)
            model.next_seq += 1
        return ready
