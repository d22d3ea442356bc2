"""Idle adapters are saved and released from the model; the next request brings them back, and
training goes on as if nothing happened. A graceful restart does the same for every adapter."""

from __future__ import annotations

import time

import pytest
import torch
from peft import LoraConfig

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
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
        assert group.optim_step == 6
        assert group.consumed_train_samples == sum(len(batch) for batch in batches[:6])
    assert losses == pytest.approx(uninterrupted, abs=1e-6)


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
