"""A model group of two ranks (``ranks: 2``): worker processes joined over torch.distributed
(gloo), data parallel or FSDP2, give every tenant the numbers of a one-rank server, whoever
shares its pass; a checkpoint is written once and loads anywhere.

Five tenants with LoRA ranks 2, 4, 8, 2 and 4 send requests of 1, 3, 2, 1 and 1 rows: on two
ranks request i's first share goes to rank i, so the one-row requests of 'a' and 'e' live on
rank 0 alone and that of 'd' on rank 1, and the three-row one is cut 1 + 2. The one-rank host is a
``ModelHost`` in this process. Tolerance 1e-5 (the issue's): the ranks sum their shares'
losses and gradients in another order than one process does, so float32 rounding may differ."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from server_helpers import add_key, background_server, free_port, wait_until_healthy
from tinker import types

from twinkle import assets
from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError, DataError, UnknownNameError
from twinkle.server.config import ServerConfig
from twinkle.server.execution.hosts.model_host import ModelHost, base_dtype
from twinkle.server.execution.hosts.multi_rank import MultiRankHost, gpu_env, row_share
from twinkle_client import TwinkleClient, init_twinkle_client
from twinkle_client.checkpoint_engine import CheckpointEngineManager
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

TOL = 1e-5
#: The admin key of the served fixture's server: its /metrics answers it only.
ADMIN_KEY = 'admin-' + 'k' * 40
TENANTS = {'a': 2, 'b': 4, 'c': 8, 'd': 2, 'e': 4}  # adapter -> LoRA rank
# One-row requests land on one rank each, so the other ranks hold no gradient for them: every
# rank must still decide alike which adapters step together (a mismatch hangs the group).
ROWS_PER_REQUEST = {'a': 1, 'b': 3, 'c': 2, 'd': 1, 'e': 1}


def rows(count: int, seed: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, 200, (int(torch.randint(4, 14, (1,), generator=generator)),), generator=generator)
        out.append({'input_ids': ids.tolist(), 'labels': [-100, *ids.tolist()[1:]]})
    return out


def train(host: Any, steps: int = 3) -> list[list[float]]:
    """Five tenants: add, configure, then mixed passes and optimizer steps; every number seen."""
    for name, rank in TENANTS.items():
        host.add_adapter(name, {'r': rank, 'lora_alpha': 2 * rank, 'target_modules': 'all-linear'}, 1, seed=rank)
        host.run(name, 'set_optimizer', {'optimizer_cls': 'AdamW', 'lr': 1e-2})
    seen = []
    for step in range(steps):
        requests = [(name, {'inputs': rows(ROWS_PER_REQUEST[name], 10 * step + i)}) for i, name in enumerate(TENANTS)]
        seen.append([out['loss'] for out in host.run_mixed('forward_backward', requests)])
        seen.append(host.run_steps([(name, {'max_grad_norm': 0.5}) for name in TENANTS]))
    # One tenant alone (the host's plain forward_backward), and logprobs of a forward-only pass.
    seen.append([host.run('b', 'forward_backward', {'inputs': rows(1, 77)})['loss']])
    outputs = host.run_mixed('forward_only', [('a', {'inputs': rows(3, 88)}), ('c', {'inputs': rows(1, 99)})])
    seen.append([logp for out in outputs for row in out['logps'] for logp in row])
    return seen


def flat(numbers: list[list[float]]) -> torch.Tensor:
    return torch.tensor([value for row in numbers for value in row], dtype=torch.float64)


@pytest.fixture(scope='module')
def one_rank() -> list[list[float]]:
    return train(ModelHost(ServerConfig(base_model=assets.tiny_model('tiny-qwen3'), device='cpu')))


@pytest.fixture(scope='module', params=[1, 2], ids=['data-parallel', 'fsdp2'])
def two_ranks(request) -> Iterator[MultiRankHost]:
    config = ServerConfig(base_model=assets.tiny_model('tiny-qwen3'), device='cpu', ranks=2, fsdp_size=request.param)
    host = MultiRankHost(config)
    try:
        yield host
    finally:
        host.shutdown()


@pytest.fixture(scope='module')
def trained(two_ranks) -> list[list[float]]:
    """The numbers of ``train`` on the two ranks (which then hold the three adapters)."""
    return train(two_ranks)


@pytest.mark.integration
def test_three_tenants_on_two_ranks_get_the_numbers_of_one_rank(trained, one_rank):
    numbers = trained
    assert [len(row) for row in numbers] == [len(row) for row in one_rank]
    assert torch.allclose(flat(numbers), flat(one_rank), rtol=TOL, atol=TOL)
    assert flat(one_rank).abs().sum() > 0 and numbers[0] != numbers[2]  # trained: the losses moved


def test_each_rank_takes_its_share_of_a_pass():
    # Three rows over two ranks: 2 and 1, and the per-row arguments with them; a scalar goes whole.
    kwargs = {'inputs': rows(3, 1), 'advantages': [1.0, 2.0, 3.0], 'micro': 4}
    shares = [row_share(kwargs, 0, rank, 2) for rank in (0, 1)]
    assert [(len(s['inputs']), s['advantages'], s['micro']) for s in shares] == [(2, [1.0, 2.0], 4), (1, [3.0], 4)]
    shares = [row_share(kwargs, 1, rank, 2) for rank in (0, 1)]  # the second request of a pass starts on rank 1
    assert [(len(s['inputs']), s['advantages'], s['micro']) for s in shares] == [(1, [3.0], 4), (2, [1.0, 2.0], 4)]
    assert row_share(kwargs, 0, 0, 1) is kwargs  # one rank: the whole request


@pytest.mark.integration
def test_the_fsdp_ranks_hold_half_the_layers(two_ranks):
    assert len(set(two_ranks.pids)) == 2
    footprint = two_ranks.footprint()
    assert [rank['rank'] for rank in footprint] == [0, 1]
    held = [rank['decoder_elements_held'] for rank in footprint]
    total = footprint[0]['decoder_elements']  # the decoder layers' (FSDP2 keeps the root's weights whole)
    if two_ranks.config.fsdp_size == 2:
        assert sum(held) == total and max(held) <= total // 2 + 64  # each rank its half
    else:
        assert held == [total, total]  # data parallel: each rank the whole model


@pytest.mark.integration
def test_a_checkpoint_is_written_once_and_loads_on_one_rank(two_ranks, trained, tmp_path):
    path = Path(two_ranks.save('a', tmp_path, 'step-3', save_optimizer=True))
    assert [p.name for p in tmp_path.iterdir()] == ['step-3']  # one directory, no rank's leftovers
    assert {'adapter_config.json', 'adapter_model.safetensors', 'trainer_state.json'} <= {
        p.name for p in path.iterdir()
    }
    saved = load_file(str(path / 'adapter_model.safetensors'))
    one = ModelHost(ServerConfig(base_model=assets.tiny_model('tiny-qwen3'), device='cpu'))
    one.add_adapter('a', {'r': 2, 'lora_alpha': 4, 'target_modules': 'all-linear'})
    one.run('a', 'set_optimizer', {'optimizer_cls': 'AdamW', 'lr': 1e-2})
    one.restore_state('a', path)
    probe = rows(2, 5)
    local = one.run('a', 'forward_only', {'inputs': probe})['logps']
    served = two_ranks.run('a', 'forward_only', {'inputs': probe})['logps']
    assert torch.allclose(flat(served), flat(local), rtol=TOL, atol=TOL)
    assert all(torch.isfinite(t).all() for t in saved.values()) and len(saved) > 0
    # The counters are the global batch's on every rank: 'b' sent 3 rows a step for 3 steps, then 1.
    state = json.loads(
        (Path(two_ranks.save('b', tmp_path, 'b', save_optimizer=True)) / 'trainer_state.json').read_text()
    )
    assert (state['consumed_train_samples'], state['optim_step']) == (10, 3)


@pytest.mark.integration
def test_errors_come_back_as_themselves_and_the_group_keeps_serving(two_ranks, trained):
    with pytest.raises(UnknownNameError, match="Unknown adapter 'nobody'"):
        two_ranks.run('nobody', 'forward_only', {'inputs': rows(1, 1)})
    with pytest.raises(ValueError, match='micro_batch_size'):
        two_ranks.run('a', 'forward_backward', {'inputs': rows(2, 1), 'micro_batch_size': 1})
    # Refused by every rank alike, before any collective: no rank is left waiting for another.
    with pytest.raises(DataError, match="loss input 'advantages' has 3 entries for 5 rows"):
        two_ranks.run('a', 'forward_backward', {'inputs': rows(5, 1), 'advantages': [1.0, 2.0, 3.0]})
    assert len(two_ranks.run('a', 'forward_only', {'inputs': rows(1, 2)})['logps']) == 1


# ---- behind the service -------------------------------------------------------------------------
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear')
SERVED_ROWS = [{'input_ids': [11, 23, 5, 42, 17, 8], 'labels': [-100, 23, 5, 42, 17, 8]}] * 3


@pytest.fixture(scope='module')
def served(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Any]]:
    """A server whose default model is a two-rank FSDP2 group, beside a second model in its process."""
    data_dir = tmp_path_factory.mktemp('ranks')
    more = [{'base_model': 'small-qwen3', 'device': 'cpu'}]
    options = {'ranks': 2, 'fsdp_size': 2, 'release_memory_after_idle_s': None, 'more_models': more}
    options['admin_api_key'] = ADMIN_KEY  # the metrics'
    with background_server(data_dir, 'tiny-qwen3', **options) as running:
        yield running


#: The native client's learning rate, as the five tenants' above. At 5e-2 the third step overshoots
#: (loss 4.07 -> 5.26, gradient norm 50), and Adam's first step (lr * g / (|g| + eps)) turns a float32
#: rounding difference of 5e-9 in a gradient element of 2e-7 (layer 0's o_proj B) into 6e-5 in its
#: weight: the third loss then differs by 5e-5 between one process on 1 and on 2 threads, and by
#: 9e-5 between two ranks and one (their summation orders differ). At 1e-2 it is 4e-6.
NATIVE_LR = 1e-2


def native_losses(model: MultiLoraTransformersModel, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(model.forward_backward(inputs=SERVED_ROWS).loss)
        model.clip_grad_and_step()
    return losses


@pytest.mark.integration
def test_the_native_client_trains_on_the_group_as_on_one_rank(served, tmp_path):
    url, keys, _ = served
    model = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, keys['alice']))
    model.add_adapter_to_model('default', LORA, seed=5)
    model.set_optimizer('AdamW', lr=NATIVE_LR)
    on_group = native_losses(model, 3)
    # The run's history is recorded from the group too; evaluation by calculate_loss is refused
    # before it is queued (each rank holds a share of a forward_only's rows), and the group goes on.
    assert [step.step for step in model.client.run_history(model.runs['default'])] == [1, 2, 3]
    model.forward_only(inputs=SERVED_ROWS)
    with pytest.raises(ConfigurationError, match='calculate_loss is not taken by a model on several ranks'):
        model.calculate_loss()
    with background_server(tmp_path, 'tiny-qwen3') as (one_url, one_keys, _):
        one = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(one_url, one_keys['alice']))
        one.add_adapter_to_model('default', LORA, seed=5)
        one.set_optimizer('AdamW', lr=NATIVE_LR)
        on_one = native_losses(one, 3)
    assert on_group == pytest.approx(on_one, rel=TOL, abs=TOL)
    assert on_group[-1] < on_group[0]


def tinker_numbers(url: str, key: str) -> list[float]:
    """Three Tinker SDK steps (2 datums, clipping at 0.5): each step's loss:sum and gradient norm."""
    with tinker.ServiceClient(base_url=url, api_key=key) as service:  # its heartbeat stops with its session
        trainer = service.create_lora_training_client(base_model='tiny-qwen3', rank=4, seed=3).result()
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={'target_tokens': tokens[1:], 'weights': [1.0] * (len(tokens) - 1)},
            )
            for tokens in ([11, 23, 5, 42, 17, 8], [7, 19, 3, 88, 21])
        ]
        numbers = []
        for _ in range(3):
            output = trainer.forward_backward(data, 'cross_entropy').result()
            assert len(output.loss_fn_outputs) == 2
            step = trainer.optim_step(types.AdamParams(learning_rate=5e-2, grad_clip_norm=0.5)).result()
            numbers += [output.metrics['loss:sum'], step.metrics['grad_norm:mean']]
        reply = (
            trainer.save_weights_and_get_sampling_client()
            .result()
            .sample(types.ModelInput.from_ints([11, 23, 5]), 1, types.SamplingParams(max_tokens=3, temperature=0.0))
        )
        assert len(reply.result().sequences[0].tokens) == 3
    return numbers


@pytest.mark.integration
def test_a_tinker_sdk_client_trains_on_the_group_as_on_one_rank(served, tmp_path):
    url, keys, _ = served
    on_group = tinker_numbers(url, keys['bob'])
    with background_server(tmp_path, 'tiny-qwen3') as (one_url, one_keys, _):
        on_one = tinker_numbers(one_url, one_keys['bob'])
    # Each rank runs a Tinker request whole; rank 0's counts: the gradient norm is one rank's, not 2x.
    assert on_group == pytest.approx(on_one, rel=TOL, abs=TOL)
    assert on_group[4] < on_group[0]  # trained: the loss went down


@pytest.mark.integration
def test_a_killed_worker_fails_its_request_and_the_group_comes_back(served):
    url, keys, background = served
    service = background.app.state.service
    host = service.default.host
    model = MultiLoraTransformersModel('tiny-qwen3', client=TwinkleClient(url, keys['alice']))
    model.add_adapter_to_model('default', LORA, seed=9)
    model.set_optimizer('AdamW', lr=5e-2)
    native_losses(model, 2)
    model.save('before-the-crash', save_optimizer=True)
    model.forward_backward(inputs=SERVED_ROWS)
    model.clip_grad_and_step()  # a step after the save: answered, so its state was kept with its answer
    kept = model.forward_only(inputs=SERVED_ROWS).logps  # what the run reads from that state
    # Rank 1 is killed (as ``kill -9`` would) while the group is idle: the next call fails, saying why.
    victim = host.pids[1]
    os.kill(victim, signal.SIGKILL)
    held = service.default.scheduler.submit('probe', host.ping)
    assert held.wait(120) and held.status == 'failed'
    assert 'model worker rank 1 of 2 died (signal 9)' in str(held.error)
    # The other model keeps serving while this one is down.
    other = MultiLoraTransformersModel('small-qwen3', client=TwinkleClient(url, keys['bob']))
    other.add_adapter_to_model('default', LORA, seed=1)
    assert math.isfinite(other.forward_backward(inputs=SERVED_ROWS).loss)
    # The next request restarts the group; the run continues from its last answered step.
    again = model.forward_only(inputs=SERVED_ROWS).logps
    assert [v for row in again for v in row] == pytest.approx([v for row in kept for v in row], rel=TOL, abs=TOL)
    assert victim not in host.pids and len(host.pids) == 2
    restarts = service.store.history.restarts(service.default.name)
    assert [reason for reason, _ in restarts] == [str(held.error).split(';')[0]]
    metrics = httpx.get(f'{url}/metrics', headers={'X-API-Key': ADMIN_KEY}).text
    assert re.search(r'twinkle_model_restarts_total\{base_model="tiny-qwen3"\} 1\.0', metrics)


SEED_SERVER = """
import twinkle
from twinkle import DeviceGroup, DeviceMesh

device_groups = [
    DeviceGroup(name='model', ranks=2, device_type='cpu'),
    DeviceGroup(name='sampler', ranks=1, device_type='cpu'),
]

twinkle.initialize(mode='http', groups=device_groups, base_model='tiny-qwen3', port={port}, data_dir={data_dir!r})
"""


@pytest.mark.integration
def test_seed_003_server_script_and_client_loop(tmp_path):
    """Seed 003's ``server.py`` as written (no ``__main__`` guard: the model workers must not run
    it again), with two CPU ranks for the model and one for its sampler group, and its client
    loop: a sampler from the model id alone samples the base model, the run trains on what it
    sampled, a saved checkpoint's weights are sampled through their ``twinkle://`` path, and the
    run's own sampler samples them once synced."""
    port, data_dir = free_port(), tmp_path / 'data'
    script = tmp_path / 'server.py'
    script.write_text(SEED_SERVER.format(port=port, data_dir=str(data_dir)))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_healthy(process, port, timeout_s=180)
        key = add_key('tiny-qwen3', data_dir, 'alice')
        client = init_twinkle_client(base_url=f'http://127.0.0.1:{port}', api_key=key)
        assert client.health_check()
        model = MultiLoraTransformersModel(model_id='tiny-qwen3')
        model.add_adapter_to_model('default', LORA, seed=4)
        model.set_optimizer('AdamW', lr=5e-2)
        model.set_loss('GRPOLoss')
        sampler = vLLMSampler(model_id='tiny-qwen3')
        params = SamplingParams(max_tokens=4, temperature=1.0, num_samples=2, seed=11)
        prompts = [{'input_ids': [11, 23, 5, 42]}, {'input_ids': [7, 8, 9]}]
        losses = []
        for _ in range(3):
            responses = sampler.sample(inputs=prompts, sampling_params=params)
            batch = [seq.new_input_feature for response in responses for seq in response.sequences]
            assert len(batch) == 4 and all(len(row['input_ids']) > 3 for row in batch)
            advantages = [1.0, -1.0, 1.0, -1.0]
            losses.append(model.forward_backward(inputs=batch, advantages=advantages).loss)
            model.step()
        assert all(math.isfinite(loss) for loss in losses)
        path = model.save('step-3')
        saved = vLLMSampler(model_id='tiny-qwen3', model_path=path)
        greedy = SamplingParams(max_tokens=3, temperature=0.0)
        through_path = saved.sample(inputs=prompts[:1], sampling_params=greedy)[0].sequences[0].tokens
        # The sampler group sees the run as of its last sync: sync, then sample through the run.
        run_sampler = vLLMSampler(model=model)
        assert CheckpointEngineManager(model, run_sampler).sync_weights().weight_version == 3
        through_run = run_sampler.sample(inputs=prompts[:1], sampling_params=greedy)[0].sequences[0]
        assert through_path == through_run.tokens and len(through_path) == 3 and through_run.weight_version == 3
        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 0
    finally:
        process.kill()
        process.wait()


def test_the_base_dtype_is_configured_and_adapters_and_optimizer_stay_float32():
    config = ServerConfig(base_model=assets.tiny_model('tiny-qwen3'), device='cpu', dtype='bfloat16')
    host = ModelHost(config)
    host.add_adapter('a', {'r': 4, 'lora_alpha': 8, 'target_modules': 'all-linear'})
    host.run('a', 'set_optimizer', {'optimizer_cls': 'AdamW', 'lr': 1e-3})
    for _ in range(2):
        assert math.isfinite(host.run('a', 'forward_backward', {'inputs': rows(2, 1)})['loss'])
        host.run('a', 'clip_grad_and_step', {})
    group = host.model.groups['a']
    base = {p.dtype for name, p in host.model.model.named_parameters() if 'lora_' not in name}
    state = {v.dtype for s in group.optimizer.state.values() for v in s.values() if v.is_floating_point()}
    assert base == {torch.bfloat16}
    assert {p.dtype for p in group.params} == {torch.float32} and state == {torch.float32}
    assert base_dtype(ServerConfig(base_model='tiny-qwen3', device='cpu')) == torch.float32  # 'auto' on a CPU


def test_a_group_pins_each_rank_to_its_listed_gpu():
    assert gpu_env('cuda:2,3', 1) == {'CUDA_VISIBLE_DEVICES': '3', 'TWINKLE_RANK_DEVICE': '3'}
    assert gpu_env('cuda', 1) == {} and gpu_env('cpu', 0) == {}
    with pytest.raises(ConfigurationError, match="device 'cuda:0,1' lists 2 GPUs for 3 ranks"):
        ServerConfig.build(base_model='tiny-qwen3', device='cuda:0,1', ranks=3)
    with pytest.raises(ConfigurationError, match="device 'cuda:4,5' lists 2 GPUs for 1 ranks"):
        ServerConfig.build(base_model='tiny-qwen3', sampler={'ranks': 1, 'device': 'cuda:4,5'})
