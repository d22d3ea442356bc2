"""What a request that fails validation gets back, on every API of a real server on loopback: the
first few problems and how many there are, never an answer that grows with what was sent (a 6 MB
body of 1.5 million bad token ids was answered with 158 MB), and a 405 that lists every method the
path takes."""

from __future__ import annotations

import json

import httpx
import pytest
from server_helpers import background_server

from twinkle.server.api.errors import MAX_PROBLEMS

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

#: Bytes a 422 of a handful of problems fits in: a problem is under 200 bytes (a location of a few
#: short parts, a one-line message); the largest possible one is under 2 kB (errors.MAX_* cut it).
SMALL_ANSWER_BYTES = 4096
#: The failure of strict integer validation, as pydantic words it.
NOT_AN_INT = {'msg': 'Input should be a valid integer', 'type': 'int_type'}


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('validation'), tiny_model_dir, tenants=('alice',)) as running:
        url, keys, _ = running
        yield url, {'Authorization': f'Bearer {keys["alice"]}'}


def send(server, path: str, body: object) -> httpx.Response:
    url, headers = server
    content = json.dumps(body, separators=(',', ':')).encode()
    return httpx.post(
        f'{url}{path}', content=content, headers={**headers, 'Content-Type': 'application/json'}, timeout=300
    )


# ---- the native API ---------------------------------------------------------------------------------
@pytest.mark.parametrize('bad', ['7', 7.5], ids=['string ids', 'float ids'])
def test_a_forward_backward_of_a_million_bad_ids_is_a_small_422(server, bad):
    # 1.5 million ids that are not integers (strict JSON takes neither '7' nor 7.5), in input_ids and
    # labels alike: validation stops at the first bad id of each list, so 2 problems, each named.
    n = 1_500_000
    body = {'inputs': [{'input_ids': [bad] * n, 'labels': [bad] * n}]}
    answer = send(server, '/twinkle/v1/runs/any-run/ops/forward_backward', body)
    assert answer.status_code == 422
    assert len(answer.content) < SMALL_ANSWER_BYTES, len(answer.content)
    row = ['body', 'inputs', 0]
    assert answer.json() == {
        'detail': [{'loc': [*row, 'input_ids', 0], **NOT_AN_INT}, {'loc': [*row, 'labels', 0], **NOT_AN_INT}],
        'problems': 2,
    }


def test_a_422_lists_the_first_problems_and_counts_them_all(server):
    # 5000 fields step does not take: 5000 problems, of which the answer spells out the first 10.
    body = {f'field_{i}': i for i in range(5000)}
    answer = send(server, '/twinkle/v1/runs/any-run/ops/step', body)
    assert answer.status_code == 422
    assert len(answer.content) < SMALL_ANSWER_BYTES, len(answer.content)
    refused = answer.json()
    assert refused['problems'] == 5000
    extra = {'msg': 'Extra inputs are not permitted', 'type': 'extra_forbidden'}
    assert refused['detail'] == [{'loc': ['body', f'field_{i}'], **extra} for i in range(MAX_PROBLEMS)]


def test_long_names_and_messages_are_cut(server):
    # A figure name of 100,000 characters is quoted by its validator's message and is a field name
    # the client chose: the answer holds at most 300 characters of the one and 64 of the other.
    name = 'f' * 100_000
    answer = send(server, '/twinkle/v1/runs/any-run/ops/log_step_figures', {'figures': {name: 1.0}, name: 1})
    assert answer.status_code == 422
    assert len(answer.content) < SMALL_ANSWER_BYTES, len(answer.content)
    problems = answer.json()['detail']
    assert len(problems) == answer.json()['problems'] == 2
    assert all(len(problem['msg']) <= 300 for problem in problems)
    assert ['body', 'f' * 64] in [problem['loc'] for problem in problems]


# ---- the Tinker API ----------------------------------------------------------------------------------
def test_a_tinker_422_names_the_first_problems_in_one_short_sentence(server, tiny_model_dir):
    # The SDK's own request type (not the server's, so its lists cannot stop at the first problem)
    # checks every token: 200,000 problems.
    n = 200_000
    body = {
        'prompt': {'chunks': [{'type': 'encoded_text', 'tokens': ['x'] * n}]},
        'sampling_params': {'max_tokens': 1},
        'num_samples': 1,
        'base_model': tiny_model_dir,
    }
    answer = send(server, '/api/v1/asample', body)
    assert answer.status_code == 422
    assert len(answer.content) < SMALL_ANSWER_BYTES, len(answer.content)
    detail = answer.json()['detail']
    assert detail.startswith('invalid SampleRequest: prompt.chunks.0.EncodedTextChunk.tokens.0: ')
    # 3 spelled out; the chunk also fits none of the SDK's 3 other chunk types: 11 problems more
    assert detail.endswith(f' (and {n + 11 - 3} more problems)'), detail


# ---- the OpenAI API ----------------------------------------------------------------------------------
def test_an_openai_422_names_the_first_problems_and_how_many_more(server, tiny_model_dir):
    # Five fields wrong at once: the message spells out three and counts the other two.
    body = {'model': 5, 'messages': 'hi', 'n': 0, 'temperature': 9, 'max_tokens': 0}
    answer = send(server, '/v1/chat/completions', body)
    assert answer.status_code == 422
    error = answer.json()['error']
    assert error['param'] == 'model'
    assert error['message'].startswith('invalid request: model: Input should be a valid string; ')
    assert error['message'].endswith(' (and 2 more problems)'), error['message']
    spelled = error['message'].removeprefix('invalid request: ').removesuffix(' (and 2 more problems)').split('; ')
    fields = {'model', 'messages', 'n', 'temperature', 'max_tokens'}
    assert len(spelled) == 3 and {problem.split(':')[0] for problem in spelled} <= fields, spelled


def test_an_openai_body_of_a_million_bad_parts_is_a_small_422(server, tiny_model_dir):
    # 300,000 content parts whose text is a number: validation stops at the first bad part.
    parts = [{'type': 'text', 'text': 5}] * 300_000
    body = {'model': tiny_model_dir, 'messages': [{'role': 'user', 'content': parts}], 'max_tokens': 1}
    answer = send(server, '/v1/chat/completions', body)
    assert answer.status_code == 422
    assert len(answer.content) < SMALL_ANSWER_BYTES, len(answer.content)
    assert answer.json()['error']['param'] == 'messages.0.content.str'


def test_every_model_id_is_answered_in_openais_shape(server):
    # A line break in the id: Starlette's path parameter stops at one, so the framework answered a 404
    # in the native API's shape, which GET /v1/models/{model} does not declare.
    url, headers = server
    answer = httpx.get(f'{url}/v1/models/a%0Ab', headers=headers)
    assert answer.status_code == 404
    assert answer.json()['error']['code'] == 'model_not_found', answer.text


# ---- methods ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ('path', 'allowed'),
    [
        ('/twinkle/v1/runs', {'GET', 'POST'}),  # two routes: listing and creating runs
        ('/twinkle/v1/runs/r/checkpoints/c', {'DELETE'}),
        ('/v1/models/some-model', {'GET'}),
    ],
)
def test_a_405_lists_every_method_the_path_takes(server, path, allowed):
    url, headers = server
    answer = httpx.request('PATCH', f'{url}{path}', headers=headers)
    assert answer.status_code == 405
    assert {method.strip() for method in answer.headers['allow'].split(',')} == allowed
