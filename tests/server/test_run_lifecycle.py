"""A run's life through what a server survives (issue 28, point 9): a model worker killed under a
group of two ranks, a graceful stop, a pool its tenants fill with gradients, and a ``kill -9``
at a save's commit (its row in the store).

What each test wants, from the issue:

- after a worker's death a run comes back with exactly the state of one of its acknowledged
  steps, whatever its loop left pending (seed 003's ``forward_backward`` then ``step()``, no
  ``zero_grad()``), at most ``MAX_LOST_STEPS`` behind its last acknowledged step, from a
  weights-only checkpoint when that is all it saved, and without any checkpoint; and it says so
  (``restored_from``, its history);
- a ``forward_only`` holds no gradient: it pins no run against making room, and a graceful stop
  saves every run, whatever it did last;
- tenants holding un-stepped gradients do not keep another tenant out, and a 429's
  ``Retry-After`` is true: a retry after it is not refused for the same reason;
- a save killed just before or just after its commit leaves a row and a folder that agree: a
  save answered 'failed' left the old content under the name, one answered 'done' the new; every
  route that saves a checkpoint commits so.

Every server here is on the CPU with a tiny model; the rank cases share one group of two ranks
and one kill.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import tinker
import torch
from peft import LoraConfig
from server_helpers import add_key, background_server, free_port, server_command, start_server, wait_until_healthy

from twinkle.errors import StateError
from twinkle.model import TransformersModel
from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
from twinkle.server.execution.groups.run_files import STATE_FOLDER
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

#: Acknowledged optimizer steps a model worker's death may cost a run: the bound the server states.
#: It keeps each run's state with every step's answer (``save_state_every_steps``, 1 by default): none lost.
MAX_LOST_STEPS = 0
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
#: Logprobs of the same two rows read a run's weights: one row on each rank of the group.
PROBE = [
    {'input_ids': [11, 23, 5, 42, 17, 8, 9], 'labels': [-100, 23, 5, 42, 17, 8, 9]},
    {'input_ids': [7, 19, 3, 88, 21, 64], 'labels': [-100, 19, 3, 88, 21, 64]},
]
#: Summed logprobs of two states agree to this (float32 sums of about a hundred terms).
ABS_TOL = 1e-4


def rows(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` rows of 5 to 12 token ids drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, 200, (int(torch.randint(5, 13, (1,), generator=generator)),), generator=generator)
        out.append({'input_ids': ids.tolist(), 'labels': [-100, *ids.tolist()[1:]]})
    return out


def batch(step: int) -> list[dict[str, Any]]:
    """The rows of a run's ``step``-th optimizer step: three, so the two ranks hold 2 and 1."""
    return rows(3, 100 + step)


def logprob_sum(model: MultiLoraTransformersModel, base: bool = False) -> float:
    """The run's (``base``: the base model's) summed logprobs of ``PROBE``: what its weights say."""
    logps = model.forward_only(inputs=PROBE, disable_lora=base).logps
    assert logps is not None
    return float(sum(value for row in logps for value in row))


def adapter(url: str, key: str, seed: int) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, key))
    model.add_adapter_to_model('default', LORA, seed=seed)
    model.set_optimizer('AdamW', lr=5e-2)
    return model


# ---- a model worker dies under a group of two ranks --------------------------------------------
@dataclass
class Trained:
    """A run, and what it answered at each acknowledged optimizer step before the kill."""

    model: MultiLoraTransformersModel
    loop: Callable[[MultiLoraTransformersModel], object]  # its optimizer step after each forward_backward
    saved_at: int = 0  # the step of its last checkpoint (0: none)
    logprobs: dict[int, float] = field(default_factory=dict)  # step -> logprob_sum after it (0: as created)
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss of that step's forward_backward
    after_last: tuple[float, float] = (math.nan, math.nan)  # the loss and logprob_sum of the step after the last

    @property
    def acknowledged(self) -> int:
        return max(self.logprobs)

    def train(self, steps: int) -> None:
        if not self.logprobs:
            self.logprobs[0] = logprob_sum(self.model)
        for step in range(self.acknowledged + 1, self.acknowledged + steps + 1):
            self.losses[step] = self.model.forward_backward(inputs=batch(step)).loss
            self.loop(self.model)
            self.logprobs[step] = logprob_sum(self.model)

    def train_twin(self, twin: MultiLoraTransformersModel) -> None:
        """A twin run (the same seed, loop and rows) one step further than this one: what the step
        after its last acknowledged one gives (``after_last``)."""
        for step in range(1, self.acknowledged + 2):
            loss = twin.forward_backward(inputs=batch(step)).loss
            self.loop(twin)
            assert step > self.acknowledged or loss == pytest.approx(self.losses[step], abs=1e-6), 'not a twin'
        self.after_last = (loss, logprob_sum(twin))

    def state_now(self) -> int:
        """The acknowledged step whose weights the run answers with now; fails naming what it
        answered if none (a later step would mean a state never acknowledged)."""
        now = logprob_sum(self.model)
        match = [step for step, value in self.logprobs.items() if abs(value - now) <= ABS_TOL]
        assert match, (
            f'the run came back with weights of none of its acknowledged steps: summed logprobs {now:.4f}; '
            f'before the kill, step by step: { {step: round(v, 4) for step, v in self.logprobs.items()} }'
        )
        return match[-1]

    def continues_exactly(self, step: int) -> None:
        """From ``step``, the next step gives the loss and weights it gave before the kill (after
        the last acknowledged step: those its twin's gave)."""
        loss = self.model.forward_backward(inputs=batch(step + 1)).loss
        self.loop(self.model)
        expected = (self.losses[step + 1], self.logprobs[step + 1]) if step < self.acknowledged else self.after_last
        assert loss == pytest.approx(expected[0], abs=1e-5), f'the loss of step {step + 1}'
        assert logprob_sum(self.model) == pytest.approx(expected[1], abs=ABS_TOL), f'the weights after step {step + 1}'


@dataclass
class AfterTheKill:
    runs: dict[str, Trained]
    first_error: str  # what the first call after the kill answered
    base_before: float  # the base model's logprob_sum before the kill


def worker_processes() -> list[psutil.Process]:
    """The model workers this process started for its server's group, oldest (rank 0) first."""
    workers = [p for p in psutil.Process().children() if any('twinkle.server' in part for part in p.cmdline())]
    return sorted(workers, key=lambda p: p.create_time())


@pytest.fixture(scope='module')
def after_the_kill(tmp_path_factory) -> Iterator[AfterTheKill]:
    """One group of two ranks (data parallel), three tenants' runs, then one rank SIGKILLed:

    - 'seed' trains with seed 003's loop (``step()``, no ``zero_grad()``), saves with its
      optimizer at step 6, and trains ``MAX_LOST_STEPS + 2`` steps more;
    - 'weights' trains 3 steps (``clip_grad_and_step``) and saves its weights only, as
      ``save`` does by default (the seeds' call);
    - 'unsaved' trains ``MAX_LOST_STEPS + 2`` steps and never saves.

    Each has a twin run one step further (the reference of the step after its last). No idle
    release: a released run's saved state would hide what a worker's death costs."""
    # The bound stated with the setting's default: its state with every step, so none lost.
    assert ServerConfig.model_fields['save_state_every_steps'].default == MAX_LOST_STEPS + 1
    data_dir = tmp_path_factory.mktemp('ranks')
    options = {'ranks': 2, 'release_memory_after_idle_s': None, 'idle_release_s': 3600.0}
    tenants = ('seed', 'weights', 'unsaved')
    with background_server(data_dir, 'tiny-qwen3', tenants, **options) as (url, keys, _):
        runs = {
            'seed': Trained(adapter(url, keys['seed'], 9), lambda model: model.step()),
            'weights': Trained(adapter(url, keys['weights'], 10), lambda model: model.clip_grad_and_step()),
            'unsaved': Trained(adapter(url, keys['unsaved'], 11), lambda model: model.clip_grad_and_step()),
        }
        seed = runs['seed']
        seed.train(6)
        seed.model.save('six', save_optimizer=True)
        seed.saved_at = 6
        assert logprob_sum(seed.model) == seed.logprobs[6]  # the same request, the same sum: a forward changes nothing
        seed.train(MAX_LOST_STEPS + 2)
        runs['weights'].train(3)
        runs['weights'].model.save('three')
        runs['weights'].saved_at = 3
        runs['unsaved'].train(MAX_LOST_STEPS + 2)
        for (name, run), seed_of in zip(runs.items(), (9, 10, 11), strict=True):
            run.train_twin(adapter(url, keys[name], seed_of))
        base_before = logprob_sum(seed.model, base=True)

        workers = worker_processes()
        assert len(workers) == 2, workers
        workers[1].send_signal(signal.SIGKILL)
        while workers[1].is_running() and workers[1].status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)  # dead; its parent's Popen reaps it (a wait here would take its exit code)
        try:
            logprob_sum(seed.model)
            first_error = ''
        except Exception as error:  # the call that meets the dead worker
            first_error = f'{type(error).__name__}: {error}'
        yield AfterTheKill(runs, first_error, base_before)


def test_a_run_of_seed_003s_loop_comes_back_exactly_after_a_worker_dies(after_the_kill):
    assert 'died' in after_the_kill.first_error, after_the_kill.first_error  # the call it met fails, saying why
    run = after_the_kill.runs['seed']
    assert logprob_sum(run.model, base=True) == pytest.approx(after_the_kill.base_before, abs=ABS_TOL)
    step = run.state_now()
    assert step >= run.saved_at, f'the run came back at step {step}, before its checkpoint of step {run.saved_at}'
    lost = run.acknowledged - step
    assert lost <= MAX_LOST_STEPS, f'the run lost {lost} acknowledged steps ({run.acknowledged} -> {step})'
    said_to_have_lost(run, step, fresh_optimizer=False)
    run.continues_exactly(step)


def said_to_have_lost(run: Trained, step: int, fresh_optimizer: bool, checkpoint: str | None = None) -> None:
    """The run's answer and its history say it came back at ``step``, and with what."""
    client, run_id = run.model.client, run.model.runs['default']
    restored = client.get_training_run(run_id).restored_from
    if run.acknowledged == step and not fresh_optimizer:
        assert restored is None, f'the run came back as it was, yet says it has less: {restored}'
    else:
        assert restored is not None, 'the run does not say it came back with less than it had'
        told = (restored.step, restored.fresh_optimizer, restored.lost_steps, restored.checkpoint)
        assert told == (step, fresh_optimizer, run.acknowledged - step, checkpoint), restored
        assert client.run_restores(run_id)[-1] == restored
    assert [entry.step for entry in client.run_history(run_id)] == list(range(1, step + 1))  # the lost ones forgotten


def test_a_run_saved_without_its_optimizer_comes_back_after_a_worker_dies(after_the_kill):
    """Its state kept with its third step (optimizer included) ties with its checkpoint of weights alone
    at that step, and wins the tie: it comes back as it was (before states were kept with each step: from
    the weights, its optimizer afresh; before that, a 409 'left no state to restore')."""
    run = after_the_kill.runs['weights']
    step = run.state_now()
    assert step == run.acknowledged == run.saved_at
    said_to_have_lost(run, step, fresh_optimizer=False)
    # It trains on from there (with a fresh optimizer if it saved none), its step count too.
    assert math.isfinite(run.model.forward_backward(inputs=batch(step + 1)).loss)
    run.model.clip_grad_and_step()
    history = run.model.client.run_history(run.model.runs['default'])
    assert history[-1].step == step + 1, [entry.step for entry in history]


def test_a_run_never_saved_loses_at_most_the_stated_steps_when_a_worker_dies(after_the_kill):
    run = after_the_kill.runs['unsaved']
    step = run.state_now()  # before: 409 'left no state to restore'
    lost = run.acknowledged - step
    assert lost <= MAX_LOST_STEPS, f'the run lost {lost} acknowledged steps ({run.acknowledged} -> {step})'
    said_to_have_lost(run, step, fresh_optimizer=False)
    run.continues_exactly(step)


# ---- a forward holds no gradient ----------------------------------------------------------------
def create_run(url: str, key: str) -> httpx.Response:
    """A raw POST: the client would retry a 429 after its Retry-After."""
    body = {'lora': {'r': 4, 'target_modules': ['q_proj']}}
    return httpx.post(f'{url}/twinkle/v1/runs', json=body, headers={'Authorization': f'Bearer {key}'})


def test_runs_whose_last_request_was_a_forward_make_room_for_a_new_one(tmp_path):
    limits = {'max_adapters_per_tenant': 2}
    with background_server(tmp_path, 'tiny-qwen3', limits=limits, idle_release_s=3600.0) as (url, keys, _):
        model = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, keys['alice']))
        for name in ('a', 'b'):
            model.add_adapter_to_model(name, LORA, seed=1)
            # The embedded model by its name, not the server's folder of it (asked before 'b' is used: a
            # request to 'a' after it would make 'b' the least recently used, on a slow machine).
            assert model.get_train_configs(adapter_name=name).startswith('model: tiny-qwen3\n')
            model.forward_only(inputs=PROBE, adapter_name=name)  # evaluation: no gradient waits for a step
        created = create_run(url, keys['alice'])
        assert created.status_code == 201, created.text  # before: 429, '... each holds gradients waiting ...'
        # 'a' went for it: its pending forward did not, and the error says to run it again.
        assert model.calculate_loss(adapter_name='b') > 0
        with pytest.raises(StateError, match=r'released the run.s adapter since .* run forward_only\(\) again'):
            model.calculate_loss(adapter_name='a')


def local_losses(model_dir: str, steps: int) -> list[float]:
    """One process's losses of ``steps`` steps (seed 5, ``batch(1..steps)``, ``clip_grad_and_step``)."""
    model = TransformersModel(model_dir, device='cpu')
    torch.manual_seed(5)
    model.add_adapter_to_model('default', LORA)
    model.set_optimizer('AdamW', lr=5e-2)
    losses = []
    for step in range(1, steps + 1):
        losses.append(float(model.forward_backward(inputs=batch(step)).loss))
        model.clip_grad_and_step()
    return losses


def test_a_graceful_stop_saves_every_run_whatever_its_last_request(tmp_path, tiny_model_dir):
    """Two runs train 3 steps; then 'evaluated' runs ``forward_only`` and 'pending' runs the
    ``forward_backward`` of its step 4 without stepping. The server stops gracefully (its
    lifespan's end, as on SIGTERM) and starts again: both continue as one process would."""
    config = ServerConfig.build(base_model=tiny_model_dir, port=0, data_dir=str(tmp_path), device='cpu')
    key = add_key(tiny_model_dir, tmp_path, 'alice')
    run_ids = {}
    with BackgroundServer(config) as url:
        client = TwinkleClient(url, key)
        for name in ('evaluated', 'pending'):
            model = MultiLoraTransformersModel(client=client)
            run_ids[name] = model.add_adapter_to_model('default', LORA, seed=5)
            model.set_optimizer('AdamW', lr=5e-2)
            for step in range(1, 4):
                model.forward_backward(inputs=batch(step))
                model.clip_grad_and_step()
            if name == 'evaluated':
                model.forward_only(inputs=PROBE)
            else:
                model.forward_backward(inputs=batch(4))
    expected = local_losses(tiny_model_dir, 5)
    with BackgroundServer(config) as url:
        client = TwinkleClient(url, key)
        evaluated = MultiLoraTransformersModel(client=client)
        evaluated.attach(run_ids['evaluated'])
        losses = [evaluated.forward_backward(inputs=batch(4)).loss]  # before: 409 'left no state to restore'
        pending = MultiLoraTransformersModel(client=client)
        pending.attach(run_ids['pending'])
        pending.clip_grad_and_step()  # the step its gradients waited for
        losses.append(pending.forward_backward(inputs=batch(5)).loss)
    # AdamW at lr 5e-2 turns the kernels' summation order into 3e-5 by step 4 on some CPUs (seen on CI), where
    # 'pending' losing its step 4 moves its step 5 loss by 8e-4 (8.87315 against 8.87397).
    assert losses == pytest.approx(expected[3:5], abs=2e-4)


# ---- the pool and its tenants -------------------------------------------------------------------
def test_tenants_holding_gradients_do_not_keep_another_out_and_retry_after_is_true(tmp_path):
    """Three tenants hold two runs each with gradients waiting for a step: a pool of 6 is full.
    A fourth tenant gets its run at once, or after a 429 whose Retry-After holds: a retry
    after it is not refused again. Each holder then steps with its gradient, or is told it was
    dropped (the same rows from the same seed: every kept gradient has the same norm)."""
    holders = ('t1', 't2', 't3')
    limits = {'max_adapters': 6, 'max_adapters_per_tenant': 2}
    options = {'limits': limits, 'idle_release_s': 3600.0}
    with background_server(tmp_path, 'tiny-qwen3', (*holders, 'newcomer'), **options) as (url, keys, _):
        models = []
        for tenant in holders:
            model = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, keys[tenant]))
            for name in ('a', 'b'):
                model.add_adapter_to_model(name, LORA, seed=1)
                model.forward_backward(inputs=batch(1), adapter_name=name)  # waits for a step
            models.append(model)
        started = time.monotonic()
        created = create_run(url, keys['newcomer'])
        if created.status_code == 429:
            retry_after = int(created.headers['Retry-After'])
            assert retry_after <= 120, created.headers
            time.sleep(retry_after)
            again = create_run(url, keys['newcomer'])
            assert again.status_code == 201, (
                f'Retry-After said {retry_after} s; {time.monotonic() - started:.0f} s later the retry was refused '
                f'again: {again.status_code} {again.text}'
            )
        else:
            assert created.status_code == 201, created.text
        norms = []
        for model in models:
            for name in ('a', 'b'):
                try:
                    norms.append(model.clip_grad_and_step(adapter_name=name))
                except Exception as error:  # a dropped gradient must say so
                    assert 'gradient' in str(error), error
        assert norms and all(norm == pytest.approx(norms[0], rel=1e-5) for norm in norms), norms


# ---- a checkpoint's row and its folder ----------------------------------------------------------
#: Run in the server's process: once ``signals/arm`` exists, a save stops at its commit point (the
#: store transaction that replaces the name's row and settles the save's future), just before it
#: (``before``: its new folder is written) or just after it (``after``: the old folder not yet
#: deleted), writes ``signals/window`` and sleeps, for the test to kill.
STOP_AT_COMMIT = r"""
import contextlib, sys, time
from pathlib import Path
from twinkle.server.store import Store

signals, when = Path(sys.argv[1]), sys.argv[2]
transaction = Store.transaction

def stop():
    (signals / 'window').write_text(when)
    time.sleep(3600)

@contextlib.contextmanager
def stopping(self):
    armed = (signals / 'arm').exists()
    if armed and when == 'before':
        stop()
    with transaction(self):
        yield
    if armed and when == 'after':
        stop()

Store.transaction = stopping
from twinkle.server.cli import main
main(sys.argv[3:])
"""


def weights_digest(client: TwinkleClient, path: str, out: Path) -> str:
    """The digest of a checkpoint's weights as a client downloads them."""
    folder = client.download_checkpoint(path, out)
    return hashlib.sha256((folder / 'adapter_model.safetensors').read_bytes()).hexdigest()


@pytest.mark.parametrize(('when', 'told'), [('before', 'failed'), ('after', 'done')])
def test_a_save_killed_at_its_commit_leaves_row_and_folder_agreeing(tmp_path, tiny_model_dir, when, told):
    """A save of a name that holds a checkpoint, killed just before or just after the transaction
    that records it: after the restart the client is told 'failed' and the name holds the old
    weights, or 'done' and the new ones; no folder is left that no row names."""
    data_dir, port, signals = tmp_path / 'data', free_port(), tmp_path / 'signals'
    signals.mkdir()
    key = add_key(tiny_model_dir, data_dir, 'alice')
    server_args = server_command(tiny_model_dir, data_dir, port)[3:]
    command = [sys.executable, '-c', STOP_AT_COMMIT, str(signals), when, *server_args]
    server = subprocess.Popen([*command, 'serve'], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_healthy(server, port)
        client = TwinkleClient(f'http://127.0.0.1:{port}', key)
        model = MultiLoraTransformersModel(client=client)
        run_id = model.add_adapter_to_model('default', LORA, seed=3)
        saved = model.save('ck')  # acknowledged
        old = weights_digest(client, saved, tmp_path / 'old')
        other = MultiLoraTransformersModel(client=client)
        other.add_adapter_to_model('default', LORA, seed=4)
        other_path = other.save('other')
        new = weights_digest(client, other_path, tmp_path / 'new')
        model.load(other_path)  # other weights for the next save of 'ck'
        (signals / 'arm').write_text('')
        future = client.submit(f'/twinkle/v1/runs/{run_id}/save', {'name': 'ck'})
        deadline = time.monotonic() + 120
        while not (signals / 'window').exists():
            assert server.poll() is None and time.monotonic() < deadline, 'the save did not reach its commit'
            time.sleep(0.05)
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()

    server = start_server(tiny_model_dir, data_dir, port)
    try:
        client = TwinkleClient(f'http://127.0.0.1:{port}', key)
        status = client.request('GET', f'/twinkle/v1/futures/{future}')['status']
        assert status == told, status
        now = weights_digest(client, saved, tmp_path / 'now')
        if status == 'failed':  # what the client was told: the old content is under the name
            assert now == old, "the save was answered 'failed', yet checkpoint 'ck' holds the new weights"
        else:
            assert now == new, "the save was answered 'done', yet checkpoint 'ck' does not hold the new weights"
        run_dir = next((data_dir / 'checkpoints').glob(f'*/{run_id}'))
        folders = [p.name for p in run_dir.iterdir() if not STATE_FOLDER.fullmatch(p.name)]  # its kept state aside
        assert len(folders) == 1 and folders[0].startswith('ck@'), folders  # the row's, and no other
    finally:
        server.terminate()
        server.wait(30)


def test_every_save_route_writes_a_folder_of_its_own_and_drops_the_one_it_replaced(tmp_path, tiny_model_dir):
    """Native ``save`` and ``sync_sampler``, Tinker ``save_weights``, ``save_weights_for_sampler``
    and ``save_weights_external`` all commit by the row (the test above kills one): each save of
    a name writes a new folder, its row names it, and the folder it replaced is gone once the
    requests queued before it have finished. Nothing is left that no row names."""
    with background_server(tmp_path, tiny_model_dir, ('alice',)) as (url, keys, server):
        store = server.app.state.service.store
        client = TwinkleClient(url, keys['alice'])
        model = MultiLoraTransformersModel(client=client)
        run_id = model.add_adapter_to_model('default', LORA, seed=3)
        with tinker.ServiceClient(base_url=url, api_key=keys['alice']) as service:
            trainer = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=3).result()
            saves: dict[tuple[str, str, str], Callable[[], object]] = {
                (run_id, 'training', 'ck'): lambda: model.save('ck'),
                (run_id, 'sampler', 'sync'): lambda: client.call(f'/twinkle/v1/runs/{run_id}/sync_sampler', {}),
                (trainer.model_id, 'training', 'w'): lambda: trainer.save_state('w', overwrite=True).result(),
                (trainer.model_id, 'sampler', 's'): lambda: trainer.save_weights_for_sampler('s').result(),
                (trainer.model_id, 'external', 'e'): lambda: trainer.save_weights_external('e').result(),
            }
            for (owner, kind, name), save in saves.items():
                folders = []
                for _ in range(2):
                    save()
                    row = store.checkpoints.get(store.runs.by_id(owner).tenant_id, owner, name, kind)
                    folders.append(Path(row.path))
                    assert folders[-1].name.startswith(f'{name}@') and folders[-1].is_dir(), (kind, folders)
                assert folders[0] != folders[1], kind  # a folder of its own: never one a row named
                deadline = time.monotonic() + 30
                while folders[0].exists():  # deleted once the requests before the replacement finished
                    assert time.monotonic() < deadline, f'the {kind} folder {folders[0]} that {name!r} replaced stayed'
                    time.sleep(0.05)
        recorded = store.checkpoints.paths()
        root = server.app.state.service.config.checkpoint_dir
        on_disk = {str(p) for p in root.glob('*/*/**/*@ckpt-*') if p.is_dir()}
        assert on_disk == recorded, (sorted(on_disk), sorted(recorded))
