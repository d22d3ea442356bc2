"""Several base models in one service, each on a model group of its own: listed by the native
and Tinker APIs, chosen by the run, trained with that model's numbers, and run by their own
worker threads (one model's pass does not wait for another's)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
import torch
from peft import LoraConfig
from server_helpers import background_server
from tinker import types

from twinkle import assets
from twinkle.model import TransformersModel
from twinkle.utils.memory import can_release_memory
from twinkle_client import TwinkleClient
from twinkle_client.client import PREFIX, RemoteError
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

TOL = 1e-5
MODELS = ('tiny-qwen3', 'small-qwen3')  # the default first
ROWS = [{'input_ids': [11, 23, 5, 42, 17, 8], 'labels': [-100, 23, 5, 42, 17, 8]}]
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)


@pytest.fixture(scope='module')
def server(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Any]]:
    data_dir = tmp_path_factory.mktemp('models')
    more = [{'base_model': 'small-qwen3', 'device': 'cpu'}]
    # No idle releases of their own: a test below calls the service's with the models held as it needs.
    with background_server(data_dir, 'tiny-qwen3', more_models=more, release_memory_after_idle_s=None) as running:
        yield running


def local_logps(model_name: str, seed: int) -> torch.Tensor:
    """The logprobs of ROWS through a fresh adapter drawn from ``seed``, in this process."""
    model = TransformersModel(assets.tiny_model(model_name), device='cpu')
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter_to_model('local', LORA)
    return model.forward_only(inputs=ROWS, adapter_name='local').logps[0, : len(ROWS[0]['input_ids'])]


def gap(served: list[list[float]], local: torch.Tensor) -> float:
    return (torch.tensor(served[0]) - local).abs().max().item()


def test_both_models_are_listed_by_the_native_and_the_tinker_api(server, sdk_clients):
    url, keys, background = server
    info = httpx.get(f'{url}{PREFIX}/server', headers={'X-API-Key': keys['alice']}).json()
    assert (info['base_model'], info['base_models']) == ('tiny-qwen3', list(MODELS))
    capabilities = sdk_clients(url, keys['alice']).get_server_capabilities()
    listed = {m.model_name: m.max_context_length for m in capabilities.supported_models}
    groups = background.app.state.service.groups
    assert listed == {name: groups[name].host.context for name in MODELS}
    assert groups['tiny-qwen3'].host.model_id != groups['small-qwen3'].host.model_id


@pytest.mark.parametrize('model_name', MODELS)
def test_a_run_trains_the_base_model_it_names(server, model_name):
    url, keys, background = server
    model = MultiLoraTransformersModel(model_name, client=TwinkleClient(url, keys['alice']))
    run_id = model.add_adapter_to_model('default', LORA, seed=7)
    assert model.client.get_training_run(run_id).base_model == model_name
    assert gap(model.forward_only(inputs=ROWS).logps, local_logps(model_name, 7)) <= TOL
    groups = background.app.state.service.groups
    assert run_id in groups[model_name].adapters
    assert all(run_id not in g.adapters for name, g in groups.items() if name != model_name)


def test_an_unknown_base_model_is_a_404_that_names_the_hosted_ones(server, sdk_clients):
    url, keys, _ = server
    model = MultiLoraTransformersModel('Qwen/Qwen3-235B', client=TwinkleClient(url, keys['alice']))
    with pytest.raises(RemoteError, match=r"'Qwen/Qwen3-235B' is not served here.*'tiny-qwen3', 'small-qwen3'") as e:
        model.add_adapter_to_model('default', LORA)
    assert e.value.status == 404
    alice = sdk_clients(url, keys['alice'])
    with pytest.raises(tinker.NotFoundError, match='small-qwen3'):
        alice.create_lora_training_client(base_model='Qwen/Qwen3-235B', rank=4).result()


def test_a_checkpoint_loads_only_into_a_run_of_its_base_model(server):
    url, keys, _ = server
    client = TwinkleClient(url, keys['alice'])
    tiny = MultiLoraTransformersModel('tiny-qwen3', client=client)
    tiny.add_adapter_to_model('default', LORA, seed=1)
    path = tiny.save('for-small')
    small = MultiLoraTransformersModel('small-qwen3', client=client)
    small.add_adapter_to_model('default', LORA, seed=1)
    with pytest.raises(RemoteError, match="holds weights for 'tiny-qwen3', not 'small-qwen3'") as e:
        small.load(path)
    assert e.value.status == 400


def test_the_tinker_sdk_trains_and_samples_the_model_it_names(server, sdk_clients):
    url, keys, _ = server
    alice = sdk_clients(url, keys['alice'])
    trainer = alice.create_lora_training_client(base_model='small-qwen3', rank=4, seed=3).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([11, 23, 5, 42, 17]),
        loss_fn_inputs={'target_tokens': [23, 5, 42, 17, 8], 'weights': [1.0] * 5},
    )
    losses = []
    for _ in range(3):
        output = trainer.forward_backward([datum], 'cross_entropy').result()
        losses.append(-sum(float(x) for x in output.loss_fn_outputs[0]['logprobs'].to_torch()))
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert losses[-1] < losses[0]
    assert trainer.get_info().model_data.model_name == 'small-qwen3'
    sampler = alice.create_sampling_client(base_model='small-qwen3')
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0)
    reply = sampler.sample(types.ModelInput.from_ints([11, 23, 5]), 1, greedy).result()
    assert len(reply.sequences[0].tokens) == 3


def test_each_model_has_its_own_worker(server):
    # The default model's worker is held by a job that waits for the other model's request:
    # with one worker for both, that request could never run and the job would time out.
    url, keys, background = server
    groups = background.app.state.service.groups
    small = MultiLoraTransformersModel('small-qwen3', client=TwinkleClient(url, keys['bob']))
    small.add_adapter_to_model('default', LORA, seed=2)
    other_ran = threading.Event()
    held = groups['tiny-qwen3'].scheduler.submit('gatekeeper', lambda: other_ran.wait(120))
    logps = small.forward_only(inputs=ROWS).logps
    other_ran.set()
    assert held.wait(120) and held.result is True and held.status == 'done'
    assert gap(logps, local_logps('small-qwen3', 2)) <= TOL


def test_a_base_model_recorded_under_another_spelling_is_still_found(server):
    service = server[2].app.state.service
    assert service.find_group('hf://tiny-qwen3') is service.groups['tiny-qwen3']
    assert service.find_group('ms://small-qwen3') is service.groups['small-qwen3']
    assert service.find_group('Qwen/Qwen3-235B') is None


def releases(service: Any) -> float:
    return service.registry.get_sample_value('twinkle_memory_releases_total') or 0.0


def test_an_idle_model_gives_memory_back_only_while_the_others_in_its_process_are_idle(server):
    # The heap release (malloc_trim) is the process's: not while another model here runs a pass.
    service = server[2].app.state.service
    tiny, small = service.groups['tiny-qwen3'], service.groups['small-qwen3']
    released, running = threading.Event(), threading.Event()
    held = tiny.scheduler.submit('gatekeeper', lambda: running.set() or released.wait(120))
    assert running.wait(120)
    before = releases(service)
    service._on_idle(small)
    assert releases(service) == before
    released.set()
    assert held.wait(120) and tiny.scheduler.drain(120)
    service._on_idle(small)
    assert releases(service) == before + can_release_memory()
