"""A model with a sampler group of its own (``sampler: {ranks: 1}``): sampling runs in its own
worker process and thread, at the same time as training; a run's samples come from its weights
as of its last sync, each sequence marked with that version; Tinker's sampler weights sample
there too."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from peft import LoraConfig
from server_helpers import Gate, background_server
from tinker import types

from twinkle.data_format import SamplingParams
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.checkpoint_engine import CheckpointEngineManager
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
ROWS = [{'input_ids': [11, 23, 5, 42, 17, 8], 'labels': [-100, 23, 5, 42, 17, 8]}] * 2
PROMPT = [{'input_ids': [11, 23, 5, 42]}]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1)


@pytest.fixture(scope='module')
def served(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Any]]:
    data_dir = tmp_path_factory.mktemp('sampler-group')
    options = {'sampler': {'ranks': 1, 'device': 'cpu'}, 'release_memory_after_idle_s': None}
    with background_server(data_dir, 'tiny-qwen3', **options) as running:
        yield running


def sampled(sampler: vLLMSampler) -> tuple[list[int], list[float], int]:
    sequence = sampler.sample(PROMPT, GREEDY)[0].sequences[0]
    return sequence.tokens, sequence.token_logprobs, sequence.weight_version


def test_a_run_samples_its_weights_as_of_its_last_sync(served):
    url, keys, background = served
    model = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, keys['alice']))
    model.add_adapter_to_model('default', LORA, seed=3)
    model.set_optimizer('AdamW', lr=5e-2)
    sampler = vLLMSampler(model=model)
    manager = CheckpointEngineManager(model, sampler)
    with pytest.raises(RemoteError, match='no sampler weights yet') as error:
        sampler.sample(PROMPT, GREEDY)
    assert error.value.status == 409
    assert manager.sync_weights().weight_version == 0
    before = sampled(sampler)
    for _ in range(3):
        model.forward_backward(inputs=ROWS)
        model.clip_grad_and_step()
    assert sampled(sampler) == before  # trained since, not synced: the sampler still sees version 0
    assert manager.sync_weights().weight_version == 3
    after = sampled(sampler)
    assert after[2] == 3 and after[1] != before[1]
    # The samples are those of the run's weights: the same weights sampled by their saved path.
    path = model.save('step-3')
    assert sampled(vLLMSampler(model_path=path, client=model.client))[:2] == after[:2]
    group = background.app.state.service.default
    assert group.sampler is not None and len(group.sampler.host.pids) == 1  # a worker process of its own


def test_sampling_runs_while_the_model_is_busy_training(served):
    # The model's worker is held by a job that waits for a sampling request to finish: with
    # one worker for both, that request could never run and the job would time out.
    url, keys, background = served
    group = background.app.state.service.default
    sampler = vLLMSampler(model_id='tiny-qwen3', client=TwinkleClient(url, keys['bob']))
    sampled_meanwhile = threading.Event()
    held = group.scheduler.submit('gatekeeper', lambda: sampled_meanwhile.wait(120))
    tokens, _, version = sampled(sampler)
    sampled_meanwhile.set()
    assert held.wait(120) and held.result is True
    assert len(tokens) == 5 and version == 0  # the base model


def test_tinker_sampler_weights_sample_on_the_sampler_group(served, sdk_clients):
    url, keys, background = served
    service_client = sdk_clients(url, keys['alice'])
    trainer = service_client.create_lora_training_client(base_model='tiny-qwen3', rank=4, seed=5).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([11, 23, 5, 42, 17]),
        loss_fn_inputs={'target_tokens': [23, 5, 42, 17, 8], 'weights': [1.0] * 5},
    )
    for _ in range(2):
        trainer.forward_backward([datum], 'cross_entropy').result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampling = trainer.save_weights_and_get_sampling_client().result()  # saved on the model's worker
    # Then the model's worker is held until the sample is back: it must come from the sampler's.
    group = background.app.state.service.default
    sampled_meanwhile = threading.Event()
    held = group.scheduler.submit('gatekeeper', lambda: sampled_meanwhile.wait(120))
    reply = sampling.sample(types.ModelInput.from_ints([11, 23, 5]), 1, types.SamplingParams(max_tokens=3)).result()
    sampled_meanwhile.set()
    assert held.wait(120) and held.result is True
    assert len(reply.sequences[0].tokens) == 3


def test_sampling_requests_waiting_together_run_as_one_pass_each_as_alone(served, sdk_clients):
    url, keys, background = served
    group = background.app.state.service.default
    clients = {name: sdk_clients(url, keys[name]).create_sampling_client(base_model='tiny-qwen3').result()
               for name in ('alice', 'bob')}  # fmt: skip
    requests = [('alice', [11, 42, 7], 8, 1, 1.0), ('alice', [5, 6, 7, 8], 6, 2, 0.7), ('alice', [3], 5, 3, 0.0),
                ('bob', [11, 42, 7], 8, 4, 1.0), ('bob', [1, 2], 7, 5, 1.2)]  # fmt: skip

    def send(tenant: str, prompt: list[int], max_tokens: int, seed: int, temperature: float) -> Any:
        params = types.SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature)
        return clients[tenant].sample(types.ModelInput.from_ints(prompt), 1, params)

    alone = [send(*request).result() for request in requests]
    scheduler = group.sampler.scheduler
    gate = Gate(scheduler)
    futures = [send(*request) for request in requests]
    deadline = time.monotonic() + 60
    while scheduler.queued() < len(requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    passes = scheduler.stats()['passes']
    gate.open()
    for future, want in zip(futures, alone, strict=True):
        got = future.result()
        assert got.sequences[0].tokens == want.sequences[0].tokens
        assert got.sequences[0].logprobs == pytest.approx(want.sequences[0].logprobs, abs=1e-4)
    assert scheduler.stats()['passes'] - passes == 1  # after the gate's (running already), all five in one
