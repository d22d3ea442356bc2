"""Sampling in slices, and in one batch: a long generation gives the model's worker up every
``slice_s`` seconds, so other tenants' jobs run between its slices instead of waiting for the whole
reply; and the sampling requests waiting, of one tenant and of several, decode together.

vLLM's engine interleaves requests at token granularity: each of its steps decodes one token of every
running request within a token budget (``max_num_batched_tokens``), prefills in chunks, and preempts
a request (recomputing or swapping its cache) when memory runs out; no request holds the engine past
a step. This worker runs one job at a time, round robin across tenants (``scheduling/scheduler.py``), so a
sampling job gives way between its decode steps instead. :func:`sliced` runs the job's function on a
thread of its own; each time the torch sampler (``TorchSampler.turns``) finds the slice spent, it puts
the model back as it found it and hands the worker back, and the job returns ``Continue``: the
scheduler runs the other tenants' jobs, then the next slice. Only one of the two threads runs at a
time, so nothing uses the model from both. The generation keeps its state (its KV cache, its
generators) where it is: the reply is the one an unsliced run gives, whatever ran between its slices.

One batch: the torch sampler decodes the rows of every call in flight as one batch
(``twinkle.sampler.batching``: continuous batching), and each sampling job, when it holds the worker,
adds its rows to that batch and steps the whole of it, so its slice advances every request in it; its
job ends once its own rows have. The scheduler lets a tenant's sampling jobs pass one another
(``Scheduler.shares``: a paused one waits behind its tenant's next ones) and a slice gives way at once
when a sampling job that has not started waits (``joining``), so that job adds its rows at the next
step rather than after the running one ends: 32 requests sent at once share one generation, each
getting the tokens it would alone (its own adapter, seed, parameters and stop conditions).

On vLLM (``sampler: vllm``, or a sampler group of its own on vLLM) the same: each sampling job adds
its requests to the engine's running generation and steps the engine (``vLLMSampler.calls``,
``twinkle.sampler.vllm_batching``), giving the worker up between two engine steps when its slice is
spent or a sampling job waits to join. There the engine's process holds the generation's state, and
``limit_s`` does not apply (a request's ``max_tokens`` and the engine's context bound it).

``limit_s`` bounds a request's worker time: the seconds of the batch's steps its rows took part in;
past it the sampler ends its rows as at ``max_tokens`` (stop reason 'length'), so no request holds the
model for longer however much it asked for (``max_sampling_s``). A job's duration and charge are its
own slices' time, during which it also steps the other requests' rows.

What it costs: a paused generation's cache stays on the device while the other jobs run, and each
slice hands the turn over twice (tens of microseconds) and sets the model up for sampling again (a
walk over its modules).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from twinkle.server.execution.scheduling.scheduler import Continue

_NUMBERS = itertools.count()


class _Cancelled(BaseException):
    """Raised on a slice thread whose job failed while paused: its stack unwinds (``finally`` blocks
    put back what they hold) and the thread ends. A BaseException, so no ``except Exception`` of the
    sampling code takes it for an error of its own."""


class SliceThread(threading.Thread):
    """A job's function on a thread of its own, run a slice at a time: the worker hands it the turn
    (:meth:`run_slice`) and waits until it gives way (:meth:`give_way`) or ends."""

    def __init__(
        self,
        fn: Callable[[], Any],
        slice_s: float | None,
        limit_s: float | None,
        contended: Callable[[], bool] = lambda: True,
        joining: Callable[[], bool] = lambda: False,
    ):
        super().__init__(name=f'twinkle-slice-{next(_NUMBERS)}', daemon=True)
        self._fn, self.slice_s, self.limit_s, self._contended = fn, slice_s, limit_s, contended
        self._joining = joining
        # The worker's CUDA device: a new thread's current device is the first one (megatron-core, for
        # one, allocates on the current device). Asked only where CUDA is up, so no CUDA starts here.
        started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self._device = torch.cuda.current_device() if started else None
        self._turn = threading.Condition()
        self._theirs = False  # whose turn it is: this thread's (True) or the worker's
        self._ended = self._cancelled = False
        self._result: Any = None  # Any: what the job's function returns
        self._error: BaseException | None = None
        self._slice_at = 0.0  # when this slice started

    # ---- the worker's side --------------------------------------------------------------------------
    def run_slice(self) -> Any:
        """Give this thread its turn and wait for it to end: the function's result, its error raised,
        or ``Continue`` with the next slice if it gave way."""
        with self._turn:
            self._slice_at, self._theirs = time.monotonic(), True
            if not self.is_alive() and not self._ended:
                self.start()
            self._turn.notify_all()
            self._turn.wait_for(lambda: not self._theirs)
        if not self._ended:
            return Continue(self.run_slice, self.cancel)
        self.join()
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """The job failed while paused (the server is stopping): unwind the function and end the thread."""
        with self._turn:
            self._cancelled = self._theirs = True
            self._turn.notify_all()
            self._turn.wait_for(lambda: not self._theirs)
        self.join()

    # ---- this thread's side -------------------------------------------------------------------------
    def run(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        try:
            self._result = self._fn()
        except BaseException as error:  # raised on the worker (a cancel's is the canceller's own doing)
            self._error = None if isinstance(error, _Cancelled) else error
        finally:
            with self._turn:
                self._ended, self._theirs = True, False
                self._turn.notify_all()

    def give_way(self) -> None:
        """Hand the worker back until the job's next turn (on this thread, between two steps)."""
        with self._turn:
            self._theirs = False
            self._turn.notify_all()
            self._turn.wait_for(lambda: self._theirs)
            if self._cancelled:
                raise _Cancelled()

    def due(self) -> bool:
        """Whether this slice should end: a job waits to join the batch (``joining``), or the slice
        has run its ``slice_s`` and other work waits for the worker (alone, a job goes on: a pause
        would cost a hand-over and a model set-up for nothing)."""
        spent = self.slice_s is not None and time.monotonic() - self._slice_at >= self.slice_s
        return (spent and self._contended()) or self._joining()


def sliced(
    fn: Callable[[], Any],
    slice_s: float | None,
    limit_s: float | None,
    contended: Callable[[], bool] = lambda: True,
    joining: Callable[[], bool] = lambda: False,
) -> Callable[[], Any]:
    """A job function that runs ``fn`` in slices of ``slice_s`` seconds (None: whole) on a thread of
    its own, its generations bounded to ``limit_s`` seconds of steps (None: no bound); what it
    returns is ``fn``'s result, or ``Continue``. A slice runs on past ``slice_s`` while
    ``contended()`` is False (no other tenant's job waits), and ends at the next step once
    ``joining()`` is True (a sampling job waits to add its rows). ``fn`` gives way only where the
    code it runs asks ``TURNS``."""
    return lambda: SliceThread(fn, slice_s, limit_s, contended, joining).run_slice()


class ThreadTurns:
    """``TorchSampler.turns`` of this process: the turns of the sliced job whose thread asks. On any
    other thread (a job that is not sliced, a sampler outside the server) nothing is ever due."""

    def due(self) -> bool:
        thread = threading.current_thread()
        return isinstance(thread, SliceThread) and thread.due()

    def time_limit_s(self) -> float | None:
        thread = threading.current_thread()
        return thread.limit_s if isinstance(thread, SliceThread) else None

    def give_way(self) -> None:
        thread = threading.current_thread()
        if isinstance(thread, SliceThread):
            thread.give_way()


#: The one ``ThreadTurns`` (it holds no state: each job's is on its thread).
TURNS = ThreadTurns()

__all__ = ['TURNS', 'SliceThread', 'ThreadTurns', 'sliced']
