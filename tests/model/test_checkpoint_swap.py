"""Overwriting a checkpoint name, killed with SIGKILL in the middle of the swap.

A child process saves ``ck``, changes its weights, and saves ``ck`` again; a hook in the child
(the test's, not the library's) stops it at the swap and tells the test, which kills it with
SIGKILL. The name must then hold one whole checkpoint, the old or the new, and the next load
clears what the swap left beside it. A server's kept states are new folders, named by the store:
one killed before a state's commit is tested here too.

Two ways to swap are tried: Linux's ``renameat2(RENAME_EXCHANGE)``, stopped just after the
exchange, and the portable one (park the old, move the new in), stopped between its two renames,
where the name is missing.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from peft import LoraConfig
from server_helpers import add_key, free_port, server_command, start_server, wait_until_healthy

from twinkle.errors import LostWorkError
from twinkle.model import TransformersModel
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

#: Seconds to wait for the child to reach the swap (it loads a model first).
REACH_S = 300.0

#: Patches the running process so that a save stops at the swap: writes ``window`` in the signal
#: directory (with the digest of the checkpoint then under the name, if any) and sleeps.
HOOK = r"""
import hashlib, os, shutil, sys, time
from pathlib import Path
from twinkle.model.checkpoint import files as ckpt

def _digest(path):
    return hashlib.sha256((Path(path) / 'adapter_model.safetensors').read_bytes()).hexdigest()

def _stop(signals, text=''):
    (Path(signals) / 'window').write_text(text)
    time.sleep(3600)

def stop_at_swap(mode, signals):
    if mode == 'park':
        ckpt._exchange = lambda staging, destination: False  # as on a system without RENAME_EXCHANGE
        rename = os.rename
        def stopping_rename(source, destination):
            destination = Path(destination)
            parked = list(destination.parent.glob(f'.{destination.name}.old-*'))
            if parked and not destination.exists():  # the old is parked, the new not yet in
                _stop(signals)
            rename(source, destination)
        os.rename = stopping_rename
    else:
        exchange = ckpt._exchange
        def stopping_exchange(staging, destination):
            if not exchange(staging, destination):
                (Path(signals) / 'unsupported').write_text('')
                sys.exit(3)
            _stop(signals, _digest(destination))  # the new is in; the old waits to be deleted
        ckpt._exchange = stopping_exchange
"""

LIBRARY_CHILD = (
    HOOK
    + r"""
import torch
from peft import LoraConfig
from twinkle.errors import LostWorkError
from twinkle.model import TransformersModel

model_dir, out, mode = sys.argv[1:4]
torch.manual_seed(0)
model = TransformersModel(model_id=model_dir)
lora = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
model.add_adapter_to_model('default', lora)
first = model.save('ck', output_dir=f'{out}/ckpts')
(Path(out) / 'old').write_text(_digest(first))
with torch.no_grad():
    for parameter in model.model.parameters():
        if parameter.requires_grad:
            parameter.add_(1.0)
stop_at_swap(mode, out)
model.save('ck', output_dir=f'{out}/ckpts')
"""
)

#: A server whose commit of a run's kept state stops once the test arms it (``arm`` in the signal
#: directory): the state's folder is written, the store does not name it yet, the step is not answered.
SERVER_CHILD = r"""
import sys, time
from pathlib import Path
from twinkle.server.store import states

commit, signals = states.States.commit, Path(sys.argv[1])
def stopping_commit(self, run_id, folder):
    if (signals / 'arm').exists():
        (signals / 'window').write_text(folder)
        time.sleep(3600)
    return commit(self, run_id, folder)
states.States.commit = stopping_commit
from twinkle.server.cli import main
main(sys.argv[2:])
"""


def digest(checkpoint: Path) -> str:
    return hashlib.sha256((checkpoint / 'adapter_model.safetensors').read_bytes()).hexdigest()


def wait_for_window(process: subprocess.Popen, signals: Path) -> str:
    deadline = time.monotonic() + REACH_S
    while not (signals / 'window').exists():
        if (signals / 'unsupported').exists():
            process.wait()
            pytest.skip('this filesystem cannot exchange two directories (RENAME_EXCHANGE)')
        if process.poll() is not None:
            raise AssertionError(f'the child ended before the swap: {process.stderr.read().decode()[-3000:]}')
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError('the child did not reach the swap')
        time.sleep(0.1)
    time.sleep(0.05)  # the file is written; the child is asleep in the window
    return (signals / 'window').read_text()


def kill_9(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)


@pytest.mark.parametrize('mode', ['exchange', 'park'])
def test_a_save_killed_in_the_swap_leaves_one_whole_checkpoint(tmp_path, tiny_model_dir, mode):
    child = [sys.executable, '-c', LIBRARY_CHILD, tiny_model_dir, str(tmp_path), mode]
    process = subprocess.Popen(child, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        new = wait_for_window(process, tmp_path)
    finally:
        kill_9(process)
    # Exchanged: the new one is under the name. Parked: the new one never moved in, the old comes back.
    expected = new if mode == 'exchange' else (tmp_path / 'old').read_text()
    model = TransformersModel(model_id=tiny_model_dir)
    model.add_adapter_to_model('default', lora())
    model.load('ck', str(tmp_path / 'ckpts'))
    assert digest(tmp_path / 'ckpts' / 'ck') == expected
    assert [p.name for p in (tmp_path / 'ckpts').iterdir()] == ['ck']  # nothing left beside it
    # The next save of the name works as ever.
    model.save('ck', output_dir=str(tmp_path / 'ckpts'))
    assert [p.name for p in (tmp_path / 'ckpts').iterdir()] == ['ck']


def test_a_server_killed_before_a_steps_state_is_committed_brings_the_run_back_without_that_step(
    tmp_path, tiny_model_dir
):
    """A server keeps each run's state in a folder of its own, then commits it with the step's answer
    (``tests/server/test_run_lifecycle.py`` kills a save at its commit). Killed after the 4th step wrote its
    state and before its commit: the restart sweeps that folder, the step is answered 'failed', and the
    run continues from its 3rd step's state (nothing answered is lost but the 4th ``forward_backward``,
    which the run's next request names); it then holds the weights of 3 steps."""
    data_dir, port, signals = tmp_path / 'data', free_port(), tmp_path / 'signals'
    signals.mkdir()
    key = add_key(tiny_model_dir, data_dir, 'alice')
    command = [sys.executable, '-c', SERVER_CHILD, str(signals), *server_command(tiny_model_dir, data_dir, port)[3:]]
    server = subprocess.Popen([*command, 'serve'], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows = [{'input_ids': [11, 23, 5, 42, 17, 8], 'labels': [-100, 23, 5, 42, 17, 8]}]

    def train(model: MultiLoraTransformersModel, steps: int) -> None:
        for _ in range(steps):
            model.forward_backward(inputs=rows)
            model.clip_grad_and_step()

    try:
        wait_until_healthy(server, port)
        client = TwinkleClient(f'http://127.0.0.1:{port}', key)
        model = MultiLoraTransformersModel(client=client)
        run_id = model.add_adapter_to_model('default', lora(), seed=3)
        model.set_optimizer('AdamW', lr=1e-2)
        train(model, 3)
        lost = client.submit(f'/twinkle/v1/runs/{run_id}/ops/forward_backward', {'inputs': rows})
        client.result(lost)
        (signals / 'arm').write_text('')
        step = client.submit(f'/twinkle/v1/runs/{run_id}/ops/clip_grad_and_step', {})  # the 4th: stopped at its commit
        uncommitted = wait_for_window(server, signals)
    finally:
        kill_9(server)

    server = start_server(tiny_model_dir, data_dir, port)
    try:
        client = TwinkleClient(f'http://127.0.0.1:{port}', key)
        assert client.request('GET', f'/twinkle/v1/futures/{step}')['status'] == 'failed'
        assert not list(data_dir.glob(f'checkpoints/*/{run_id}/{uncommitted}'))  # swept at the start
        model = MultiLoraTransformersModel(client=client)
        model.attach(run_id)
        with pytest.raises(LostWorkError, match=rf'forward_backward {lost}\b'):
            model.forward_only(inputs=rows)
        (continued,) = model.forward_only(inputs=rows).logps
        again = MultiLoraTransformersModel(client=client)
        again.add_adapter_to_model('default', lora(), seed=3)
        again.set_optimizer('AdamW', lr=1e-2)
        train(again, 3)
        (expected,) = again.forward_only(inputs=rows).logps
        assert continued == pytest.approx(expected, abs=1e-6)
        assert len(list(data_dir.glob(f'checkpoints/*/{run_id}/*'))) == 1  # its committed state, nothing beside it
        assert client.get_training_run(run_id).restored_from is None  # no answered step lost
    finally:
        server.terminate()
        server.wait()
