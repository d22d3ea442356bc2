"""Idle adapters are saved and released from the model; the next request brings them back, and
training goes on as if nothing happened. A graceful restart does the same for every adapter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from peft import LoraConfig

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError
from twinkle.model import TransformersModel
from twinkle.model.checkpoint import files as ckpt
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
from twinkle.server.execution.groups.run_files import OWNER, RELEASE_STATE, claim_memory, kept_state, release_memory
from twinkle.server.store import Store
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel


@pytest.fixture(scope='module')
def batches(tiny_model_dir, self_cognition_path) -> list[list[dict]]:
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(24)))
    dataset.set_template('Template', model_id=tiny_model_dir, max_length=128)
    dataset.map(SelfCognitionProcessor('twinkle model', 'ModelScope'))
    dataset.encode()
    return list(DataLoader(dataset=dataset, batch_size=4))


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules='all-linear', init_lora_weights=False)


def setup(model) -> None:
    model.set_optimizer('AdamW', lr=1e-2)
    model.set_lr_scheduler('CosineWarmupScheduler', num_warmup_steps=2, num_training_steps=6)
    model.set_loss('CrossEntropyLoss')


def steps(model, batches: list) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(model.forward_backward(inputs=batch).loss)
        model.clip_grad_and_step()
    return losses


@pytest.fixture(scope='module')
def uninterrupted(tiny_model_dir, batches) -> list[float]:
    model = TransformersModel(tiny_model_dir, device='cpu')
    torch.manual_seed(5)
    model.add_adapter_to_model('default', lora())
    setup(model)
    return steps(model, batches[:6])


def config_for(tiny_model_dir: str, data_dir, **kwargs) -> ServerConfig:
    return ServerConfig.build(base_model=tiny_model_dir, port=0, data_dir=str(data_dir), device='cpu', **kwargs)


def add_key(config: ServerConfig) -> str:
    with Store(config.db_path) as store:
        return store.tenants.add('alice')[1]


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, 'timed out'
        time.sleep(0.05)


@pytest.mark.integration
def test_an_idle_adapter_is_released_and_comes_back_unchanged(tmp_path, tiny_model_dir, batches, uninterrupted):
    config = config_for(tiny_model_dir, tmp_path, idle_release_s=0.3)
    key = add_key(config)
    server = BackgroundServer(config)
    with server as url:
        client = TwinkleClient(url, key)
        model = MultiLoraTransformersModel(client=client)
        model.add_adapter_to_model('default', lora(), seed=5)
        setup(model)
        losses = steps(model, batches[:3])
        host = server.app.state.service.default.host
        wait_until(lambda: client.list_training_runs()[0].status == 'released')
        assert host.model.adapter_names == []  # the weights left the model
        losses += steps(model, batches[3:6])  # the first call brings the adapter back
        group = host.model.groups[server.app.state.service.default.adapters[model.runs['default']]]
        # One optimizer step per batch (accumulation 1): 3 restored from the released state (the
        # model's restore_counters), 3 after; every row of the 6 batches counted once.
        assert group.window.optim_step == 6
        assert group.window.consumed_train_samples == sum(len(batch) for batch in batches[:6])
    assert losses == pytest.approx(uninterrupted, abs=1e-6)


@pytest.mark.integration
def test_a_graceful_restart_keeps_every_adapter(tmp_path, tiny_model_dir, batches, uninterrupted):
    config = config_for(tiny_model_dir, tmp_path)
    key = add_key(config)
    with BackgroundServer(config) as url:
        model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
        run_id = model.add_adapter_to_model('default', lora(), seed=5)
        setup(model)
        losses = steps(model, batches[:3])
    with BackgroundServer(config) as url:  # same data directory, a new process state
        model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
        model.attach(run_id)
        losses += steps(model, batches[3:6])
    assert losses == pytest.approx(uninterrupted, abs=1e-6)


# ---- released states in host memory, then on disk -------------------------------------------------
def state_bytes(tiny_model_dir: str, batches: list, tmp_path) -> int:
    """The bytes of one run's released state after a step (the size every run here has)."""
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('default', lora())
    setup(model)
    steps(model, batches[:1])
    return ckpt.folder_size(model.save('state', str(tmp_path), save_optimizer=True))


def step_of(state) -> int:
    return int(ckpt.read_trainer_state(state)['optim_step'])


def where_kept(service, run_id: str) -> tuple[str, int]:
    """Where the run's committed kept state is ('memory' or 'disk') and its optimizer step."""
    config, store = service.config, service.store
    named = store.states.get(run_id)
    assert named is not None and named.folder is not None
    path = kept_state(config, store.runs.by_id(run_id), named.folder)
    assert path is not None
    return ('memory' if path.is_relative_to(config.memory_dir) else 'disk'), step_of(path)


@pytest.mark.integration
def test_kept_states_tier_between_host_memory_and_disk(tmp_path, tiny_model_dir, batches, uninterrupted):
    """One adapter on the model and two states' room in host memory: a run's state is kept in memory
    after each step and at its release, and comes back from there; pushed out by three other runs'
    states, it goes to disk (off the requests' path) and comes back from there, each time exact (the
    losses of an uninterrupted run, 1e-6); only the committed state of a run is kept; a graceful stop
    moves memory to disk."""
    budget = int(2.5 * state_bytes(tiny_model_dir, batches, tmp_path / 'one'))
    config = config_for(tiny_model_dir, tmp_path / 'data', limits={'max_adapters': 1}, memory_state_bytes=budget)
    memory_root = config.memory_dir
    if memory_root is None:
        pytest.skip('no /dev/shm here')
    key = add_key(config)
    server = BackgroundServer(config)
    with server as url:
        client = TwinkleClient(url, key)
        model = MultiLoraTransformersModel(client=client)
        run_id = model.add_adapter_to_model('default', lora(), seed=5)
        setup(model)
        service = server.app.state.service
        pool = service.default.pool
        losses = steps(model, batches[:2])
        assert where_kept(service, run_id) == ('memory', 2)  # kept with each step's answer
        others = MultiLoraTransformersModel(client=client)

        def another(name: str) -> None:  # a run of one step: it takes the model's one place
            others.add_adapter_to_model(name, lora(), seed=1)
            others.set_optimizer('AdamW', lr=1e-2, adapter_name=name)
            others.forward_backward(inputs=batches[0], adapter_name=name)
            others.clip_grad_and_step(adapter_name=name)

        another('y')
        assert where_kept(service, run_id) == ('memory', 2) and run_id not in service.default.adapters
        losses += steps(model, batches[2:4])  # back from memory
        assert where_kept(service, run_id) == ('memory', 4)
        run_dirs = [memory_root / service.store.runs.by_id(run_id).tenant_id / run_id]
        run_dirs.append(config.checkpoint_dir / service.store.runs.by_id(run_id).tenant_id / run_id)
        assert len([f for d in run_dirs if d.is_dir() for f in d.glob('state@*')]) == 1  # the older ones deleted
        for name in ('z', 'w', 'v'):  # each run's states push the least recently kept to disk
            another(name)
        # the spill thread moves them, off the requests' path
        wait_until(lambda: where_kept(service, run_id) == ('disk', 4))
        wait_until(lambda: sum(size for _, _, size in pool.in_memory.values()) <= budget)
        losses += steps(model, batches[4:6])  # back from disk
    assert losses == pytest.approx(uninterrupted, abs=1e-6)
    # the graceful stop released every run to disk and emptied memory
    assert not any(memory_root.glob('*/*/state@*'))
    with Store(config.db_path) as store:
        for run in (run_id, *others.runs.values()):
            kept = store.states.get(run)
            assert kept is not None and kept.folder is not None
            tenant = store.runs.by_id(run).tenant_id
            assert (config.checkpoint_dir / tenant / run / kept.folder / 'optimizer.pt').is_file()


HOLD_LOCK = """
import fcntl, sys, time
handle = open(sys.argv[1], 'a+')
fcntl.flock(handle, fcntl.LOCK_EX)
print('locked', flush=True)
time.sleep(600)
"""


@pytest.mark.integration
def test_states_a_dead_server_left_in_memory_are_moved_to_disk_at_start(tmp_path):
    """A killed server's kept states outlive it in host memory: the next start moves them to disk
    whole (where its runs come back from) and empties memory; a half-written one is dropped; an older
    server's ``released-state`` replaces the one on disk only if newer. Memory folders of data
    directories that are gone are removed, unless their server runs (holds the folder's lock)."""
    config = ServerConfig.build(base_model='unused', data_dir=str(tmp_path / 'data'))
    root = config.memory_dir
    if root is None:
        pytest.skip('no /dev/shm here')
    kept, half = root / 'tenant' / 'run-1' / 'state@0123456789ab', root / 'tenant' / 'run-2' / 'state@0123456789ac'
    for folder in (kept, half):
        folder.mkdir(parents=True)
        (folder / 'adapter_model.safetensors').write_bytes(b'weights')
    (kept / 'trainer_state.json').write_text('{"optim_step": 3}')
    stale = root / 'tenant' / 'run-3' / RELEASE_STATE  # an older server's; its run saved step 5 on disk since
    newer = config.checkpoint_dir / 'tenant' / 'run-3' / RELEASE_STATE
    for folder, step in ((stale, 3), (newer, 5)):
        folder.mkdir(parents=True)
        (folder / 'trainer_state.json').write_text(f'{{"optim_step": {step}}}')
    orphan, running = root.parent / 'twinkle-orphan-of-a-test', root.parent / 'twinkle-running-elsewhere'
    for folder in (orphan, running):
        folder.mkdir(exist_ok=True)
        (folder / OWNER).write_text(str(tmp_path / 'gone'))
    holder = subprocess.Popen(  # another process's server: it holds its folder's lock
        [sys.executable, '-c', HOLD_LOCK, str(running / OWNER)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == 'locked'
        assert claim_memory(config) == 1
        disk = config.checkpoint_dir / 'tenant' / 'run-1' / kept.name
        assert (disk / 'trainer_state.json').read_text() == '{"optim_step": 3}'
        assert (disk / 'adapter_model.safetensors').read_bytes() == b'weights'
        assert not (config.checkpoint_dir / 'tenant' / 'run-2').exists()
        assert step_of(newer) == 5
        assert [p.name for p in root.iterdir()] == [OWNER] and not orphan.exists() and running.exists()
        claim = (
            f'from twinkle.server.config import ServerConfig as C; from {claim_memory.__module__} import '
            f"claim_memory; claim_memory(C.build(base_model='unused', data_dir={config.data_dir!r}))"
        )
        second = subprocess.run([sys.executable, '-c', claim], capture_output=True, text=True, timeout=120)
        assert second.returncode != 0 and 'another server of data_dir' in second.stderr  # one server owns it
    finally:
        holder.kill()
        holder.wait()
        release_memory(config)
        for folder in (root, orphan, running):
            shutil.rmtree(folder, ignore_errors=True)


def test_the_memory_folder_is_this_users_alone_and_one_of_another_user_is_refused(tmp_path):
    """Every tenant's latest state is in the memory folder, whose name anyone can work out in a place anyone may
    write (``/dev/shm``): the server makes it 0700 (one of its own left 0755 too), and refuses one another user made."""
    config = ServerConfig.build(base_model='unused', data_dir=str(tmp_path / 'data'))
    root = config.memory_dir
    if root is None:
        pytest.skip('no /dev/shm here')
    try:
        root.mkdir(mode=0o755)
        root.chmod(0o755)
        claim_memory(config)
        assert root.stat().st_mode & 0o777 == 0o700
        release_memory(config)
        if os.geteuid() != 0:
            return  # only root can make a folder another user owns
        shutil.rmtree(root, ignore_errors=True)  # release removed it if nothing was left in it
        root.mkdir()
        os.chown(root, 65534, 65534)
        with pytest.raises(ConfigurationError, match=r'is not a folder of this user .*memory_state_dir'):
            claim_memory(config)
    finally:
        release_memory(config)
        shutil.rmtree(root, ignore_errors=True)
