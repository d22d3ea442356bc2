"""The service sampling through vLLM: ``sampler: vllm`` (an engine beside the model: a run samples
its current weights) and ``sampler: {backend: vllm}`` (a sampler group of its own: a run samples
its last sync), through the native client and the unmodified Tinker SDK.

Each server's engine runs ``tiny-qwen3`` in float32 (``engine_args``), so samples match a local
``TorchSampler`` holding the same weights: greedy tokens equal, logprobs within 1e-4.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from peft import LoraConfig
from server_helpers import Gate, background_server
from tinker import types
from transformers import AutoModelForCausalLM

from twinkle import assets
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler as LocalSampler
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.checkpoint_engine import CheckpointEngineManager as RemoteManager
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

pytest.importorskip('vllm')

TOL = 1e-4
ENGINE = {'dtype': 'float32', 'max_model_len': 512}
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
ROWS = [{'input_ids': [11, 23, 5, 42, 17, 8], 'labels': [-100, 23, 5, 42, 17, 8]}] * 2
PROMPTS = [
    {'messages': [{'role': 'user', 'content': 'What is your name?'}], 'user_data': {'answer': 'twinkle'}},
    {'input_ids': [11, 23, 5, 42]},
]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)


@pytest.fixture(scope='module')
def beside(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Any]]:
    options = {'sampler': {'backend': 'vllm', 'group': False, 'engine_args': ENGINE}}
    with background_server(tmp_path_factory.mktemp('vllm-beside'), 'tiny-qwen3', **options) as running:
        yield running


@pytest.fixture(scope='module')
def grouped(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Any]]:
    options = {'sampler': {'backend': 'vllm', 'device': 'cpu', 'engine_args': ENGINE}}
    with background_server(tmp_path_factory.mktemp('vllm-group'), 'tiny-qwen3', **options) as running:
        yield running


def local_twin(tiny_model_dir: str, seed: int, steps: int) -> LocalSampler:
    """A local TorchSampler holding what a run of ``seed`` holds after ``steps`` steps on ``ROWS``."""
    model = TransformersModel(tiny_model_dir, device='cpu')
    torch.manual_seed(seed)
    model.add_adapter_to_model('policy', LORA)
    model.set_optimizer('AdamW', lr=5e-2)
    for _ in range(steps):
        model.forward_backward(inputs=ROWS)
        model.clip_grad_and_step()
    sampler = LocalSampler(tiny_model_dir, device='cpu')
    CheckpointEngineManager(model, sampler).sync_weights(merge_and_sync=False)
    return sampler


def same_samples(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        for a, b in zip(g.sequences, w.sequences, strict=True):
            assert a.tokens == b.tokens and a.decoded == b.decoded
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=TOL)
            assert [[t for t, _ in e] for e in a.logprobs] == [[t for t, _ in e] for e in b.logprobs]
            assert a.new_input_feature == b.new_input_feature


def test_a_run_samples_its_current_weights_through_the_engine_beside_the_model(beside, tiny_model_dir):
    url, keys, background = beside
    model = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, keys['alice']))
    model.add_adapter_to_model('policy', LORA, seed=7)
    model.set_optimizer('AdamW', lr=5e-2)
    sampler = vLLMSampler(model=model)
    for steps in (0, 2):  # each sample sees the run's weights after its last step, exported when they changed
        for _ in range(steps):
            model.forward_backward(inputs=ROWS)
            model.clip_grad_and_step()
        got = sampler.sample(PROMPTS, GREEDY)
        same_samples(got, local_twin(tiny_model_dir, 7, steps).sample(PROMPTS, GREEDY))
        assert {s.weight_version for r in got for s in r.sequences} == {steps}
    base = sampler.sample(PROMPTS, GREEDY, base_model=True)
    same_samples(base, LocalSampler(tiny_model_dir, device='cpu').sample(PROMPTS, GREEDY))
    host = background.app.state.service.default.host
    assert host.vllm is not None and host.vllm.sampler.adapter_names == ['run-' + model.runs['policy']]
    # What the CPU build of vLLM cannot do is a clear 400 at the route, and the engine serves on.
    with pytest.raises(RemoteError, match='prompt logprobs are not served') as error:
        sampler.sample(PROMPTS, SamplingParams(max_tokens=2, prompt_logprobs=True))
    assert error.value.status == 400
    assert len(sampler.sample(PROMPTS[1], GREEDY)[0].sequences[0].tokens) == 6


def test_the_tinker_sdk_samples_its_sampler_weights_through_the_engine(beside, sdk_clients):
    url, keys, _ = beside
    service = sdk_clients(url, keys['bob'])
    trainer = service.create_lora_training_client(base_model='tiny-qwen3', rank=4, seed=5).result()
    prompt = [11, 23, 5, 42]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([*prompt, 17]),
        loss_fn_inputs={'target_tokens': [23, 5, 42, 17, 8], 'weights': [1.0] * 5},
    )
    for _ in range(2):
        trainer.forward_backward([datum], 'cross_entropy').result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampling = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    reply = sampling.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    tokens, logprobs = reply.sequences[0].tokens, reply.sequences[0].logprobs
    # The trainer's own logprobs of the sampled tokens (teacher-forced): what the engine sampled with.
    forced = types.Datum(
        model_input=types.ModelInput.from_ints([*prompt, *tokens[:-1]]),
        loss_fn_inputs={'target_tokens': [*prompt[1:], *tokens], 'weights': [0.0] * 3 + [1.0] * 4},
    )
    trained = trainer.forward([forced], 'cross_entropy').result().loss_fn_outputs[0]['logprobs'].tolist()
    assert len(tokens) == 4 and logprobs == pytest.approx(trained[-4:], abs=TOL)


@pytest.mark.parametrize('temperature', [0.5, 1.5])
def test_every_api_gives_the_logprobs_of_the_distribution_at_the_temperature(beside, sdk_clients, temperature):
    # The engine's processed logprobs: log_softmax(logits / t) of the model's own forward at each
    # sampled token (tests/server/test_temperature_logprobs.py: the same through TorchSampler).
    url, keys, _ = beside
    model = AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3'), torch_dtype=torch.float32).eval()
    prompt = [11, 23, 5, 42]

    def expected(tokens: list[int]) -> list[float]:
        with torch.no_grad():
            logits_TV = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits_TV / temperature, dim=-1)[range(len(tokens)), tokens].tolist()

    params = SamplingParams(max_tokens=6, temperature=temperature, seed=42, num_samples=2, ignore_eos=True)
    native = vLLMSampler('tiny-qwen3', client=TwinkleClient(url, keys['alice'])).sample({'input_ids': prompt}, params)
    sampling = sdk_clients(url, keys['bob']).create_sampling_client(base_model='tiny-qwen3').result()
    tinker_params = types.SamplingParams(max_tokens=6, temperature=temperature, seed=42)
    reply = sampling.sample(types.ModelInput.from_ints(prompt), 2, tinker_params).result()
    for tokens, logprobs in [(s.tokens, s.token_logprobs) for s in native[0].sequences] + [
        (s.tokens, s.logprobs) for s in reply.sequences
    ]:
        assert len(tokens) > 0 and logprobs == pytest.approx(expected(tokens), abs=TOL)
    # OpenAI's text completion names its token by text: one token, whose text's ids include it.
    client = openai.OpenAI(base_url=f'{url}/v1', api_key=keys['alice'], max_retries=0, timeout=120)
    template = LocalSampler(assets.tiny_model('tiny-qwen3'), device='cpu').template
    for seed in range(3):
        logprobs = (
            client.completions.create(
                model='tiny-qwen3', prompt=prompt, max_tokens=1, temperature=temperature, seed=seed, logprobs=1
            )
            .choices[0]
            .logprobs
        )
        [text], [logprob] = logprobs.tokens, logprobs.token_logprobs
        ids = [i for i in range(model.config.vocab_size) if template.decode([i]) == text]
        assert any(logprob == pytest.approx(expected([i])[0], abs=TOL) for i in ids), (text, logprob)


def test_a_vllm_sampler_group_samples_each_runs_last_sync(grouped, tiny_model_dir):
    url, keys, background = grouped
    model = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, keys['alice']))
    model.add_adapter_to_model('policy', LORA, seed=7)
    model.set_optimizer('AdamW', lr=5e-2)
    sampler = vLLMSampler(model=model)
    manager = RemoteManager(model, sampler)
    with pytest.raises(RemoteError, match='no sampler weights yet'):
        sampler.sample(PROMPTS, GREEDY)
    assert manager.sync_weights().weight_version == 0
    same_samples(sampler.sample(PROMPTS, GREEDY), local_twin(tiny_model_dir, 7, 0).sample(PROMPTS, GREEDY))
    for _ in range(2):
        model.forward_backward(inputs=ROWS)
        model.clip_grad_and_step()
    stale = sampler.sample(PROMPTS, GREEDY)  # trained since, not synced: still version 0
    assert {s.weight_version for r in stale for s in r.sequences} == {0}
    assert manager.sync_weights().weight_version == 2
    fresh = sampler.sample(PROMPTS, GREEDY)
    same_samples(fresh, local_twin(tiny_model_dir, 7, 2).sample(PROMPTS, GREEDY))
    assert {s.weight_version for r in fresh for s in r.sequences} == {2}
    group = background.app.state.service.default
    assert group.sampler is not None and type(group.sampler.host).__name__ == 'VllmSamplerHost'


#: (tenant, prompt, max_tokens, seed, temperature) of the requests sent at once.
AT_ONCE = [
    ('alice', [11, 42, 7], 16, 1, 1.0),
    ('alice', [5, 6, 7, 8, 9], 8, 2, 0.7),
    ('alice', [3], 12, 3, 0.0),
    ('bob', [11, 42, 7], 16, 4, 1.0),
    ('bob', [1, 2], 10, 5, 1.2),
]


@pytest.mark.parametrize('where', ['beside', 'grouped'])
def test_concurrent_tinker_requests_of_two_tenants_share_one_generation_of_the_engine(where, request, sdk_clients):
    url, keys, background = request.getfixturevalue(where)
    group = background.app.state.service.default
    clients = {name: sdk_clients(url, keys[name]).create_sampling_client(base_model='tiny-qwen3').result()
               for name in ('alice', 'bob')}  # fmt: skip

    def send(tenant: str, prompt: list[int], max_tokens: int, seed: int, temperature: float) -> Any:
        params = types.SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature)
        return clients[tenant].sample(types.ModelInput.from_ints(prompt), 1, params)

    single = [send(*at_once).result() for at_once in AT_ONCE]
    engine = (group.host.vllm if group.sampler is None else group.sampler.host.sampling).sampler.calls
    scheduler = group.scheduler_for('sample')
    gate = Gate(scheduler)  # holds the worker: the requests wait together, then run
    futures = [send(*at_once) for at_once in AT_ONCE]
    deadline = time.monotonic() + 60
    while scheduler.queued() < len(AT_ONCE) and time.monotonic() < deadline:
        time.sleep(0.02)
    engine.widest = 0
    gate.open()
    for future, want in zip(futures, single, strict=True):
        got = future.result()
        assert got.sequences[0].tokens == want.sequences[0].tokens
        assert got.sequences[0].logprobs == pytest.approx(want.sequences[0].logprobs, abs=TOL)
    assert engine.widest == len(AT_ONCE)  # every request in one step of the engine
