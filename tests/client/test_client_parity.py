"""The native client does what the local model does: evaluation without a step
(``forward_only``, ``calculate_loss``, ``calculate_metric(is_training=False)``), with the same
numbers and types, and the same error classes for the same mistakes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, PeftModel
from server_helpers import background_server, free_port
from transformers import AutoModelForCausalLM

from twinkle.errors import DataError, HubUnavailableError, NotFoundError, StateError, TwinkleError, UnknownNameError
from twinkle.model import TransformersModel
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

TRAIN = [
    {'input_ids': [5 + i, 17, 42, 99, 3 + i, 8, 61], 'labels': [-100, -100, 42, 99, 3 + i, 8, 61]} for i in range(4)
]
EVAL = [{'input_ids': [9, 33 + i, 71, 12, 55], 'labels': [-100, 33 + i, 71, 12, 55]} for i in range(3)]
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('parity'), tiny_model_dir) as running:
        yield running


@pytest.fixture
def pair(server, tiny_model_dir):
    """The same adapter (seed 11) on a local model and on the server, each trained two steps."""
    url, keys, _ = server
    local = TransformersModel(tiny_model_dir, device='cpu')
    torch.manual_seed(11)
    local.add_adapter_to_model('parity', LORA)
    remote = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
    remote.add_adapter_to_model('parity', LORA, seed=11)
    for model in (local, remote):
        model.set_optimizer('AdamW', lr=1e-2)
        for _ in range(2):
            model.forward_backward(inputs=TRAIN)
            model.clip_grad_and_step()
        model.calculate_metric(is_training=True)  # both start the evaluation with no training figures pending
    return local, remote


def evaluate(model) -> tuple[list[float], dict[str, float]]:
    losses = []
    for row in EVAL:
        output = model.forward_only(inputs=[row])
        assert output.loss is None  # a forward alone computes no loss, locally and remotely
        losses.append(model.calculate_loss())
    return losses, model.calculate_metric(is_training=False)


def test_evaluation_without_a_step_gives_the_local_numbers_and_types(pair):
    local, remote = pair
    (local_losses, local_metrics), (remote_losses, remote_metrics) = evaluate(local), evaluate(remote)
    assert remote_losses == pytest.approx(local_losses, rel=1e-5, abs=1e-6)
    assert all(type(value) is float for value in local_losses + remote_losses)
    assert set(remote_metrics) == set(local_metrics) == {'loss', 'accuracy'}
    assert remote_metrics == pytest.approx(local_metrics, rel=1e-5, abs=1e-6)
    # Evaluation took no step and left the training figures alone.
    assert remote.calculate_metric(is_training=True)['steps'] == local.calculate_metric(is_training=True)['steps'] == 2


def test_a_policy_loss_is_computed_from_given_inputs_as_locally(pair):
    local, remote = pair
    row = EVAL[0]
    completion = sum(label != -100 for label in row['labels'])
    old_logps = [[-2.5] * completion]  # one per trained token
    values = []
    for model in (local, remote):
        model.set_loss('GRPOLoss', epsilon=0.2)
        model.forward_only(inputs=[row])
        values.append(model.calculate_loss(advantages=[1.5], old_logps=old_logps))
    assert values[1] == pytest.approx(values[0], rel=1e-5, abs=1e-6)
    assert values[0] != 0.0


@pytest.mark.parametrize(
    ('mistake', 'error', 'from_server'),
    [
        (lambda model: model.calculate_loss(adapter_name='fresh'), StateError, True),  # no forward on it yet
        (lambda model: model.set_loss('NoSuchLoss', adapter_name='fresh'), UnknownNameError, True),
        # the client refuses these itself, before a request: an adapter it does not know, a misaligned row
        (lambda model: model.calculate_metric(adapter_name='nobody'), UnknownNameError, False),
        (
            lambda model: model.forward_only(inputs=[{'input_ids': [1, 2], 'labels': [1]}], adapter_name='fresh'),
            DataError,
            False,
        ),
    ],
)
def test_the_same_mistake_raises_the_same_error_class(pair, mistake, error, from_server):
    local, remote = pair
    local.add_adapter_to_model('fresh', LORA)
    remote.add_adapter_to_model('fresh', LORA)
    for model in (local, remote):
        with pytest.raises(error) as raised:
            mistake(model)
        assert isinstance(raised.value, TwinkleError)
    # A server's refusal is a RemoteError too, with its status, and also the local class.
    assert isinstance(raised.value, RemoteError) == from_server


def test_the_client_exports_its_checkpoints_as_the_local_export_does(pair, server, tmp_path, tiny_model_dir):
    url, keys, _ = server
    _, remote = pair
    path = remote.save('to-export', save_optimizer=True)
    adapter = remote.export(path, tmp_path / 'adapter')
    names = {p.name for p in adapter.iterdir()}
    assert {'adapter_config.json', 'adapter_model.safetensors'} <= names and 'optimizer.pt' not in names
    merged = remote.export(path, tmp_path / 'merged', merge=True)
    tokens = torch.tensor([[3, 17, 42, 99, 5, 8]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        expected = PeftModel.from_pretrained(base, str(adapter))(input_ids=tokens).logits
        got = AutoModelForCausalLM.from_pretrained(merged)(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Another tenant's checkpoint is not found; the folder it would have filled is not made.
    with pytest.raises(NotFoundError):
        TwinkleClient(url, keys['bob']).download_checkpoint(path, tmp_path / 'stolen')
    assert not (tmp_path / 'stolen').exists()


@pytest.mark.parametrize('hub_id', ['hf://org/adapter', 'ms://org/adapter'])
def test_an_unreachable_hub_is_a_clear_error(pair, tmp_path, hub_id):
    _, remote = pair
    path = remote.save('to-upload')
    # Offline (the tests run so): refused before any request.
    with pytest.raises(HubUnavailableError, match=rf"turned off here \(offline mode\): '{hub_id}' was not uploaded"):
        remote.upload_to_hub(path, hub_id, token='t' * 32)
    # Online, with nothing listening at the hub's endpoint: the hub library's own connection error, seen
    # through the command line in a process of its own (huggingface_hub reads its offline flag at import).
    checkpoint = remote.client.download_checkpoint(path, tmp_path / 'local')
    closed = f'http://127.0.0.1:{free_port()}'
    environment = {k: v for k, v in os.environ.items() if not k.endswith('_OFFLINE')}
    environment |= {'HF_ENDPOINT': closed, 'MODELSCOPE_ENDPOINT': closed, 'HF_TOKEN': 'hf_' + 'x' * 34}
    # modelscope_hub tries a refused connection 5 times with back-off (15 s); one try shows the error.
    environment['MODELSCOPE_API_MAX_RETRIES'] = '1'
    command = [sys.executable, '-m', 'twinkle.cli', 'export', str(checkpoint), '--out', str(tmp_path / 'out')]
    result = subprocess.run(
        [*command, '--push-to-hub', hub_id], capture_output=True, text=True, timeout=300, env=environment, check=False
    )
    last = result.stderr.splitlines()[-1] if result.stderr else ''
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.fullmatch(
        rf"twinkle: error: .* could not be reached to upload '{hub_id}': \w+; check the network .*", last
    )
