"""The OpenAI-compatible chat API on loopback: a real server, the real ``openai`` client, and
checkpoints made through the real Tinker SDK. Expected replies come from a local sampler over
the same tiny model (greedy, so there is one right answer) or from the Tinker API's own sampling
of the same checkpoint."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import background_server
from tinker import types

from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.sampler import TorchSampler
from twinkle.server.api.openai_api import error_response
from twinkle.server.execution.sampling.chat import DEFAULT_MAX_TOKENS
from twinkle.server.execution.scheduling.scheduler import QueueFullError
from twinkle.template import Template

MESSAGES = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Count to three.'}]
#: The reply the checkpoint is trained to give to MESSAGES.
TARGET = 'twinkle twinkle little star'
MAX_TOKENS = 12


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    data_dir = tmp_path_factory.mktemp('server')
    with background_server(data_dir, tiny_model_dir, limits={'max_tokens_per_request': 4096}) as (url, keys, running):
        yield url, keys, running.app.state.service


def client(server, tenant: str) -> openai.OpenAI:
    url, keys, _ = server
    return openai.OpenAI(base_url=f'{url}/v1', api_key=keys[tenant], max_retries=0, timeout=120)


def post(
    server,
    body: object,
    tenant: str | None = 'alice',
    content: str | bytes | None = None,
    path: str = '/v1/chat/completions',
) -> httpx.Response:
    url, keys, _ = server
    headers = {'Authorization': f'Bearer {keys[tenant]}'} if tenant else {}
    if content is None:
        return httpx.post(f'{url}{path}', json=body, headers=headers, timeout=120)
    headers['Content-Type'] = 'application/json'
    return httpx.post(f'{url}{path}', content=content, headers=headers, timeout=120)


@pytest.fixture(scope='module')
def template(tiny_model_dir) -> Template:
    return Template(tiny_model_dir)


@pytest.fixture(scope='module')
def prompt_ids(template) -> list[int]:
    return template.encode({'messages': MESSAGES}, add_generation_prompt=True)['input_ids']


@pytest.fixture(scope='module')
def local_greedy(tiny_model_dir, prompt_ids):
    """What the base model samples greedily for MESSAGES, from a sampler outside the server."""
    sampler = TorchSampler(tiny_model_dir, device='cpu')
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    return sampler.sample([{'input_ids': prompt_ids}], params)[0].sequences[0]


@pytest.fixture(scope='module')
def checkpoints(server, module_sdk_clients, tiny_model_dir, template) -> dict[str, str]:
    """Alice's sampler and training checkpoints of an adapter trained hard (lr 3e-3) to answer
    MESSAGES with TARGET; made through the Tinker SDK."""
    url, keys, _ = server
    service = module_sdk_clients(url, keys['alice'])
    trainer = service.create_lora_training_client(base_model=tiny_model_dir, rank=4, seed=0).result()
    feature = template.encode({'messages': [*MESSAGES, {'role': 'assistant', 'content': TARGET}]})
    labels = feature['labels']
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(feature['input_ids'])),
        loss_fn_inputs={
            'target_tokens': [0 if t == IGNORE_INDEX else t for t in labels],
            'weights': [0.0 if t == IGNORE_INDEX else 1.0 for t in labels],
        },
    )
    for _ in range(8):
        trainer.forward_backward([datum], 'cross_entropy').result()
        trainer.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    return {
        'sampler': trainer.save_weights_for_sampler('x').result().path,
        'training': trainer.save_state('t').result().path,
        'url': url,
        'key': keys['alice'],
    }


def greedy(server, model: str, tenant: str = 'alice', max_tokens: int = MAX_TOKENS, **options):
    return client(server, tenant).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0, **options
    )


# ---- answers -----------------------------------------------------------------------------------------
def host_greedy(server, prompt_ids: list[int]) -> str:
    """The server's own sampler (its host, on its worker thread) sampling the prompt greedily, decoded."""
    _, keys, service = server

    def sample() -> str:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        return service.default.host.generate([{'input_ids': prompt_ids}], params, None)[0].sequences[0].decoded

    job = service.submit(service.store.tenants.for_key(keys['alice']), service.default, None, 'test_sample', sample)
    assert job.wait(120) and job.error is None, job.error
    return job.result


@pytest.mark.integration
def test_a_greedy_reply_of_the_base_model_is_the_samplers(server, tiny_model_dir, local_greedy, prompt_ids):
    reply = greedy(server, tiny_model_dir, logprobs=True, top_logprobs=2)
    assert reply.object == 'chat.completion' and reply.id.startswith('chatcmpl-')
    assert reply.model == tiny_model_dir
    [choice] = reply.choices
    assert choice.message.role == 'assistant'
    # what the host's sampler gives for the templated prompt, and a sampler outside the server too
    assert choice.message.content == host_greedy(server, prompt_ids) == local_greedy.decoded
    assert choice.finish_reason == local_greedy.stop_reason == 'length'  # 12 tokens of an untrained model
    # usage: the templated prompt, and the 12 sampled tokens
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), MAX_TOKENS)
    assert reply.usage.total_tokens == len(prompt_ids) + MAX_TOKENS
    # logprobs: one per sampled token, the sampled token's then the 2 most likely, as the sampler gives them
    content = choice.logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx(local_greedy.token_logprobs, abs=1e-4)
    tops = [[top.logprob for top in entry.top_logprobs] for entry in content]
    assert tops == [pytest.approx([lp for _, lp in entries[1:]], abs=1e-4) for entries in local_greedy.logprobs]
    # greedy: the sampled token is the most likely one
    assert [entry.token for entry in content] == [entry.top_logprobs[0].token for entry in content]


@pytest.mark.integration
def test_a_stop_string_ends_the_reply_before_it(server, tiny_model_dir, local_greedy):
    text = local_greedy.decoded
    # a 3-character stop string from the second half of the greedy reply; the reply ends where it first occurs
    stop = next(text[k : k + 3] for k in range(len(text) // 2, len(text) - 3) if '\ufffd' not in text[k : k + 3])
    reply = greedy(server, tiny_model_dir, stop=[stop])
    assert reply.choices[0].message.content == text[: text.index(stop)]
    assert reply.choices[0].finish_reason == 'stop'


@pytest.mark.integration
def test_top_p_0_is_greedy_and_max_completion_tokens_wins_over_max_tokens(server, tiny_model_dir, local_greedy):
    reply = client(server, 'alice').chat.completions.create(
        model=tiny_model_dir, messages=MESSAGES, temperature=1.0, top_p=0.0, max_tokens=3, max_completion_tokens=12
    )
    assert reply.choices[0].message.content == local_greedy.decoded  # 12 greedy tokens
    assert reply.usage.completion_tokens == MAX_TOKENS


@pytest.mark.integration
def test_n_choices_with_a_seed_are_reproducible(server, tiny_model_dir):
    def sample():
        return client(server, 'alice').chat.completions.create(
            model=tiny_model_dir, messages=MESSAGES, max_tokens=6, temperature=1.0, n=3, seed=7
        )

    first, second = sample(), sample()
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    assert texts == [choice.message.content for choice in second.choices]
    assert len(set(texts)) > 1  # each choice draws its own noise
    assert first.usage.completion_tokens == 3 * 6


@pytest.mark.integration
def test_streaming_sends_the_same_reply_in_chunks(server, tiny_model_dir):
    whole = greedy(server, tiny_model_dir, logprobs=True, top_logprobs=1)
    stream = greedy(
        server, tiny_model_dir, logprobs=True, top_logprobs=1, stream=True, stream_options={'include_usage': True}
    )
    chunks = list(stream)
    assert {chunk.object for chunk in chunks} == {'chat.completion.chunk'}
    assert len({chunk.id for chunk in chunks}) == 1
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert choices[0].delta.role == 'assistant'
    assert ''.join(choice.delta.content or '' for choice in choices) == whole.choices[0].message.content
    assert len(choices) > 3  # the text comes in pieces, not one chunk
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + [whole.choices[0].finish_reason]
    streamed = [entry for c in choices if c.logprobs for entry in c.logprobs.content]
    assert streamed == whole.choices[0].logprobs.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


@pytest.mark.integration
def test_the_stream_is_server_sent_events_ending_with_done(server, tiny_model_dir):
    body = {'model': tiny_model_dir, 'messages': MESSAGES, 'max_tokens': 4, 'temperature': 0, 'stream': True}
    url, keys, _ = server
    headers = {'Authorization': f'Bearer {keys["alice"]}'}
    with httpx.stream('POST', f'{url}/v1/chat/completions', json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers['content-type'].startswith('text/event-stream')
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith('data: ') for line in lines)
    assert lines[-1] == 'data: [DONE]'
    events = [json.loads(line[len('data: ') :]) for line in lines[:-1]]
    assert events[-1]['choices'][0]['finish_reason'] == 'length'
    assert all('usage' not in event for event in events)  # only with stream_options.include_usage


@pytest.mark.integration
def test_without_max_tokens_the_reply_is_capped_by_the_default(server, tiny_model_dir):
    reply = post(server, {'model': tiny_model_dir, 'messages': MESSAGES, 'temperature': 0, 'user': 'x', 'foo': [1]})
    assert reply.status_code == 200, reply.text  # unknown fields ('foo') are ignored, as OpenAI does
    body = reply.json()
    tokens, finish = body['usage']['completion_tokens'], body['choices'][0]['finish_reason']
    assert (finish == 'length' and tokens == DEFAULT_MAX_TOKENS) or (finish == 'stop' and tokens < DEFAULT_MAX_TOKENS)


# ---- models and checkpoints ------------------------------------------------------------------------
@pytest.mark.integration
def test_models_lists_the_base_model_and_the_tenants_own_checkpoints(server, tiny_model_dir, checkpoints):
    alice = [model.id for model in client(server, 'alice').models.list()]
    bob = [model.id for model in client(server, 'bob').models.list()]
    assert alice[0] == bob[0] == tiny_model_dir
    assert sorted(alice[1:]) == sorted([checkpoints['sampler'], checkpoints['training']])
    assert bob == [tiny_model_dir]
    found = client(server, 'alice').models.retrieve(checkpoints['sampler'])
    assert (found.id, found.object, found.owned_by) == (checkpoints['sampler'], 'model', 'alice')
    with pytest.raises(openai.NotFoundError):
        client(server, 'bob').models.retrieve(checkpoints['sampler'])


@pytest.mark.integration
def test_a_trained_checkpoint_answers_as_the_tinker_api_samples_it(
    server, sdk_clients, tiny_model_dir, checkpoints, prompt_ids
):
    base = greedy(server, tiny_model_dir, max_tokens=16).choices[0]
    answer = greedy(server, checkpoints['sampler'], max_tokens=16, logprobs=True)
    reply = answer.choices[0]
    trained = reply.message.content
    # 8 steps at lr 3e-3 on one example: it learned the answer (12 tokens) and its end token
    assert (trained, reply.finish_reason) == (TARGET, 'stop')
    # the end token counts as sampled, but has no logprob entry: the entries are the reply's tokens
    assert answer.usage.completion_tokens == 13
    assert ''.join(entry.token for entry in reply.logprobs.content) == TARGET
    assert base.message.content != TARGET
    # the Tinker API's greedy sample of the same checkpoint and prompt, decoded
    sampling = sdk_clients(checkpoints['url'], checkpoints['key'])
    sampler = sampling.create_sampling_client(model_path=checkpoints['sampler']).result()
    params = types.SamplingParams(max_tokens=16, temperature=0.0)
    sample = sampler.sample(types.ModelInput.from_ints(prompt_ids), 1, params).result().sequences[0]
    tokens = sample.tokens[:-1] if sample.stop_reason == 'stop' else sample.tokens  # the end token is no text
    assert trained == Template(tiny_model_dir).decode(tokens, skip_special_tokens=True)
    # the training checkpoint holds the same weights
    assert greedy(server, checkpoints['training'], max_tokens=16).choices[0].message.content == trained


@pytest.mark.integration
def test_another_tenants_checkpoint_does_not_exist_for_bob(server, checkpoints):
    for path in (checkpoints['sampler'], checkpoints['training']):
        with pytest.raises(openai.NotFoundError) as caught:
            greedy(server, path, tenant='bob')
        assert caught.value.body['code'] == 'model_not_found' and caught.value.body['param'] == 'model'


# ---- bad requests --------------------------------------------------------------------------------------
def ok(base_model: str, **changes: object) -> dict:
    return {'model': base_model, 'messages': MESSAGES, 'max_tokens': 2, **changes}


BAD_REQUESTS = [
    # (what, body changes, status, param)
    ('unknown model', {'model': 'gpt-4o'}, 404, 'model'),
    ('malformed checkpoint path', {'model': 'tinker://../sampler_weights/x'}, 404, 'model'),
    ('tools', {'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {}}}]}, 400, 'tools'),
    ('a required tool choice', {'tool_choice': 'required'}, 400, 'tool_choice'),
    ('too many choices', {'n': 9}, 400, 'n'),
    (
        'a json schema',
        {'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x'}}},
        400,
        'response_format',
    ),
    ('json mode', {'response_format': {'type': 'json_object'}}, 400, 'response_format'),
    ('a logit bias', {'logit_bias': {'5': 10}}, 400, 'logit_bias'),
    ('a presence penalty', {'presence_penalty': 0.5}, 400, 'presence_penalty'),
    ('top logprobs without logprobs', {'top_logprobs': 2}, 400, 'top_logprobs'),
    ('an image', {'messages': [{'role': 'user', 'content': [{'type': 'image_url'}]}]}, 400, 'messages[0].content[0]'),
    (
        'earlier tool calls',
        {'messages': [{'role': 'assistant', 'content': None, 'tool_calls': [{}]}]},
        400,
        'messages[0]',
    ),
    ('a role the template refuses', {'messages': [{'role': 'wizard', 'content': 'hi'}]}, 400, None),
    ('a conversation ending with the assistant', {'messages': [{'role': 'assistant', 'content': 'hi'}]}, 400, None),
    ('an empty stop string', {'stop': ['']}, 400, None),
    ('prompt plus max_tokens over the context', {'max_tokens': 2048}, 400, 'messages'),
    ('a string temperature', {'temperature': 'hot'}, 422, 'temperature'),
    ('a temperature over 2', {'temperature': 2.5}, 422, 'temperature'),
    ('zero choices', {'n': 0}, 422, 'n'),
    ('messages as a string', {'messages': 'hi'}, 422, 'messages'),
    ('no messages', {'messages': []}, 422, 'messages'),
    ('a message without a role', {'messages': [{'content': 'hi'}]}, 422, 'messages.0.role'),
    ('a number as content', {'messages': [{'role': 'user', 'content': 5}]}, 422, 'messages.0.content.str'),
    ('max_tokens 0', {'max_tokens': 0}, 422, 'max_tokens'),
    ('logprobs as a list', {'logprobs': [1]}, 422, 'logprobs'),
]


@pytest.mark.integration
@pytest.mark.parametrize(('what', 'changes', 'status', 'param'), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_a_bad_request_is_a_4xx_in_openais_error_shape(server, tiny_model_dir, what, changes, status, param):
    response = post(server, ok(tiny_model_dir, **changes))
    assert response.status_code == status, response.text
    error = response.json()['error']
    assert set(error) == {'message', 'type', 'param', 'code'}
    assert error['type'] == 'invalid_request_error' and error['message']
    if param is not None:
        assert error['param'] == param, error


@pytest.mark.integration
def test_a_refused_option_is_named_in_the_message(server, tiny_model_dir):
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(server, tiny_model_dir, tools=[{'type': 'function', 'function': {'name': 'f', 'parameters': {}}}])
    assert 'tools is not supported' in caught.value.message
    response = post(server, ok(tiny_model_dir, messages=[{'role': 'wizard', 'content': 'hi'}]))
    assert "'wizard'" in response.json()['error']['message']  # the template's refusal names the role
    response = post(server, ok(tiny_model_dir, max_tokens=2048))
    assert response.json()['error']['code'] == 'context_length_exceeded'


@pytest.mark.integration
def test_bodies_that_are_not_a_request_are_4xx(server, tiny_model_dir):
    response = post(server, None, content='not json')  # not JSON at all: a 400, as OpenAI answers it
    assert response.status_code == 400 and 'not valid JSON' in response.json()['error']['message'], response.text
    for content in (
        '[1, 2]',
        '{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
    ):
        response = post(server, None, content=content)
        assert response.status_code == 422, (content, response.text)
        assert response.json()['error']['type'] == 'invalid_request_error'
    response = post(server, None, content=b'\xcd\xe4/\x14')  # not UTF-8: the body cannot even be read
    assert response.status_code == 400 and response.json()['error']['message'], response.text


def test_a_full_queue_is_a_429_that_says_when_to_retry():
    response = error_response(QueueFullError('alice', 2, retry_after_s=7.4))
    assert response.status_code == 429 and response.headers['retry-after'] == '7'
    error = json.loads(response.body)['error']
    assert (error['type'], error['code']) == ('rate_limit_error', 'rate_limit_exceeded')
    assert 'max_queued_per_tenant=2' in error['message']


@pytest.mark.integration
def test_a_request_without_a_known_api_key_is_401(server, tiny_model_dir):
    url, _, _ = server
    for headers in ({}, {'Authorization': 'Bearer tml-not-a-key'}):
        response = httpx.post(f'{url}/v1/chat/completions', json=ok(tiny_model_dir), headers=headers)
        assert response.status_code == 401
        assert response.json()['error']['type'] == 'authentication_error'
        assert httpx.get(f'{url}/v1/models', headers=headers).status_code == 401


@pytest.mark.integration
def test_developer_messages_and_text_parts_are_what_system_and_plain_text_give(server, tiny_model_dir):
    plain = greedy(server, tiny_model_dir).choices[0].message.content
    parts = [
        {'role': 'developer', 'content': 'Be brief.'},
        {'role': 'user', 'content': [{'type': 'text', 'text': 'Count to three.'}]},
    ]
    reply = client(server, 'alice').chat.completions.create(
        model=tiny_model_dir, messages=parts, max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == plain


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
# Sizes stay small where a valid value would make the tiny model sample long (max_tokens, n).
SMALL = st.integers(-2, 3) | st.text(max_size=4) | st.booleans() | st.lists(st.integers(), max_size=2)
MESSAGE = st.fixed_dictionaries(
    {'role': st.sampled_from(['user', 'system', 'tool', 'wizard', '']) | JSON},
    optional={
        'content': JSON
        | st.lists(st.fixed_dictionaries({'type': st.sampled_from(['text', 'image_url']), 'text': JSON})),
        'tool_calls': JSON,
    },
)
FIELDS = {
    'model': JSON | st.sampled_from(['tinker://r/sampler_weights/x', 'twinkle://r/checkpoints/x', 'tinker://']),
    'messages': st.lists(MESSAGE, max_size=3) | JSON,
    'max_tokens': SMALL,
    'max_completion_tokens': SMALL,
    'n': SMALL,
    **{
        name: JSON
        for name in (
            'temperature',
            'top_p',
            'stop',
            'seed',
            'stream',
            'stream_options',
            'logprobs',
            'top_logprobs',
            'top_k',
            'repetition_penalty',
            'tools',
            'tool_choice',
            'response_format',
            'logit_bias',
            'user',
        )
    },
}


@pytest.mark.integration
@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.fixed_dictionaries({}, optional=FIELDS))
def test_no_request_body_gets_a_5xx(server, tiny_model_dir, changes):
    # json.dumps writes NaN and Infinity as the bare words Python's JSON reader (the server's) takes
    response = post(server, None, content=json.dumps(ok(tiny_model_dir, **changes)))
    assert response.status_code < 500, (changes, response.text)
    if response.status_code >= 400:
        error = response.json()['error']
        assert set(error) == {'message', 'type', 'param', 'code'} and error['message'], response.text
    elif response.headers['content-type'].startswith('text/event-stream'):
        # Streamed: the request asked for it, in a form pydantic reads as true (True, 1, 'yes', ...).
        assert pydantic.TypeAdapter(bool).validate_python(changes.get('stream')) is True, (changes, response.text)
    else:
        assert response.json()['object'] == 'chat.completion', response.text
