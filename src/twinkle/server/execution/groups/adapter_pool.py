"""``AdapterPool``: the runs with an adapter on one hosted model.

A model holds at most ``max_adapters`` adapters, ``max_adapters_per_tenant`` of one tenant. A
run's adapter comes and goes: released when idle or to make room for another (its whole state
kept: weights, optimizer, counters, gradients waiting for a step), restored on its next request
from its kept state or a newer checkpoint (``run_files.latest_state``). A state is also kept every
``save_state_every_steps`` steps, committed with the step's answer (``keep_state``): a worker that
dies takes no answered step with it, and what it does take (requests answered after the state was
kept) is told to the run's client, as its next request's error (``LostWorkError``). Kept states
tier: in host memory (``memory_state_bytes`` of them, in a RAM-backed folder, which outlives the
server's process), then the least recently kept on disk.
Room is made fairly: an adapter of a tenant holding more than an equal share of the pool goes
first, least recently used first; only the adapters the running requests use are never released.
Every method runs on the model's worker thread, where no request can use an adapter while it moves;
states move from memory to disk on a thread of their own, off the requests' path, one at a time
under the pool's lock, which every method that reads or writes a state holds.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypedDict

from typing_extensions import Unpack

from twinkle.errors import CapacityError, LostWorkError, NotFoundError, StateError
from twinkle.model.checkpoint import files as ckpt
from twinkle.server.config import ServerConfig
from twinkle.server.execution.groups.run_files import (
    copy_to_disk,
    drop,
    kept_places,
    latest_state,
    new_state_folder,
    state_in_memory,
    state_on_disk,
)
from twinkle.server.execution.host import Host, JsonObject
from twinkle.server.store import Checkpoint, LostRequest, Run, Store
from twinkle.utils.logger import get_logger

logger = get_logger()
#: Operations of both APIs whose effect lives in a run's kept state (its gradients, weights, optimizer,
#: counters): answered after the state a run comes back from, they were lost with it. (Setup calls are
#: replayed, and forwards change nothing.)
STATEFUL_OPERATIONS = frozenset(
    {'forward_backward', 'clip_grad_norm', 'step', 'zero_grad', 'lr_step', 'clip_grad_and_step', 'load',
     'optim_step', 'load_weights'}
)  # fmt: skip
#: Lost requests a ``LostWorkError`` lists by id; more are counted.
LISTED_LOST = 20


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
        #: Runs whose kept state is in host memory, least recently kept first: run id -> (its state
        #: there, where it goes on disk, its bytes). A state stays after its run comes back (what a
        #: dead worker's runs come back from) until the run's next kept state replaces it or it goes to disk.
        self.in_memory: OrderedDict[str, tuple[Path, Path, int]] = OrderedDict()
        #: Runs brought back without requests the server had answered, which their clients have not
        #: been told of yet: their next request fails with them (``loaded``), once.
        self.lost: dict[str, list[LostRequest]] = {}
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
        """Take a run's adapter off the model, if it is there, and the state kept of it (worker thread)."""
        adapter = self.adapters.pop(run.id, None)
        if adapter is not None:
            self.host.remove_adapter(adapter)
        self.forget_states(run)

    def adapter_name(self, run: Run) -> str:
        """The name of a run's adapter on the model: its run id, unique on the server (the store
        makes it), so what the model's errors name is what the tenant knows. A tenant reaches an
        adapter only through its own runs, so naming another tenant's run reaches nothing."""
        return run.id

    def loaded(self, run: Run) -> str:
        """The run's adapter on the model, restored first if it was released (worker thread).
        ``LostWorkError`` instead while the run's client has not been told of requests it lost."""
        if run.id not in self.adapters:
            self.restore(self._stored_run(run.id))
        if run.id in self.lost:
            raise self._lost_error(run.id, self.lost[run.id])
        self.pinned.add(run.id)
        return self.adapters[run.id]

    def told(self, run_id: str, fail: Callable[[], object]) -> None:
        """A request of the run failed with its ``LostWorkError``: ``fail`` writes it in the request's
        future, and the run's lost requests are forgotten in the same commit, so a crash between the
        two neither leaves the client untold nor tells it twice."""
        with self.store.transaction():
            fail()
            if run_id in self.lost:
                self.store.states.told(run_id)
        self.lost.pop(run_id, None)

    def _stored_run(self, run_id: str) -> Run:
        """The run as the store has it now (its latest config and status)."""
        run = self.store.runs.by_id(run_id)
        if run is None:
            raise NotFoundError(f'training run {run_id!r} not found')
        return run

    # ---- kept states ------------------------------------------------------------------------------
    def saved_state(self, run: Run) -> Path | None:
        """Where a run off the model continues from (``restore``); None if it has nothing. Safe
        off the worker thread (a route asks): a state moving from memory to disk is in one or the
        other at every moment (``_spill``), and both are looked in (``run_files.kept_places``)."""
        found = self._saved_state(run)
        return None if found is None else found[0]

    def _saved_state(self, run: Run) -> tuple[Path, Checkpoint | None] | None:
        """The run's kept state or training checkpoint that stands at its latest optimizer step (``latest_state``)."""
        checkpoints = [c for c in self.store.checkpoints.of_run(run.tenant_id, run.id) if c.kind == 'training']
        named = self.store.states.get(run.id)
        return latest_state(kept_places(self.config, run, None if named is None else named.folder), checkpoints)

    def keep_state(
        self, run: Run, adapter: str, to_disk: bool = False, commit: Callable[[], None] | None = None
    ) -> None:
        """Keep the run's whole state (weights, optimizer, counters, accumulation window) in a folder of
        its own, in host memory while it has room (else, or ``to_disk``, on disk), then commit it: the
        store names it the run's state in one transaction with ``commit()`` (a step's answer), and the
        state it replaces is deleted. A crash before the commit leaves the old state and the old answer."""
        folder = new_state_folder()
        with self._states:
            path = self._write_state(run, adapter, folder, to_disk)
            try:
                with self.store.transaction():
                    replaced = self.store.states.commit(run.id, folder)
                    if commit is not None:
                        commit()
            except BaseException:
                drop(path)
                raise
            self._forget_state(run, replaced)
            disk = state_on_disk(self.config, run, folder)
            if path != disk:
                self.in_memory[run.id] = (path, disk, ckpt.folder_size(path))
        if self.in_memory:
            self._spiller.submit(self._spill, self.config.memory_state_bytes)

    def _write_state(self, run: Run, adapter: str, folder: str, to_disk: bool) -> Path:
        """Save the run's state as ``folder`` in host memory (unless ``to_disk``, or memory does not
        take it) or on disk; where it went."""
        memory = None if to_disk else state_in_memory(self.config, run, folder)
        if memory is not None:
            try:
                self.host.save(adapter, memory.parent, memory.name, save_optimizer=True)
                if (memory / ckpt.TRAINER_STATE).is_file():
                    return memory
                unshared = 'memory_state_dir is not shared with its model'
                logger.warning(f'the state of run {run.id!r} went to disk: {unshared}')
            except OSError as error:
                logger.warning(f'the state of run {run.id!r} went to disk, host memory did not take it: {error}')
            drop(memory)
        disk = state_on_disk(self.config, run, folder)
        self.host.save(adapter, disk.parent, disk.name, save_optimizer=True)
        return disk

    def _forget_state(self, run: Run, folder: str | None) -> None:
        """Delete a kept state no row names any more, wherever it is (under the lock)."""
        kept = self.in_memory.get(run.id)
        if kept is not None and (folder is None or kept[0].name == folder):
            del self.in_memory[run.id]
        if folder is None:
            return
        memory = state_in_memory(self.config, run, folder)
        for place in (memory, state_on_disk(self.config, run, folder)):
            if place is not None:
                drop(place)

    def keep_state_or_warn(self, run: Run, commit: Callable[[], None] | None = None) -> None:
        """``keep_state`` if the run is on the model; a failure is logged (and ``commit`` made alone),
        its next save or step tries again."""
        adapter = self.adapters.get(run.id)
        if adapter is None:
            if commit is not None:
                with self.store.transaction():
                    commit()
            return
        try:
            self.keep_state(run, adapter, commit=commit)
        except Exception as error:  # a dead worker, a full disk: its next save or step tries again
            logger.warning(f'the state of run {run.id!r} was not kept: {type(error).__name__}: {error}')
            if commit is not None:
                with self.store.transaction():
                    commit()

    def release(self, run: Run, to_disk: bool = False) -> bool:
        """Keep a run's adapter with its optimizer, counters and accumulation window (gradients
        waiting for a step included), then take it off the model (worker thread): into host memory
        while it has room (``memory_state_bytes``, the least recently kept going to disk to make
        it), else, or ``to_disk``, to disk. A pending forward (``forward_only``, waiting for
        ``calculate_loss``) is not kept. False if the run was not on the model."""
        adapter = self.adapters.get(run.id)
        if adapter is None:
            return False
        self.keep_state(run, adapter, to_disk=to_disk)
        self.host.remove_adapter(adapter)
        del self.adapters[run.id]
        self.store.runs.set_status(run.id, 'released')
        return True

    def spill_all(self) -> int:
        """Move every kept state in host memory to disk (a graceful stop), once the moves
        under way are done; how many."""
        count = len(self.in_memory)
        self._spiller.submit(self._spill, 0).result()
        return count

    def close(self) -> None:
        """Finish the moves under way and stop their thread (the server stops)."""
        self._spiller.shutdown(wait=True)

    def _spill(self, budget: int) -> None:
        """Move the least recently kept states in memory to disk until they hold ``budget`` bytes
        (the spill thread). A kept folder never changes, so it is copied without the lock, which
        steps and restores hold; under it, the copy in memory goes if the run still names it, and
        the one on disk does if the run replaced or deleted its state meanwhile."""
        while True:
            with self._states:
                if not self.in_memory or sum(size for _, _, size in self.in_memory.values()) <= budget:
                    return
                run_id, kept = next(iter(self.in_memory.items()))
            memory, disk, _ = kept
            try:
                copy_to_disk(memory, disk)
            except Exception as error:  # a full disk: the state stays in memory, a later step tries again
                with self._states:
                    if self.in_memory.get(run_id) == kept:
                        self.in_memory.move_to_end(run_id, last=False)
                        logger.warning(f'the state of run {run_id!r} stays in memory, the disk refused it: {error}')
                        return
                continue  # replaced or deleted while it was copied: nothing to move
            with self._states:
                if self.in_memory.get(run_id) == kept:
                    del self.in_memory[run_id]
                    drop(memory)
                else:
                    drop(disk)

    def forget_states(self, run: Run) -> None:
        """The run was deleted: its kept state goes, from memory and disk, and its row."""
        named = self.store.states.get(run.id)
        with self._states:
            self._forget_state(run, None if named is None else named.folder)
        self.store.states.forget(run.id)
        self.lost.pop(run.id, None)

    def restore(self, run: Run) -> None:
        """Bring a released run back: its adapter, its setup calls replayed, then its saved state
        (``_saved_state``). A state older than the run's last recorded step, or weights alone,
        is recorded in its history (``History.record_restore``: what its ``restored_from`` says);
        requests answered after the state was kept are the run's lost ones (``_find_lost``)."""
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
        self._find_lost(run, path, checkpoint)

    def _find_lost(self, run: Run, path: Path, checkpoint: Checkpoint | None) -> None:
        """The requests the server answered after the state ``path`` was kept (or ``checkpoint``
        saved) whose effect the run does not have now: added to what its client is to be told."""
        named = self.store.states.get(run.id)
        if checkpoint is not None:
            since = checkpoint.created_at
        elif named is not None and named.folder is not None:
            since = named.at
        else:  # an older server's state, which the store does not name
            since = (path / ckpt.TRAINER_STATE).stat().st_mtime
        since = max(since, named.lost_through if named is not None else 0.0)  # those told of already
        answered = self.store.futures.answered_since(run.id, since, STATEFUL_OPERATIONS)
        if not answered and not (named is not None and named.lost):
            return
        through = max((started for _, _, started in answered), default=since)
        lost = [LostRequest(id=future_id, op=op) for future_id, op, _ in answered]
        self.lost[run.id] = self.store.states.add_lost(run.id, lost, through)
        if self.lost[run.id]:
            logger.warning(f'training run {run.id!r} came back without {len(self.lost[run.id])} answered requests')
        else:
            del self.lost[run.id]

    def _lost_error(self, run_id: str, lost: list[LostRequest]) -> LostWorkError:
        named = ', '.join(f'{request.op} {request.id}' for request in lost[:LISTED_LOST])
        more = f' and {len(lost) - LISTED_LOST} more' if len(lost) > LISTED_LOST else ''
        return LostWorkError(
            f'training run {run_id!r} came back from its last kept state after its model worker stopped (the '
            f'server restarted, or a worker died); these {len(lost)} requests were answered after that state and '
            f'are not in it: {named}{more}. Send them again, in order, then this request (it did not run)',
            run_id=run_id,
        )

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
