"""The service's model on N worker processes: data parallel, FSDP2, or both, as a device mesh says.

``MultiRankHost`` (in the server's process) starts ``ranks`` worker processes on this machine.
They join over ``torch.distributed`` (gloo on the CPU, NCCL on GPUs), each builds a ``RankHost``
(a ``ModelHost`` on the mesh ``DeviceMesh.from_sizes(**config.mesh_sizes())``: FSDP2 and data parallel, or
with ``backend: megatron`` tensor, pipeline and data parallel),
and from then on every call of the service runs on every rank, in the same order (SPMD):

- a pass of several tenants' rows (``run_mixed``, ``forward_backward``, ``forward_only``) is split
  over the data-parallel ranks, each request into contiguous shares (a rank's share may be empty);
  the losses and gradients are summed over the ranks and divided by the pass's global item count,
  so a tenant gets the numbers of a one-rank server whoever shares its pass; a rank's logprobs
  are gathered, so every rank returns the whole request's result, and the server takes rank 0's;
- under FSDP2 the base model is sharded before any adapter (``TransformersModel.shard_base``):
  each tenant's LoRA weights and optimizer state stay whole, in fp32, on every rank;
- everything else (adapters, optimizer steps, saves, loads) runs alike on every rank; a checkpoint
  is written once, by rank 0, atomically as in one process.

The checks a route runs before queueing (``RequestChecks``) are answered in the server's process,
without a round trip to the workers. The workers run one call at a time, in the order the server
sends them; a call that fails raises rank 0's error (every rank raises the same one, since each
checks the same request). A worker that dies (``kill -9``, an OOM kill) fails the call in flight
with an error that says so; the others are stopped (their collectives would wait for it forever),
and the next call starts the group again (``ModelGroup`` restores its runs).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, Protocol, cast

import torch

from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import ConfigurationError, DataError, WorkerError
from twinkle.infra import distributed
from twinkle.infra.ray.dispatch import shard_bounds
from twinkle.server.config import ServerConfig, check_layout, gpu_indices
from twinkle.server.execution.checks.images import ImageRows
from twinkle.server.execution.host import (
    FORWARDED,
    AdapterRequest,
    Footprint,
    Forwarded,
    ForwardingHost,
    Json,
    JsonObject,
    Outcome,
)
from twinkle.server.execution.hosts.model_host import Described, ModelHost, weights_footprint
from twinkle.server.execution.sampling.vllm import samples_on_vllm

#: Seconds a worker may take to load the model and join the others.
START_TIMEOUT_S = 600.0
#: Seconds the workers get to exit at shutdown before they are killed.
STOP_TIMEOUT_S = 10.0
#: A CPU worker's torch threads, when ``ProcessRanks`` is given them (a sampler group beside its model).
THREADS_ENV = 'TWINKLE_RANK_THREADS'
#: Seconds the other ranks get to answer once one rank failed a call: every rank checks the same
#: request, so they fail alike at once; ranks that do not answer wait in a collective for it.
ERROR_GRACE_S = 30.0


# ---- the worker side ----------------------------------------------------------------------------
class RankDescribed(Described):
    """What rank 0 tells the server once: the model's shape, and the LoRA targets of each choice
    of Tinker's switches (so a route never waits for a pass to learn them)."""

    lora_targets: dict[tuple[bool, bool, bool], list[str]]
    expert_targets: list[str]


class RankHost(ModelHost):
    """A ``ModelHost`` on one rank of a mesh: the data operations take the whole request, run this
    rank's share of its rows, and return the whole request's result (gathered from every rank)."""

    def __init__(self, config: ServerConfig):
        super().__init__(config)
        self.model.shard_base()  # FSDP2: the base is sharded now, adapters come and go beside it
        mesh = self.model.device_mesh
        self.data_rank = distributed.data_rank(mesh) if mesh is not None else 0
        self.data_ranks = mesh.dp_world_size if mesh is not None else 1

    def hosts_sampler_engine(self) -> bool:
        return distributed.is_main()

    def describe(self) -> RankDescribed:
        """What the server keeps of the model: its shape, and the LoRA targets of each choice of
        Tinker's switches (so a route never waits for a pass to learn them)."""
        switches = [
            (attn, mlp, unembed) for attn in (False, True) for mlp in (False, True) for unembed in (False, True)
        ]
        return {
            **super().describe(),
            'lora_targets': {choice: self.lora_targets(*choice) for choice in switches},
            'expert_targets': self.expert_targets(),
        }

    def footprint(self) -> list[Footprint]:
        """Every rank's: what it holds of the base weights (its FSDP2 shard), and its resident memory."""
        return distributed.all_gather_object(weights_footprint(self.model.model, distributed.rank()))

    def run_mixed(self, operation: str, requests: list[AdapterRequest]) -> list[Outcome]:
        shared = [
            (adapter, row_share(kwargs, index, self.data_rank, self.data_ranks))
            for index, (adapter, kwargs) in enumerate(requests)
        ]
        results = super().run_mixed(operation, shared)
        if operation != 'forward_only':
            return results  # losses and token counts are the pass's, summed over the ranks already
        gathered = distributed.all_gather_object(
            (self.data_rank, [r['logps'] if isinstance(r, dict) else [] for r in results])
        )
        # By data rank: the ranks of one tensor- or pipeline-parallel group hold the same share.
        shares: dict[int, list[Json]] = {}
        for data_rank, logps in gathered:
            shares.setdefault(data_rank, logps)
        for index, result in enumerate(results):
            if isinstance(result, dict):  # the shares in row order: request i's first share is data rank i's
                ranks = sorted(range(self.data_ranks), key=lambda rank: (rank - index) % self.data_ranks)
                result['logps'] = [row for rank in ranks for row in shares[rank][index]]
        return results

    def _forward_backward(self, adapter: str, inputs: Json, **kwargs: Json) -> JsonObject:
        if kwargs.pop('micro_batch_size', None) is not None:
            raise ConfigurationError(
                'micro_batch_size is not taken by a model on several ranks: each rank runs its share of the rows '
                'in one pass; send smaller requests instead'
            )
        return _one(self.run_mixed('forward_backward', [(adapter, {'inputs': inputs, **kwargs})]))

    def _forward_only(self, adapter: str, inputs: Json, disable_lora: bool = False) -> JsonObject:
        if disable_lora:  # the base model alone: every rank runs the whole request (no adapter to mix)
            return super()._forward_only(adapter, inputs, disable_lora=True)
        return _one(self.run_mixed('forward_only', [(adapter, {'inputs': inputs})]))

    def whole_request_share(self) -> float:
        """The ranks of data shard 0 count a request every rank runs whole (Tinker's
        ``forward_backward``): the other shards' losses are scaled by 0, so the gradient summed over
        the data-parallel ranks is one shard's, not N times it. Under megatron every rank of shard
        0's tensor- and pipeline-parallel group counts it: each computes the gradient of its own
        slice of the weights (rank 0 alone, when every rank is a shard of its own)."""
        return 1.0 if self.data_rank == 0 else 0.0

    def generate(
        self, prompts: list[JsonObject], params: SamplingParams, adapter: str | None, weight_version: int = 0
    ) -> list[SampleResponse]:
        """Data parallel, or through vLLM (``sampler: vllm``, whose engine rank 0 holds): rank 0
        samples, the others wait. FSDP2: every rank samples the same sequences in step (its
        forwards all-gather the weights), from one seed rank 0 draws."""
        if not self.model.uses_fsdp or samples_on_vllm(self.config):
            return super().generate(prompts, params, adapter, weight_version) if distributed.is_main() else []
        seed = distributed.all_gather_object(int(torch.randint(0, 2**62, ()).item()))[0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return super().generate(prompts, params, adapter, weight_version)


def row_share(kwargs: JsonObject, index: int, data_rank: int, data_ranks: int) -> JsonObject:
    """Rank ``data_rank``'s share of the ``index``-th request of a pass: its contiguous part of the
    rows (``inputs``) and of each per-row argument (advantages, old logprobs). Request ``i``'s
    first share goes to rank ``i`` (modulo the ranks), so one-row requests spread evenly.

    >>> kwargs = {'inputs': [{'input_ids': [1]}] * 3, 'advantages': [1.0, 2.0, 3.0], 'micro': 4}
    >>> [row_share(kwargs, 0, rank, 2)['advantages'] for rank in (0, 1)]
    [[1.0, 2.0], [3.0]]
    >>> [row_share(kwargs, 1, rank, 2)['advantages'] for rank in (0, 1)]  # request 1 starts on rank 1
    [[3.0], [1.0, 2.0]]
    """
    rows = kwargs['inputs']
    if not isinstance(rows, list):
        return kwargs
    for key, value in kwargs.items():  # every rank holds the whole request: all refuse it alike
        if isinstance(value, list) and len(value) != len(rows):
            raise DataError(f'loss input {key!r} has {len(value)} entries for {len(rows)} rows')
    if data_ranks == 1:
        return kwargs
    start, end = shard_bounds(len(rows), (data_rank - index) % data_ranks, data_ranks)
    return {k: v[start:end] if isinstance(v, list) else v for k, v in kwargs.items()}


def _one(results: list[Outcome]) -> JsonObject:
    """The result of a pass of one request, or its error raised."""
    (result,) = results
    if isinstance(result, Exception):
        raise result
    return cast(JsonObject, result)


def serve_rank(address: str, authkey: bytes) -> None:
    """A worker process: connect to the server, join the group, build the ``RankHost``, then run
    the server's calls until it says stop or goes away."""
    server_host, server_port = address.rsplit(':', 1)
    conn = Client((server_host, int(server_port)), authkey=authkey)
    rank, world, port, config, path = _recv(conn)
    pinned = bool(os.environ.get('TWINKLE_RANK_DEVICE'))  # one visible GPU (CUDA_VISIBLE_DEVICES), its own
    sys.path[:] = path  # the modules the server imports (whose functions it sends) import here too
    os.environ.update(
        MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(0 if pinned else rank), LOCAL_WORLD_SIZE=str(1 if pinned else world),
    )  # fmt: skip
    try:
        host = _rank_host(ServerConfig(**config), world)
        _send(conn, ('ok', host.describe()))
    except BaseException as error:
        _send(conn, ('error', _portable(error)))
        return
    while True:
        try:
            message = _recv(conn)
        except EOFError:
            return  # the server is gone
        except Exception as error:  # a message this process cannot unpickle (a function it cannot import)
            _send(conn, ('error', _portable(error)))
            continue
        if message is None:
            host.shutdown()
            return
        name, args = message
        try:
            if name not in FORWARDED:
                raise ConfigurationError(f'a model worker runs {sorted(FORWARDED)}; not {name!r}')
            reply = ('ok', getattr(host, name)(*args))
        except BaseException as error:
            reply = ('error', _portable(error))
        _send(conn, reply)


def _rank_host(config: ServerConfig, world: int) -> RankHost:
    """What each torchrun process of a script runs first (the mesh, the process group), then the host."""
    from twinkle.infra.mesh import DeviceMesh
    from twinkle.infra.runtime import Runtime, start_local

    device_type = 'cuda' if (config.device or '').startswith('cuda') else 'cpu'
    if device_type == 'cpu':
        torch.set_num_threads(rank_threads(world))
    mesh = DeviceMesh.from_sizes(**config.model_copy(update={'ranks': world}).mesh_sizes(), device_type=device_type)
    start_local(Runtime('local', None, global_device_mesh=mesh))
    # One rank keeps its device as given (cuda:1, say); ranks of a mesh take cuda:LOCAL_RANK.
    device = config.device if world == 1 else (None if device_type == 'cuda' else 'cpu')
    if os.environ.get('TWINKLE_RANK_DEVICE'):  # the one GPU CUDA_VISIBLE_DEVICES leaves this rank
        device = None
    return RankHost(config.model_copy(update={'device': device}))


def rank_threads(world: int) -> int:
    """A CPU worker's torch threads: the machine's cores shared by the ranks (and by a model beside
    them, when ``ProcessRanks`` was given ``threads``), not each taking them all."""
    return int(os.environ.get(THREADS_ENV) or 0) or max(1, (os.cpu_count() or 1) // world)


def _send(conn: Connection, message: Any) -> None:
    """Plain pickle, not the connection's own: torch makes that one pass tensors as shared
    memory handles, which only a ``multiprocessing`` child (with the server's authkey) can open."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _portable(error: BaseException) -> tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]:
    """An exception as (class, args, attributes): twinkle's errors take other arguments than the
    message they keep in ``args``, so pickling them whole would fail on the server's side."""
    attributes = {k: v for k, v in vars(error).items() if _picklable(v)}
    return type(error), tuple(a for a in error.args if _picklable(a)), attributes


def _rebuilt(portable: tuple[type[BaseException], tuple[Any, ...], dict[str, Any]]) -> BaseException:
    cls, args, attributes = portable
    error = cls.__new__(cls)
    error.args = args
    vars(error).update(attributes)
    return error


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


# ---- the server side ----------------------------------------------------------------------------
class RankDied(Exception):
    """A worker of the group died (or did not start in time); the message says which and how."""


class Ranks(Protocol):
    """How the server reaches its workers: processes it starts (``ProcessRanks``), or Ray
    actors on any node of a cluster (``twinkle.server.execution.hosts.ray_ranks.RayRanks``)."""

    described: RankDescribed  # rank 0's RankHost.describe()

    @property
    def pids(self) -> list[int]:
        """The worker processes, by rank."""
        ...

    def run(self, name: Forwarded, args: tuple[object, ...]) -> object:
        """Rank 0's result of ``name`` on every rank; a rank's error raised; ``RankDied`` if one died."""
        ...

    def stop(self, dead: bool) -> None: ...


class MultiRankHost(ForwardingHost):
    """The model on ``config.ranks`` workers: every forwarded method runs on every rank, in order."""

    def __init__(self, config: ServerConfig, start: Callable[[ServerConfig], Ranks] | None = None):
        """``start`` makes the workers: ``ProcessRanks`` (the default) or ``RayRanks``."""
        check_layout(config)  # a config made by model_copy is not validated again
        if config.backend == 'megatron':  # say so here, before starting workers that would each fail
            from twinkle.model.megatron.model import require_megatron

            require_megatron()
        self.config = config
        self._start_workers = start or ProcessRanks
        self.ranks = config.ranks
        self.device = torch.device('cuda' if (config.device or '').startswith('cuda') else 'cpu')
        self.restarts = 0  # times the workers were started again after one died
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._workers = self._start()
        described = self._workers.described
        self.model_id = described['model_id']
        self.vocab_size = described['vocab_size']
        self.context = described['context']
        self.architecture = described['architecture']
        self.image_rows = ImageRows.of(self.model_id, config.limits)
        self._lora_targets: dict[tuple[bool, bool, bool], list[str]] = described['lora_targets']
        self._expert_targets: list[str] = described['expert_targets']

    @property
    def pids(self) -> list[int]:
        """The worker processes, by rank."""
        return self._workers.pids

    def forward(self, name: Forwarded, *args: object) -> object:
        with self._lock:
            if self._dead is not None:
                raise WorkerError(f'{self._dead}; it restarts before the next request')
            try:
                return self._workers.run(name, args)
            except RankDied as died:
                self._workers.stop(dead=True)  # the others wait in a collective for the dead one
                self._dead = str(died)
                raise WorkerError(
                    f'{died}; the model restarts, and its runs continue from their last saved state'
                ) from None

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[str]:
        return list(self._lora_targets[(attn, mlp, unembed)])

    def expert_targets(self) -> list[str]:
        return list(self._expert_targets)

    def shutdown(self) -> None:
        with self._lock:
            self._workers.stop(dead=False)
            self._dead = self._dead or 'the model workers were stopped'

    def restart_if_dead(self) -> str | None:
        """Start the workers again if one died; then what happened to it (every adapter is gone),
        else None."""
        with self._lock:
            reason = self._dead
            if reason is None:
                return None
            self._workers = self._start()
            self._dead = None
            self.restarts += 1
            return reason

    def _start(self) -> Ranks:
        return self._start_workers(self.config)


class ProcessRanks:
    """The workers as processes of this machine: ``python -m twinkle.server.execution.hosts.multi_rank``, a fresh
    interpreter (the server's own script, which may lack a ``__main__`` guard, is not run again),
    each connected back over a local socket."""

    def __init__(self, config: ServerConfig, threads: int | None = None):
        """``threads``: each CPU worker's torch threads (None: the machine's cores split among the ranks)."""
        self.config, self.ranks = config, config.ranks
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        authkey = secrets.token_bytes(32)
        with Listener(('127.0.0.1', 0), authkey=authkey) as listener:
            host, port = listener.address
            env = {**os.environ, 'TWINKLE_RANK_AUTHKEY': authkey.hex()}
            env.pop(THREADS_ENV, None)
            if threads is not None:
                env[THREADS_ENV] = str(threads)
            command = [sys.executable, '-m', 'twinkle.server.execution.hosts.multi_rank', f'{host}:{port}']
            try:
                for rank in range(self.ranks):
                    self._procs.append(subprocess.Popen(command, env={**env, **gpu_env(config.device, rank)}))
                self.described: RankDescribed = self._join(listener)
            except BaseException:
                self.stop(dead=True)
                raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def run(self, name: Forwarded, args: tuple[object, ...]) -> object:
        for rank, conn in enumerate(self._conns):
            try:
                _send(conn, (name, args))
            except OSError:  # its end is closed: the worker died while the group was idle
                raise self._died(rank, name) from None
        return self._replies(name)

    def stop(self, dead: bool) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):  # that worker is gone already
                _send(conn, None)
        for proc in self._procs:
            try:
                proc.wait(0.1 if dead else STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns = []

    def _join(self, listener: Listener) -> RankDescribed:
        """Accept every worker's connection, give each its rank and the config, wait until ready.
        A worker that exits before it connects closes the listener, so ``accept`` gives up."""
        port, data = _free_port(), self.config.model_dump()
        connected = threading.Event()
        watcher = threading.Thread(target=self._watch_start, args=(listener, connected), daemon=True)
        watcher.start()
        try:
            for rank in range(self.ranks):
                try:
                    conn = listener.accept()
                except OSError:
                    ended = next((r for r, p in enumerate(self._procs) if p.poll() is not None), None)
                    raise self._died(ended, 'start-up') from None
                _send(conn, (rank, self.ranks, port, data, sys.path))
                self._conns.append(conn)
        finally:
            connected.set()
            watcher.join()
        return cast(RankDescribed, self._replies('start-up', timeout=START_TIMEOUT_S, fail_fast=True))

    def _watch_start(self, listener: Listener, connected: threading.Event) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not connected.wait(0.2):
            if time.monotonic() > deadline or any(proc.poll() is not None for proc in self._procs):
                listener.close()
                return

    def _replies(self, what: str, timeout: float | None = None, fail_fast: bool = False) -> object:
        """Every rank's reply to the call just sent; rank 0's value, or the first rank's error
        (``fail_fast``: as soon as one rank fails, as at start-up, where the others may be waiting
        for it to join)."""
        replies: dict[int, tuple[str, Any]] = {}
        while len(replies) < self.ranks:
            waiting = [conn for rank, conn in enumerate(self._conns) if rank not in replies]
            failed = [rank for rank, (status, _) in replies.items() if status == 'error']
            ready = wait(waiting, ERROR_GRACE_S if failed else timeout)
            if not ready and failed:  # the others wait in a collective for the rank that failed
                error = _rebuilt(replies[failed[0]][1])
                raise RankDied(
                    f'model worker rank {failed[0]} of {self.ranks} failed during {what} ({error}) while '
                    'the others went on'
                )
            if not ready:
                raise self._died(None, what)
            for item in ready:
                assert isinstance(item, Connection)
                rank = self._conns.index(item)
                try:
                    replies[rank] = _recv(item)
                except (EOFError, OSError):  # the worker's end closed: it died
                    raise self._died(rank, what) from None
                if fail_fast and replies[rank][0] == 'error':
                    raise _rebuilt(replies[rank][1])
        for rank in range(self.ranks):
            status, value = replies[rank]
            if status == 'error':
                raise _rebuilt(value)
        return replies[0][1]

    def _died(self, rank: int | None, what: str) -> RankDied:
        """What died: the workers that ended, killed ones first (a rank whose peer was killed may
        end too, when its collective breaks); or the start that timed out."""
        if rank is None:
            return RankDied(f'the model workers did not answer {what} within {START_TIMEOUT_S:.0f} s')
        deaths = ', '.join(f'rank {r} of {self.ranks} {_how(code)}' for r, code in _ended(self._procs, rank))
        return RankDied(f'model worker {deaths} during {what}')


def gpu_env(device: str | None, rank: int) -> dict[str, str]:
    """The environment that pins rank ``rank`` to its GPU of ``device`` ('cuda:2,3': rank 0 on
    GPU 2, rank 1 on GPU 3); none for a device without a list of indices."""
    indices = gpu_indices(device)
    if not indices:
        return {}
    return {'CUDA_VISIBLE_DEVICES': str(indices[rank]), 'TWINKLE_RANK_DEVICE': str(indices[rank])}


def _ended(procs: list[subprocess.Popen[bytes]], rank: int) -> list[tuple[int, int | None]]:
    """(rank, exit code) of the workers that have ended, within a moment, killed ones first;
    ``rank`` (whose connection closed) at least."""
    deadline = time.monotonic() + 2.0
    while procs[rank].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = [(r, proc.poll()) for r, proc in enumerate(procs) if proc.poll() is not None or r == rank]
    return sorted(ended, key=lambda item: (item[1] is None or item[1] >= 0, item[0]))


def _how(code: int | None) -> str:
    if code is None:
        return 'stopped answering'
    return f'died (signal {-code})' if code < 0 else f'died (exit code {code})'


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port: int = sock.getsockname()[1]
        return port


__all__ = ['MultiRankHost', 'ProcessRanks', 'RankDied', 'RankHost', 'Ranks', 'serve_rank']

if __name__ == '__main__':
    serve_rank(sys.argv[1], bytes.fromhex(os.environ.pop('TWINKLE_RANK_AUTHKEY')))
