"""Tinker's async pieces against a real server, through the unmodified SDK and tinker-cookbook:
sequences sampled with ``record_stability_info``, datums whose provenance spans name them, the
``stable_reinforce`` loss that reads the recorded sampler logprobs, and ``inflight`` sampling
clients that follow the training model's latest weights.

The cookbook test runs its RL loop off-policy (``AsyncConfig(max_steps_off_policy=1)``, the
default ``stable_reinforce``) on the toy arithmetic environment, for two steps.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tinker
import torch
from server_helpers import background_server
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from twinkle.errors import DataError
from twinkle.loss.tinker import RECORDED_LOGPROBS, RECORDED_MASK, tinker_loss_terms
from twinkle.server.execution.tinker.codec import Span, parse_forward_backward
from twinkle.server.store import SEQUENCE_TTL_S, Store

pytest.importorskip('chz')  # tinker-cookbook's config library, installed beside it by `make setup`

PROMPT = [11, 42, 7, 99, 5]


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    data_dir = tmp_path_factory.mktemp('tinker-async')
    tinker_settings = {'seq_gap_timeout_s': 2.0, 'retrieve_wait_s': 5.0}
    with background_server(data_dir, tiny_model_dir, tinker=tinker_settings) as running:
        url, keys, background = running
        yield url, keys, background.app.state.service.store


def training_client(service: tinker.ServiceClient, model: str, seed: int = 0) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=model, rank=4, seed=seed).result()


def sample(sampler: tinker.SamplingClient, num_samples: int = 1) -> list[types.SampledSequence]:
    params = types.SamplingParams(max_tokens=4, stop=[], seed=3)
    return sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples, params).result().sequences


def traced(sequence: types.SampledSequence, advantage: float = 1.0, **inputs: object) -> types.Datum:
    """The prompt and the sampled tokens as one datum (position i predicts token i + 1), with the
    provenance the cookbook gives it: the prompt's positions, then the sampled ones."""
    tokens, sid, p, s = PROMPT + sequence.tokens, sequence.sequence_id, len(PROMPT), len(sequence.tokens)
    given = {'advantages': [advantage] * (len(tokens) - 1), **inputs}
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={'target_tokens': tokens[1:], **given}
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=p),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=s - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=p - 1),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=s),
        ],
    )


def recording_sampler(client: tinker.TrainingClient) -> tinker.SamplingClient:
    return client.save_weights_and_get_sampling_client(record_stability_info=True).result()


# ---- the loss, by hand ------------------------------------------------------------------------------
def test_stable_reinforce_matches_hand_worked_values():
    # Three positions: two sampled (mask 1), one prompt position (mask 0, adds nothing).
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    q = torch.tensor([-1.0 - math.log(3), -2.0 + math.log(2), 9.0])  # ratios exp(lp - q): 3 and 1/2
    inputs = {
        'advantages': torch.tensor([1.0, -2.0, 5.0]),
        RECORDED_LOGPROBS: q,
        RECORDED_MASK: torch.tensor([1, 1, 0.0]),
    }
    terms = tinker_loss_terms('stable_reinforce', lp, inputs, {'ratio_cap': 2.0, 'kl_coeff': 0.5})
    # policy: position 0, r = min(3, 2) = 2: 2 * 1 * -1 = -2; position 1, r = 1/2: 0.5 * -2 * -2 = 2; sum 0.
    # k3(q, lp) with d = q - lp: d0 = -ln 3: 1/3 + ln 3 - 1; d1 = ln 2: 2 - ln 2 - 1.
    k3 = (1 / 3 + math.log(3) - 1) + (2 - math.log(2) - 1)
    assert terms.loss.item() == pytest.approx(-0.0 + 0.5 * k3, abs=1e-6)
    assert terms.metrics['truncated:sum'].item() == 1 and terms.metrics['kl_k3:sum'].item() == pytest.approx(k3)
    terms.loss.backward()
    # d/dlp: -r * A + kl * (1 - exp(q - lp)): -2 + 0.5 * (1 - 1/3); 1 + 0.5 * (1 - 2); 0 at the prompt position.
    assert lp.grad.tolist() == pytest.approx([-2 + 0.5 * (2 / 3), 1 - 0.5, 0.0], abs=1e-6)


def test_stable_reinforce_defaults_and_ranges():
    lp = torch.tensor([-1.0])
    inputs = {'advantages': torch.tensor([2.0]), RECORDED_LOGPROBS: torch.tensor([-1.0 - math.log(5)])}
    inputs[RECORDED_MASK] = torch.tensor([1.0])
    # defaults: ratio_cap 2 (r = 5 is cut to 2), kl_coeff 0: -(2 * 2 * -1) = 4
    assert tinker_loss_terms('stable_reinforce', lp, inputs).loss.item() == pytest.approx(4.0)
    for bad in ({'ratio_cap': 0.0}, {'kl_coeff': -1.0}, {'clip_low_threshold': 0.5}):
        with pytest.raises(Exception, match=r'ratio_cap|kl_coeff|unknown'):
            tinker_loss_terms('stable_reinforce', lp, inputs, bad)


# ---- provenance on the wire ------------------------------------------------------------------------
def spanned_request(model: list, loss: list) -> pb.ForwardBackwardRequest:
    """A one-datum request (3 input tokens, 3 targets) whose spans are then set by hand (the SDK
    checks tiling itself, so a bad tiling must be written into the protobuf)."""
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={'target_tokens': [2, 3, 4]})
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn='cross_entropy')
    message = forward_backward_request_to_proto(
        types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id='s:train:0', seq_id=1)
    )
    for field, spans in (('model_input_spans', model), ('loss_fn_input_spans', loss)):
        for arm, sequence_id, offset, length in spans:
            target = getattr(getattr(message.data[0], field).add(), arm)
            target.sequence_id, target.offset, target.length = sequence_id, offset, length
    return message


def test_the_codec_decodes_spans_and_checks_their_tiling():
    message = spanned_request(
        [('prompt_tokens', 'a:0', 0, 2), ('sampled_tokens', 'a:0', 0, 1)], [('sampled_tokens', 'a:0', 1, 3)]
    )
    [datum] = parse_forward_backward(message.SerializeToString()).data
    assert datum.model_input_spans == [Span('prompt', 'a:0', 0, 2), Span('sampled', 'a:0', 0, 1)]
    assert datum.loss_fn_input_spans == [Span('sampled', 'a:0', 1, 3)]
    assert parse_forward_backward(spanned_request([], []).SerializeToString()).data[0].model_input_spans is None
    cases = {
        'cover 2 positions but the field has 3': ([('prompt_tokens', 'a:0', 0, 2)], [('sampled_tokens', 'a:0', 0, 3)]),
        'only one of model_input_spans and loss_fn_input_spans': ([('prompt_tokens', 'a:0', 0, 3)], []),
        'loss_fn_input_spans[0] names no sequence_id': (
            [('prompt_tokens', 'a:0', 0, 3)],
            [('sampled_tokens', '', 0, 3)],
        ),
    }
    for fragment, (model, loss) in cases.items():
        with pytest.raises(DataError, match=re.escape(fragment)):
            parse_forward_backward(spanned_request(model, loss).SerializeToString())


# ---- recorded sequences and spans ---------------------------------------------------------------
@pytest.mark.integration
def test_stable_reinforce_trains_on_the_recorded_logprobs_not_the_clients(server, sdk_clients, tiny_model_dir):
    url, keys, _ = server
    client = training_client(sdk_clients(url, keys['alice']), tiny_model_dir)
    [sequence] = sample(recording_sampler(client))
    assert sequence.sequence_id and len(sequence.tokens) == 4
    # The client claims sampler logprobs of 0 everywhere: the loss must use the recorded ones.
    datum = traced(sequence, advantage=1.5, logprobs=[0.0] * (len(PROMPT) + 3))
    config = {'ratio_cap': 1.05, 'kl_coeff': 0.5}
    output = client.forward([datum], 'stable_reinforce', loss_fn_config=config).result()
    lp = output.loss_fn_outputs[0]['logprobs'].to_torch().double()[len(PROMPT) - 1 :]  # the 4 sampled targets
    q = torch.tensor(sequence.logprobs, dtype=torch.float64)
    ratio = torch.exp(lp - q).clamp(max=1.05)
    k3 = torch.exp(q - lp) - (q - lp) - 1
    expected = -(ratio * 1.5 * lp).sum() + 0.5 * k3.sum()
    assert output.metrics['loss:sum'] == pytest.approx(float(expected), abs=1e-4)
    # The same weights sampled and scored: the trainer agrees with the recorded sampler logprobs.
    assert lp.tolist() == pytest.approx(q.tolist(), abs=1e-3)


def test_recorded_sequences_outlive_a_restart_and_expire_after_a_day_unused(tmp_path):
    now = [1000.0]
    with Store(tmp_path / 'twinkle.db', clock=lambda: now[0]) as store:
        tenant, _ = store.tenants.add('alice')
        session = store.sessions.create(tenant.id, {})
        store.sequences.record(tenant.id, session.id, [1, 2], [('seq-a:0', [3, 4], [-0.5, -0.25])])
    with Store(tmp_path / 'twinkle.db', clock=lambda: now[0]) as store:
        record = store.sequences.get(tenant.id, ['seq-a:0'])['seq-a:0']
        assert (record.prompt, record.tokens, record.logprobs) == ([1, 2], [3, 4], [-0.5, -0.25])
        assert store.sequences.get('another-tenant', ['seq-a:0']) == {}
        now[0] += SEQUENCE_TTL_S - 1
        store.sequences.touch(['seq-a:0'])  # used by a training request: a new day starts
        now[0] += SEQUENCE_TTL_S - 1
        assert not store.sequences.get(tenant.id, ['seq-a:0'])['seq-a:0'].expired(now[0])
        now[0] += 2
        assert store.sequences.get(tenant.id, ['seq-a:0'])['seq-a:0'].expired(now[0])
        store.sequences.record(tenant.id, session.id, [1], [])  # recording deletes what has expired
        assert store.sequences.get(tenant.id, ['seq-a:0']) == {}


@pytest.mark.integration
def test_spans_must_name_a_recorded_sequence_of_the_models_own_session(server, sdk_clients, tiny_model_dir):
    url, keys, _ = server
    mine, other = sdk_clients(url, keys['alice']), sdk_clients(url, keys['alice'])
    client = training_client(mine, tiny_model_dir)
    [sequence] = sample(recording_sampler(training_client(other, tiny_model_dir)))
    with pytest.raises(tinker.BadRequestError, match=r'datum 0 model_input_spans\[0\].*another session') as refused:
        client.forward_backward([traced(sequence)], 'stable_reinforce').result()
    assert 'sampled_sequences' not in str(refused.value) and '/' not in str(refused.value).split('sequence')[0]
    # another tenant's sequence does not exist for bob
    thief = training_client(sdk_clients(url, keys['bob']), tiny_model_dir)
    with pytest.raises(tinker.BadRequestError, match='names no sequence this server recorded'):
        thief.forward_backward([traced(sequence)], 'stable_reinforce').result()
    # a loss that reads no record only decodes the spans (the cookbook attaches them to every datum)
    ratio_one = traced(sequence, logprobs=[0.0] * (len(PROMPT) + 3))
    assert thief.forward([ratio_one], 'importance_sampling').result().metrics['loss:sum'] is not None
    # the model's requests go on after the refusals (their turns were passed over)
    [own] = sample(recording_sampler(client))
    assert client.forward_backward([traced(own)], 'stable_reinforce').result().metrics['loss:sum'] is not None


@pytest.mark.integration
def test_spans_must_match_the_recorded_tokens_and_stay_inside_the_sequence(server, sdk_clients, tiny_model_dir):
    url, keys, _ = server
    client = training_client(sdk_clients(url, keys['alice']), tiny_model_dir)
    [sequence] = sample(recording_sampler(client))
    good = traced(sequence)
    wrong = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={**good.loss_fn_inputs, 'target_tokens': [t ^ 1 for t in PROMPT[1:] + sequence.tokens]},
        model_input_spans=good.model_input_spans,
        loss_fn_input_spans=good.loss_fn_input_spans,
    )
    with pytest.raises(tinker.BadRequestError, match=r'datum 1 loss_fn_input_spans\[0\].*is not the recorded'):
        client.forward([good, wrong], 'stable_reinforce').result()
    sid, p = sequence.sequence_id, len(PROMPT)
    beyond = good.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=p + 3)],
        loss_fn_inputs=list(good.loss_fn_input_spans),
    )
    with pytest.raises(tinker.BadRequestError, match=r'model_input_spans\[0\].*covers positions \[1, 9\)'):
        client.forward([beyond], 'stable_reinforce').result()
    with pytest.raises(tinker.BadRequestError, match='recorded_logprobs'):
        client.forward([traced(sequence, recorded_logprobs=torch.zeros(p + 3))], 'stable_reinforce').result()


@pytest.mark.integration
def test_an_expired_sequence_is_refused_and_each_use_restarts_its_day(server, sdk_clients, tiny_model_dir):
    url, keys, store = server
    client = training_client(sdk_clients(url, keys['alice']), tiny_model_dir)
    [sequence] = sample(recording_sampler(client))

    def age(seconds: float) -> None:
        sql = 'UPDATE sampled_sequences SET last_used_at = last_used_at - ? WHERE id = ?'
        store.db.execute(sql, (seconds, sequence.sequence_id))

    age(SEQUENCE_TTL_S - 60)
    client.forward([traced(sequence)], 'stable_reinforce').result()  # within the day: used, so a new day starts
    age(SEQUENCE_TTL_S - 60)
    client.forward([traced(sequence)], 'stable_reinforce').result()
    age(SEQUENCE_TTL_S + 60)
    with pytest.raises(tinker.BadRequestError, match='has expired'):
        client.forward([traced(sequence)], 'stable_reinforce').result()


@pytest.mark.integration
def test_record_stability_info_is_kept_only_when_asked(server, sdk_clients, tiny_model_dir):
    url, keys, _ = server
    client = training_client(sdk_clients(url, keys['alice']), tiny_model_dir)
    [plain] = sample(client.save_weights_and_get_sampling_client().result())
    assert plain.sequence_id  # every sequence has an id, recorded or not
    with pytest.raises(tinker.BadRequestError, match='names no sequence this server recorded'):
        client.forward([traced(plain)], 'stable_reinforce').result()
    with pytest.raises(tinker.BadRequestError, match='no provenance spans'):
        client.forward([types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={
            'target_tokens': [2, 3], 'advantages': [1.0, 1.0]})], 'stable_reinforce').result()  # fmt: skip


# ---- inflight sampling clients --------------------------------------------------------------------
@pytest.mark.integration
def test_inflight_clients_follow_the_latest_inflight_save_and_snapshots_do_not(server, sdk_clients, tiny_model_dir):
    url, keys, _ = server
    client = training_client(sdk_clients(url, keys['alice']), tiny_model_dir, seed=7)
    prompt = types.ModelInput.from_ints(PROMPT)
    inflight = client.save_weights_and_get_sampling_client(kind='inflight').result()
    snapshot = client.save_weights_and_get_sampling_client().result()
    before = inflight.compute_logprobs(prompt).result()
    assert snapshot.compute_logprobs(prompt).result() == pytest.approx(before, abs=1e-5)
    sft = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={'target_tokens': PROMPT[1:], 'weights': [1.0] * (len(PROMPT) - 1)},
    )
    for _ in range(2):
        client.forward_backward([sft], 'cross_entropy').result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    newer = client.save_weights_and_get_sampling_client(kind='inflight').result()
    after = inflight.compute_logprobs(prompt).result()
    assert after == pytest.approx(newer.compute_logprobs(prompt).result(), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(after[1:], before[1:], strict=True)) > 0.05  # two steps trained it
    assert snapshot.compute_logprobs(prompt).result() == pytest.approx(before, abs=1e-5)
    with pytest.raises(tinker.BadRequestError, match='inflight'):
        client.save_weights_for_sampler('inflight').result()


# ---- tinker-cookbook's async RL loop --------------------------------------------------------------
COOKBOOK_ASYNC_RL = textwrap.dedent(
    """
    import asyncio, sys
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl.train import AsyncConfig, Config, main

    model, log_path = sys.argv[1], sys.argv[2]
    dataset = ArithmeticDatasetBuilder(
        batch_size=2, model_name_for_tokenizer=model, renderer_name='qwen3', n_batches=3, group_size=2
    )
    config = Config(
        learning_rate=1e-3, dataset_builder=dataset, model_name=model, recipe_name='twinkle_test_async',
        renderer_name='qwen3', max_tokens=4, log_path=log_path, eval_every=0, save_every=0, lora_rank=4,
        async_config=AsyncConfig(max_steps_off_policy=1, groups_per_batch=2), max_steps=2,
        rollout_json_export=False, num_groups_to_log=0,
    )
    asyncio.run(main(config))
    """
)


@pytest.mark.integration
def test_tinker_cookbooks_async_rl_loop_trains_with_stable_reinforce(tmp_path: Path, tiny_model_dir: str) -> None:
    with background_server(tmp_path / 'server', tiny_model_dir, tenants=('cookbook',)) as (url, keys, background):
        environment = {**os.environ, 'TINKER_BASE_URL': url, 'TINKER_API_KEY': keys['cookbook']}
        command = [sys.executable, '-c', COOKBOOK_ASYNC_RL, tiny_model_dir, str(tmp_path / 'run')]
        result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
        store = background.app.state.service.store
        recorded = store.db.count('SELECT COUNT(*) FROM sampled_sequences')
        trained = store.db.count('SELECT COUNT(*) FROM sampled_sequences WHERE last_used_at > created_at')
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    steps = [record for record in records if 'optim/lr' in record]
    assert [step['step'] for step in steps] == [0, 1]
    # Off-policy by at most the one step allowed (step 1 usually trains on step 0's samples).
    assert all(step['async/staleness_max'] <= 1 for step in steps)
    # Two steps of 2 groups of 2: the sequences each step trained on were recorded, then named by its spans.
    assert recorded >= 8 and trained >= 8
