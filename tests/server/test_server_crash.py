"""A server killed (``kill -9``) while its tenants train: every step it answered comes back, and what it
answered but lost (the ``forward_backward`` calls since a run's last step) is its client's next error.

The server keeps each run's state with every step's answer (``save_state_every_steps=1``), in one
commit: a step answered is in the state its run comes back from, one not answered is not; the calls
answered after that state died with the process, and the run's next request fails with a
``LostWorkError`` naming them, once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import tinker
from sdk_clients import ServiceClients
from server_helpers import add_key, free_port, start_server
from tinker import types

from twinkle.errors import LostWorkError
from twinkle.model.checkpoint import files as ckpt
from twinkle.server.config import ServerConfig
from twinkle.server.execution.groups.run_files import kept_state
from twinkle.server.store import Store
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / 'benchmarks'))
import worker_crash  # the benchmark's run: tenants, the kill, the checks against the store

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration


def test_an_answered_step_comes_back_and_the_calls_answered_after_it_are_named(tmp_path, tiny_model_dir):
    """Two steps answered, then a ``forward_backward`` answered, then the kill: the run comes back at step
    2 (not at the state kept when it was made), its next request fails naming that call, the call sent
    again trains as it would have (the weights of 3 local steps), and a state written but never
    committed (a kill between the two) is swept at the start, never restored from."""
    settings = worker_crash.Settings(steps=3)
    tenant = worker_crash.Tenant('alice', '', 7, worker_crash.batches(7, settings))
    data_dir, port = tmp_path / 'data', free_port()
    tenant.key = add_key(tiny_model_dir, data_dir, 'alice')
    server = start_server(tiny_model_dir, data_dir, port)
    url = f'http://127.0.0.1:{port}'
    try:
        tenant.create(url)
        model = MultiLoraTransformersModel(client=TwinkleClient(url, tenant.key))
        model.attach(tenant.run_id)
        for batch in tenant.data[:2]:
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
        lost = model.client.submit(f'/twinkle/v1/runs/{tenant.run_id}/ops/forward_backward', {'inputs': tenant.data[2]})
        model.client.result(lost)  # answered: its gradients wait for a step on the model
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()
    with Store(data_dir / 'twinkle.db') as store:
        kept = store.states.get(tenant.run_id)
        run = store.runs.by_id(tenant.run_id)
    assert kept is not None and kept.folder is not None and run is not None
    config = ServerConfig.build(base_model=tiny_model_dir, data_dir=str(data_dir))
    committed = kept_state(config, run, kept.folder)  # in host memory, or on disk
    assert committed is not None and ckpt.read_trainer_state(committed)['optim_step'] == 2
    uncommitted = config.checkpoint_dir / run.tenant_id / run.id / 'state@ffffffffffff'
    shutil.copytree(committed, uncommitted)  # a step's state the kill cut off before its commit
    ckpt.write_json(uncommitted / ckpt.TRAINER_STATE, {**ckpt.read_trainer_state(uncommitted), 'optim_step': 3})

    server = start_server(tiny_model_dir, data_dir, port)
    try:
        assert not uncommitted.exists()
        model = MultiLoraTransformersModel(client=TwinkleClient(url, tenant.key))
        model.attach(tenant.run_id)
        with pytest.raises(LostWorkError, match=rf'forward_backward {lost}\b.*Send them again'):
            model.clip_grad_and_step()
        model.forward_backward(inputs=tenant.data[2])  # told once: the call sent again
        model.clip_grad_and_step()
        assert [step.step for step in model.client.run_history(tenant.run_id)] == [1, 2, 3]
        remote = model.forward_only(inputs=worker_crash.PROBE).logps
    finally:
        server.terminate()
        server.wait(60)
    local = worker_crash.local_weights(tiny_model_dir, tenant, 3)
    for row, ref in zip(remote, local, strict=True):
        assert row == pytest.approx(ref[: len(row)], abs=worker_crash.ABS_TOL)


def test_tenants_killed_under_load_get_back_every_answered_step_and_are_told_of_every_lost_call(tmp_path):
    """Three tenants training at once, the server killed wherever each is: per run, against the store's
    futures, the weights and history hold exactly the answered steps, the next request names exactly
    the calls answered after the last of them, every answer a client got is true, and nothing is left
    pending (``benchmarks/worker_crash.py`` runs the same with eight)."""
    settings = worker_crash.Settings(tenants=3, steps=6, kill_after=2)
    report = worker_crash.crash_run(settings, tmp_path)
    for run in report['runs']:
        assert run['steps_answered'] >= settings.kill_after, run
        assert (run['steps_kept'], run['lost_told'], run['answers_true']) == (True, True, True), json.dumps(run)


def test_a_tinker_optim_step_whose_gradients_died_fails_naming_them(tmp_path, tiny_model_dir):
    """Through the Tinker SDK: a step answered, a ``forward_backward`` answered, the kill; the
    ``optim_step`` after the restart is an error naming that call (was: ``skipped_steps:sum`` 1.0 and no
    error), and the call sent again is stepped."""
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={'target_tokens': row[1:], 'weights': [1.0] * (len(row) - 1)},
        )
        for row in ([(7 * i + 3 * j) % 300 + 20 for j in range(10)] for i in range(3))
    ]
    adam = types.AdamParams(learning_rate=2e-2)
    data_dir, port = tmp_path / 'data', free_port()
    key, url = add_key(tiny_model_dir, data_dir, 'alice'), f'http://127.0.0.1:{port}'
    server = start_server(tiny_model_dir, data_dir, port)
    try:
        with ServiceClients() as clients:
            training = clients(url, key).create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
            training.forward_backward(data, 'cross_entropy').result()
            training.optim_step(adam).result()
            training.forward_backward(data, 'cross_entropy').result()  # answered: its gradients wait on the model
            with Store(data_dir / 'twinkle.db') as store:
                (lost,) = store.db.ids(
                    "SELECT id FROM futures WHERE op = 'forward_backward' ORDER BY created_at DESC LIMIT 1"
                )
            os.kill(server.pid, signal.SIGKILL)
            server.wait(30)
            server = start_server(tiny_model_dir, data_dir, port)
            with pytest.raises(tinker.RequestFailedError, match=rf'LostWorkError: .*forward_backward {lost}\b'):
                training.optim_step(adam).result()
            training.forward_backward(data, 'cross_entropy').result()  # told once: sent again, it is stepped
            assert 'skipped_steps:sum' not in training.optim_step(adam).result().metrics
    finally:
        server.kill()
        server.wait(30)
