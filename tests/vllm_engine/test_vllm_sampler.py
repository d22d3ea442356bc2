"""``vLLMSampler`` on a real vLLM engine (vLLM's CPU build here, ``make test-vllm``): the sampling
contract ``TorchSampler`` keeps, several adapters in one call, both weight-sync modes, errors.

One engine serves the module (it takes about 20 s to start): ``tiny-qwen3`` in float32, so the
trainer's fp32 forward and the engine agree to 1e-4 (vLLM's own attention and matmul kernels
sum in another order than torch's; measured differences are about 4e-6). ``max_loras=1``, the
setting under which vLLM's CPU build ran base-model rows of a mixed batch through the adapter.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from peft import LoraConfig

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError, DataError, SequenceTooLongError, UnknownNameError
from twinkle.model import TransformersModel
from twinkle.model.lora import multi as multi_lora
from twinkle.sampler import vLLMSampler
from twinkle.sampler.logits import processed_scores
from twinkle.sampler.vllm_sampler import engine_arguments

pytest.importorskip('vllm')

TOL = 1e-4
PROMPTS = [
    {'messages': [{'role': 'user', 'content': 'What is your name?'}], 'user_data': {'ground_truth': '7'}},
    {'messages': [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Name three fruits'}]},
    {'messages': [{'role': 'user', 'content': 'hi'}]},
    {'input_ids': [5, 6, 7, 8, 9, 10]},
]
ENGINE = {'enable_lora': True, 'max_lora_rank': 16, 'max_loras': 1, 'dtype': 'float32', 'max_model_len': 512}


@pytest.fixture(scope='module')
def sampler(tiny_model_dir: str):
    sampler = vLLMSampler(tiny_model_dir, engine_args=ENGINE)
    yield sampler
    sampler.close()


@pytest.fixture(scope='module')
def trainer(tiny_model_dir: str) -> TransformersModel:
    model = TransformersModel(tiny_model_dir, device='cpu')
    for index, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(index)
        model.add_adapter_to_model(name, config)
    return model


ADAPTERS = {
    'a': LoraConfig(r=8, lora_alpha=32, target_modules='all-linear', init_lora_weights=False),
    'b': LoraConfig(r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj'], init_lora_weights=False),
}


def completion_logps(model: TransformersModel, features: list[dict], adapter_name: str | None = None) -> list[list]:
    """The trainer's teacher-forced logprobs of each feature's completion tokens (the base model
    with ``adapter_name`` None: every adapter off)."""
    with multi_lora.row_adapters(model.model, adapter_name), torch.no_grad():
        out = []
        for feature in features:
            ids = torch.tensor([feature['input_ids']])
            logps = torch.log_softmax(model.model(input_ids=ids).logits[0].float(), -1)
            mask = torch.tensor(feature['completion_mask']).bool()
            labels = torch.tensor(feature['labels'])
            out.append(logps[mask].gather(-1, labels[mask][:, None]).squeeze(-1).tolist())
    return out


def sequences(responses) -> list:
    return [seq for response in responses for seq in response.sequences]


def worst(seqs, expected) -> float:
    return max(
        abs(a - b) for s, e in zip(seqs, expected, strict=True) for a, b in zip(s.token_logprobs, e, strict=True)
    )


def test_responses_keep_the_sampling_contract(sampler):
    params = SamplingParams(max_tokens=8, num_samples=3, logprobs=2, seed=0, ignore_eos=True)
    responses = sampler.sample(PROMPTS, params)
    assert len(responses) == len(PROMPTS) and all(len(r.sequences) == 3 for r in responses)
    for prompt, response in zip(PROMPTS, responses, strict=True):
        if 'input_ids' in prompt:
            assert response.prompt_token_ids == prompt['input_ids']
        for seq in response.sequences:
            assert seq.stop_reason == 'length' and len(seq.tokens) == 8 == len(seq.logprobs)
            for token, entry in zip(seq.tokens, seq.logprobs, strict=True):
                assert entry[0][0] == token and len(entry) == 3  # the sampled token, then the 2 most likely
                assert entry[1][1] >= entry[2][1] and entry[0][1] <= entry[1][1] + 1e-6
            feature = seq.new_input_feature
            assert feature['input_ids'] == response.prompt_token_ids + seq.tokens
            assert sum(feature['completion_mask']) == len(seq.tokens)
            assert seq.weight_version == sampler.weight_version == 0
            if 'messages' in prompt:
                assert feature['messages'][-1] == {'role': 'assistant', 'content': seq.decoded}
    assert responses[0].sequences[0].new_input_feature['user_data'] == {'ground_truth': '7'}


@pytest.mark.parametrize(
    'params',
    [
        SamplingParams(max_tokens=10, temperature=1.0, seed=3, num_samples=2, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
    ],
)
def test_at_temperature_one_and_greedy_the_logprobs_are_the_trainers(sampler, trainer, params):
    # At temperature 1 (no top-k, top-p or penalty) the distribution sampled from is the model's
    # own; greedy reports the logits' own logprobs.
    seqs = sequences(sampler.sample(PROMPTS, params))
    assert worst(seqs, completion_logps(trainer, [s.new_input_feature for s in seqs])) <= TOL


def completion_logits(model: TransformersModel, seq) -> torch.Tensor:
    """``[completion tokens, vocab]``: the base model's float32 logits (every adapter off), in one
    forward of prompt plus completion, at each position that predicts a completion token."""
    ids = seq.new_input_feature['input_ids']
    with multi_lora.row_adapters(model.model, None), torch.no_grad():
        logits = model.model(input_ids=torch.tensor([ids])).logits[0].float()
    return logits[len(ids) - len(seq.tokens) - 1 : -1]


@pytest.mark.parametrize('temperature', [0.5, 0.7, 1.0, 1.5])
def test_logprobs_are_of_the_distribution_at_the_temperature(sampler, trainer, temperature):
    # logprobs_mode='processed_logprobs': log_softmax(logits / t) of the sampled token and of the
    # top 3, as TorchSampler's (tests/sampler/test_sampler.py) and Tinker's.
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=42, num_samples=2, logprobs=3, ignore_eos=True)
    for seq in sequences(sampler.sample(PROMPTS, params)):
        expected_TV = torch.log_softmax(completion_logits(trainer, seq) / temperature, dim=-1)
        assert seq.token_logprobs == pytest.approx(expected_TV[range(len(seq.tokens)), seq.tokens].tolist(), abs=TOL)
        values_TK = expected_TV.topk(3, dim=-1).values
        got = [[value for _, value in entry[1:]] for entry in seq.logprobs]
        assert [v for row in got for v in row] == pytest.approx(values_TK.flatten().tolist(), abs=TOL)


def test_with_top_k_top_p_and_a_penalty_the_logprobs_are_of_the_processed_scores(sampler, trainer):
    # The penalty on the tokens seen so far, logits / 0.6, top-k 20 and top-p 0.9, renormalised:
    # the distribution vLLM drew from, as twinkle's processed_scores computes it.
    params = SamplingParams(max_tokens=10, temperature=0.6, top_k=20, top_p=0.9, seed=4, repetition_penalty=1.3)
    for seq in sequences(sampler.sample(PROMPTS, params)):
        ids, logits_TV = seq.new_input_feature['input_ids'], completion_logits(trainer, seq)
        start = len(ids) - len(seq.tokens)
        seen_TV = torch.zeros_like(logits_TV, dtype=torch.bool)
        for i in range(len(seq.tokens)):
            seen_TV[i, ids[: start + i]] = True
        expected_TV = torch.log_softmax(processed_scores(logits_TV, params, seen_TV), dim=-1)
        assert seq.token_logprobs == pytest.approx(expected_TV[range(len(seq.tokens)), seq.tokens].tolist(), abs=TOL)


def test_a_seed_reproduces_a_sample_in_any_batch(sampler):
    params = SamplingParams(max_tokens=10, seed=123, num_samples=3, ignore_eos=True)
    alone = [s.tokens for s in sampler.sample(PROMPTS[1], params)[0].sequences]
    in_batch = [s.tokens for s in sampler.sample(PROMPTS, params)[1].sequences]
    assert alone == in_batch
    assert len({tuple(t) for t in alone}) == 3  # the samples of one prompt differ
    other = sampler.sample(PROMPTS[1], SamplingParams(**{**vars(params), 'seed': 124}))[0].sequences
    assert [s.tokens for s in other] != alone


def test_stop_string_and_stop_token_end_with_stop_and_max_tokens_with_length(sampler):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = sampler.sample(PROMPTS[0], greedy)[0].sequences[0]
    assert free.stop_reason == 'length' and len(free.tokens) == 12

    stop_id = free.tokens[4]
    seq = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=[stop_id]))[0].sequences[0]
    assert seq.stop_reason == 'stop' and seq.tokens == free.tokens[: free.tokens.index(stop_id) + 1]
    assert seq.decoded == sampler.template.decode(seq.tokens[:-1], skip_special_tokens=True)

    text = free.decoded
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=12, temperature=0, stop=stop, ignore_eos=True)
    seq = sampler.sample(PROMPTS[0], params)[0].sequences[0]
    assert seq.stop_reason == 'stop' and len(seq.tokens) < 12
    assert seq.decoded == text[: text.index(stop)]
    assert seq.tokens == free.tokens[: len(seq.tokens)]  # the tokens that completed the stop string stay


def test_several_adapters_in_one_call_each_as_sampled_alone(sampler, trainer):
    for name in ADAPTERS:
        sampler.load_adapter_weights(name, multi_lora.peft_state_dict(trainer.model, name), ADAPTERS[name])
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    names = ['a', None, 'b', 'a']  # the base model beside adapters: vLLM's CPU build got this wrong (max_loras=1)
    mixed = sampler.sample(PROMPTS, greedy, adapter_name=names)
    for index, (name, response) in enumerate(zip(names, mixed, strict=True)):
        alone = sampler.sample(PROMPTS[index], greedy, adapter_name=name)[0].sequences[0]
        seq = response.sequences[0]
        assert seq.tokens == alone.tokens, (index, name)
        assert seq.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-5)
        assert worst([seq], completion_logps(trainer, [seq.new_input_feature], name)) <= TOL
    assert len({tuple(r.sequences[0].tokens) for r in mixed[:3]}) == 3  # three different models sampled


def test_bad_requests_fail_before_the_engine_and_leave_it_serving(sampler):
    params = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(UnknownNameError, match="adapter 'nope'"):
        sampler.sample(PROMPTS[0], params, adapter_name='nope')
    with pytest.raises(DataError, match='2 adapters for 4 prompts'):
        sampler.sample(PROMPTS, params, adapter_name=['a', 'b'])
    with pytest.raises(DataError, match='token id 999999, outside the vocabulary'):
        sampler.sample({'input_ids': [1, 999999]}, params)
    with pytest.raises(SequenceTooLongError, match='engine context of 512 tokens'):
        sampler.sample({'input_ids': [1] * 500}, SamplingParams(max_tokens=20))
    with pytest.raises(ConfigurationError, match='prompt logprobs are not served'):
        sampler.sample(PROMPTS[0], SamplingParams(max_tokens=2, prompt_logprobs=True))
    too_big = LoraConfig(r=32, lora_alpha=32, target_modules=['q_proj'])
    with pytest.raises(ConfigurationError, match='rank 32, over the engine max_lora_rank=16'):
        sampler.load_adapter_weights(
            'big', {'model.layers.0.self_attn.q_proj.lora_A.weight': torch.zeros(32, 128)}, too_big
        )
    with pytest.raises(ConfigurationError, match="may not set 'model'"):
        engine_arguments('/m', {'model': 'other'}, None, cpu=True)
    assert len(sampler.sample(PROMPTS[0], params)[0].sequences[0].tokens) == 4  # still serving


@pytest.mark.parametrize('merge_and_sync', [False, True])
def test_after_sync_the_sampler_logprobs_equal_the_trainers(sampler, tiny_model_dir, merge_and_sync):
    torch.manual_seed(0)
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model(
        'policy', LoraConfig(r=8, lora_alpha=16, target_modules='all-linear', init_lora_weights=False)
    )
    model.set_optimizer('AdamW', lr=1e-2)
    manager = CheckpointEngineManager(model, sampler)
    engine = sampler.llm
    params = SamplingParams(max_tokens=8, seed=0, num_samples=2, ignore_eos=True)
    for _ in range(2):
        result = manager.sync_weights(merge_and_sync=merge_and_sync)
        assert result.mode == ('merged' if merge_and_sync else 'adapter')
        assert result.weight_version == sampler.weight_version
        seqs = sequences(sampler.sample(PROMPTS, params))
        assert {s.weight_version for s in seqs} == {result.weight_version}
        features = [s.new_input_feature for s in seqs]
        assert worst(seqs, completion_logps(model, features, 'policy')) <= TOL
        model.forward_backward(inputs=features)  # a step, so the next sync has something new to move
        model.clip_grad_and_step()
    # Before the sync the sampler still holds the old policy: its logprobs differ.
    stale = sequences(sampler.sample(PROMPTS, params))
    assert worst(stale, completion_logps(model, [s.new_input_feature for s in stale], 'policy')) > 1e-3
    assert sampler.llm is engine  # in place: the same engine, never restarted
    if merge_and_sync:  # the next tests sample the base model again: put its weights back
        base = {name: p for name, p in TransformersModel(tiny_model_dir).model.named_parameters()}
        sampler.load_weights(base)
        sampler.default_adapter = None
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        seqs = sequences(sampler.sample(PROMPTS, greedy))
        assert worst(seqs, completion_logps(model, [s.new_input_feature for s in seqs], None)) <= TOL


class _Holding:
    """A ``Turns`` that unwinds the call at its first give-way (a job cancelled while paused)."""

    def due(self) -> bool:
        return True

    def give_way(self) -> None:
        raise KeyboardInterrupt('cancelled')


def _calls_at_once(sampler, calls: list[tuple[dict, SamplingParams, str | None]]) -> list:
    """``calls`` made on threads of their own while the engine is held, so every one has added its
    requests before any steps: the first to get the engine steps them all in one generation."""
    results: list = [None] * len(calls)

    def call(index: int) -> None:
        prompt, params, adapter = calls[index]
        results[index] = sampler.sample(prompt, params, adapter_name=adapter)[0]

    rows = sum(params.num_samples for _, params, _ in calls)
    with sampler.calls._driving:
        threads = [threading.Thread(target=call, args=(index,)) for index in range(len(calls))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while sampler.calls.in_flight < rows and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.calls.in_flight == rows
        sampler.calls.widest = 0
    for thread in threads:
        thread.join(60)
    assert sampler.calls.widest == rows  # one engine step held every call's requests
    return results


def test_calls_made_at_once_share_one_generation_and_each_gets_its_tokens_alone(sampler, trainer):
    for name in ADAPTERS:
        sampler.load_adapter_weights(name, multi_lora.peft_state_dict(trainer.model, name), ADAPTERS[name])
    calls = [
        (PROMPTS[index % len(PROMPTS)], SamplingParams(max_tokens=6 + index, seed=index, num_samples=2), adapter)
        for index, adapter in enumerate(['a', None, 'b', 'a', None, 'b'])
    ]
    calls.append((PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=[13]), None))
    together = _calls_at_once(sampler, calls)
    for (prompt, params, adapter), response in zip(calls, together, strict=True):
        alone = sampler.sample(prompt, params, adapter_name=adapter)[0]
        assert [s.tokens for s in response.sequences] == [s.tokens for s in alone.sequences], (params, adapter)
        for seq, solo in zip(response.sequences, alone.sequences, strict=True):
            assert seq.token_logprobs == pytest.approx(solo.token_logprobs, abs=1e-5)
            assert len(seq.tokens) <= params.max_tokens


def test_a_call_unwound_between_steps_takes_its_requests_out_of_the_engine(sampler):
    sampler.turns = _Holding()
    try:
        with pytest.raises(KeyboardInterrupt):
            sampler.sample(PROMPTS[0], SamplingParams(max_tokens=8, seed=0))
    finally:
        sampler.turns = None
    assert sampler.calls.in_flight == 0 and not sampler.llm.llm_engine.has_unfinished_requests()
    after = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=4, seed=0))[0].sequences[0]
    assert len(after.tokens) == 4


def test_an_adapter_removed_while_a_call_samples_it_goes_once_the_call_ends(sampler, trainer):
    config = ADAPTERS['a']
    sampler.load_adapter_weights('gone', multi_lora.peft_state_dict(trainer.model, 'a'), config)
    lora_id = sampler._adapters['gone'].request.lora_int_id
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = sampler.sample(PROMPTS[1], params, adapter_name='gone')[0].sequences[0].tokens
    removed: list[bool] = []

    class RemoveMidway:
        def due(self) -> bool:
            return not removed

        def give_way(self) -> None:  # another job runs between two steps and drops the adapter
            sampler.remove_adapter('gone')
            removed.append(lora_id in sampler.llm.llm_engine.list_loras())

    sampler.turns = RemoveMidway()
    try:
        got = sampler.sample(PROMPTS[1], params, adapter_name='gone')[0].sequences[0].tokens
    finally:
        sampler.turns = None
    assert removed == [True]  # still on the engine while the call used it
    assert got == want and lora_id not in sampler.llm.llm_engine.list_loras()
