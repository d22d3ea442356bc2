"""64 tenants training at once through two gateways on PostgreSQL, against one server on SQLite, and a gateway
killed in the middle.

Each phase starts its own processes on loopback (``twinkle-server serve``, ``twinkle-server gateway``) and, for
PostgreSQL, its own database in a PostgreSQL server the benchmark starts (Debian's package, as the tests do:
``tests/pg_helpers.py``). 64 tenants, each with its own key, run and client thread, make ``--steps`` LoRA steps
on ``tiny-qwen3`` (a ``forward_backward`` of one ``--seq-len``-token row, then ``clip_grad_and_step``), all
started together. Each request is submitted (a 202 with its future's id) and its result then polled, so that a
client whose gateway dies polls the same future at the other; a submit whose connection broke before its 202
is sent again there (``resubmitted``: the one case where a request might run twice; the history check below
would show it).

1. ``sqlite_one_server``: the worker alone, on SQLite; each tenant talks to it.
1b. ``postgres_one_server``: the worker alone, on PostgreSQL (what the store costs, apart from the gateways).
2. ``postgres_two_gateways``: the worker on PostgreSQL behind two gateways; tenant ``i`` talks to gateway ``i % 2``.
3. ``postgres_gateway_killed``: as 2, and gateway 0 gets ``kill -9`` once the tenants made ``--kill-at`` of their
   steps; its tenants go on at gateway 1.

Figures per phase: errors (other than the connection to a killed gateway), the max/min tenant wall time (aim:
at most 1.1), tokens/s over the wall time of the slowest tenant, and ``requests_lost``: steps missing from, or
repeated in, each run's history (``GET /runs/{id}/history``) against what its tenant was answered. For phase 3,
the seconds from a tenant's first failed call at the killed gateway to its next answer from the other.

Usage::

    .venv/bin/python benchmarks/gateways.py      # ~5 min on 2 cores; writes results/gateways.json
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from machine import describe, settings_from_args
from peft import LoraConfig
from server_overhead import ServerProcess, _free_port

from twinkle import assets
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tests'))
import pg_helpers  # the tests' PostgreSQL server, started the same way


@dataclass
class Settings:
    model: str = 'tiny-qwen3'
    device: str = 'cpu'
    tenants: int = 64
    steps: int = 20
    seq_len: int = 32
    lora_r: int = 8
    # Gateway 0 dies once the tenants made this many steps in all, on average each (phase 3).
    kill_at: int = 10
    startup_timeout_s: float = 300.0


class Worker(ServerProcess):
    """``twinkle-server serve`` with room for every tenant's adapter, on SQLite or on ``store_url``."""

    def __init__(self, settings: Settings, workdir: Path, store_url: str | None):
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(settings, workdir)  # type: ignore[arg-type]
        limits = {'max_adapters': settings.tenants + 8, 'max_adapters_per_tenant': 2}
        (workdir / 'server.json').write_text(json.dumps({'device': settings.device, 'limits': limits}))
        if store_url is not None:
            self.env['TWINKLE_STORE'] = store_url


class Gateway:
    """``twinkle-server gateway`` in front of ``worker_url``."""

    def __init__(self, worker_url: str, store_url: str):
        self.port = _free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        command = [sys.executable, '-m', 'twinkle.server.cli', '--host', '127.0.0.1', '--port', str(self.port)]
        command += ['--log-level', 'warning', 'gateway', '--worker', worker_url]
        env = {**os.environ, 'TWINKLE_STORE': store_url, 'TWINKLE_OFFLINE': '1', 'HF_HUB_OFFLINE': '1'}
        self.process = subprocess.Popen(command, env=env, start_new_session=True)

    def __enter__(self) -> Gateway:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f'the gateway exited at start ({self.process.returncode})')
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f'{self.url}/healthz', timeout=2).status_code == 200:
                    return self
            time.sleep(0.1)
        raise RuntimeError('the gateway did not answer /healthz')

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def __exit__(self, *exc: object) -> None:
        self.kill()


@dataclass
class Tenant:
    """One tenant's client thread: its gateways in order of use, and what happened."""

    index: int
    key: str
    urls: list[str]
    run_id: str = ''
    wall_s: float = 0.0
    answered_steps: int = 0
    errors: list[str] = field(default_factory=list)
    resubmitted: int = 0
    failover_s: list[float] = field(default_factory=list)
    client: TwinkleClient | None = None

    def switch(self) -> None:
        """The next gateway (after a connection to this one failed)."""
        self.urls = [*self.urls[1:], self.urls[0]]
        self.client = TwinkleClient(self.urls[0], self.key)

    def call(self, path: str, body: dict[str, Any]) -> Any:
        """Submit, then poll the future; a broken connection moves to the next gateway."""
        assert self.client is not None
        broke: float | None = None
        future_id: str | None = None
        for _ in range(len(self.urls) + 1):
            try:
                if future_id is None:
                    future_id = self.client.submit(path, body)
                result = self.client.result(future_id)
            except httpx.TransportError:
                broke = broke or time.perf_counter()
                self.resubmitted += future_id is None
                self.switch()
                continue
            if broke is not None:
                self.failover_s.append(time.perf_counter() - broke)
            return result
        raise RuntimeError(f'tenant {self.index}: no gateway answers')


def run_tenant(tenant: Tenant, settings: Settings, rows: list[dict[str, list[int]]], start: threading.Barrier,
               progress: list[int]) -> None:  # fmt: skip
    try:
        tenant.client = TwinkleClient(tenant.urls[0], tenant.key)
        model = MultiLoraTransformersModel(client=tenant.client)
        config = LoraConfig(r=settings.lora_r, lora_alpha=2 * settings.lora_r, target_modules='all-linear')
        tenant.run_id = model.add_adapter_to_model('bench', config, seed=tenant.index)
        model.set_optimizer('AdamW', lr=1e-3)
        ops = f'/twinkle/v1/runs/{tenant.run_id}/ops'
    except Exception as exc:  # reported as an error of the phase
        tenant.errors.append(f'setup: {exc!r}')
        start.wait()
        return
    start.wait()
    began = time.perf_counter()
    for step in range(settings.steps):
        try:
            tenant.call(f'{ops}/forward_backward', {'inputs': [rows[step]]})
            tenant.call(f'{ops}/clip_grad_and_step', {})
            tenant.answered_steps += 1
            progress[tenant.index] += 1
        except Exception as exc:
            tenant.errors.append(f'step {step}: {exc!r}')
    tenant.wall_s = time.perf_counter() - began


def phase(name: str, settings: Settings, workdir: Path, store_url: str | None, gateways: int, kill: bool) -> dict:
    vocab = json.loads((Path(assets.tiny_model(settings.model)) / 'config.json').read_text())['vocab_size']
    worker = Worker(settings, workdir / name, store_url)
    keys = [worker.add_key(f't{i}') for i in range(settings.tenants)]
    with contextlib.ExitStack() as stack:
        worker_url = stack.enter_context(worker)
        fronts = [stack.enter_context(Gateway(worker_url, store_url)) for _ in range(gateways)] if store_url else []
        assert not kill or fronts, 'a gateway to kill'
        urls = [g.url for g in fronts] or [worker_url]
        tenants = [
            Tenant(i, keys[i], [urls[(i + j) % len(urls)] for j in range(len(urls))]) for i in range(settings.tenants)
        ]
        gen = torch.Generator().manual_seed(0)
        rows = [
            [{'input_ids': (ids := torch.randint(0, vocab, (settings.seq_len,), generator=gen).tolist()), 'labels': ids}
             for _ in range(settings.steps)]
            for _ in tenants
        ]  # fmt: skip
        start, progress = threading.Barrier(settings.tenants + 1), [0] * settings.tenants
        threads = [
            threading.Thread(target=run_tenant, args=(t, settings, rows[t.index], start, progress)) for t in tenants
        ]
        for thread in threads:
            thread.start()
        start.wait()
        began = time.perf_counter()
        killed_at = None
        if kill:
            while sum(progress) < settings.kill_at * settings.tenants and any(t.is_alive() for t in threads):
                time.sleep(0.05)
            fronts[0].kill()
            killed_at = time.perf_counter() - began
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
        alive = urls[-1] if kill else urls[0]
        lost = sum(missing_or_repeated(alive, t) for t in tenants)
    walls = [t.wall_s for t in tenants if t.wall_s > 0]
    failovers = [s for t in tenants for s in t.failover_s]
    figures = {
        'errors': sum(len(t.errors) for t in tenants),
        'first_errors': [e for t in tenants for e in t.errors][:5],
        'max_over_min_tenant_wall': max(walls) / min(walls) if walls else None,
        'wall_s': wall,
        'tokens_per_s': sum(t.answered_steps for t in tenants) * settings.seq_len / wall,
        'requests_lost': lost,
        'resubmitted': sum(t.resubmitted for t in tenants),
    }
    if kill:
        figures |= {
            'killed_after_s': killed_at,
            'tenants_moved': sum(1 for t in tenants if t.failover_s),
            'failover_s_median': statistics.median(failovers) if failovers else None,
            'failover_s_max': max(failovers) if failovers else None,
        }
    print(f'  {name}: ' + ', '.join(f'{k} {v:.3g}' if isinstance(v, float) else f'{k} {v}' for k, v in figures.items()))
    return figures


def missing_or_repeated(url: str, tenant: Tenant) -> int:
    """The tenant's run history against the steps it was answered: a step lost or run twice shows."""
    if not tenant.run_id:
        return 0
    client = TwinkleClient(url, tenant.key)
    steps = [s['step'] for s in client.request('GET', f'/twinkle/v1/runs/{tenant.run_id}/history')['steps']]
    return abs(len(steps) - tenant.answered_steps) + (len(steps) - len(set(steps)))


def main() -> None:
    settings, output_path = settings_from_args(Settings(), __doc__.split('\n\n')[0], 'benchmarks/results/gateways.json')
    load_before = os.getloadavg()[0]
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, pg_helpers.postgres_server() as pg:
        workdir = Path(tmp)
        figures['sqlite_one_server'] = phase('sqlite_one_server', settings, workdir, None, 1, kill=False)
        with pg_helpers.fresh_database(pg) as url:
            figures['postgres_one_server'] = phase('postgres_one_server', settings, workdir, url, 0, kill=False)
        with pg_helpers.fresh_database(pg) as url:
            figures['postgres_two_gateways'] = phase('postgres_two_gateways', settings, workdir, url, 2, kill=False)
        with pg_helpers.fresh_database(pg) as url:
            figures['postgres_gateway_killed'] = phase('postgres_gateway_killed', settings, workdir, url, 2, kill=True)
    sqlite = figures['sqlite_one_server']['tokens_per_s']
    figures['throughput_two_gateways_vs_one_server'] = figures['postgres_two_gateways']['tokens_per_s'] / sqlite
    figures['throughput_postgres_vs_sqlite_one_server'] = figures['postgres_one_server']['tokens_per_s'] / sqlite
    result = {
        'benchmark': 'gateways',
        'settings': asdict(settings),
        'environment': {**describe(), 'load_average_1min_before': load_before},
        'figures': figures,
    }
    output = Path(output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print(
        f'two gateways on PostgreSQL: x{figures["throughput_two_gateways_vs_one_server"]:.2f} of one server on SQLite'
    )
    print(f'wrote {output}')


if __name__ == '__main__':
    main()
