"""Tenants training when their server is killed (``kill -9``) and started again: what comes back.

``--tenants`` tenants each train a run of their own on one ``twinkle-server serve`` (``forward_backward`` of
one batch, then ``clip_grad_and_step``, each tenant on a thread of its own, every request submitted and then
waited for). Once every tenant has had ``--kill-after`` steps answered and one of them a ``forward_backward``
since its last (so that one run has answered gradients to lose), the server is killed with SIGKILL, wherever
each tenant is, and started again on the same data directory. Then, for each run, against the
store's futures (what the server answered, whether or not the answer reached its client):

- ``steps_kept``: the run comes back with exactly the steps the server answered: its weights are those of a
  local model trained on the same batches for that many steps (logprobs within ``ABS_TOL``), and its
  history holds those steps;
- ``lost_told``: the ``forward_backward`` calls answered after its last answered step died with the server,
  and its next request fails with a ``LostWorkError`` that names exactly them;
- ``answers_true``: every answer its client got is one the store holds; no request is left pending or
  running (each one unanswered failed, which its client reads as an error).

Usage::

    .venv/bin/python benchmarks/worker_crash.py                 # 8 tenants; writes results/worker_crash.json
    .venv/bin/python benchmarks/worker_crash.py --tenants 3     # what tests/server/test_server_crash.py runs
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from peft import LoraConfig

from twinkle import assets
from twinkle.errors import LostWorkError, TwinkleError
from twinkle.model import TransformersModel
from twinkle.server.store import Store
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Logprobs of the run on the server and of its local replay agree to this. Not to float32's rounding: AdamW's
#: first steps move a weight whose gradient is near zero by about ``lr`` whatever its sign, so the kernels'
#: summation order (another CPU, another batch layout) shows as 2e-4 after 3 steps (seen on CI). One step
#: more or less moves them by 1.7 (tiny-qwen3, 2 against 3 steps), four orders of magnitude above this.
ABS_TOL = 2e-3
#: Rows every run is read on: its weights, as logprobs.
PROBE = [
    {'input_ids': [11, 23, 5, 42, 17, 8, 9], 'labels': [-100, 23, 5, 42, 17, 8, 9]},
    {'input_ids': [7, 19, 3, 88, 21, 64], 'labels': [-100, 19, 3, 88, 21, 64]},
]
STEP_OPS = ('clip_grad_and_step',)
FUTURE_ID = re.compile(r'fut-[0-9a-f]{12}')
LR = 1e-2


@dataclass
class Settings:
    model: str = 'tiny-qwen3'
    tenants: int = 8
    steps: int = 12
    # The server dies once every tenant has had this many steps answered.
    kill_after: int = 3
    rows: int = 2
    seq_len: int = 24
    startup_timeout_s: float = 300.0


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)


def batches(seed: int, settings: Settings) -> list[list[dict[str, list[int]]]]:
    """``settings.steps`` batches of random token rows, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(settings.steps):
        ids = [torch.randint(0, 4000, (settings.seq_len,), generator=gen).tolist() for _ in range(settings.rows)]
        out.append([{'input_ids': row, 'labels': [-100, *row[1:]]} for row in ids])
    return out


class Server:
    """``twinkle-server serve`` in a process of its own on ``data_dir``, once it answers."""

    def __init__(self, model_dir: str, data_dir: Path, port: int, timeout_s: float):
        self.url = f'http://127.0.0.1:{port}'
        command = [sys.executable, '-m', 'twinkle.server.cli', '--base-model', model_dir, '--port', str(port)]
        command += ['--data-dir', str(data_dir), 'serve']
        env = {**os.environ, 'OMP_NUM_THREADS': '1'}
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f'the server did not start: {self.process.stderr.read().decode()[-3000:]}')
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f'{self.url}/healthz', timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Tenant:
    """One tenant's run and the loop that trains it until its server dies."""

    name: str
    key: str
    seed: int
    data: list[list[dict[str, list[int]]]] = field(repr=False)
    run_id: str = ''
    #: The futures its client saw answered, in order: (id, op).
    answered: list[tuple[str, str]] = field(default_factory=list)
    #: What ended its loop: the error its last call met (the server's death), or None (it finished).
    ended_by: str | None = None

    def create(self, url: str) -> None:
        model = MultiLoraTransformersModel(client=TwinkleClient(url, self.key))
        self.run_id = model.add_adapter_to_model('default', lora(), seed=self.seed)
        model.set_optimizer('AdamW', lr=LR)

    def owes_a_step(self) -> bool:
        """Whether its last answered call is a ``forward_backward`` (its gradients wait on the model)."""
        return bool(self.answered) and self.answered[-1][1] == 'forward_backward'

    def steps_answered(self) -> int:
        return sum(op in STEP_OPS for _, op in self.answered)

    def train(self, url: str) -> None:
        client = TwinkleClient(url, self.key)
        path = f'/twinkle/v1/runs/{self.run_id}/ops'
        try:
            for batch in self.data:
                for op, body in (('forward_backward', {'inputs': batch}), ('clip_grad_and_step', {})):
                    future = client.submit(f'{path}/{op}', body)
                    client.result(future)
                    self.answered.append((future, op))
        except (httpx.HTTPError, TwinkleError) as error:  # the server died under the call
            self.ended_by = f'{type(error).__name__}: {error}'
        finally:
            client.close()


def local_weights(model_dir: str, tenant: Tenant, steps: int) -> list[list[float]]:
    """The probe's logprobs of a local model trained as the tenant's run, for ``steps`` steps."""
    model = TransformersModel(model_dir, device='cpu')
    torch.manual_seed(tenant.seed)
    model.add_adapter_to_model('default', lora())
    model.set_optimizer('AdamW', lr=LR)
    for batch in tenant.data[:steps]:
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
    return [list(map(float, row)) for row in model.forward_only(inputs=PROBE).logps]


def check(model_dir: str, url: str, store: Store, tenant: Tenant) -> dict[str, Any]:
    """What came back of one tenant's run after the restart, against what the store says was answered."""
    futures = store.db.query(
        'SELECT id, op, status FROM futures WHERE run_id = ? ORDER BY created_at, rowid', (tenant.run_id,)
    )
    done = [(row['id'], row['op']) for row in futures if row['status'] == 'done']
    unsettled = [row['id'] for row in futures if row['status'] not in ('done', 'failed')]
    last_step = max((i for i, (_, op) in enumerate(done) if op in STEP_OPS), default=-1)
    steps = sum(op in STEP_OPS for _, op in done)
    expected_lost = [fid for fid, op in done[last_step + 1 :] if op == 'forward_backward']
    model = MultiLoraTransformersModel(client=TwinkleClient(url, tenant.key))
    model.attach(tenant.run_id)
    told: list[str] = []
    try:
        model.forward_only(inputs=PROBE)  # the run's first request after the restart
    except LostWorkError as error:
        told = FUTURE_ID.findall(str(error))
    remote = model.forward_only(inputs=PROBE).logps
    local = local_weights(model_dir, tenant, steps)
    pairs = [(a, b) for row, ref in zip(remote, local, strict=True) for a, b in zip(row, ref[: len(row)], strict=True)]
    diff = max(abs(a - b) for a, b in pairs)  # the local rows are padded to the longest
    history = [int(entry.step) for entry in model.client.run_history(tenant.run_id)]
    return {
        'tenant': tenant.name,
        'steps_client_saw': tenant.steps_answered(),
        'steps_answered': steps,
        'history_steps': len(history),
        'weights_max_abs_diff': diff,
        'lost_answered': len(expected_lost),
        'lost_told': told == expected_lost,
        'answers_true': set(tenant.answered) <= set(done) and not unsettled,
        'steps_kept': diff <= ABS_TOL and history == list(range(1, steps + 1)),
        'ended_by': tenant.ended_by,
    }


def crash_run(settings: Settings, workdir: Path) -> dict[str, Any]:
    """Train ``settings.tenants`` runs, kill the server under them, start it again, check every run."""
    model_dir = assets.tiny_model(settings.model)
    data_dir = workdir / 'data'
    keys = {}
    with Store(data_dir / 'twinkle.db') as store:
        for i in range(settings.tenants):
            keys[f'tenant-{i}'] = store.tenants.add(f'tenant-{i}')[1]
    port = _free_port()
    tenants = [Tenant(name, key, 100 + i, batches(100 + i, settings)) for i, (name, key) in enumerate(keys.items())]
    server = Server(model_dir, data_dir, port, settings.startup_timeout_s)
    try:
        for tenant in tenants:
            tenant.create(server.url)
        threads = [threading.Thread(target=t.train, args=(server.url,), name=t.name) for t in tenants]
        for thread in threads:
            thread.start()
        while not (
            all(t.steps_answered() >= settings.kill_after for t in tenants) and any(map(Tenant.owes_a_step, tenants))
        ):
            if not any(thread.is_alive() for thread in threads):
                raise RuntimeError(f'the tenants ended before the kill: {[t.ended_by for t in tenants]}')
            time.sleep(0.01)
        killed_at = {t.name: len(t.answered) for t in tenants}
        server.kill()
        for thread in threads:
            thread.join(120)
    finally:
        server.stop()
    started = time.monotonic()
    server = Server(model_dir, data_dir, port, settings.startup_timeout_s)
    restart_s = time.monotonic() - started
    try:
        with Store(data_dir / 'twinkle.db') as store:
            runs = [check(model_dir, server.url, store, tenant) for tenant in tenants]
    finally:
        server.stop()
    return {'answered_at_kill': killed_at, 'restart_s': restart_s, 'runs': runs}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return int(s.getsockname()[1])


def main() -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in asdict(Settings()).items():
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(default), default=default)
    parser.add_argument('--output', default=str(Path(__file__).parent / 'results' / 'worker_crash.json'))
    args = parser.parse_args()
    settings = Settings(**{name: getattr(args, name) for name in asdict(Settings())})
    with tempfile.TemporaryDirectory() as workdir:
        report = crash_run(settings, Path(workdir))
    runs = report['runs']
    summary = {
        'tenants': len(runs),
        'steps_answered': sum(r['steps_answered'] for r in runs),
        'steps_client_saw': sum(r['steps_client_saw'] for r in runs),
        'forward_backward_lost': sum(r['lost_answered'] for r in runs),
        'runs_with_every_step_kept': sum(r['steps_kept'] for r in runs),
        'runs_told_exactly_what_they_lost': sum(r['lost_told'] for r in runs),
        'runs_with_true_answers': sum(r['answers_true'] for r in runs),
    }
    for run in runs:
        print(json.dumps(run))
    print(json.dumps(summary))
    out = {'settings': asdict(settings), 'summary': summary, **report, 'date': time.strftime('%Y-%m-%d')}
    Path(args.output).write_text(json.dumps(out, indent=1) + '\n')


if __name__ == '__main__':
    main()
