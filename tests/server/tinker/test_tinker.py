"""The official ``tinker`` SDK, unmodified, against a real server on loopback: training with
every loss, chunked and custom requests, checkpoints, sampling, isolation and bad input.

The server splits forward_backward batches into chunks of 2 datums (``fwdbwd_max_chunk_len``),
so every multi-datum request here also exercises out-of-order chunks.
"""

from __future__ import annotations

import math
import re

import httpx
import pytest
import tinker
import torch
from server_helpers import background_server
from tinker import types

from twinkle.server.store import Store

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    tinker_settings = {'fwdbwd_max_chunk_len': 2, 'seq_gap_timeout_s': 2.0, 'retrieve_wait_s': 5.0}
    limits = {'max_adapters_per_tenant': 64}  # alice makes a model per test; quotas: test_server_quota.py
    data_dir = tmp_path_factory.mktemp('tinker')
    with background_server(data_dir, tiny_model_dir, tinker=tinker_settings, limits=limits) as running:
        url, keys, background = running
        yield url, keys, background.app.state.service.config


@pytest.fixture(scope='module')
def alice(server, module_sdk_clients) -> tinker.ServiceClient:
    url, keys, _ = server
    return module_sdk_clients(url, keys['alice'])


@pytest.fixture(scope='module')
def bob(server, module_sdk_clients) -> tinker.ServiceClient:
    url, keys, _ = server
    return module_sdk_clients(url, keys['bob'])


def training_client(service: tinker.ServiceClient, model: str, seed: int = 0, rank: int = 4) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=model, rank=rank, seed=seed).result()


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    """A datum whose position i predicts ``tokens[i + 1]``."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={'target_tokens': tokens[1:], **inputs},
    )


def sft_data(n: int = 5, length: int = 9) -> list[types.Datum]:
    return [
        datum([(7 * i + 3 * j) % 400 + 10 for j in range(length + i)], weights=[1.0] * (length + i - 1))
        for i in range(n)
    ]


def logprobs_of(output: types.ForwardBackwardOutput) -> list[torch.Tensor]:
    return [item['logprobs'].to_torch() for item in output.loss_fn_outputs]


def test_sft_through_the_sdk_lowers_the_loss(alice, tiny_model_dir):
    client = training_client(alice, tiny_model_dir)
    data = sft_data()
    losses = []
    for _ in range(6):
        forward_backward = client.forward_backward(data, 'cross_entropy')
        step = client.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(forward_backward.result().metrics['loss:sum'])
        step.result()
    assert losses[-1] < 0.7 * losses[0], losses
    info = client.get_info()
    assert info.model_data.tokenizer_id == tiny_model_dir and info.lora_rank == 4
    assert client.get_tokenizer().vocab_size > 0  # loads offline from the path get_info gives


def test_each_loss_matches_its_formula_on_a_small_datum(alice, tiny_model_dir):
    client = training_client(alice, tiny_model_dir, seed=1)
    tokens = [11, 42, 7, 99, 5, 63]
    base = datum(tokens, weights=[1.0] * 5)
    lp = logprobs_of(client.forward([base], 'cross_entropy').result())[0].double()
    delta = torch.tensor([0.0, 0.5, -0.5, 0.1, -0.3], dtype=torch.float64)
    old = lp + delta  # the sampler's logprobs: ratio = exp(lp - old) = exp(-delta)
    advantages = torch.tensor([1.0, -1.0, 2.0, 0.5, -2.0], dtype=torch.float64)
    weights = torch.tensor([1.0, -0.5, 0.0, 2.0, 1.0], dtype=torch.float64)
    ratio = torch.exp(-delta)
    rl = {'logprobs': old.tolist(), 'advantages': advantages.tolist()}
    cases = {
        ('cross_entropy', None, 'w'): -(lp * weights).sum(),
        ('importance_sampling', None, 'rl'): -(ratio * advantages).sum(),
        ('ppo', None, 'rl'): -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).sum(),
        ('ppo', (0.9, 1.05), 'rl'): -torch.minimum(ratio * advantages, ratio.clamp(0.9, 1.05) * advantages).sum(),
        ('cispo', (0.9, 1.05), 'rl'): -(ratio.clamp(0.9, 1.05) * lp * advantages).sum(),
        ('dro', 0.5, 'rl'): -(lp * advantages - 0.25 * delta**2).sum(),
    }
    for (loss_fn, config, kind), expected in cases.items():
        inputs = {'weights': weights.tolist()} if kind == 'w' else rl
        if isinstance(config, tuple):
            config = {'clip_low_threshold': config[0], 'clip_high_threshold': config[1]}
        elif config is not None:
            config = {'beta': config}
        output = client.forward([datum(tokens, **inputs)], loss_fn, loss_fn_config=config).result()
        assert output.metrics['loss:sum'] == pytest.approx(float(expected), abs=1e-4), (loss_fn, config)
    # GSPO: one sequence-level ratio, the geometric mean of the token ratios, then PPO-style clipping.
    sequence_ratio = torch.exp((-delta).mean())
    gspo = -torch.minimum(sequence_ratio * advantages, sequence_ratio.clamp(0.8, 1.2) * advantages).sum()
    config = {'clip_low_threshold': 0.8, 'clip_high_threshold': 1.2}
    output = client.forward([datum(tokens, **rl)], 'gspo', loss_fn_config=config).result()
    assert output.metrics['loss:sum'] == pytest.approx(float(gspo), abs=1e-4)


def test_chunked_requests_equal_single_datum_requests(alice, tiny_model_dir):
    data = sft_data(5)
    chunked, single = training_client(alice, tiny_model_dir, seed=5), training_client(alice, tiny_model_dir, seed=5)
    total = chunked.forward_backward(data, 'cross_entropy').result()  # 3 chunks of at most 2 datums
    parts = [single.forward_backward([d], 'cross_entropy').result() for d in data]
    assert total.metrics['loss:sum'] == pytest.approx(sum(p.metrics['loss:sum'] for p in parts), rel=1e-5)
    for client in (chunked, single):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [logprobs_of(c.forward(data, 'cross_entropy').result()) for c in (chunked, single)]
    for a, b in zip(*after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_forward_backward_custom_equals_the_builtin_loss(alice, tiny_model_dir):
    data = sft_data(3)
    custom, builtin = training_client(alice, tiny_model_dir, seed=9), training_client(alice, tiny_model_dir, seed=9)

    def weighted_nll(batch: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        loss = sum(-(lp * d.loss_fn_inputs['weights'].to_torch()).sum() for d, lp in zip(batch, logprobs, strict=True))
        return loss, {'custom:sum': float(loss)}

    result = custom.forward_backward_custom(data, weighted_nll).result()
    expected = builtin.forward_backward(data, 'cross_entropy').result()
    assert result.metrics['custom:sum'] == pytest.approx(expected.metrics['loss:sum'], rel=1e-5)
    for client in (custom, builtin):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [logprobs_of(c.forward(data, 'cross_entropy').result()) for c in (custom, builtin)]
    for a, b in zip(*after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_model_from_a_checkpoint_with_its_optimizer_continues_exactly(alice, tiny_model_dir):
    data, adam = sft_data(2), types.AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
    original = training_client(alice, tiny_model_dir, seed=3)

    def steps(client: tinker.TrainingClient, n: int) -> list[float]:
        losses = []
        for _ in range(n):
            losses.append(client.forward_backward(data, 'cross_entropy').result().metrics['loss:sum'])
            client.optim_step(adam).result()
        return losses

    steps(original, 2)
    path = original.save_state('mid').result().path
    assert path == f'tinker://{original.model_id}/weights/mid'
    expected = steps(original, 3)
    resumed = alice.create_training_client_from_state_with_optimizer(path)
    assert steps(resumed, 3) == pytest.approx(expected, abs=1e-6)
    fresh_optimizer = steps(alice.create_training_client_from_state(path), 3)
    assert fresh_optimizer[0] == pytest.approx(expected[0], abs=1e-6)
    assert abs(fresh_optimizer[2] - expected[2]) > 1e-4  # Adam's moments started again


def test_sampling_parameters(alice, tiny_model_dir):
    client = training_client(alice, tiny_model_dir, seed=4)
    sampler = client.save_weights_and_get_sampling_client('sampling')
    prompt = types.ModelInput.from_ints([11, 42, 7, 99])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    first, again = (sampler.sample(prompt, 2, greedy).result() for _ in range(2))
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert first.sequences[0].tokens == first.sequences[1].tokens and len(first.sequences[0].tokens) == 6
    assert first.sequences[0].stop_reason == 'length'

    for narrow in (types.SamplingParams(max_tokens=6, top_k=1, seed=1), types.SamplingParams(max_tokens=6, top_p=1e-6)):
        assert sampler.sample(prompt, 1, narrow).result().sequences[0].tokens == first.sequences[0].tokens

    seeded = types.SamplingParams(max_tokens=8, temperature=1.0, seed=123)
    a, b = (sampler.sample(prompt, 1, seeded).result().sequences[0] for _ in range(2))
    assert a.tokens == b.tokens
    # The sampled tokens' logprobs are the model's own: score the completion teacher-forced.
    scored = sampler.compute_logprobs(types.ModelInput.from_ints([11, 42, 7, 99, *a.tokens])).result()
    assert scored[0] is None
    assert a.logprobs == pytest.approx(scored[4:], abs=1e-4)

    stop_token = first.sequences[0].tokens[2]
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_token]))
    sequence = stopped.result().sequences[0]
    assert sequence.stop_reason == 'stop' and sequence.tokens[-1] == stop_token and len(sequence.tokens) == 3

    top = sampler.sample(
        prompt, 1, greedy, include_prompt_logprobs=True, topk_prompt_logprobs=3, topk_sample_logprobs=2
    )
    response = top.result()
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == 4
    assert response.prompt_logprobs[1:] == pytest.approx(scored[1:4], abs=1e-4)
    assert all(len(row) == 3 for row in response.topk_prompt_logprobs[1:])
    sampled = response.sequences[0]
    assert [len(row) for row in sampled.topk_logprobs] == [2] * 6
    assert [row[0][0] for row in sampled.topk_logprobs] == sampled.tokens  # greedy: the top token is the one taken
    nothing_stops = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=5, temperature=0.0, stop=[]))
    assert nothing_stops.result().sequences[0].stop_reason == 'length'


def test_sampling_from_the_base_model_and_by_name(alice, tiny_model_dir):
    client = training_client(alice, tiny_model_dir, seed=6)
    for _ in range(3):
        client.forward_backward(sft_data(2), 'cross_entropy')
        client.optim_step(types.AdamParams(learning_rate=5e-2))
    path = client.save_weights_for_sampler('named').result().path
    assert path == f'tinker://{client.model_id}/sampler_weights/named'
    prompt, greedy = types.ModelInput.from_ints([11, 42, 7]), types.SamplingParams(max_tokens=8, temperature=0.0)
    trained = alice.create_sampling_client(model_path=path).sample(prompt, 1, greedy).result().sequences[0].tokens
    base = alice.create_sampling_client(base_model=tiny_model_dir).sample(prompt, 1, greedy).result()
    assert trained != base.sequences[0].tokens


def test_another_tenants_models_paths_and_futures_do_not_exist(server, alice, bob, tiny_model_dir):
    url, keys, _ = server
    client = training_client(alice, tiny_model_dir)
    path = client.save_state('private').result().path
    sampler_path = client.save_weights_for_sampler('private').result().path
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=sampler_path).sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    headers = {'X-API-Key': keys['bob']}
    answer = httpx.post(
        f'{url}/api/v1/get_info', json={'model_id': client.model_id, 'type': 'get_info'}, headers=headers
    )
    assert answer.status_code == 404 and client.model_id in answer.json()['detail']
    body = {'model_id': client.model_id, 'adam_params': {}, 'type': 'optim_step'}
    request_id = httpx.post(f'{url}/api/v1/optim_step', json=body, headers={'X-API-Key': keys['alice']}).json()[
        'request_id'
    ]
    stolen = httpx.post(f'{url}/api/v1/retrieve_future', json={'request_id': request_id}, headers=headers)
    assert stolen.status_code == 404


def test_failures_are_errors_not_hangs(server, alice, tiny_model_dir):
    url, keys, _ = server
    client = training_client(alice, tiny_model_dir)
    with pytest.raises(tinker.BadRequestError, match='no provenance spans'):
        client.forward_backward(sft_data(1), 'stable_reinforce').result()
    with pytest.raises(tinker.RequestFailedError, match='outside the vocabulary'):
        client.forward_backward([datum([1, 2, 10**7], weights=[1.0, 1.0])], 'cross_entropy').result()
    with pytest.raises(tinker.RequestFailedError, match='NaN'):
        client.forward_backward([datum([1, 2, 3], weights=[1.0, math.nan])], 'cross_entropy').result()
    # the model goes on after its failed requests
    assert client.forward_backward(sft_data(1), 'cross_entropy').result().metrics['loss:sum'] > 0
    sampler = client.save_weights_and_get_sampling_client('failures')
    with pytest.raises(tinker.BadRequestError, match='prompt_alt_tokens_k'):
        sampler.sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2), prompt_alt_tokens_k=2
        ).result()
    headers = {'X-API-Key': keys['alice']}
    garbage = httpx.post(f'{url}/api/v1/forward_backward', content=b'\xff\x00garbage', headers=headers)
    assert garbage.status_code == 400 and 'malformed ForwardBackwardRequest' in garbage.json()['detail']


def test_an_optim_step_with_a_bad_hyperparameter_is_refused_at_the_route(server, alice, tiny_model_dir):
    # As the native set_optimizer refuses lr=-1 with a 400, not a future that fails at the step.
    url, keys, _ = server
    client = training_client(alice, tiny_model_dir)
    client.forward_backward(sft_data(1), 'cross_entropy').result()
    for params, named in (
        (types.AdamParams(learning_rate=-1.0), "'learning_rate': -1.0"),
        (types.AdamParams(beta1=1.0), 'beta1 and beta2 must be in [0, 1)'),
        (types.AdamParams(grad_clip_norm=-0.5), "'grad_clip_norm': -0.5"),
    ):
        with pytest.raises(tinker.BadRequestError, match=re.escape(named)):
            client.optim_step(params).result()
    # Each refused request took its seq_id: the model's next step runs, on the gradients still pending.
    assert client.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics['grad_norm:mean'] > 0
    # The route answers 400 in the error shape, naming the value (the raw request, a model of its own).
    other = training_client(alice, tiny_model_dir)
    body = {'model_id': other.model_id, 'seq_id': 1, 'adam_params': {'learning_rate': -1.0}, 'type': 'optim_step'}
    answer = httpx.post(f'{url}/api/v1/optim_step', json=body, headers={'X-API-Key': keys['alice']})
    assert answer.status_code == 400 and answer.json()['error'] == 'DataError', answer.text
    assert "'learning_rate': -1.0" in answer.json()['detail']


def test_a_gap_in_seq_ids_fails_the_waiting_requests(server, alice, tiny_model_dir):
    url, keys, _ = server
    client = training_client(alice, tiny_model_dir)
    headers = {'X-API-Key': keys['alice']}
    body = {'model_id': client.model_id, 'seq_id': 50, 'adam_params': {}, 'type': 'optim_step'}  # 1..49 never come
    request_id = httpx.post(f'{url}/api/v1/optim_step', json=body, headers=headers).json()['request_id']
    answer = {'type': 'try_again'}
    for _ in range(10):
        answer = httpx.post(f'{url}/api/v1/retrieve_future', json={'request_id': request_id}, headers=headers).json()
        if answer.get('type') != 'try_again':
            break
    assert answer['category'] == 'user' and 'seq_id=1' in answer['error'] and 'never arrived' in answer['error']


def test_a_retried_request_gets_its_first_request_id_and_runs_once(server, alice, tiny_model_dir):
    url, keys, _ = server
    client = training_client(alice, tiny_model_dir)
    headers = {'X-API-Key': keys['alice']}
    steps_before = client.optim_step(types.AdamParams()).result()  # seq 1; the client's next would be 2
    assert steps_before.metrics is not None
    body = {'model_id': client.model_id, 'seq_id': 2, 'adam_params': {'learning_rate': 0.1}, 'type': 'optim_step'}
    first, retry = (httpx.post(f'{url}/api/v1/optim_step', json=body, headers=headers).json() for _ in range(2))
    assert first['request_id'] == retry['request_id']
    answer = httpx.post(f'{url}/api/v1/retrieve_future', json={'request_id': first['request_id']}, headers=headers)
    assert answer.status_code == 200 and 'metrics' in answer.json()


def test_sessions_heartbeat_until_finished(server):
    url, keys, _ = server
    headers = {'X-API-Key': keys['alice']}
    body = {'tags': [], 'user_metadata': None, 'sdk_version': '0.38.0', 'type': 'create_session'}
    session_id = httpx.post(f'{url}/api/v1/create_session', json=body, headers=headers).json()['session_id']
    beat = {'session_id': session_id, 'type': 'session_heartbeat'}
    assert httpx.post(f'{url}/api/v1/session_heartbeat', json=beat, headers=headers).status_code == 200
    bob = {'X-API-Key': keys['bob']}
    assert httpx.post(f'{url}/api/v1/session_heartbeat', json=beat, headers=bob).status_code == 404
    finish = {'reason': {'type': 'success'}, 'detail': None}
    assert httpx.post(f'{url}/api/v1/sessions/{session_id}/finish', json=finish, headers=headers).status_code == 200
    assert httpx.post(f'{url}/api/v1/session_heartbeat', json=beat, headers=headers).status_code == 410
    unknown = httpx.post(f'{url}/api/v1/create_session', json={**body, 'colour': 'red'}, headers=headers)
    assert unknown.status_code == 422 and 'colour' in unknown.json()['detail']
    assert unknown.json()['error'] == 'DataError'  # a class of twinkle.errors, as every error body names


def test_lora_switches_rank_and_seed_are_honoured(server, alice, tiny_model_dir):
    _, _, config = server
    attention_only = alice.create_lora_training_client(
        base_model=tiny_model_dir, rank=3, seed=1, train_mlp=False, train_unembed=False
    ).result()
    with Store(config.db_path) as store:
        lora = store.runs.by_id(attention_only.model_id).config['lora']
    assert lora['r'] == 3 and sorted(lora['target_modules']) == ['k_proj', 'o_proj', 'q_proj', 'v_proj']
    assert attention_only.get_info().lora_rank == 3
    data, adam = sft_data(2), types.AdamParams(learning_rate=1e-2)
    after = []
    for seed in (7, 7, 8):
        client = training_client(alice, tiny_model_dir, seed=seed)
        client.forward_backward(data, 'cross_entropy')
        client.optim_step(adam).result()
        after.append(torch.cat(logprobs_of(client.forward(data, 'cross_entropy').result())))
    torch.testing.assert_close(after[0], after[1], atol=0, rtol=0)  # the same seed: the same LoRA A
    assert not torch.allclose(after[0], after[2])


def test_a_forward_backward_without_seq_id_is_refused(server, alice, tiny_model_dir):
    from tinker.proto.request_conv import forward_backward_request_to_proto

    url, keys, _ = server
    client = training_client(alice, tiny_model_dir)
    request = types.ForwardBackwardRequest(
        model_id=client.model_id,
        forward_backward_input=types.ForwardBackwardInput(data=sft_data(1), loss_fn='cross_entropy'),
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    answer = httpx.post(f'{url}/api/v1/forward_backward', content=body, headers={'X-API-Key': keys['alice']})
    assert answer.status_code == 400 and 'seq_id >= 1' in answer.json()['detail']


#: JSON nested past what the parser takes (Python's json raises RecursionError near 1,000 levels).
TOO_DEEP = ('[' * 100_000 + ']' * 100_000).encode()
#: Routes that read a JSON body, of every API this server speaks ('x' fills path parameters).
JSON_ROUTES = [
    ('POST', '/api/v1/create_session'),
    ('POST', '/api/v1/session_heartbeat'),
    ('POST', '/api/v1/create_model'),
    ('POST', '/api/v1/get_info'),
    ('POST', '/api/v1/optim_step'),
    ('POST', '/api/v1/save_weights'),
    ('POST', '/api/v1/save_weights_for_sampler'),
    ('POST', '/api/v1/load_weights'),
    ('POST', '/api/v1/create_sampling_session'),
    ('POST', '/api/v1/asample'),
    ('POST', '/api/v1/retrieve_future'),
    ('POST', '/api/v1/forward_backward'),
    ('POST', '/api/v1/weights_info'),
    ('PUT', '/api/v1/training_runs/x/checkpoints/weights/x/ttl'),
    ('POST', '/twinkle/v1/runs'),
    ('POST', '/twinkle/v1/runs/x/save'),
    ('POST', '/v1/chat/completions'),
]


@pytest.mark.parametrize(('method', 'route'), JSON_ROUTES, ids=[route for _, route in JSON_ROUTES])
def test_a_body_nested_too_deep_to_parse_is_a_400(server, method, route):
    url, keys, _ = server
    headers = {'X-API-Key': keys['alice'], 'Content-Type': 'application/json'}
    answer = httpx.request(method, f'{url}{route}', content=TOO_DEEP, headers=headers)
    assert answer.status_code == 400, answer.text[:300]
    assert answer.json()['detail'], answer.text[:300]  # never an empty 400: the SDK retries those


def test_no_route_of_any_api_answers_a_body_too_deep_to_parse_with_a_5xx(server):
    url, keys, _ = server
    headers = {'X-API-Key': keys['alice'], 'Content-Type': 'application/json'}
    paths = httpx.get(f'{url}/openapi.json').json()['paths']
    tried = 0
    for path, operations in paths.items():
        route = '/'.join('x' if part.startswith('{') else part for part in path.split('/'))
        for method in set(operations) & {'post', 'put', 'patch', 'delete'}:
            answer = httpx.request(method.upper(), f'{url}{route}', content=TOO_DEEP, headers=headers)
            assert answer.status_code < 500, (method, path, answer.text[:300])
            tried += 1
    assert tried >= len(JSON_ROUTES)


def test_a_body_nested_deeper_than_the_server_keeps_is_a_400(server):
    # 300 levels parse, but storing or answering them would fail (pydantic serializes 255 at most)
    url, keys, _ = server
    metadata: dict = {}
    for _ in range(300):
        metadata = {'a': metadata}
    body = {'tags': [], 'user_metadata': metadata, 'sdk_version': '0.38.0', 'type': 'create_session'}
    answer = httpx.post(f'{url}/api/v1/create_session', json=body, headers={'X-API-Key': keys['alice']})
    assert answer.status_code == 400 and 'deeper than 32 levels' in answer.json()['detail'], answer.text[:300]


def schema_of(document: dict, schema: dict) -> dict:
    """``schema`` with its ``$ref`` (to ``#/components/schemas/...``) followed."""
    while '$ref' in schema:
        schema = document['components']['schemas'][schema['$ref'].rsplit('/', 1)[-1]]
    return schema


def error_detail_type(document: dict, path: str, status: int) -> str:
    """The JSON type the schema gives ``detail`` in a ``status`` answer of POST ``path``."""
    response = document['paths'][path]['post']['responses'][str(status)]
    return schema_of(document, response['content']['application/json']['schema'])['properties']['detail']['type']


def test_the_schema_declares_each_tinker_body_and_the_errors_as_they_are_answered(server):
    url, keys, _ = server
    document = httpx.get(f'{url}/openapi.json').json()
    tinker_routes = [route for method, route in JSON_ROUTES if route.startswith('/api/v1/') and method == 'POST']
    for route in tinker_routes:
        operation = document['paths'][route]['post']
        content = operation['requestBody']['content']
        assert set(operation['responses']) >= {'200', '400', '401', '404', '422', '429'}, route
        if route == '/api/v1/forward_backward':
            assert list(content) == ['application/x-protobuf'], route
            continue
        assert schema_of(document, content['application/json']['schema'])['additionalProperties'] is False, route
    assert schema_of(document, {'$ref': '#/components/schemas/CreateSessionRequest'})['required'] == [
        'tags', 'user_metadata', 'sdk_version'
    ]  # fmt: skip
    # what the schema says a 422 holds is what one holds, on the Tinker and the OpenAI routes
    headers = {'X-API-Key': keys['alice']}
    body = {'tags': [], 'user_metadata': None, 'sdk_version': '0.38.0', 'type': 'create_session', 'colour': 'red'}
    tinker_422 = httpx.post(f'{url}/api/v1/create_session', json=body, headers=headers)
    openai_422 = httpx.post(f'{url}/v1/chat/completions', json={'model': 'm', 'messages': []}, headers=headers)
    for path, answer in (('/api/v1/create_session', tinker_422), ('/v1/chat/completions', openai_422)):
        assert answer.status_code == 422 and error_detail_type(document, path, 422) == 'string', answer.text
        assert isinstance(answer.json()['detail'], str), answer.text
    assert set(schema_of(document, {'$ref': '#/components/schemas/OpenAIErrorDetail'})['properties']) == {
        'message', 'type', 'param', 'code'
    }  # fmt: skip
