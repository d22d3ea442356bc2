"""The service on the seeds' model families: one server hosting tiny-qwen3.5 (hybrid linear
attention), tiny-qwen3-moe and tiny-qwen3.5-moe beside tiny-qwen3. Native runs get the numbers
of a local model of their family, the Tinker SDK trains and samples each, and on an MoE model
Tinker's ``train_mlp`` trains the experts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from peft import LoraConfig
from server_helpers import background_server
from tinker import types

from twinkle import assets
from twinkle.model import TransformersModel
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.experts import MultiLoraExperts
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

TOL = 1e-5
FAMILIES = ('tiny-qwen3.5', 'tiny-qwen3-moe', 'tiny-qwen3.5-moe')
ROWS = [{'input_ids': [11, 23, 5, 42, 17, 8], 'labels': [-100, 23, 5, 42, 17, 8]}]
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([11, 23, 5, 42, 17]),
    loss_fn_inputs={'target_tokens': [23, 5, 42, 17, 8], 'weights': [1.0] * 5},
)


@pytest.fixture(scope='module')
def server(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Any]]:
    more = [{'base_model': name, 'device': 'cpu'} for name in FAMILIES]
    with background_server(tmp_path_factory.mktemp('families'), 'tiny-qwen3', more_models=more) as running:
        yield running


def local_logps(model_name: str, seed: int, config: LoraConfig = LORA) -> torch.Tensor:
    model = TransformersModel(assets.tiny_model(model_name), device='cpu')
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter_to_model('local', config)
    return model.forward_only(inputs=ROWS, adapter_name='local').logps[0, : len(ROWS[0]['input_ids'])]


@pytest.mark.parametrize('model_name', FAMILIES)
def test_a_native_run_gets_the_numbers_of_a_local_model_and_trains(server, model_name):
    url, keys, _ = server
    model = MultiLoraTransformersModel(model_name, client=TwinkleClient(url, keys['alice']))
    model.add_adapter_to_model('default', LORA, seed=7)
    served = torch.tensor(model.forward_only(inputs=ROWS).logps[0])
    assert (served - local_logps(model_name, 7)).abs().max().item() <= TOL
    model.set_optimizer('AdamW', lr=5e-2)
    losses = []
    for _ in range(3):
        losses.append(model.forward_backward(inputs=ROWS).loss)
        model.clip_grad_and_step()
    assert losses[-1] < losses[0]


def test_a_native_run_adapts_the_expert_stacks_it_names(server):
    url, keys, background = server
    config = LoraConfig(r=2, lora_alpha=4, target_parameters=['mlp.experts.down_proj'], init_lora_weights=False)
    model = MultiLoraTransformersModel('tiny-qwen3-moe', client=TwinkleClient(url, keys['alice']))
    run_id = model.add_adapter_to_model('default', config, seed=5)
    served = torch.tensor(model.forward_only(inputs=ROWS).logps[0])
    assert (served - local_logps('tiny-qwen3-moe', 5, config)).abs().max().item() <= TOL
    layers = multi_lora.multi_lora_layers(background.app.state.service.groups['tiny-qwen3-moe'].host.model.model)
    held = {path: layer for path, layer in layers.items() if run_id in layer.adapters}
    assert sorted(held) == ['model.layers.0.mlp.experts', 'model.layers.1.mlp.experts']
    assert all(list(layer.adapter_stacks(run_id)) == ['down_proj'] for layer in held.values())


@pytest.mark.parametrize('model_name', FAMILIES)
def test_the_tinker_sdk_trains_and_samples_each_family(server, sdk_clients, model_name):
    url, keys, _ = server
    service = sdk_clients(url, keys['bob'])
    trainer = service.create_lora_training_client(base_model=model_name, rank=4, seed=3).result()
    losses = []
    for _ in range(3):
        output = trainer.forward_backward([DATUM], 'cross_entropy').result()
        losses.append(-sum(float(x) for x in output.loss_fn_outputs[0]['logprobs'].to_torch()))
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[0]
    sampler = trainer.save_weights_and_get_sampling_client().result()
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
    reply = sampler.sample(types.ModelInput.from_ints([11, 23, 5]), 1, greedy).result()
    assert len(reply.sequences[0].tokens) == 3


@pytest.mark.parametrize('model_name', ['tiny-qwen3-moe', 'tiny-qwen3.5-moe'])
@pytest.mark.parametrize('train_mlp', [True, False])
def test_tinker_train_mlp_means_the_experts_on_an_moe_model(server, sdk_clients, model_name, train_mlp):
    url, keys, background = server
    service = sdk_clients(url, keys['alice'])
    trainer = service.create_lora_training_client(
        base_model=model_name, rank=2, train_mlp=train_mlp, train_attn=True, train_unembed=False
    ).result()
    trainer.forward_backward([DATUM], 'cross_entropy').result()
    host = background.app.state.service.groups[model_name].host
    layers = multi_lora.multi_lora_layers(host.model.model)
    run = trainer.model_id  # the run's adapter on the model
    assert any(run in layer.adapters for layer in layers.values())
    experts = [layer for layer in layers.values() if isinstance(layer, MultiLoraExperts) and run in layer.adapters]
    assert len(experts) == (2 if train_mlp else 0)
    assert all(list(layer.adapter_stacks(run)) == ['gate_up_proj', 'down_proj'] for layer in experts)
