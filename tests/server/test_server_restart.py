"""A server process killed with SIGKILL mid-request: after a restart the runs and every
acknowledged checkpoint are there, nothing half-written is, a resumed run continues with the
losses the uninterrupted run had, and the killed run itself continues from its newest kept state
(the server keeps it with every answered step: here it lost none of its 4)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from peft import LoraConfig
from server_helpers import add_key, free_port, start_server

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration


@pytest.fixture(scope='module')
def batches(tiny_model_dir, self_cognition_path) -> list[list[dict]]:
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(20)))
    dataset.set_template('Template', model_id=tiny_model_dir, max_length=128)
    dataset.map(SelfCognitionProcessor('twinkle model', 'ModelScope'))
    dataset.encode()
    return list(DataLoader(dataset=dataset, batch_size=4))


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)


def test_kill_9_mid_step_then_restart_keeps_runs_and_checkpoints_and_resumes_exactly(tmp_path, tiny_model_dir, batches):
    data_dir, port = tmp_path / 'data', free_port()
    key = add_key(tiny_model_dir, data_dir, 'alice')
    server = start_server(tiny_model_dir, data_dir, port)
    try:
        client = TwinkleClient(f'http://127.0.0.1:{port}', key)
        model = MultiLoraTransformersModel(client=client)
        run_id = model.add_adapter_to_model('default', lora(), seed=3)
        model.set_optimizer('AdamW', lr=1e-2)
        losses = []
        for step, batch in enumerate(batches[:4]):
            if step == 2:
                saved = model.save('after-two', save_optimizer=True)
            losses.append(model.forward_backward(inputs=batch).loss)
            model.clip_grad_and_step()
        # Kill while a step and then a save are queued or running.
        pending = client.submit(f'/twinkle/v1/runs/{run_id}/ops/forward_backward', {'inputs': batches[4]})
        client.submit(f'/twinkle/v1/runs/{run_id}/save', {'name': 'maybe', 'save_optimizer': True})
    finally:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()

    server = start_server(tiny_model_dir, data_dir, port)
    try:
        client = TwinkleClient(f'http://127.0.0.1:{port}', key)
        assert [(r.training_run_id, r.status) for r in client.list_training_runs()] == [(run_id, 'released')]
        checkpoints = {c.name: c for c in client.list_checkpoints(run_id)}
        assert 'after-two' in checkpoints and checkpoints['after-two'].twinkle_path == saved
        future = client.request('GET', f'/twinkle/v1/futures/{pending}')
        assert future['status'] in ('done', 'failed')  # never left 'running' after a restart
        # Every listed checkpoint is whole and loads; resuming from it continues the old losses.
        resumed = MultiLoraTransformersModel(client=client)
        resumed.add_adapter_to_model('default', lora())
        resumed.set_optimizer('AdamW', lr=1e-2)
        for name, checkpoint in checkpoints.items():
            assert resumed.load(checkpoint.twinkle_path, load_optimizer=True) == checkpoint.twinkle_path, name
        resumed.load(saved, load_optimizer=True)
        again = []
        for batch in batches[2:4]:
            again.append(resumed.forward_backward(inputs=batch).loss)
            resumed.clip_grad_and_step()
        assert again == pytest.approx(losses[2:4], abs=1e-6)
        # The old run's adapter died with the process: it continues from the state the server kept
        # after its 4th step, the weights the resumed run has after the same 4 steps.
        expected = resumed.forward_only(inputs=batches[0]).logps
        continued = client.call(f'/twinkle/v1/runs/{run_id}/ops/forward_only', {'inputs': batches[0]})
        for row, local in zip(continued['logps'], expected, strict=True):
            assert torch.allclose(torch.tensor(row), torch.tensor(local[: len(row)]), atol=1e-5)
    finally:
        server.terminate()
        server.wait(30)
