"""Ray mode on a real local Ray (2 CPUs): components built with ``remote_group=`` are one actor
per rank; dispatch and collect as each class declares; lazy results; the GRPO pieces (model and
sampler on two groups, synced by CheckpointEngineManager); two model ranks training exactly as
one process; errors that name what went wrong; and a script joining a cluster from ``ray start``.
"""

from __future__ import annotations

import doctest
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from server_helpers import free_port

import twinkle
from twinkle import DeviceGroup, DeviceMesh, assets
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.dataloader import DataLoader
from twinkle.errors import ConfigurationError, DataError, StateError, WorkerError
from twinkle.infra.ray import dispatch, hook, remote_class
from twinkle.infra.ray.cluster import LOCAL_SYSTEM_CONFIG
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ray = pytest.importorskip('ray')

from twinkle.infra.ray.proxy import LazyResult, RemoteComponent  # noqa: E402


class Shard:
    """A toy component: each rank reports who it is (from the torchrun environment) and what it got."""

    def __init__(self, scale: int = 1):
        self.scale = scale
        self.uneven = False  # rank r yields r more items than rank 0

    def rank(self) -> int:
        return int(os.environ['RANK'])

    def env(self) -> dict[str, str]:
        names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')
        return {name: os.environ[name] for name in names}

    def scaled(self, rows: list[int], weights: list[int] | None = None) -> list[int]:
        return [r * self.scale * (w if weights else 1) for r, w in zip(rows, weights or rows, strict=True)]

    def total(self, rows: list[int]) -> float:
        return float(sum(rows))

    def stats(self) -> dict[str, float]:
        return {'rank': float(self.rank()), 'scale': float(self.scale)}

    def fail(self) -> None:
        raise DataError('row 3 is malformed')

    def die_on(self, rank: int) -> None:
        """Rank ``rank`` exits; the others wait as if for it in a collective."""
        if self.rank() == rank:
            os._exit(1)
        time.sleep(60)

    def __iter__(self):
        for step in range(3 + (self.rank() if self.uneven else 0)):
            yield [10 * step + self.rank()]


remote_class(
    Shard,
    {
        'rank': ('all', 'list'),
        'env': ('all', 'list'),
        'scaled': ('slice_dp', 'flatten'),
        'total': ('slice_dp', 'mean'),
        'stats': ('all', 'mean'),
        '__iter__': ('all', 'flatten'),
    },
)
LORA = LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)
CPU = 'cpu'


@pytest.fixture(scope='module', autouse=True)
def local_ray():
    """One small Ray for the module; the actors import this test module by value (it is not on their path)."""
    ray.init(
        address='local', num_cpus=2, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_SYSTEM_CONFIG
    )
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    twinkle.initialize(mode='local', seed=None)
    ray.shutdown()


def ray_mode(*groups: DeviceGroup, lazy: bool = False) -> twinkle.infra.Runtime:
    return twinkle.initialize(mode='ray', groups=list(groups), lazy_collect=lazy, seed=0)


# ---- dispatch and collect, pure -------------------------------------------------------------------
def test_dispatch_rules_by_hand():
    twinkle.initialize(mode='local', seed=None)  # the hook's doctest builds its example here
    assert doctest.testmod(dispatch).failed == 0 and doctest.testmod(hook).failed == 0
    # 5 rows over 2 data ranks: shards of 3 and 2; per-row loss inputs cut alike, scalars kept.
    args, kwargs = dispatch.slice_inputs(([1, 2, 3, 4, 5],), {'adv': [5, 4, 3, 2, 1], 'mbs': 2}, data_rank=1, dp_size=2)
    assert args == ([4, 5],) and kwargs == {'adv': [2, 1], 'mbs': 2}
    with pytest.raises(DataError, match='1 rows cannot be split over 2'):
        dispatch.slice_inputs(([1],), {}, data_rank=0, dp_size=2)
    assert dispatch.COLLECTS['mean']([{'loss': 1.0}, {'loss': 3.0}]) == {'loss': 2.0}
    assert dispatch.COLLECTS['flatten']([[1], (2, 3)]) == [1, 2, 3]
    with pytest.raises(ConfigurationError, match="Invalid collect 'sum'"):
        dispatch.Dispatch('all', 'sum')
    with pytest.raises(KeyError, match="Unknown method of Other 'nope'"):
        remote_class(type('Other', (), {}), {'nope': ('all', 'first')})


# ---- a toy component on 2 ranks -----------------------------------------------------------------
def test_each_rank_is_an_actor_with_the_torchrun_environment():
    ray_mode(DeviceGroup('toy', 2, CPU))
    shard = Shard(3, remote_group='toy')
    assert isinstance(shard, RemoteComponent) and len(shard.remote_actors) == 2
    assert shard.rank() == [0, 1]  # collect='list'
    env = shard.env()
    assert [e['RANK'] for e in env] == ['0', '1'] and {e['WORLD_SIZE'] for e in env} == {'2'}
    assert [e['LOCAL_RANK'] for e in env] == ['0', '1']  # one node
    assert env[0]['MASTER_ADDR'] == env[1]['MASTER_ADDR'] and env[0]['MASTER_PORT'] == env[1]['MASTER_PORT']
    # Without remote_group it is built here, as in local mode.
    assert type(Shard(3)) is Shard


def test_methods_dispatch_and_collect_as_declared():
    ray_mode(DeviceGroup('toy', 2, CPU))
    shard = Shard(3, remote_group='toy')
    # slice_dp + flatten: rank 0 gets rows [1, 2, 3] (weights [1, 1, 1]), rank 1 rows [4, 5]
    # (weights [1, 10]); each multiplies by scale 3; concatenated in rank order.
    assert shard.scaled([1, 2, 3, 4, 5], weights=[1, 1, 1, 1, 10]) == [3, 6, 9, 12, 150]
    assert shard.total([1, 2, 3, 4]) == (3 + 7) / 2  # slice_dp + mean: sum([1, 2]), sum([3, 4])
    assert shard.stats() == {'rank': 0.5, 'scale': 3.0}  # all + mean, key by key
    assert shard.scale == 3  # an attribute: rank 0's
    shard.scale = 5  # set on every rank
    assert shard.scaled([1, 2]) == [5, 10]
    assert list(shard) == [[0, 1], [10, 11], [20, 21]]  # each step's items flattened over the ranks
    shard.uneven = True
    with pytest.raises(StateError, match=r'Shard ranks \[0\] ran out of items while the others had more'):
        list(shard)
    with pytest.raises(DataError, match='row 3 is malformed'):  # the component's own error type
        shard.fail()
    with pytest.raises(TypeError, match='has no __len__'):
        len(shard)


def test_a_mesh_decides_the_data_shards():
    ray_mode(DeviceGroup('toy', 2, CPU))
    # tp=2: both ranks read the same (one) data shard; flatten keeps one copy, 'list' sees both.
    shard = Shard(device_mesh=DeviceMesh.from_sizes(tp_size=2, device_type=CPU), remote_group='toy')
    assert shard.scaled([1, 2, 3]) == [1, 2, 3] and shard.rank() == [0, 1]
    with pytest.raises(ConfigurationError, match="world_size 4 but device group 'toy' has 2 worker"):
        Shard(device_mesh=DeviceMesh.from_sizes(dp_size=4, device_type=CPU), remote_group='toy')


def test_lazy_results_stay_in_the_object_store_until_used():
    ray_mode(DeviceGroup('toy', 2, CPU), lazy=True)
    producer, consumer = Shard(2, remote_group='toy'), Shard(1, remote_group='toy')
    rows = producer.scaled([1, 2, 3, 4])
    assert isinstance(rows, LazyResult)
    # Handed to another component, the actors fetch the shards themselves: the driver never does.
    total = consumer.total(rows)  # flatten [2, 4, 6, 8], re-sliced: mean(2 + 4, 6 + 8)
    assert isinstance(total, LazyResult) and not rows._call.fetched
    assert float(total) == 10.0 and not rows._call.fetched
    assert rows == [2, 4, 6, 8] and len(rows) == 4 and rows[1] == 4  # used here: fetched now
    # A failure whose result was dropped unused is raised at the next call on that component.
    failed = producer.fail()
    while not failed.done():
        time.sleep(0.01)
    del failed
    with pytest.raises(DataError, match='row 3 is malformed'):
        producer.rank()
    assert producer.rank() == [0, 1]  # raised once


# ---- errors -------------------------------------------------------------------------------------
def test_unknown_group_lists_the_groups_and_too_many_ranks_fail_before_any_actor():
    ray_mode(DeviceGroup('toy', 1, CPU), DeviceGroup('other', 1, CPU))
    with pytest.raises(
        ConfigurationError, match=r"Invalid device group 'nope'. Accepted values are: \['other', 'toy'\]"
    ):
        Shard(remote_group='nope')
    with pytest.raises(ConfigurationError, match=r"need 3 CPU \('model': 2, 'sampler': 1\) but the Ray cluster has 2"):
        ray_mode(DeviceGroup('model', 2, CPU), DeviceGroup('sampler', 1, CPU))
    with pytest.raises(ConfigurationError, match=r'need 1 GPU .* but the Ray cluster has 0'):
        ray_mode(DeviceGroup('model', 1, 'GPU'))
    assert twinkle.get_runtime().mode == 'local'
    reserved = [pg for pg in ray.util.placement_group_table().values() if pg['state'] != 'REMOVED']
    assert reserved == []  # nothing held: the earlier runtime's devices were given back too


def kill_and_wait(actor) -> None:
    """``ray.kill`` returns before the actor is gone: wait until a call to it fails."""
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.1)
    raise AssertionError('the killed actor still answers after 30 s')


def test_a_dead_worker_is_an_error_naming_component_and_rank_not_a_hang():
    ray_mode(DeviceGroup('toy', 2, CPU))
    shard = Shard(remote_group='toy')
    kill_and_wait(shard.remote_actors[1])
    with pytest.raises(WorkerError, match=r"Shard rank 1 \(device group 'toy'\) died during rank"):
        shard.rank()
    # Rank 1 dies mid-call while rank 0 waits (as in a collective): the error comes at once.
    waiting = Shard(remote_group='toy')
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"Shard rank 1 \(device group 'toy'\) died during die_on"):
        waiting.die_on(1)
    assert time.monotonic() - started < 30
    ray.kill(waiting.remote_actors[0])


# ---- the real components ------------------------------------------------------------------------
def completion_logps(model, features: list[dict]) -> list[list[float]]:
    logps = model.forward_only(inputs=features).logps
    return [
        logps[i, : len(f['labels'])][torch.tensor(f['completion_mask']).bool()].tolist() for i, f in enumerate(features)
    ]


PROMPTS = [
    {'messages': [{'role': 'user', 'content': 'What is your name?'}]},
    {'messages': [{'role': 'user', 'content': 'Name three fruits'}]},
    {'messages': [{'role': 'user', 'content': 'hi'}]},
    {'messages': [{'role': 'user', 'content': 'Count to five'}]},
]


def prompts() -> list[dict]:
    return PROMPTS


def test_grpo_pieces_model_and_sampler_on_two_groups(tiny_model_dir):
    ray_mode(DeviceGroup('model', 1, CPU), DeviceGroup('sampler', 1, CPU))  # lazy_collect=False, as the seed
    model = TransformersModel(model_id=tiny_model_dir, remote_group='model')
    sampler = TorchSampler(tiny_model_dir, remote_group='sampler')
    loader = DataLoader(dataset=prompts, batch_size=2, remote_group='model')
    model.add_adapter_to_model('default', LORA)
    model.set_optimizer('AdamW', lr=1e-2)
    model.set_loss('GRPOLoss', epsilon=0.2)
    manager = CheckpointEngineManager(model=model, sampler=sampler)
    params = SamplingParams(max_tokens=6, seed=0, ignore_eos=True, logprobs=1)
    for step, batch in enumerate(loader):
        assert manager.sync_weights(merge_and_sync=step == 0).weight_version == step + 1
        sequences = [s for r in sampler.sample(batch * 2, params) for s in r.sequences]
        assert {s.weight_version for s in sequences} == {step + 1}
        features = [s.new_input_feature for s in sequences]
        # After the sync (merged, then the adapter after a step) the sampler is the trainer.
        for seq, logps in zip(sequences, completion_logps(model, features), strict=True):
            assert seq.token_logprobs == pytest.approx(logps, abs=1e-5)
        old = [s.token_logprobs for s in sequences]
        out = model.forward_backward(inputs=features, old_logps=old, advantages=[1.0, -1.0, 0.5, -0.5])
        assert out.loss is not None and model.clip_grad_and_step() is not None
    assert step == 1 and sampler.weight_version == 2


def train_default_adapter(model, loader, lr: float) -> list[float]:
    """A LoRA adapter 'default' trained over every batch of ``loader``; the losses."""
    model.add_adapter_to_model('default', LORA)
    model.set_optimizer('AdamW', lr=lr)
    losses = []
    for batch in loader:
        losses.append(float(model.forward_backward(inputs=batch).loss))
        model.clip_grad_and_step()
    return losses


def test_two_model_ranks_train_exactly_as_one_process(tiny_model_dir):
    rows = [{'input_ids': [(3 * i + 7 * j) % 300 + 20 for j in range(6 + i % 3)]} for i in range(8)]
    for row in rows:
        row['labels'] = [*row['input_ids'][1:], -100]

    twinkle.initialize(mode='local', seed=0)
    expected = train_default_adapter(TransformersModel(tiny_model_dir), DataLoader(rows, batch_size=4), lr=1e-2)
    ray_mode(DeviceGroup('model', 2, CPU), lazy=True)
    mesh = DeviceMesh.from_sizes(dp_size=2, device_type=CPU)
    model = TransformersModel(model_id=tiny_model_dir, device_mesh=mesh, remote_group='model')
    loader = DataLoader(rows, batch_size=4, device_mesh=mesh, remote_group='model')
    # Each rank's loader yields its half of the global batch; they go to the model's ranks lazily.
    assert train_default_adapter(model, loader, lr=1e-2) == pytest.approx(expected, abs=1e-5)
    assert 'data parallel over' in model.get_train_configs()


def test_two_model_ranks_holding_half_the_experts_each_train_as_one_process():
    """Expert parallel in the model group: each of two Ray ranks keeps 4 of tiny-qwen3-moe's 8
    experts and sends tokens to the other's experts; the adapter (on the experts too) trains as
    in one process."""
    moe = assets.tiny_model('tiny-qwen3-moe')
    rows = [{'input_ids': [(5 * i + 11 * j) % 3000 + 20 for j in range(5 + 2 * i)]} for i in range(8)]
    for row in rows:
        row['labels'] = [-100, *row['input_ids'][1:]]

    twinkle.initialize(mode='local', seed=0)
    local = TransformersModel(moe, router_aux_loss_coef=0.0)
    expected = train_default_adapter(local, DataLoader(rows, batch_size=4), lr=1e-3)
    ray_mode(DeviceGroup('model', 2, CPU), lazy=True)
    mesh = DeviceMesh.from_sizes(dp_size=2, ep_size=2, device_type=CPU)
    model = TransformersModel(model_id=moe, device_mesh=mesh, remote_group='model', router_aux_loss_coef=0.0)
    loader = DataLoader(rows, batch_size=4, device_mesh=mesh, remote_group='model')
    assert train_default_adapter(model, loader, lr=1e-3) == pytest.approx(expected, rel=1e-5)
    assert 'data parallel, experts split over 2 ranks, over' in model.get_train_configs()


# ---- an existing cluster ------------------------------------------------------------------------
SCRIPT = """
import os, ray, twinkle
from twinkle import DeviceGroup
from twinkle.infra.ray import remote_class

class Where:
    def pid(self):
        return os.getpid()

remote_class(Where)
twinkle.initialize(mode='ray', groups=[DeviceGroup('g', 2, 'cpu')], lazy_collect=False)
print('GCS', ray.get_runtime_context().gcs_address, 'CPU', int(ray.cluster_resources()['CPU']))
print('PID', Where(remote_group='g').pid() != os.getpid())
"""


def test_a_script_joins_the_cluster_that_RAY_ADDRESS_names(tmp_path):
    ray_cli = Path(sys.executable).with_name('ray')
    if not ray_cli.exists():
        pytest.skip('the ray command line is not installed')
    port, temp_dir = free_port(), tempfile.mkdtemp(prefix='tw-ray-', dir='/tmp')  # short: Ray's socket paths
    # A token of this test's own; no drain on SIGTERM, so the head stops at once.
    env = {**os.environ, 'RAY_AUTH_MODE': 'token', 'RAY_AUTH_TOKEN': secrets.token_hex(16)}
    env['RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S'] = '0'
    command = [str(ray_cli), 'start', '--head', '--block', f'--port={port}', '--node-ip-address=127.0.0.1']
    command += ['--num-cpus=2', '--include-dashboard=false', '--disable-usage-stats', f'--temp-dir={temp_dir}']
    log = tmp_path / 'head.log'
    with log.open('wb') as out:
        head = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while 'Ray runtime started' not in log.read_text(errors='replace'):
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        script = tmp_path / 'script.py'
        script.write_text(textwrap.dedent(SCRIPT))
        run = subprocess.run(
            [sys.executable, str(script)],
            env={**env, 'RAY_ADDRESS': f'127.0.0.1:{port}'},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert f':{port} CPU 2' in run.stdout and 'PID True' in run.stdout, run.stdout
    finally:
        head.terminate()
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)
