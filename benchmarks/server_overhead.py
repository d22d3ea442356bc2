"""What does training through the twinkle server cost, against the same calls on a local
``TransformersModel``?

The server is a real ``twinkle-server serve`` subprocess on a free loopback port with its own
data directory (so its compute does not share this process's GIL), serving the same model on
the same device; tenant keys are made beforehand with ``twinkle-server keys add``. It is always
stopped when the benchmark ends, and runs with ``TWINKLE_OFFLINE=1`` and ``HF_HUB_OFFLINE=1``.
Three measurements, in one run:

1. **Training step.** LoRA r=16, alpha=32, ``all-linear``, AdamW lr 1e-4, clipping at 1.0, on
   fixed batches of self-cognition rows encoded once (as ``lora_overhead.py``):
   ``forward_backward`` then ``clip_grad_and_step``, locally on ``TransformersModel`` and
   remotely on ``MultiLoraTransformersModel`` (two requests, each one POST that waits for its
   future to settle, ``?wait=``: the real client cost). Both adapters start from the same seed, so the
   first-step losses must agree within 1e-4. After ``--warmup`` untimed steps each, the two
   take turns in blocks of ``--steps`` (local, remote, remote, local, ...) for ``--repeats``
   blocks; step ``k`` of either trains batch ``k``.
2. **Small request.** The round trip of ``get_train_configs()`` through the client against the
   same local call, in alternating blocks of ``--calls``; beside them a bare ``GET /healthz``
   (the HTTP floor) and the same request as two round trips, the client's ``submit`` (a POST
   answered with the future's id) then ``result`` (a GET of the future): what each call cost
   before ``?wait=``. Beside them, in this process, what the server spends reading a
   ``forward_backward`` body of the benchmark's rows as JSON (``json_ms_per_batch``: parsing and
   validating it, as its route does; ``json_us_per_token`` per token of the batch).
3. **Concurrent tenants.** Each of 1, 4 and 8 tenants (its own key, client and adapter) runs
   ``--tenant-steps`` training steps in its own thread, all started together; the total steps
   and tokens over the wall time, median over ``--tenant-rounds`` rounds (1, 4, 8, then 8, 4,
   1, ...). The server runs one step at a time on one worker, so the ideal is flat
   throughput: more tenants share it, none gets more.

Figures (``overhead_pct`` is the headline):

* ``median_step_s``, ``tokens_per_s``: as in ``lora_overhead.py``, per side.
* ``overhead_pct`` = (median over steps of remote_step_time / local_step_time - 1) * 100, each
  step compared with the local step on the same batch. Target: under 10%.
* ``added_ms`` = median remote round trip - median local call, for the small request.
* ``throughput_ratio`` of N tenants = their tokens/s over one tenant's tokens/s (the first
  ``--tenants`` count; tokens, not steps, because batches differ in length).

Usage::

    .venv/bin/python benchmarks/server_overhead.py    # ~1.5 min on 2 idle cores; writes results/server_overhead.json
    ... --repeats 40 --tenant-steps 10 --output /tmp/server_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import fastapi
import httpx
import torch
import transformers
import uvicorn
from lora_overhead import DISTURBED, Batch, Trace, TwinkleLoop, benchmark, encode_batches, lora_config, summarize
from lora_overhead import Settings as TrainingSettings
from lora_overhead import environment as training_environment

from twinkle import assets
from twinkle.wire import OPERATIONS
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel, wire_rows

TARGET_OVERHEAD_PCT = 10.0
SERVER_ENV = {'TWINKLE_OFFLINE': '1', 'HF_HUB_OFFLINE': '1'}


@dataclass
class Settings:
    # Embedded model name (twinkle.assets.MODELS) or a local model directory, served and trained locally.
    model: str
    # 'cpu' or 'cuda', for the local model and the server alike.
    device: str
    # Training step: timed steps per block, untimed steps per side before timing, blocks per side.
    steps: int
    warmup: int
    repeats: int
    # Small request: calls per block and blocks per kind.
    calls: int
    call_repeats: int
    # Concurrent tenants: how many at once (each count in turn), the steps each runs, and rounds over the counts.
    tenants: list[int]
    tenant_steps: int
    tenant_rounds: int
    # Rows per batch, and the longest encoded row.
    batch_size: int = 8
    max_length: int = 256
    # LoRA and optimizer settings shared by every adapter.
    lora_r: int = 16
    lora_alpha: int = 32
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = 0
    # Seconds to wait for the server subprocess to answer /healthz.
    startup_timeout_s: float = 300.0

    @property
    def mixed_precision(self) -> str:
        """What the server picks for its device (it takes no setting), so the local model matches."""
        return 'bf16' if self.device == 'cuda' and torch.cuda.is_bf16_supported() else 'no'

    def training(self) -> TrainingSettings:
        """The settings ``lora_overhead``'s loop and block alternation read."""
        shared = {name: getattr(self, name) for name in TrainingSettings.__dataclass_fields__}
        return TrainingSettings(**shared)


# ---- the server subprocess ------------------------------------------------------------------------
class ServerProcess:
    """``python -m twinkle.server.cli serve`` on a free loopback port; ``with`` yields its URL and
    stops it (SIGTERM, then SIGKILL) however the block ends."""

    def __init__(self, settings: Settings, workdir: Path):
        self.port = _free_port()
        self.log_path = workdir / 'server.log'
        config = workdir / 'server.json'  # the CLI has no --device flag; without one a GPU would be taken
        config.write_text(json.dumps({'device': settings.device}))
        self.args = [
            *(sys.executable, '-m', 'twinkle.server.cli', '--config', str(config), '--base-model', settings.model),
            *('--host', '127.0.0.1', '--port', str(self.port), '--data-dir', str(workdir / 'data')),
        ]
        self.env = {**os.environ, **SERVER_ENV}
        self.timeout_s = settings.startup_timeout_s
        self.process: subprocess.Popen | None = None

    def add_key(self, tenant: str) -> str:
        """``keys add <tenant>``: the new tenant's API key (the command prints only that)."""
        done = subprocess.run([*self.args, 'keys', 'add', tenant], env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f'keys add {tenant} failed ({done.returncode}): {done.stderr.strip()[-2000:]}')
        return done.stdout.strip().splitlines()[-1]

    def __enter__(self) -> str:
        with self.log_path.open('w') as log:
            self.process = subprocess.Popen([*self.args, 'serve'], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        url = f'http://127.0.0.1:{self.port}'
        try:
            self._wait_healthy(url)
        except BaseException:
            self.__exit__()
            raise
        return url

    def _wait_healthy(self, url: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f'the server exited ({self.process.returncode}) while starting:\n{self.log_tail()}')
            try:
                if httpx.get(f'{url}/healthz', timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f'the server did not answer /healthz within {self.timeout_s:.0f} s:\n{self.log_tail()}')

    def __exit__(self, *exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        return '\n'.join(self.log_path.read_text(errors='replace').splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


# ---- 1. training step -----------------------------------------------------------------------------
class RemoteLoop:
    """The same training as ``lora_overhead.TwinkleLoop``, through the client."""

    def __init__(self, client: TwinkleClient, settings: Settings, seed: int):
        self.max_grad_norm = settings.max_grad_norm
        self.model = MultiLoraTransformersModel(settings.model, client=client)
        self.model.add_adapter_to_model('default', lora_config(settings.training()), seed=seed)
        self.model.set_optimizer('AdamW', lr=settings.lr)

    def step(self, batch: Batch) -> float:
        output = self.model.forward_backward(inputs=batch)
        self.model.clip_grad_and_step(self.max_grad_norm)
        return output.loss


def summarize_training(traces: dict[str, Trace]) -> dict[str, Any]:
    """``lora_overhead.summarize`` of the remote loop against the local one, plus the
    milliseconds the server adds per step."""
    figures = summarize(traces, baseline='local', candidate='remote', target_pct=TARGET_OVERHEAD_PCT)
    loops = figures['loops']
    added = 1000 * (loops['remote']['median_step_s'] - loops['local']['median_step_s'])
    return {'loops': loops, 'added_ms_per_step': added, **{k: v for k, v in figures.items() if k != 'loops'}}


# ---- 2. small request -----------------------------------------------------------------------------
def time_calls(call: Callable[[], Any], count: int, into: list[float]) -> None:
    for _ in range(count):
        began = time.perf_counter()
        call()
        into.append(time.perf_counter() - began)


def small_request_latency(local: TwinkleLoop, remote: RemoteLoop, settings: Settings) -> dict[str, list[float]]:
    """Seconds per call of each kind, the kinds taking turns in blocks (order reversed every repeat)."""
    client = remote.model.client
    route = f'/twinkle/v1/runs/{remote.model.runs["default"]}/ops/get_train_configs'
    times: dict[str, list[float]] = {'local': [], 'remote': [], 'healthz': [], 'submit': [], 'result': []}

    def split_calls() -> None:  # what remote.model.get_train_configs() does, each leg timed apart
        for _ in range(settings.calls):
            began = time.perf_counter()
            future_id = client.submit(route, {})
            submitted = time.perf_counter()
            client.result(future_id)
            times['submit'].append(submitted - began)
            times['result'].append(time.perf_counter() - submitted)

    blocks = {
        'local': lambda: time_calls(local.model.get_train_configs, settings.calls, times['local']),
        'remote': lambda: time_calls(remote.model.get_train_configs, settings.calls, times['remote']),
        'healthz': lambda: time_calls(lambda: client.http.get('/healthz'), settings.calls, times['healthz']),
        'split': split_calls,
    }
    names = list(blocks)
    for _ in range(2):  # two untimed rounds: connections opened, code paths warm
        for name in names:
            blocks[name]()
    for values in times.values():
        values.clear()
    for repeat in range(settings.call_repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            blocks[name]()
    return times


def json_cost(batch: Batch, calls: int = 200) -> dict[str, float]:
    """Milliseconds the server spends reading ``batch`` as a ``forward_backward`` JSON body (the
    route's parse and validation, then the arguments the host gets), median of ``calls``."""
    spec = OPERATIONS['forward_backward']
    body = json.dumps({'inputs': wire_rows(batch)})  # the fields the client sends
    times: list[float] = []
    time_calls(lambda: spec.model_validate_json(body).arguments(), calls, times)
    tokens = sum(len(row['input_ids']) for row in batch)
    return {
        'json_ms_per_batch': 1000 * statistics.median(times),
        'json_us_per_token': 1e6 * statistics.median(times) / tokens,
    }


def summarize_latency(times: dict[str, list[float]]) -> dict[str, float]:
    medians = {f'{name}_ms': 1000 * statistics.median(values) for name, values in times.items()}
    return {**medians, 'added_ms': medians['remote_ms'] - medians['local_ms']}


# ---- 3. concurrent tenants ------------------------------------------------------------------------
@dataclass
class TenantRun:
    """What the tenants of one concurrency level did, started together."""

    tenants: int
    wall_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    step_s: list[float] = field(default_factory=list)


def make_tenants(url: str, keys: list[str], settings: Settings) -> list[RemoteLoop]:
    """One tenant per key, each with its own client and adapter (seeded apart)."""
    return [RemoteLoop(TwinkleClient(url, key), settings, seed=settings.seed + 1 + i) for i, key in enumerate(keys)]


def run_tenants(loops: list[RemoteLoop], batches: list[Batch], steps: int, offset: int) -> TenantRun:
    """Every loop trains ``steps`` batches in its own thread; the wall time runs from a common start
    to the last thread's end."""
    run = TenantRun(tenants=len(loops))
    start = threading.Barrier(len(loops) + 1)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def tenant(index: int, loop: RemoteLoop) -> None:
        start.wait()
        try:
            for k in range(steps):
                batch = batches[(offset + index * steps + k) % len(batches)]
                began = time.perf_counter()
                loop.step(batch)
                elapsed = time.perf_counter() - began
                with lock:
                    run.step_s.append(elapsed)
                    run.steps += 1
                    run.tokens += sum(len(row['input_ids']) for row in batch)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=tenant, args=(i, loop)) for i, loop in enumerate(loops)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    run.wall_s = time.perf_counter() - began
    if errors:
        raise errors[0]
    return run


def concurrency(loops: list[RemoteLoop], batches: list[Batch], settings: Settings) -> dict[int, list[TenantRun]]:
    """The runs of each tenant count, one per round; the counts take turns, in reverse every other round."""
    for i, loop in enumerate(loops):  # untimed: each adapter's first step builds its optimizer state
        loop.step(batches[i % len(batches)])
    runs: dict[int, list[TenantRun]] = {count: [] for count in settings.tenants}
    offset = 0
    for round_ in range(settings.tenant_rounds):
        for count in settings.tenants if round_ % 2 == 0 else settings.tenants[::-1]:
            runs[count].append(run_tenants(loops[:count], batches, settings.tenant_steps, offset))
            offset += count * settings.tenant_steps
    return runs


def summarize_concurrency(runs: dict[int, list[TenantRun]]) -> list[dict[str, Any]]:
    rows = []
    for count, rounds in runs.items():
        tokens_per_s = [run.tokens / run.wall_s for run in rounds]
        rows.append(
            {
                'tenants': count,
                'steps_per_s': statistics.median(run.steps / run.wall_s for run in rounds),
                'tokens_per_s': statistics.median(tokens_per_s),
                'tokens_per_s_rounds': tokens_per_s,
                # What one tenant waits for a step while the others share the worker.
                'median_step_s': statistics.median(t for run in rounds for t in run.step_s),
            }
        )
    base = rows[0]['tokens_per_s']  # the first count given: 1 by default
    for row in rows:
        row['throughput_ratio'] = row['tokens_per_s'] / base
    return rows


# ---- report ---------------------------------------------------------------------------------------
def environment(settings: Settings, load_before: float) -> dict[str, Any]:
    return {
        **training_environment(settings.training()),
        'fastapi': fastapi.__version__,
        'uvicorn': uvicorn.__version__,
        'httpx': httpx.__version__,
        # The benchmark and the server take turns using about torch_threads each: more means other load.
        'load_average_1min_before': load_before,
    }


def print_summary(result: dict[str, Any]) -> None:
    s, env, fig = result['settings'], result['environment'], result['figures']
    train, small = fig['training'], fig['small_request']
    print(
        f'\nServer overhead: {s["model"]} on {s["device"]} ({env["device"]}, {env["torch_threads"]} threads), '
        f'server in a subprocess on loopback'
    )
    print(f'1. training step, batch {s["batch_size"]}, {s["repeats"]} x {s["steps"]} timed steps per side:')
    for name, loop in train['loops'].items():
        print(f'  {name:7s} median step {1000 * loop["median_step_s"]:8.1f} ms   {loop["tokens_per_s"]:9.0f} tokens/s')
    verdict = 'within' if train['within_target'] else 'OVER'
    low, high = train['overhead_pct_iqr']
    print(
        f'  overhead (median per-step remote/local - 1): {train["overhead_pct"]:+.1f}% ({verdict} the'
        f' {TARGET_OVERHEAD_PCT:.0f}% target; middle half of steps {low:+.1f}% .. {high:+.1f}%),'
        f' {train["added_ms_per_step"]:+.1f} ms per step'
    )
    if train['disturbed_pairs'] > len(result['step_s']['local']) // 10:
        print(
            f'  warning: {train["disturbed_pairs"]} of {len(result["step_s"]["local"])} step pairs ran over'
            f' {DISTURBED}x the median (load average {env["load_average_1min_before"]:.1f} before,'
            f' {env["load_average_1min"]:.1f} after, on {env["cpu_count"]} CPUs): a busy machine'
        )
    match = 'match' if train['losses_match'] else 'DIFFER'
    print(
        f'  first-step loss local {train["loops"]["local"]["first_loss"]:.6f} remote'
        f' {train["loops"]["remote"]["first_loss"]:.6f} ({match}; max |diff| over all steps'
        f' {train["max_loss_abs_diff"]:.1e})'
    )
    print(f'2. small request (get_train_configs), {s["call_repeats"]} x {s["calls"]} calls per kind, median:')
    print(
        f'  local {small["local_ms"]:.2f} ms, remote {small["remote_ms"]:.2f} ms: {small["added_ms"]:+.2f} ms added'
        f' (as two round trips: submit {small["submit_ms"]:.2f} + result {small["result_ms"]:.2f} ms;'
        f' bare GET /healthz {small["healthz_ms"]:.2f} ms)'
    )
    print(
        f'  reading a forward_backward body as JSON: {small["json_ms_per_batch"]:.2f} ms per batch,'
        f' {small["json_us_per_token"]:.2f} us per token'
    )
    print(
        f'3. concurrent tenants, {s["tenant_steps"]} steps each, median of {s["tenant_rounds"]} rounds,'
        ' one server worker:'
    )
    first = fig['concurrency'][0]['tenants']
    for row in fig['concurrency']:
        print(
            f'  {row["tenants"]} tenant(s): {row["steps_per_s"]:5.2f} steps/s {row["tokens_per_s"]:8.0f} tokens/s'
            f'  x{row["throughput_ratio"]:.2f} of {first} (tokens/s); median step seen by a tenant'
            f' {1000 * row["median_step_s"]:7.0f} ms'
        )


def parse_args() -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='small-qwen3', help='embedded model name or a local model directory')
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    parser.add_argument('--steps', type=int, default=2, help='timed training steps per block')
    parser.add_argument('--warmup', type=int, default=2, help='untimed training steps per side before timing')
    parser.add_argument('--repeats', type=int, default=20, help='timed training blocks per side')
    parser.add_argument('--calls', type=int, default=20, help='small-request calls per block')
    parser.add_argument('--call-repeats', type=int, default=6, help='small-request blocks per kind')
    parser.add_argument('--tenants', type=int, nargs='+', default=[1, 4, 8], help='concurrent tenant counts')
    parser.add_argument('--tenant-steps', type=int, default=2, help='training steps per tenant per count')
    parser.add_argument('--tenant-rounds', type=int, default=3, help='rounds over the tenant counts')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--max-length', type=int, default=256)
    parser.add_argument('--output', default='benchmarks/results/server_overhead.json')
    args = parser.parse_args()
    if args.device == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: no CUDA device is available')
    fields = ['steps', 'warmup', 'repeats', 'calls', 'call_repeats', 'tenants', 'tenant_steps', 'tenant_rounds']
    values = [getattr(args, name) for name in fields if name != 'tenants'] + args.tenants
    if min(values) < 1:
        parser.error('--steps, --warmup, --repeats, --calls, --call-repeats and every --tenant* value: at least 1')
    names = ['model', 'device', *fields, 'batch_size', 'max_length']
    settings = Settings(**{name: getattr(args, name) for name in names})
    return settings, Path(args.output)


def measure(settings: Settings, batches: list[Batch], model_dir: str, workdir: Path) -> dict[str, Any]:
    phase_s, began = {}, time.perf_counter()
    server = ServerProcess(settings, workdir)
    bench_key = server.add_key('bench')
    tenant_keys = [server.add_key(f'tenant-{i}') for i in range(max(settings.tenants))]

    def phase(name: str) -> None:
        nonlocal began
        phase_s[name], began = time.perf_counter() - began, time.perf_counter()

    with server as url:
        local = TwinkleLoop(model_dir, settings.training())
        remote = RemoteLoop(TwinkleClient(url, bench_key), settings, seed=settings.seed)
        phase('start')
        traces = benchmark({'local': local, 'remote': remote}, batches, settings.training())
        phase('training')
        latency = small_request_latency(local, remote, settings)
        phase('small_request')
        runs = concurrency(make_tenants(url, tenant_keys, settings), batches, settings)
        phase('concurrency')
    return {
        'figures': {
            'training': summarize_training(traces),
            'small_request': summarize_latency(latency) | json_cost(batches[0]),
            'concurrency': summarize_concurrency(runs),
        },
        'losses': {name: trace.losses for name, trace in traces.items()},
        'step_s': {name: trace.step_s for name, trace in traces.items()},
        'small_request_s': latency,
        'tenant_step_s': {str(count): [run.step_s for run in rounds] for count, rounds in runs.items()},
        # Wall time of each part (start: keys, server start, both models built).
        'phase_s': phase_s,
    }


def main() -> None:
    settings, output = parse_args()
    load_before = os.getloadavg()[0]
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings('ignore', category=FutureWarning)  # deprecations inside peft/transformers
    model_dir = assets.tiny_model(settings.model) if settings.model in assets.MODELS else settings.model
    batches = encode_batches(model_dir, settings.batch_size, settings.max_length, settings.seed)
    with tempfile.TemporaryDirectory(prefix='twinkle-server-bench-') as workdir:
        measured = measure(settings, batches, model_dir, Path(workdir))
    result = {
        'benchmark': 'server_overhead',
        'settings': asdict(settings),
        'environment': environment(settings, load_before),
        **measured,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print_summary(result)
    print(f'  results: {output}')


if __name__ == '__main__':
    main()
