"""Run history in the service: each run's figures at every optimizer step (loss, lr, grad norm,
tokens/s), recorded in the store whatever the tenant reads, for runs of both APIs, and read
back through ``GET /twinkle/v1/runs/{id}/history``; another tenant's history does not exist."""

from __future__ import annotations

import math
import threading

import httpx
import pytest
from peft import LoraConfig
from server_helpers import background_server
from tinker import types

from twinkle.errors import DataError
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ROWS = [{'input_ids': [5 + i, 17, 42, 99, 3 + i, 8], 'labels': [5 + i, 17, 42, 99, 3 + i, 8]} for i in range(4)]


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('history'), tiny_model_dir) as running:
        yield running


def native_run(url: str, key: str, name: str, lr: float) -> tuple[MultiLoraTransformersModel, str]:
    model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
    run_id = model.add_adapter_to_model(name, LoraConfig(r=4, target_modules='all-linear'), seed=1)
    model.set_optimizer('AdamW', lr=lr)
    model.set_lr_scheduler('LinearLR', start_factor=1.0, end_factor=0.5, total_iters=4)
    return model, run_id


def test_each_optimizer_step_of_a_native_run_is_recorded_with_its_figures(server):
    url, keys, _ = server
    model, run_id = native_run(url, keys['alice'], 'history', lr=1e-2)
    losses, norms = [], []
    for step in range(3):
        # two accumulation calls per step: the step's loss is their mean
        calls = [model.forward_backward(inputs=ROWS[:2]).loss, model.forward_backward(inputs=ROWS[2:]).loss]
        losses.append(sum(calls) / 2)
        norms.append(model.clip_grad_and_step())
        if step == 1:
            metrics = model.calculate_metric()  # the tenant reading its metrics takes nothing from the history
            assert metrics['steps'] == 2
    history = model.client.run_history(run_id)
    assert [s.step for s in history] == [1, 2, 3]
    assert [s.loss for s in history] == pytest.approx(losses, rel=1e-6)
    assert [s.grad_norm for s in history] == pytest.approx(norms, rel=1e-6)
    assert [s.lr for s in history] == pytest.approx([1e-2, 1e-2 * (1 - 0.5 / 4), 1e-2 * (1 - 1.0 / 4)], rel=1e-6)
    assert all(s.tokens_per_s > 0 and s.time > 0 for s in history)
    assert [s.step for s in model.client.run_history(run_id, after=2)] == [3]
    page = httpx.get(
        f'{url}/twinkle/v1/runs/{run_id}/history', params={'after': 1, 'limit': 1}, headers={'X-API-Key': keys['alice']}
    ).json()
    assert [s['step'] for s in page['steps']] == [2]

    bob = TwinkleClient(url, keys['bob'])
    with pytest.raises(RemoteError) as refused:
        bob.run_history(run_id)
    assert refused.value.status == 404


def test_tenants_stepping_together_each_get_their_own_history(server):
    url, keys, _ = server
    runs = {}

    def train(name: str, lr: float) -> None:
        model, run_id = native_run(url, keys[name], f'{name}-together', lr=lr)
        for _ in range(4):
            model.forward_backward(inputs=ROWS)
            model.clip_grad_and_step()
        runs[name] = (model, run_id)

    threads = [threading.Thread(target=train, args=args) for args in (('alice', 1e-2), ('bob', 1e-3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, lr in (('alice', 1e-2), ('bob', 1e-3)):
        model, run_id = runs[name]
        history = model.client.run_history(run_id)
        assert [s.step for s in history] == [1, 2, 3, 4], name
        assert history[0].lr == pytest.approx(lr)


def test_a_tinker_model_s_steps_are_recorded_too(server, sdk_clients, tiny_model_dir):
    url, keys, _ = server
    sdk = sdk_clients(url, keys['alice'])
    client = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=4).result()
    tokens = [11, 22, 33, 44, 55, 66, 77]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={'target_tokens': tokens[1:], 'weights': [1.0] * (len(tokens) - 1)},
    )
    for _ in range(2):
        client.forward_backward([datum], 'cross_entropy').result()
        client.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    history = TwinkleClient(url, keys['alice']).run_history(client.model_id)
    assert [(s.step, s.lr) for s in history] == [(1, pytest.approx(3e-3)), (2, pytest.approx(3e-3))]
    assert all(s.loss is not None and s.loss > 0 for s in history)


def test_figures_the_trainer_logs_are_recorded_with_the_next_step(server):
    url, keys, _ = server
    model, run_id = native_run(url, keys['alice'], 'rewards', lr=1e-2)
    for reward in (0.25, 0.5):
        model.log_step_figures({'reward': reward, 'reward_std': 0.1})
        model.forward_backward(inputs=ROWS)
        model.clip_grad_and_step()
    model.forward_backward(inputs=ROWS)
    model.clip_grad_and_step()  # a step with nothing logged before it
    history = model.client.run_history(run_id)
    assert [step.model_extra.get('reward') for step in history] == [0.25, 0.5, None]
    assert history[0].model_extra['reward_std'] == 0.1 and history[0].loss is not None
    with pytest.raises(DataError, match="'loss' is a figure the model records itself"):
        model.log_step_figures({'loss': 1.0})  # refused by the client (the wire), as by the local model
    with pytest.raises(DataError, match='finite number'):
        model.log_step_figures({'reward': float('nan')})  # refused by the client before a request


def test_a_grpo_step_s_sampler_figures_are_recorded_in_the_history(server):
    # The loss's own sampler-vs-trainer figures go to the history with the step, whatever the loop reads:
    # this one logs none of them.
    url, keys, _ = server
    model, run_id = native_run(url, keys['alice'], 'rollout-correction', lr=1e-2)
    correction = {'level': 'token', 'mode': 'truncate', 'threshold': 2.0}
    model.set_loss('GRPOLoss', loss_type='token_mean', rollout_correction=correction)
    rows = ROWS[:2]
    trainer = model.forward_only(inputs=rows).logps  # the trainer's logp of each label (all 6 trained)
    weights = [[0.5, 1.0, 4.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 3.0]]
    sampler = [
        [lp - math.log(w) for lp, w in zip(seq, ws, strict=True)] for seq, ws in zip(trainer, weights, strict=True)
    ]
    model.forward_backward(inputs=rows, advantages=[1.0, -1.0], old_logps=sampler)
    model.clip_grad_and_step()
    [step] = model.client.run_history(run_id)
    recorded = step.model_extra
    # sampler - trainer = -ln w: v1 = -(ln 0.5 + ln 4 + ln 3) / 12 tokens, v2 = half the mean square
    assert recorded['kl_sample_train_v1'] == pytest.approx(-math.log(6) / 12, abs=1e-5)
    logs = [math.log(0.5), math.log(4), math.log(3)]
    assert recorded['kl_sample_train_v2'] == pytest.approx(0.5 * sum(x * x for x in logs) / 12, abs=1e-5)
    assert recorded['is_weight_mean'] == pytest.approx((0.5 + 4 + 3 + 9) / 12, rel=1e-4)
    assert recorded['is_weight_std'] == pytest.approx(math.sqrt(34.25 / 12 - (16.5 / 12) ** 2), rel=1e-4)
    assert recorded['is_weight_min'] == pytest.approx(0.5, rel=1e-4)
    assert recorded['is_weight_max'] == pytest.approx(4.0, rel=1e-4)
    assert recorded['is_truncated_frac'] == pytest.approx(2 / 12)  # 4 and 3 capped at 2
    # the loss took the capped weights: -(1 * (0.5 + 1 + 2 + 1 + 1 + 1) - 1 * (5 * 1 + 2)) over 12 tokens
    assert step.loss == pytest.approx(0.5 / 12, rel=1e-4)
