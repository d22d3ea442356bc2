"""A pass of sampling requests on a sampler group's worker processes, decoded as one batch.

A sampler group of its own on the torch sampler (``sampler: {ranks: 1}``) runs in worker processes,
which this process's scheduler hands one call at a time. Its sampling jobs commute (none changes
the weights another samples), so the scheduler gives the group the waiting ones as one pass
(``Batchable.commutes``), and the rank process runs them as a ``SamplingPass``: each call on a
thread of its own, so that their ``TorchSampler.sample`` calls join one running batch
(``twinkle.sampler.batching``), each getting the tokens it gets alone.

What each call does besides sampling (its checks, its prompts' encoding, loading its weights'
adapter into the model, making its reply) runs one call at a time (the pass's turn), and no call
samples before every call has prepared: an adapter is never loaded into the model while another
call's rows decode through it. Unlike the slices of the in-process sampler, a request that arrives
while a pass decodes waits for the next pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class SamplingPass:
    """The calls of one pass: ``run`` them; their sampler calls go in ``sampling()``."""

    def __init__(self, calls: int):
        self._turn = threading.Lock()  # held by the one call that prepares or finishes
        self._ready = threading.Condition()
        self._unready = calls  # calls that have neither reached their sampler call nor ended
        self._mine = threading.local()

    def run(self, calls: list[Callable[[], object]]) -> list[object]:
        """Each call on a thread of its own; its result, or its error, in order."""
        results: list[object] = [None] * len(calls)

        def one(index: int, call: Callable[[], object]) -> None:
            try:
                with self._turn:
                    results[index] = call()
            except Exception as error:  # that call's alone (a bad prompt, a deleted checkpoint)
                results[index] = error
            finally:
                self._arrive()

        threads = [threading.Thread(target=one, args=item, name=f'twinkle-pass-{item[0]}') for item in enumerate(calls)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """Around a call's sampler call: the turn let go, and entered once every call is ready, so
        they all sample at once; the turn taken back after."""
        self._arrive()
        self._turn.release()
        try:
            with self._ready:
                self._ready.wait_for(lambda: self._unready == 0)
            yield
        finally:
            self._turn.acquire()

    def _arrive(self) -> None:
        if getattr(self._mine, 'arrived', False):
            return
        self._mine.arrived = True
        with self._ready:
            self._unready -= 1
            self._ready.notify_all()


__all__ = ['SamplingPass']
