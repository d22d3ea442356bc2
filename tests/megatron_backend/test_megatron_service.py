"""The service with a Megatron model group (``backend: megatron``, ``ranks: 2``, ``tp_size: 2``, and ``pp_size: 2``):
trained by the official ``tinker`` SDK, unmodified, and by the native client (``twinkle_client``),
with the numbers of a ``backend: transformers`` server on the same data.

Both servers run on this process's threads over loopback, each with its own data directory; the
megatron group's two ranks are worker processes joined over gloo, each holding half of every
layer. An adapter drawn from the same seed is the same on both (megatron's LoRA draws peft's
numbers in peft's order), so the losses of every step agree; tolerance 1e-4, the issue's between
megatron and ``TransformersModel`` (another attention and MLP implementation, and tensor-parallel
sums in another order). Sampling runs on a sampler group of its own (``sampler: {ranks: 1}``),
from the weights a run saves for sampling: a megatron model has no KV cache to sample with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip('megatron.core')

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

import tinker  # noqa: E402
from peft import LoraConfig  # noqa: E402
from server_helpers import background_server  # noqa: E402
from tinker import types  # noqa: E402

from twinkle.errors import ConfigurationError  # noqa: E402
from twinkle.server.config import ServerConfig  # noqa: E402
from twinkle_client import TwinkleClient  # noqa: E402
from twinkle_client.model import MultiLoraTransformersModel  # noqa: E402

HF = 1e-4
MODEL = 'tiny-qwen3'
MEGATRON = {'backend': 'megatron', 'ranks': 2, 'tp_size': 2, 'release_memory_after_idle_s': None}
TOKENS = ([11, 23, 5, 42, 17, 8], [7, 19, 3, 88, 21])
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear')
ROWS = [{'input_ids': list(tokens), 'labels': [-100, *tokens[1:]]} for tokens in TOKENS]
STEPS = 3


def data() -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={'target_tokens': tokens[1:], 'weights': [1.0] * (len(tokens) - 1)},
        )
        for tokens in TOKENS
    ]


def tinker_losses(service: tinker.ServiceClient) -> tuple[list[float], tinker.TrainingClient]:
    """``STEPS`` Tinker steps (2 datums, AdamW, clipping at 0.5): each step's loss:sum and gradient norm."""
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3, train_unembed=False).result()
    numbers = []
    for _ in range(STEPS):
        output = trainer.forward_backward(data(), 'cross_entropy').result()
        assert len(output.loss_fn_outputs) == 2
        step = trainer.optim_step(types.AdamParams(learning_rate=5e-2, grad_clip_norm=0.5)).result()
        numbers += [output.metrics['loss:sum'], step.metrics['grad_norm:mean']]
    return numbers, trainer


def native_losses(url: str, key: str) -> list[float]:
    model = MultiLoraTransformersModel(MODEL, client=TwinkleClient(url, key))
    model.add_adapter_to_model('default', LORA, seed=5)
    model.set_optimizer('AdamW', lr=1e-2)
    losses = []
    for _ in range(STEPS):
        losses.append(model.forward_backward(inputs=ROWS).loss)
        model.clip_grad_and_step()
    return losses


@pytest.fixture(scope='module')
def reference(tmp_path_factory, module_sdk_clients) -> dict[str, list[float]]:
    """The same clients' numbers on a one-rank ``backend: transformers`` server."""
    with background_server(tmp_path_factory.mktemp('transformers'), MODEL) as (url, keys, _):
        numbers, _ = tinker_losses(module_sdk_clients(url, keys['alice']))
        module_sdk_clients.close()  # their sessions end before this server does
        return {'tinker': numbers, 'native': native_losses(url, keys['bob'])}


@pytest.fixture(scope='module')
def served(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Any]]:
    """The megatron server: a model group of two tensor-parallel ranks, and a sampler group."""
    options = {**MEGATRON, 'sampler': {'ranks': 1}}
    with background_server(tmp_path_factory.mktemp('megatron'), MODEL, **options) as running:
        yield running


def test_a_tinker_sdk_client_trains_the_megatron_group_as_the_transformers_server(reference, served, sdk_clients):
    url, keys, background = served
    host = background.app.state.service.default.host
    assert len(set(host.pids)) == 2  # two worker processes hold the model
    service = sdk_clients(url, keys['alice'])
    numbers, trainer = tinker_losses(service)
    assert numbers == pytest.approx(reference['tinker'], rel=HF, abs=HF)
    assert numbers[-2] < numbers[0]  # trained: the loss went down
    # Saved state and sampler weights are Tinker paths of this server; the sampler group samples the latter.
    state = trainer.save_state('after-3').result()
    assert state.path == f'tinker://{trainer.model_id}/weights/after-3'
    sampler = trainer.save_weights_and_get_sampling_client('sampler-3').result()
    reply = sampler.sample(types.ModelInput.from_ints([11, 23, 5]), 1, types.SamplingParams(max_tokens=3)).result()
    assert len(reply.sequences[0].tokens) == 3
    # A fresh client loads the saved state and goes on from where the first one stopped.
    resumed = service.create_training_client_from_state(state.path).result()
    after = resumed.forward_backward(data(), 'cross_entropy').result().metrics['loss:sum']
    assert after == pytest.approx(trainer.forward_backward(data(), 'cross_entropy').result().metrics['loss:sum'])


def test_lora_on_the_output_head_is_refused_with_what_to_ask_for(served, sdk_clients):
    url, keys, _ = served
    service = sdk_clients(url, keys['bob'])
    with pytest.raises(tinker.BadRequestError, match='train_unembed=False'):  # the SDK's default: True
        service.create_lora_training_client(base_model=MODEL, rank=4).result()
    model = MultiLoraTransformersModel(MODEL, client=TwinkleClient(url, keys['bob']))
    with pytest.raises(ConfigurationError, match=r"include the output head lm_head.*accepted: \['k_proj'"):
        model.add_adapter_to_model('head', LoraConfig(r=4, target_modules=['q_proj', 'lm_head']))


def test_the_native_client_trains_the_megatron_group_as_the_transformers_server(reference, served):
    url, keys, _ = served
    losses = native_losses(url, keys['bob'])
    assert losses == pytest.approx(reference['native'], rel=HF, abs=HF)
    assert losses[-1] < losses[0]


def test_a_pipeline_parallel_group_trains_as_the_transformers_server(reference, tmp_path_factory):
    """``pp_size: 2``: each worker holds one of the two layers; the native client's losses are the
    transformers server's."""
    options = {**MEGATRON, 'tp_size': 1, 'pp_size': 2}
    with background_server(tmp_path_factory.mktemp('megatron-pp'), MODEL, **options) as (url, keys, background):
        assert len(set(background.app.state.service.default.host.pids)) == 2
        losses = native_losses(url, keys['bob'])
    assert losses == pytest.approx(reference['native'], rel=HF, abs=HF)


def test_a_tensor_parallel_group_of_ray_actors_trains_as_the_transformers_server(reference, tmp_path_factory):
    """``ray:``: the two ranks are Ray actors of a local Ray (``twinkle.server.execution.hosts.ray_ranks``)."""
    ray = pytest.importorskip('ray')
    from twinkle.infra.ray.cluster import LOCAL_SYSTEM_CONFIG

    ray.init(
        address='local', num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG
    )
    try:
        options = {**MEGATRON, 'ray': {'num_cpus': 1}}
        with background_server(tmp_path_factory.mktemp('megatron-ray'), MODEL, **options) as (url, keys, background):
            pids = background.app.state.service.default.host.pids
            # Ray's raylet starts them: the workers are not this process's children, as ProcessRanks' are.
            assert len(set(pids)) == 2 and all(psutil.Process(pid).ppid() != os.getpid() for pid in pids)
            losses = native_losses(url, keys['bob'])
    finally:
        ray.shutdown()
    assert losses == pytest.approx(reference['native'], rel=HF, abs=HF)


SAMPLE_ON_THE_WORKER = """
import json, sys
from twinkle.errors import ConfigurationError
from twinkle.server.config import ServerConfig
from twinkle.server.execution.hosts.model_host import ModelHost

host = ModelHost(ServerConfig(base_model='tiny-qwen3', backend='megatron', device='cpu'))
host.add_adapter('a', {'r': 4, 'lora_alpha': 8, 'target_modules': 'all-linear'}, seed=5)
loss = host.run('a', 'forward_backward', {'inputs': json.loads(sys.argv[1])})['loss']
try:
    host.run('a', 'sample', {'inputs': [{'input_ids': [11, 23, 5]}], 'sampling_params': {'max_tokens': 2}})
    refused = None
except ConfigurationError as error:
    refused = str(error)
print(json.dumps({'loss': loss, 'refused': refused, 'model': type(host.model).__name__}))
"""


def test_one_rank_in_the_server_process_trains_and_refuses_to_sample_without_a_sampler_group(reference):
    """``ranks: 1``: the megatron model in the server's own process (a separate one here, as megatron's
    process groups are the process's); its first loss is the transformers server's."""
    done = subprocess.run(
        [sys.executable, '-c', SAMPLE_ON_THE_WORKER, json.dumps(ROWS)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result['model'] == 'MegatronModel'
    assert result['loss'] == pytest.approx(reference['native'][0], rel=HF, abs=HF)
    assert 'sampler group of its own' in result['refused'] and 'KV cache' in result['refused']


@pytest.mark.parametrize(
    ('options', 'message'),
    [
        ({'ranks': 3, 'tp_size': 2}, r'ranks=3 must be a multiple of tp_size \* pp_size \* fsdp_size = 2'),
        ({'ranks': 4, 'tp_size': 2, 'pp_size': 4}, r'= 8 \(tp_size=2, pp_size=4, fsdp_size=1\): ranks 8, 16, 24'),
        ({'ranks': 4, 'fsdp_size': 2}, r'backend: megatron has no FSDP \(fsdp_size=2\)'),
        ({'ranks': 2, 'tp_size': 2, 'sampler': 'vllm'}, r'cannot sample beside the model'),
        ({'speed': {'fused_output': True}}, r"speed: \{'fused_output': True\} switches the transformers backend"),
    ],
)
def test_layouts_that_do_not_fit_are_refused_before_a_server_starts(options, message):
    with pytest.raises(ConfigurationError, match=message):
        ServerConfig.build(base_model=MODEL, backend='megatron', **options)


def test_tensor_and_pipeline_sizes_are_refused_on_the_transformers_backend():
    with pytest.raises(ConfigurationError, match=r'tp_size=2 and pp_size=1 are for backend: megatron'):
        ServerConfig.build(base_model=MODEL, ranks=2, tp_size=2)
    more = [{'base_model': 'small-qwen3', 'backend': 'megatron', 'ranks': 2, 'pp_size': 4}]
    with pytest.raises(ConfigurationError, match=r'small-qwen3: ranks=2 must be a multiple of .* = 4'):
        ServerConfig.build(base_model=MODEL, more_models=more)
    config = ServerConfig.build(base_model=MODEL, backend='megatron', ranks=8, tp_size=2, pp_size=2)
    assert config.mesh_sizes() == {'fsdp_size': 1, 'pp_size': 2, 'tp_size': 2, 'dp_size': 2}
