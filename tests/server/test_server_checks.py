"""What a tenant's errors say, on a real server: optimizer and scheduler values refused at the
route (a 4xx naming the argument), a non-finite loss failing its request without touching the
adapter, and messages that name the tenant's own paths and runs, never the server's."""

from __future__ import annotations

import math

import pytest
from peft import LoraConfig
from server_helpers import background_server

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, DataError
from twinkle.model import TransformersModel
from twinkle.model.optim.registry import check_optimizer_args, check_scheduler_args
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('checks'), tiny_model_dir) as running:
        yield running


@pytest.fixture(scope='module')
def batch(tiny_model_dir, self_cognition_path) -> list[dict]:
    dataset = Dataset(DatasetMeta(self_cognition_path, data_slice=range(4)))
    dataset.set_template('Template', model_id=tiny_model_dir, max_length=128)
    dataset.map(SelfCognitionProcessor('twinkle model', 'ModelScope'))
    dataset.encode()
    return next(iter(DataLoader(dataset=dataset, batch_size=4)))


def lora(r: int) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules='all-linear', init_lora_weights=False)


# ---- optimizer and scheduler values ---------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize(
    ('operation', 'name', 'options', 'named'),
    [
        ('set_optimizer', 'AdamW', {'lr': -1}, 'lr=-1'),
        ('set_optimizer', 'AdamW', {'lr': 'fast'}, "lr='fast'"),
        ('set_optimizer', 'AdamW', {'betas': [0.9, 1.5]}, 'betas=[0.9, 1.5]'),
        ('set_optimizer', 'SGD', {'lr': 0.1, 'momentum': -0.5}, 'momentum=-0.5'),
        ('set_lr_scheduler', 'CosineWarmupScheduler', {'num_warmup_steps': -1}, 'num_warmup_steps=-1'),
        ('set_lr_scheduler', 'StepLR', {'step_size': 'x'}, "step_size='x'"),
    ],
)
def test_bad_optimizer_and_scheduler_values_are_a_4xx_at_the_route(server, operation, name, options, named):
    url, keys, _ = server
    model = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
    model.add_adapter_to_model('checked', lora(4))
    if operation == 'set_lr_scheduler':
        model.set_optimizer('AdamW', lr=1e-3)
    with pytest.raises(RemoteError) as error:
        getattr(model, operation)(name, **options)
    assert error.value.status == 400, str(error.value)  # before: 202, and a failed future later (status 200)
    assert named in str(error.value) and 'accept' in str(error.value), str(error.value)


def test_the_argument_checks_touch_no_model():
    check_optimizer_args('AdamW', {'lr': 1e-3, 'betas': [0.9, 0.95], 'weight_decay': 0.1})
    check_scheduler_args('CosineWarmupScheduler', {'num_warmup_steps': 2, 'num_training_steps': 10})
    with pytest.raises(ConfigurationError, match=r'optimizer AdamW does not accept eps=-1\.0.*eps: a number >= 0'):
        check_optimizer_args('AdamW', {'eps': -1.0})
    with pytest.raises(ConfigurationError, match=r"does not take \['nope'\]"):
        check_optimizer_args('AdamW', {'nope': 1})
    # Muon takes only matrices (as LoRA's A and B are): the check's parameter is one, so Muon passes ...
    check_optimizer_args('Muon', {'lr': 1e-3})
    # ... and an optimizer that refuses it whatever the arguments is not said to refuse an argument.
    with pytest.raises(ConfigurationError, match=r'SparseAdam\(lr=0\.001\) is refused \(RuntimeError'):
        check_optimizer_args('SparseAdam', {'lr': 1e-3})


# ---- a non-finite loss ----------------------------------------------------------------------------
def blow_up(model, batch: list[dict], **adapter) -> None:
    """One step at lr=1e30: the adapter's weights become infinite, every later loss NaN."""
    model.set_optimizer('SGD', lr=1e30, **adapter)
    model.set_loss('CrossEntropyLoss', **adapter)
    model.forward_backward(inputs=batch, **adapter)
    model.clip_grad_and_step(max_grad_norm=1e30, **adapter)


def test_a_non_finite_loss_fails_locally_and_nothing_is_accumulated(tiny_model_dir, batch):
    model = TransformersModel(tiny_model_dir, device='cpu')
    model.add_adapter_to_model('default', lora(4))
    model.add_metric('LossMetric')
    blow_up(model, batch)
    model.calculate_metric(is_training=True)  # reset the metrics
    group = model.groups['default']
    steps, samples = group.window.micro_step, group.window.consumed_train_samples
    with pytest.raises(DataError, match=r"loss of adapter 'default' is not finite \((nan|inf)\)"):
        model.forward_backward(inputs=batch)
    assert (group.window.micro_step, group.window.consumed_train_samples) == (steps, samples)
    assert all(p.grad is None for p in group.params)
    assert 'loss' not in model.calculate_metric(is_training=True)  # the metrics were fed nothing


@pytest.mark.integration
def test_a_non_finite_loss_fails_the_request_on_the_server(server, batch):
    url, keys, background = server
    model = MultiLoraTransformersModel(client=TwinkleClient(url, keys['bob']))
    run_id = model.add_adapter_to_model('exploding', lora(4))
    blow_up(model, batch)
    with pytest.raises(RemoteError, match=r'is not finite \((nan|inf)\)') as error:  # before: done, with loss null
        model.forward_backward(inputs=batch)
    assert error.value.category == 'user' and '--' not in str(error.value) and run_id in str(error.value)
    service = background.app.state.service
    group = service.default.host.model.groups[service.default.adapters[run_id]]
    assert all(p.grad is None for p in group.params)  # nothing accumulated from the failed request


# ---- tenant-visible names in errors ---------------------------------------------------------------
@pytest.mark.integration
def test_a_checkpoint_that_does_not_fit_names_the_twinkle_path_and_the_run(server):
    url, keys, background = server
    client = TwinkleClient(url, keys['alice'])
    source = MultiLoraTransformersModel(client=client)
    source.add_adapter_to_model('rank4', lora(4))
    path = source.save('small')
    target = MultiLoraTransformersModel(client=client)
    run_id = target.add_adapter_to_model('rank8', LoraConfig(r=8, target_modules=['q_proj']))
    with pytest.raises(RemoteError) as error:
        target.load(path)
    message = str(error.value)
    data_dir = background.app.state.service.config.data_dir
    assert path in message and run_id in message, message
    assert data_dir not in message and '--' not in message and 'checkpoints/tn-' not in message, message


@pytest.mark.integration
def test_errors_while_running_name_the_run_not_the_adapter(server, batch):
    url, keys, _ = server
    model = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
    run_id = model.add_adapter_to_model('unconfigured', lora(4))
    with pytest.raises(RemoteError) as error:
        model.set_lr_scheduler('LinearLR')  # no optimizer yet: the model names the adapter
    assert run_id in str(error.value) and '--' not in str(error.value), str(error.value)
    model.set_loss('CrossEntropyLoss')
    assert math.isfinite(model.forward_backward(inputs=batch).loss)  # the run goes on
