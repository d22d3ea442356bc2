"""``AdapterPool``: the runs with an adapter on one hosted model.

A model holds at most ``max_adapters`` adapters, ``max_adapters_per_tenant`` of one tenant. A
run's adapter comes and goes: released when idle or to make room for another (its whole state
saved: weights, optimizer, counters, gradients waiting for a step), restored on its next request
from the newest state it saved (``run_files.latest_state``). Released states tier: in host memory
(``memory_state_bytes`` of them, in a RAM-backed folder), then the least recently released on disk.
Room is made fairly: an adapter of a tenant holding more than an equal share of the pool goes
first, least recently used first; only the adapters the running requests use are never released.
Every method runs on the model's worker thread, where no request can use an adapter while it moves;
states move from memory to disk on a thread of their own, off the requests' path, one at a time
under the pool's lock, which every method that reads or writes a state holds.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypedDict

from typing_extensions import Unpack

from twinkle.errors import CapacityError, NotFoundError, StateError
from twinkle.model import checkpoint as ckpt
from twinkle.server.config import ServerConfig
from twinkle.server.execution.host import Host, JsonObject
from twinkle.server.execution.run_files import RELEASE_STATE, latest_state, memory_state, run_dir, to_disk
from twinkle.server.store import Checkpoint, Run, Store
from twinkle.utils.logger import get_logger

logger = get_logger()


class AdapterOptions(TypedDict, total=False):
    """How a new run's adapter is set up beside its LoRA config (``AdapterPool.add``)."""

    gradient_accumulation_steps: int  # micro-batches a step takes (default 1)
    seed: int | None  # the adapter's initialisation seed
    setup: list[tuple[str, JsonObject]] | None  # operations run on the adapter once it is there


class AdapterPool:
    """The runs with an adapter on ``host``'s model; ``running_left_s()`` says when the requests
    running now are expected to end (what a 429 asks a client to wait)."""

    def __init__(self, config: ServerConfig, store: Store, host: Host, running_left_s: Callable[[], float]):
        self.config, self.store, self.host = config, store, host
        self._running_left_s = running_left_s
        self.adapters: dict[str, str] = {}  # run id -> adapter name on the model
        self.pinned: set[str] = set()  # runs the worker's current jobs use: not released to make room
        #: Runs released to host memory, least recently released first: run id -> (its state there,
        #: where it goes on disk, its bytes). A state stays after its run comes back, which a dead
        #: worker's runs come back from, until the run's next release replaces it or it goes to disk.
        self.in_memory: OrderedDict[str, tuple[Path, Path, int]] = OrderedDict()
        self._states = threading.RLock()  # held while a state is written, read or moved
        self._spiller = ThreadPoolExecutor(max_workers=1, thread_name_prefix='twinkle-spill')

    def forget_all(self) -> None:
        """The model's worker died and its adapters with it: their runs are released (they come
        back from their saved state on their next request)."""
        for run_id in self.adapters:
            self.store.runs.set_status(run_id, 'released')
        self.adapters.clear()
        self.pinned.clear()

    def unpin_all(self) -> None:
        """The worker's jobs ended: no adapter is in use."""
        self.pinned.clear()

    def add(self, run: Run, lora: JsonObject, **options: Unpack[AdapterOptions]) -> str:
        """Put a new run's adapter on the model (worker thread), room made first, with its
        ``setup`` operations run on it; nothing of it stays if one fails. Its adapter's name."""
        adapter = self.adapter_name(run)
        self.make_room(run)
        self.host.add_adapter(adapter, lora, options.get('gradient_accumulation_steps', 1), options.get('seed'))
        try:
            for operation, kwargs in options.get('setup') or []:
                self.host.run(adapter, operation, dict(kwargs))
            if self.config.save_state_every_steps is not None:
                self.keep_state(run, adapter)  # what it comes back as if a worker dies before its first save
        except BaseException:
            self.host.remove_adapter(adapter)
            raise
        self.adapters[run.id] = adapter
        return adapter

    def remove(self, run: Run) -> None:
        """Take a run's adapter off the model, if it is there, and its state out of memory (worker thread)."""
        adapter = self.adapters.pop(run.id, None)
        if adapter is not None:
            self.host.remove_adapter(adapter)
        self._drop_memory(run.id)

    def adapter_name(self, run: Run) -> str:
        """The name of a run's adapter on the model: its run id, unique on the server (the store
        makes it), so what the model's errors name is what the tenant knows. A tenant reaches an
        adapter only through its own runs, so naming another tenant's run reaches nothing."""
        return run.id

    def loaded(self, run: Run) -> str:
        """The run's adapter on the model, restored first if it was released (worker thread)."""
        if run.id not in self.adapters:
            self.restore(self._stored_run(run.id))
        self.pinned.add(run.id)
        return self.adapters[run.id]

    def _stored_run(self, run_id: str) -> Run:
        """The run as the store has it now (its latest config and status)."""
        run = self.store.runs.by_id(run_id)
        if run is None:
            raise NotFoundError(f'training run {run_id!r} not found')
        return run

    # ---- releasing idle adapters -----------------------------------------------------------------
    def release_state(self, run: Run) -> Path:
        return run_dir(self.config, run) / RELEASE_STATE

    def saved_state(self, run: Run) -> Path | None:
        """Where a run off the model continues from (``restore``); None if it has nothing. Safe
        off the worker thread (a route asks): a state moving from memory to disk is in one or the
        other (``run_files.to_disk``) and one vanishing while it is read counts as absent."""
        found = self._saved_state(run)
        return None if found is None else found[0]

    def _saved_state(self, run: Run) -> tuple[Path, Checkpoint | None] | None:
        """The saved state of the run that stands at its latest optimizer step (``latest_state``)."""
        checkpoints = [c for c in self.store.checkpoints.of_run(run.tenant_id, run.id) if c.kind == 'training']
        memory = memory_state(self.config, run)
        kept = [self.release_state(run), *([] if memory is None else [memory])]
        return latest_state(kept, checkpoints)

    def keep_state(self, run: Run, adapter: str) -> None:
        """Save the run's state (weights, optimizer, counters, accumulation window) as its released
        state on disk, the newest place ``restore`` brings it back from (its copy in memory, older
        now, is dropped)."""
        path = self.release_state(run)
        with self._states:
            self.host.save(adapter, path.parent, path.name, save_optimizer=True)
            self._drop_memory(run.id)

    def keep_state_or_warn(self, run: Run) -> None:
        adapter = self.adapters.get(run.id)
        if adapter is None:
            return
        try:
            self.keep_state(run, adapter)
        except Exception as error:  # a dead worker, a full disk: its next save or step tries again
            logger.warning(f'the state of run {run.id!r} was not saved: {type(error).__name__}: {error}')

    def release(self, run: Run, to_disk: bool = False) -> bool:
        """Save a run's adapter with its optimizer, counters and accumulation window (gradients
        waiting for a step included), then take it off the model (worker thread): into host memory
        while it has room (``memory_state_bytes``, the least recently released going to disk to
        make it), else, or ``to_disk``, to disk. A pending forward (``forward_only``, waiting for
        ``calculate_loss``) is not kept. False if the run was not on the model."""
        adapter = self.adapters.get(run.id)
        if adapter is None:
            return False
        memory = None if to_disk else memory_state(self.config, run)
        with self._states:
            if memory is None or not self._keep_in_memory(run, adapter, memory):
                self.keep_state(run, adapter)
        self.host.remove_adapter(adapter)
        del self.adapters[run.id]
        self.store.runs.set_status(run.id, 'released')
        if self.in_memory:
            self._spiller.submit(self._spill, self.config.memory_state_bytes)
        return True

    def _keep_in_memory(self, run: Run, adapter: str, memory: Path) -> bool:
        """Save the run's state in host memory; False if memory would not take it (a full tmpfs)."""
        try:
            self.host.save(adapter, memory.parent, memory.name, save_optimizer=True)
        except OSError as error:
            logger.warning(f'the state of run {run.id!r} went to disk, host memory did not take it: {error}')
            self._drop_memory(run.id)
            shutil.rmtree(memory.parent, ignore_errors=True)
            return False
        if not (memory / ckpt.TRAINER_STATE).is_file():  # the model's processes are on another machine
            logger.warning(f'the state of run {run.id!r} went to disk: memory_state_dir is not shared with its model')
            return False
        self.in_memory[run.id] = (memory, self.release_state(run), ckpt.folder_size(memory))
        self.in_memory.move_to_end(run.id)
        return True

    def spill_all(self) -> int:
        """Move every released state in host memory to disk (a graceful stop), once the moves
        under way are done; how many."""
        count = len(self.in_memory)
        self._spiller.submit(self._spill, 0).result()
        return count

    def close(self) -> None:
        """Finish the moves under way and stop their thread (the server stops)."""
        self._spiller.shutdown(wait=True)

    def _spill(self, budget: int) -> None:
        """Move the least recently released states in memory to disk until they hold ``budget``
        bytes (the spill thread), one state at a time under the lock."""
        while True:
            with self._states:
                if not self.in_memory or sum(size for _, _, size in self.in_memory.values()) <= budget:
                    return
                run_id, kept = self.in_memory.popitem(last=False)
                try:
                    to_disk(*kept[:2])
                except Exception as error:  # a full disk: the state stays in memory, a later release tries again
                    self.in_memory[run_id] = kept
                    self.in_memory.move_to_end(run_id, last=False)
                    logger.warning(f'the state of run {run_id!r} stays in memory, the disk did not take it: {error}')
                    return

    def _drop_memory(self, run_id: str) -> None:
        """Forget a run's state in host memory (it is back on the model, or deleted)."""
        with self._states:
            kept = self.in_memory.pop(run_id, None)
            if kept is not None:
                shutil.rmtree(kept[0].parent, ignore_errors=True)  # the run's folder in memory

    def restore(self, run: Run) -> None:
        """Bring a released run back: its adapter, its setup calls replayed, then its saved state
        (``_saved_state``). A state older than the run's last recorded step, or weights alone,
        is recorded in its history (``History.record_restore``: what its ``restored_from`` says)."""
        self._state_or_refuse(run)  # before room is made: a run with nothing to restore releases no other
        self.make_room(run)
        adapter, config = self.adapter_name(run), run.config
        self.host.add_adapter(adapter, config.get('lora', {}), config.get('gradient_accumulation_steps', 1))
        try:
            for call in config.get('setup', []):
                self.host.run(adapter, call['operation'], dict(call['kwargs']))
            with self._states:  # looked up now: the spill thread may have moved it from memory to disk
                path, checkpoint = self._state_or_refuse(run)
                shown = f'the saved state of training run {run.id!r}' if checkpoint is None else checkpoint.twinkle_path
                restored = self.host.restore_state(adapter, path, shown)
        except BaseException:
            self.host.remove_adapter(adapter)
            raise
        self.adapters[run.id] = adapter
        self.store.runs.set_status(run.id, 'active')
        source = None if checkpoint is None else checkpoint.twinkle_path
        event = self.store.history.record_restore(run.id, restored['optim_step'], source, restored['fresh_optimizer'])
        if event is not None:
            logger.warning(f'training run {run.id!r} came back with less than it had: {event}')

    def _state_or_refuse(self, run: Run) -> tuple[Path, Checkpoint | None]:
        found = self._saved_state(run)
        if found is None:
            raise StateError(
                f'training run {run.id!r} is not on the model and left no state to restore (the server stopped '
                'without saving it): load one of its checkpoints into a new run'
            )
        return found

    # ---- room on the model -----------------------------------------------------------------------
    def make_room(self, run: Run) -> None:
        """Before ``run``'s adapter is added (worker thread): a tenant holding its
        ``max_adapters_per_tenant`` adapters gives up its least recently used one, and a model
        holding ``max_adapters`` one of a tenant holding more than an equal share of the pool
        (least recently used first; else the least recently used of all). A released adapter
        keeps all it held (gradients waiting for a step too) and comes back on its next request.
        Only adapters the running requests use stay: if every candidate is one, ``CapacityError``
        (429) with a Retry-After of when they are expected to end."""
        limits = self.config.limits
        own = self._held(run.tenant_id, but=run.id)
        if len(own) >= limits.max_adapters_per_tenant:
            why = f'you hold {len(own)} adapters on the model, the limit of max_adapters_per_tenant='
            self._release_one(own, f'{why}{limits.max_adapters_per_tenant}')
        everyone = self._held(None, but=run.id)
        if len(everyone) >= limits.max_adapters:
            why = f'the server holds its limit of {limits.max_adapters} adapters (max_adapters)'
            self._release_one(self._fairly(everyone, run.tenant_id), why)

    def _held(self, tenant_id: str | None, but: str | None = None) -> list[Run]:
        """Runs (of a tenant, or of all) with an adapter on this model, least recently used first."""
        return [run for run in self.store.runs.active(tenant_id) if run.id in self.adapters and run.id != but]

    def _fairly(self, runs: list[Run], asking: str) -> list[Run]:
        """``runs`` (least recently used first) in the order they give up their place: those of
        tenants holding more than an equal share of the pool (each tenant holding one, and the
        one asking, counted) first, so a few tenants cannot keep the others out."""
        held = Counter(run.tenant_id for run in runs)
        share = self.config.limits.max_adapters / len(held.keys() | {asking})
        return sorted(runs, key=lambda run: held[run.tenant_id] <= share)  # stable: least recently used first

    def _release_one(self, runs: list[Run], why: str) -> None:
        """Release the first of ``runs`` the running requests do not use; ``CapacityError`` if none."""
        if any(run.id not in self.pinned and self.release(run) for run in runs):
            return
        wait_s = self._running_left_s()
        raise CapacityError(
            f'{why}, and each is in use by the requests running now: retry once they end, in about {wait_s:.0f} s',
            retry_after_s=wait_s,
        )


__all__ = ['AdapterPool']
