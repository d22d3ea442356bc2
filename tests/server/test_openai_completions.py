"""OpenAI's text completions (``POST /v1/completions``) on loopback with the real ``openai`` client,
beside the chat completions of test_openai_api.py (whose server, tiny model and trained checkpoint
this module builds again). A prompt of token ids is the chat route's templated prompt, so a greedy
completion must be the chat route's reply and the local sampler's tokens; a text prompt is its
tokenizer's ids."""

# ruff: noqa: F811 (the fixtures imported from test_openai_api are taken by name as arguments)
from __future__ import annotations

import openai
import pytest
from test_openai_api import (  # noqa: F401 (fixtures, found by pytest by name)
    MAX_TOKENS,
    TARGET,
    checkpoints,
    client,
    greedy,
    local_greedy,
    post,
    prompt_ids,
    server,
    template,
)

from twinkle.server.api.openai_completions import DEFAULT_MAX_TOKENS

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

TEXT = 'Twinkle, twinkle, little'


def complete(server, model: str, prompt: str | list[int], tenant: str = 'alice', **options):
    options = {'max_tokens': MAX_TOKENS, 'temperature': 0, **options}
    return client(server, tenant).completions.create(model=model, prompt=prompt, **options)


def test_a_greedy_completion_of_the_prompt_ids_is_the_samplers_and_the_chat_routes(
    server, tiny_model_dir, local_greedy, prompt_ids, template
):
    reply = complete(server, tiny_model_dir, prompt_ids, logprobs=2)
    assert reply.object == 'text_completion' and reply.id.startswith('cmpl-') and reply.model == tiny_model_dir
    [choice] = reply.choices
    # the sampler outside the server, and the chat route, on the same templated prompt
    assert choice.text == local_greedy.decoded == greedy(server, tiny_model_dir).choices[0].message.content
    assert choice.finish_reason == local_greedy.stop_reason == 'length'  # 12 tokens of an untrained model
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), MAX_TOKENS)
    logprobs = choice.logprobs
    # the sampled tokens, each with its logprob as the sampler gives it
    assert logprobs.tokens == [template.decode([token]) for token in local_greedy.tokens]
    assert logprobs.token_logprobs == pytest.approx(local_greedy.token_logprobs, abs=1e-4)
    # the 2 most likely tokens with their logprobs; greedy, so the sampled token is the first of them
    for top, entries, token in zip(logprobs.top_logprobs, local_greedy.logprobs, logprobs.tokens, strict=True):
        expected = {template.decode([top_id]): value for top_id, value in entries[1:]}
        assert top == pytest.approx(expected, abs=1e-4) and max(top, key=top.get) == token
    # where each token's text starts in the completion: 0, then growing up to the text's length
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[-1] <= len(choice.text)


def test_a_text_prompt_is_the_completion_of_its_token_ids(server, tiny_model_dir, template):
    ids = template.tokenizer(TEXT)['input_ids']
    by_text, by_ids = complete(server, tiny_model_dir, TEXT), complete(server, tiny_model_dir, ids)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)


def test_streaming_sends_the_same_completion_in_chunks(server, tiny_model_dir):
    whole = complete(server, tiny_model_dir, TEXT, logprobs=1)
    stream = complete(server, tiny_model_dir, TEXT, logprobs=1, stream=True, stream_options={'include_usage': True})
    chunks = list(stream)
    assert {chunk.object for chunk in chunks} == {'text_completion'} and len({chunk.id for chunk in chunks}) == 1
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert ''.join(choice.text for choice in choices) == whole.choices[0].text
    assert len(choices) > 3  # the text comes in pieces, not one chunk
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + [whole.choices[0].finish_reason]
    streamed = [lp for choice in choices if choice.logprobs for lp in choice.logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [offset for choice in choices if choice.logprobs for offset in choice.logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_options_shape_the_completion(server, tiny_model_dir, local_greedy, prompt_ids):
    text = local_greedy.decoded
    # a 3-character stop string from the second half of the greedy text: the completion ends before it
    stop = next(text[k : k + 3] for k in range(len(text) // 2, len(text) - 3) if '\ufffd' not in text[k : k + 3])
    stopped = complete(server, tiny_model_dir, prompt_ids, stop=[stop]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (text[: text.index(stop)], 'stop')
    # top_p 0 keeps the most likely token only: greedy whatever the temperature
    assert complete(server, tiny_model_dir, prompt_ids, temperature=1.0, top_p=0.0).choices[0].text == text
    # n choices drawn with a seed: each its own, the same twice
    first, second = (
        complete(server, tiny_model_dir, TEXT, max_tokens=6, temperature=1.0, n=3, seed=7) for _ in range(2)
    )
    texts = [choice.text for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [choice.text for choice in second.choices] and first.usage.completion_tokens == 3 * 6
    # without max_tokens, OpenAI's default of 16
    assert complete(server, tiny_model_dir, prompt_ids, max_tokens=None).usage.completion_tokens == DEFAULT_MAX_TOKENS


# ---- checkpoints and model names -------------------------------------------------------------------------
def test_a_checkpoint_completes_as_trained_by_its_path_or_with_its_base_model(
    server, tiny_model_dir, checkpoints, prompt_ids
):
    for model in (checkpoints['sampler'], f'{tiny_model_dir};{checkpoints["sampler"]}'):
        choice = complete(server, model, prompt_ids, max_tokens=16).choices[0]
        # 8 steps at lr 3e-3 taught it TARGET for the templated MESSAGES, and its end token
        assert (choice.text, choice.finish_reason) == (TARGET, 'stop'), model
    # Tinker's '<base model>;<path>' names a model for the chat route too
    chat = greedy(server, f'{tiny_model_dir};{checkpoints["training"]}', max_tokens=16).choices[0].message
    assert chat.content == TARGET
    with pytest.raises(openai.NotFoundError):  # another tenant's, named either way
        complete(server, f'{tiny_model_dir};{checkpoints["sampler"]}', prompt_ids, tenant='bob')
    with pytest.raises(openai.NotFoundError):  # a base model this server does not host
        complete(server, f'gpt-4o;{checkpoints["sampler"]}', prompt_ids)
    found = client(server, 'alice').models.retrieve(f'{tiny_model_dir};{checkpoints["sampler"]}')
    assert (found.owned_by, found.parent) == ('alice', tiny_model_dir)


# ---- bad requests ----------------------------------------------------------------------------------------
BAD_REQUESTS = [
    # (what, body changes, status, param, in the message)
    ('echo', {'echo': True}, 400, 'echo', 'echo is not supported'),
    ('best_of', {'best_of': 3}, 400, 'best_of', 'best_of is not supported'),
    ('a suffix', {'suffix': 'x'}, 400, 'suffix', 'suffix is not supported'),
    ('a logit bias', {'logit_bias': {'5': 1.0}}, 400, 'logit_bias', 'logit_bias is not supported'),
    ('a penalty', {'frequency_penalty': 0.5}, 400, 'frequency_penalty', 'frequency_penalty is not supported'),
    ('a batch of texts', {'prompt': ['a', 'b']}, 400, 'prompt', 'a batch of prompts is not supported'),
    ('a batch of ids', {'prompt': [[1], [2]]}, 400, 'prompt', 'a batch of prompts is not supported'),
    ('too many choices', {'n': 9}, 400, 'n', 'n=9 is over the limit'),
    ('an empty prompt', {'prompt': ''}, 400, 'prompt', 'the prompt is empty'),
    ('an id outside the vocabulary', {'prompt': [10**7]}, 400, None, 'outside the vocabulary'),
    ('max_tokens past the context', {'max_tokens': 10**6}, 400, None, 'model context'),
    ('an unknown model', {'model': 'gpt-4o'}, 404, 'model', 'does not exist'),
    ('logprobs over 20', {'logprobs': 21}, 422, 'logprobs', 'less than or equal to 20'),
    ('no prompt', {'prompt': None}, 422, 'prompt.str', 'Input should be a valid string'),
]


@pytest.mark.parametrize(('what', 'changes', 'status', 'param', 'said'), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_a_bad_completion_request_is_a_4xx_naming_what_is_wrong(
    server, tiny_model_dir, what, changes, status, param, said
):
    body = {'model': tiny_model_dir, 'prompt': TEXT, 'max_tokens': 2, **changes}
    response = post(server, body, path='/v1/completions')
    assert response.status_code == status, response.text
    error = response.json()['error']
    assert said in error['message'], error
    if param is not None:
        assert error['param'] == param, error


def test_what_is_served_with_an_unsupported_option_is_its_no_op(server, tiny_model_dir):
    # the values of the refused options that change nothing are served (the schema declares them)
    plain = complete(server, tiny_model_dir, TEXT).choices[0].text
    no_ops = {'echo': False, 'best_of': 1, 'logit_bias': {}, 'presence_penalty': 0, 'frequency_penalty': 0}
    assert complete(server, tiny_model_dir, TEXT, **no_ops).choices[0].text == plain
