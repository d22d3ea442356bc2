"""Sampling through the training service on loopback: a run samples its adapter as it is after
its last step, with the local sampler's results; the samples train back over HTTP."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from server_helpers import background_server

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SampledSequence, SampleResponse, SamplingParams
from twinkle.dataset import DatasetMeta
from twinkle.errors import DataError, StateError
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler as LocalSampler
from twinkle.template import Template
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import TorchSampler, vLLMSampler

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

PROMPTS = [
    {'messages': [{'role': 'user', 'content': 'What is your name?'}], 'user_data': {'answer': 'twinkle'}},
    {'messages': [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Name three fruits'}]},
]


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    data_dir = tmp_path_factory.mktemp('server')
    with background_server(data_dir, tiny_model_dir, limits={'max_tokens_per_request': 4096}) as (url, keys, _):
        yield url, keys


@pytest.fixture(scope='module')
def batches(tiny_model_dir, self_cognition_path) -> list[list[dict]]:
    dataset = Dataset(dataset_meta=DatasetMeta(self_cognition_path, data_slice=range(8)))
    dataset.set_template('Qwen3_5Template', model_id=tiny_model_dir, max_length=128)
    dataset.map('SelfCognitionProcessor', init_args={'model_name': 'twinkle model', 'model_author': 'ModelScope'})
    dataset.encode(batched=True)
    return list(DataLoader(dataset=dataset, batch_size=4))


@pytest.fixture(scope='module')
def encoded_prompt(tiny_model_dir) -> dict:
    """An encoded prompt (as ``dataset.encode(add_generation_prompt=True)`` gives) with user data."""
    messages = [{'role': 'user', 'content': 'Count to three.'}]
    ids = Template(tiny_model_dir).encode({'messages': messages}, add_generation_prompt=True)['input_ids']
    return {'input_ids': ids, 'user_data': {'answer': '1 2 3'}}


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)


def remote_model(url: str, key: str, seed: int) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
    model.add_adapter_to_model('policy', lora(), seed=seed)
    return model


def train(model, batches: list, steps: int) -> None:
    model.set_optimizer('AdamW', lr=1e-2)
    for batch in batches[:steps]:
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()


def flat(responses: list[SampleResponse]) -> list[SampledSequence]:
    return [seq for response in responses for seq in response.sequences]


def test_a_runs_samples_equal_a_local_sampler_synced_with_the_same_adapter(
    server, batches, encoded_prompt, tiny_model_dir
):
    url, keys = server
    model = remote_model(url, keys['alice'], seed=7)
    train(model, batches, 2)
    # The same adapter locally: the seed draws the same initial LoRA weights, the steps match.
    local = TransformersModel(tiny_model_dir, device='cpu')
    torch.manual_seed(7)
    local.add_adapter_to_model('policy', lora())
    train(local, batches, 2)
    synced = LocalSampler(tiny_model_dir, device='cpu')
    CheckpointEngineManager(local, synced).sync_weights(merge_and_sync=False)

    prompts = [*PROMPTS, encoded_prompt]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, prompt_logprobs=True, ignore_eos=True)
    remote = TorchSampler(model=model).sample(prompts, params)
    want = synced.sample(prompts, params)
    assert all(isinstance(r, SampleResponse) for r in remote) and len(remote) == len(prompts)
    for got, expected in zip(remote, want, strict=True):
        assert got.prompt_token_ids == expected.prompt_token_ids
        assert got.prompt_logprobs == pytest.approx(expected.prompt_logprobs, abs=1e-5)
    for got, expected in zip(flat(remote), flat(want), strict=True):
        assert isinstance(got, SampledSequence) and isinstance(got.logprobs[0][0], tuple)
        assert got.tokens == expected.tokens and got.decoded == expected.decoded
        assert [[t for t, _ in e] for e in got.logprobs] == [[t for t, _ in e] for e in expected.logprobs]
        assert [lp for e in got.logprobs for _, lp in e] == pytest.approx(
            [lp for e in expected.logprobs for _, lp in e], abs=1e-5
        )
        assert got.new_input_feature == expected.new_input_feature  # user_data, messages and labels too
        assert got.weight_version == 2  # the run's optimizer steps
    # base_model=True samples without the adapter: a sampler holding the base weights alone.
    base = TorchSampler(model=model).sample(prompts, params, base_model=True)
    base_want = LocalSampler(tiny_model_dir, device='cpu').sample(prompts, params)
    assert [s.tokens for s in flat(base)] == [s.tokens for s in flat(base_want)] != [s.tokens for s in flat(remote)]
    assert [s.token_logprobs for s in flat(base)] == [
        pytest.approx(s.token_logprobs, abs=1e-5) for s in flat(base_want)
    ]


def test_messages_are_encoded_with_the_runs_template(server, tiny_model_dir):
    url, keys = server
    model = remote_model(url, keys['alice'], seed=1)
    model.set_template('Template', default_system='Answer in one word.')
    response = vLLMSampler(model=model).sample(PROMPTS[0], {'max_tokens': 2})[0]
    local = Template(tiny_model_dir, default_system='Answer in one word.')
    assert response.prompt_token_ids == local.encode(PROMPTS[0], add_generation_prompt=True)['input_ids']
    assert response.sequences[0].new_input_feature['messages'][:1] == PROMPTS[0]['messages']


def test_a_grpo_step_over_http_on_the_runs_own_samples(server):
    url, keys = server
    model = remote_model(url, keys['alice'], seed=3)
    model.set_loss('GRPOLoss')
    model.add_metric('GRPOMetric')
    model.set_optimizer('AdamW', lr=1e-2)
    sampler = TorchSampler(model=model)
    params = SamplingParams(max_tokens=6, num_samples=2, seed=0)
    sequences = flat(sampler.sample(PROMPTS, params))
    advantages = [1.0, -0.5, 0.2, 0.8]
    out = model.forward_backward(
        inputs=[s.new_input_feature for s in sequences],
        old_logps=[s.token_logprobs for s in sequences],
        advantages=advantages,
    )
    # The sampler ran the trainer's own weights, so the policy ratio is 1 on every token and the
    # clipped objective is -A per token: the loss is minus the mean advantage, -1.5 / 4.
    assert out.loss == pytest.approx(-sum(advantages) / len(advantages), abs=1e-5)
    assert out.num_tokens == sum(len(s.tokens) for s in sequences)
    assert model.calculate_metric()['ratio'] == pytest.approx(1.0, abs=1e-5)
    assert model.clip_grad_and_step() > 0
    # The next sample sees the step: the same seed, new weights, new logprobs, version 1.
    after = flat(sampler.sample(PROMPTS, params))
    assert {s.weight_version for s in after} == {1}
    assert [s.token_logprobs for s in after] != [s.token_logprobs for s in sequences]


def test_bad_sample_requests_are_a_400_that_names_the_problem(server, tiny_model_dir):
    url, keys = server
    model = remote_model(url, keys['bob'], seed=0)
    sampler = TorchSampler(model=model)
    context = LocalSampler(tiny_model_dir, device='cpu').model.config.max_position_embeddings
    cases = [
        (PROMPTS, {'max_tokens': 0}, 'max_tokens must be a positive integer; got 0'),
        (PROMPTS, {'max_token': 3}, "unknown sampling parameters ['max_token']"),
        (PROMPTS, {'temperature': -1}, 'temperature must be a finite number >= 0'),
        (PROMPTS, {'logprobs': 21}, 'logprobs=21 is over the limit of 20'),
        (PROMPTS, {'stop': [99999]}, 'stop token id 99999 is outside the vocabulary'),
        ([{'input_ids': [1, 5000]}], None, 'prompt 0 has token id 5000, outside the vocabulary'),
        ([{'input_ids': [1, 2]}], {'max_tokens': context}, f'exceed the model context of {context} tokens'),
        # 3 prompts x 200 samples x (2 prompt tokens + max_tokens 8) = 6000 tokens, over 4096.
        ([{'input_ids': [1, 2]}] * 3, {'max_tokens': 8, 'num_samples': 200}, 'over the limit of 4096'),
    ]
    for prompts, params, message in cases:
        with pytest.raises(RemoteError) as error:
            sampler.sample(prompts, params)
        assert error.value.status == 400, (params, str(error.value))
        assert message in str(error.value), (params, str(error.value))
    # A prompt's shape is the wire's (twinkle.wire.Prompt): the client refuses it before sending.
    shapes = [
        ([{'prompt': 'hi'}], "inputs.0: Value error, a prompt needs 'input_ids' or 'messages'"),
        ([{'messages': [{'role': 'user'}]}], 'inputs.0.messages: Value error, message 0 needs a string role'),
    ]
    for prompts, message in shapes:
        with pytest.raises(DataError) as refused:
            sampler.sample(prompts)
        assert message in str(refused.value), str(refused.value)
    # ... and the server's route, for a request that did not come through the client: a 422 naming the field.
    with pytest.raises(RemoteError, match=r'HTTP 422: base_model: Input should be a valid boolean$') as error:
        model.client.submit(f'/twinkle/v1/runs/{model.runs["policy"]}/ops/sample', {'inputs': PROMPTS, 'base_model': 1})
    assert error.value.status == 422
    # A role the template refuses is only found when encoding, on the worker: that request fails alone.
    with pytest.raises(RemoteError, match="role 'robot'") as error:
        sampler.sample([{'messages': [{'role': 'robot', 'content': 'hi'}]}])
    assert error.value.category == 'user'
    assert len(sampler.sample(PROMPTS, {'max_tokens': 3})[1].sequences[0].tokens) <= 3


def test_another_tenant_cannot_sample_with_your_run(server):
    url, keys = server
    model = remote_model(url, keys['alice'], seed=0)
    run_id = model.runs['policy']
    bob = TwinkleClient(url, keys['bob'])
    with pytest.raises(RemoteError, match='not found') as error:
        bob.submit(f'/twinkle/v1/runs/{run_id}/ops/sample', {'inputs': PROMPTS})
    assert error.value.status == 404
    thief = MultiLoraTransformersModel(client=bob)
    with pytest.raises(RemoteError) as error:
        thief.attach(run_id, 'policy')
    assert error.value.status == 404


def test_a_sampler_without_a_run_samples_the_base_model_or_saved_weights(server, tiny_model_dir):
    url, keys = server
    alice, bob = TwinkleClient(url, keys['alice']), TwinkleClient(url, keys['bob'])
    model = remote_model(url, keys['alice'], seed=0)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    tokens = lambda sampler, **kw: [r.sequences[0].tokens for r in sampler.sample(PROMPTS, greedy, **kw)]  # noqa: E731
    # The model id alone: the base model (the server's default model under any spelling it answers to).
    sampler = vLLMSampler(model_id=tiny_model_dir, client=alice)
    sampler.set_template('Qwen3_5Template', model_id='ms://Qwen/Qwen3.5-4B')  # accepted, the server's is used
    through_run = vLLMSampler(model=model)
    assert tokens(sampler) == tokens(through_run, base_model=True) == tokens(vLLMSampler(client=alice))
    # A saved checkpoint's weights, by its twinkle:// path: the run's weights as saved.
    path = model.save('for-sampling')
    assert tokens(vLLMSampler(model_path=path, client=alice)) == tokens(through_run)
    with pytest.raises(RemoteError, match='not found') as error:  # another tenant's checkpoint
        vLLMSampler(model_path=path, client=bob).sample(PROMPTS, greedy)
    assert error.value.status == 404
    with pytest.raises(RemoteError, match=r"'ms://Qwen/Qwen3\.5-4B' is not served here") as error:
        vLLMSampler(model_id='ms://Qwen/Qwen3.5-4B', client=alice).sample(PROMPTS, greedy)
    assert error.value.status == 404
    with pytest.raises(StateError, match='base_model=True samples the base model'):
        vLLMSampler(model_path=path, client=alice).sample(PROMPTS, greedy, base_model=True)
