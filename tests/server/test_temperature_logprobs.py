"""The logprob of each sampled token at temperature t, through every API of a real server on
loopback (issue 49): the native API (``twinkle_client``), the Tinker SDK, and OpenAI's chat and text
completions. Each is the logprob under the distribution the token was drawn from, as Tinker and vLLM
report it: ``log_softmax(logits / t)`` at the token, ``logits`` the model's own forward of prompt plus
completion (the float32 tiny model: 1e-5; OpenAI's routes round nothing either). The top-k lists are
of the same distribution. Prompt logprobs, and Tinker's ``compute_logprobs``, stay at temperature 1:
they score given tokens, none of them drawn.

Before the fix every API returned the temperature-1 logprob whatever ``t`` was (tinker-cookbook's
``tests/validate_temperature_logprobs.py`` measured a mean error of 1.20 at t=0.5)."""

from __future__ import annotations

import openai
import pytest
import torch
from server_helpers import background_server
from tinker import types
from transformers import AutoModelForCausalLM

from twinkle.data_format import SamplingParams
from twinkle.sampler import TorchSampler as LocalSampler
from twinkle.template import Template
from twinkle_client import TwinkleClient
from twinkle_client.sampler import TorchSampler

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

TEMPERATURES = [0.5, 0.7, 1.0, 1.5]
TOL = 1e-5
PROMPT = [11, 42, 7, 99, 512, 3]
MESSAGES = [{'role': 'user', 'content': 'Count to three.'}]
MAX_TOKENS = 8


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('server'), tiny_model_dir) as (url, keys, _):
        yield url, keys


@pytest.fixture(scope='module')
def model(tiny_model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def completion_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]``: the logits of one forward of ``prompt + tokens`` at each position
    that predicts one of ``tokens``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def tempered(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """``[len(tokens), vocab]``: the log-softmax of those logits over ``temperature``."""
    return torch.log_softmax(completion_logits(model, prompt, tokens) / temperature, dim=-1)


def at(logps_TV: torch.Tensor, tokens: list[int]) -> list[float]:
    return logps_TV[range(len(tokens)), tokens].tolist()


@pytest.mark.parametrize('temperature', TEMPERATURES)
def test_the_native_api(server, model, temperature):
    url, keys = server
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=temperature, seed=42, num_samples=2, logprobs=2, prompt_logprobs=True
    )
    [response] = TorchSampler(client=TwinkleClient(url, keys['alice'])).sample({'input_ids': PROMPT}, params)
    for seq in response.sequences:
        expected_TV = tempered(model, PROMPT, seq.tokens, temperature)
        assert seq.token_logprobs == pytest.approx(at(expected_TV, seq.tokens), abs=TOL)
        top_TK = expected_TV.topk(2, dim=-1)
        assert [[token for token, _ in entry[1:]] for entry in seq.logprobs] == top_TK.indices.tolist()
        got = [value for entry in seq.logprobs for _, value in entry[1:]]
        assert got == pytest.approx(top_TK.values.flatten().tolist(), abs=TOL)
    raw_TV = tempered(model, PROMPT[:1], PROMPT[1:], 1.0)  # the prompt's own tokens, at temperature 1
    assert response.prompt_logprobs[0] is None
    assert response.prompt_logprobs[1:] == pytest.approx(at(raw_TV, PROMPT[1:]), abs=TOL)


@pytest.fixture(scope='module')
def tinker_sampler(server, module_sdk_clients, tiny_model_dir):
    url, keys = server
    return module_sdk_clients(url, keys['alice']).create_sampling_client(base_model=tiny_model_dir).result()


@pytest.mark.parametrize('temperature', TEMPERATURES)
def test_the_tinker_sdk(tinker_sampler, model, temperature):
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=42)
    prompt = types.ModelInput.from_ints(PROMPT)
    response = tinker_sampler.sample(prompt, 2, params, topk_sample_logprobs=2).result()
    for seq in response.sequences:
        expected_TV = tempered(model, PROMPT, seq.tokens, temperature)
        assert seq.logprobs == pytest.approx(at(expected_TV, seq.tokens), abs=TOL)
        top_TK = expected_TV.topk(2, dim=-1)
        assert [[token for token, _ in row] for row in seq.topk_logprobs] == top_TK.indices.tolist()
        got = [value for row in seq.topk_logprobs for _, value in row]
        assert got == pytest.approx(top_TK.values.flatten().tolist(), abs=TOL)
        # compute_logprobs scores given tokens at temperature 1: what validate_temperature_logprobs.py
        # takes as log p_1, against which it checks log p_t(i) - log p_t(j) = (log p_1(i) - log p_1(j)) / t.
        scored = tinker_sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + seq.tokens)).result()
        raw = at(tempered(model, PROMPT, seq.tokens, 1.0), seq.tokens)
        assert scored[len(PROMPT) :] == pytest.approx(raw, abs=TOL)


@pytest.fixture(scope='module')
def openai_client(server) -> openai.OpenAI:
    url, keys = server
    return openai.OpenAI(base_url=f'{url}/v1', api_key=keys['alice'], max_retries=0, timeout=120)


@pytest.fixture(scope='module')
def local(tiny_model_dir) -> LocalSampler:
    """A sampler outside the server: with the same seed it draws the tokens the server draws, whose
    ids OpenAI's replies do not give."""
    return LocalSampler(tiny_model_dir, device='cpu')


@pytest.mark.parametrize('temperature', TEMPERATURES)
def test_openais_chat_and_text_completions(openai_client, local, model, tiny_model_dir, temperature):
    template = Template(tiny_model_dir)
    prompt = template.encode({'messages': MESSAGES}, add_generation_prompt=True)['input_ids']
    drawn = local.sample({'input_ids': prompt}, SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=42))
    tokens = drawn[0].sequences[0].tokens
    expected_TV = tempered(model, prompt, tokens, temperature)
    options = {'model': tiny_model_dir, 'max_tokens': MAX_TOKENS, 'temperature': temperature, 'seed': 42}

    chat = openai_client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **options)
    content = chat.choices[0].logprobs.content
    n = len(content)  # the tokens of the reply's text (an end-of-sequence token has none)
    assert n > 0 and [entry.token for entry in content] == [template.decode([t]) for t in tokens[:n]]
    assert [entry.logprob for entry in content] == pytest.approx(at(expected_TV, tokens)[:n], abs=TOL)
    top_TK = expected_TV[:n].topk(2, dim=-1)
    assert [[top.logprob for top in entry.top_logprobs] for entry in content] == [
        pytest.approx(row, abs=TOL) for row in top_TK.values.tolist()
    ]

    text = openai_client.completions.create(prompt=prompt, logprobs=2, **options).choices[0].logprobs
    assert text.tokens == [template.decode([t]) for t in tokens[:n]]
    assert text.token_logprobs == pytest.approx(at(expected_TV, tokens)[:n], abs=TOL)
    sampled = zip(tokens, at(expected_TV, tokens), top_TK.indices.tolist(), top_TK.values.tolist(), strict=False)
    for top, (token, logprob, ids, values) in zip(text.top_logprobs, sampled, strict=True):
        # OpenAI's legacy shape, keyed by text: the 2 most likely tokens and the sampled one
        expected = {template.decode([i]): v for i, v in zip(ids, values, strict=True)}
        assert top == pytest.approx(expected | {template.decode([token]): logprob}, abs=TOL)
