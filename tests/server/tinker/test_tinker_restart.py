"""The Tinker SDK's checkpoints survive a server killed with SIGKILL: after a restart, a model
created from the saved state computes what the original did, and the saved sampler weights
sample what they sampled before."""

from __future__ import annotations

import os
import signal

import pytest
import tinker
import torch
from sdk_clients import ServiceClients
from server_helpers import add_key, free_port, start_server
from tinker import types

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration


def data() -> list[types.Datum]:
    rows = [[(5 * i + 3 * j) % 300 + 20 for j in range(10)] for i in range(3)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={'target_tokens': row[1:], 'weights': [1.0] * 9},
        )
        for row in rows
    ]


def logprobs(client: tinker.TrainingClient) -> list[torch.Tensor]:
    output = client.forward(data(), 'cross_entropy').result()
    return [item['logprobs'].to_torch() for item in output.loss_fn_outputs]


def test_saved_checkpoints_load_after_kill_9_and_restart(tmp_path, tiny_model_dir):
    data_dir, port = tmp_path / 'data', free_port()
    key = add_key(tiny_model_dir, data_dir, 'alice')
    url, prompt = f'http://127.0.0.1:{port}', types.ModelInput.from_ints([21, 42, 63])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    server = start_server(tiny_model_dir, data_dir, port)
    try:
        with ServiceClients() as clients:  # closed before the server is killed
            client = clients(url, key)
            training = client.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()
            for _ in range(3):
                training.forward_backward(data(), 'cross_entropy')
                training.optim_step(types.AdamParams(learning_rate=2e-2))
            state = training.save_state('before-kill').result().path
            sampler_path = training.save_weights_for_sampler('before-kill').result().path
            expected = logprobs(training)
            sampled = client.create_sampling_client(model_path=sampler_path).sample(prompt, 1, greedy).result()
            training.forward_backward(data(), 'cross_entropy')  # in flight, or not, when the server dies
            os.kill(server.pid, signal.SIGKILL)
            server.wait(30)
            server = start_server(tiny_model_dir, data_dir, port)

            again = clients(url, key)
            resumed = again.create_training_client_from_state_with_optimizer(state).result()
            for before, after in zip(expected, logprobs(resumed), strict=True):
                torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
            sampler = again.create_sampling_client(model_path=sampler_path)
            assert sampler.sample(prompt, 1, greedy).result().sequences[0].tokens == sampled.sequences[0].tokens
            listed = {c.tinker_path for c in again.create_rest_client().list_user_checkpoints().result().checkpoints}
            assert {state, sampler_path} <= listed
    finally:
        server.kill()
