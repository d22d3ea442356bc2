"""Metric sinks: a short training run's metrics written to TensorBoard, W&B (offline) and JSONL,
and read back with each library's own reader (W&B's from its offline run file)."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from peft import LoraConfig

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, DataError, MissingExtraError, UnknownNameError
from twinkle.metric import SINKS, MetricWriter
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """The history rows of a W&B run file, by step. The file is W&B's transaction log: a
    7-byte header (``:W&B``, magic, version) then LevelDB-log records (crc32, length, type) in
    32 KiB blocks, each a serialized ``wandb_internal_pb2.Record`` (wandb has no reader for it
    since its Go core took over)."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = run_file.read_bytes(), 32768, 7
    assert data[:4] == b':W&B', data[:7]
    position, pending, history = 7, b'', {}
    while position + header <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack('<IHB', data[position : position + header]) if left >= header else (0, 0, 0)
        if kind == 0:  # the padding at a block's end
            position += left
            continue
        pending += data[position + header : position + header + length]
        position += header + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b''
            if record.WhichOneof('record_type') == 'history':
                items = {
                    item.key or '/'.join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith('_')}
    return history


@pytest.fixture(scope='module')
def trained(tiny_model_dir, self_cognition_path, tmp_path_factory):
    """Six LoRA steps of SFT with every sink on; what calculate_metric returned, by step."""
    dataset = Dataset(dataset_meta=DatasetMeta(self_cognition_path, data_slice=range(24)))
    dataset.set_template('Template', model_id=tiny_model_dir, max_length=128)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community')).encode()
    model = TransformersModel(model_id=tiny_model_dir)
    model.add_adapter_to_model('default', LoraConfig(r=4, target_modules='all-linear'))
    model.set_optimizer(optimizer_cls='AdamW', lr=1e-3)
    log_dir = tmp_path_factory.mktemp('run') / 'sft'
    written: dict[int, dict[str, float]] = {}
    with MetricWriter(['tensorboard', 'wandb', 'jsonl'], log_dir, config={'lr': 1e-3, 'rank': 4}) as writer:
        for step, batch in enumerate(DataLoader(dataset, batch_size=4), start=1):
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            written[step] = model.calculate_metric(is_training=True)
            writer.write(written[step], step=step)
    return log_dir, written


@pytest.mark.integration
def test_tensorboard_reads_back_every_scalar_at_its_step(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir, written = trained
    events = EventAccumulator(str(log_dir / 'tensorboard'))
    events.Reload()
    assert set(events.Tags()['scalars']) == {f'train/{name}' for name in written[1]}
    for name in written[1]:
        scalars = events.Scalars(f'train/{name}')
        assert [s.step for s in scalars] == list(written)
        assert [s.value for s in scalars] == pytest.approx([written[step][name] for step in written], rel=1e-6)
    assert {'loss', 'lr', 'grad_norm'} <= set(written[1])


@pytest.mark.integration
def test_wandb_offline_run_file_holds_the_history(trained):
    log_dir, written = trained
    (run_file,) = (log_dir / 'wandb').glob('offline-run-*/run-*.wandb')
    history = wandb_history(run_file)
    assert sorted(history) == list(written)
    for step, values in written.items():
        assert history[step] == pytest.approx({f'train/{k}': v for k, v in values.items()}, rel=1e-9)


@pytest.mark.integration
def test_jsonl_holds_one_line_per_write(trained):
    log_dir, written = trained
    lines = [json.loads(line) for line in (log_dir / 'metrics.jsonl').read_text().splitlines()]
    assert [line.pop('step') for line in lines] == list(written)
    for line, values in zip(lines, written.values(), strict=True):
        assert line.pop('time') > 0
        assert line == pytest.approx({f'train/{k}': v for k, v in values.items()}, rel=1e-9)


def test_jsonl_writes_non_finite_values_as_strings_and_steps_must_rise(tmp_path):
    with MetricWriter('jsonl', tmp_path) as writer:
        writer.write({'loss': float('nan'), 'grad_norm': float('inf')}, step=1)
        writer.write({'loss': 2.0}, step=1, prefix='eval')  # another prefix keeps its own steps
        with pytest.raises(DataError, match='step 1 come after step 1'):
            writer.write({'loss': 1.0}, step=1)
        with pytest.raises(DataError, match="metric 'loss' must be a number; got str"):
            writer.write({'loss': 'low'}, step=2)
    first, second = (json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines())
    assert (first['train/loss'], first['train/grad_norm'], second['eval/loss']) == ('nan', 'inf', 2.0)
    with pytest.raises(ConfigurationError, match='closed'):
        writer.write({'loss': 1.0}, step=3)


def test_unknown_and_missing_sinks_are_refused(tmp_path):
    with pytest.raises(UnknownNameError, match=r"'mlflow'.*jsonl.*tensorboard.*wandb"):
        MetricWriter(['jsonl', 'mlflow'], tmp_path)
    with pytest.raises(ConfigurationError, match='at least one sink'):
        MetricWriter([], tmp_path)
    assert {'jsonl', 'tensorboard', 'wandb'} <= set(SINKS.names())


def test_a_sink_whose_library_is_missing_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, 'wandb', None)  # `import wandb` now raises ImportError
    with pytest.raises(MissingExtraError, match=r"the 'wandb' sink needs the wandb package .*twinkle-train\[logging\]"):
        MetricWriter(['jsonl', 'wandb'], tmp_path)
