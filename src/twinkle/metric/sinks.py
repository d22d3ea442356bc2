"""Where a training loop's metrics go: TensorBoard, Weights & Biases, a JSONL file, several at once.

A sink takes what ``calculate_metric`` returns, with its step number; ``MetricWriter`` fans it out
to the sinks chosen by name (``SINKS``), each writing under one run folder::

    writer = MetricWriter(['tensorboard', 'jsonl'], log_dir='runs/sft', config=vars(args))
    for step, batch in enumerate(dataloader):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        writer.write(model.calculate_metric(), step=step)            # train/loss, train/lr, ...
    writer.write(evaluate(model, eval_set), step=step, prefix='eval')
    writer.close()

- ``tensorboard``: event files under ``log_dir/tensorboard`` (the ``tensorboard`` package's own
  writer, through ``torch.utils.tensorboard``); ``tensorboard --logdir runs`` shows them.
- ``wandb``: a Weights & Biases run under ``log_dir/wandb``. Offline unless ``WANDB_MODE`` says
  otherwise: it needs no network, and ``wandb sync`` uploads it later.
- ``jsonl``: ``log_dir/metrics.jsonl``, one ``{"step": .., "time": .., name: value}`` line per
  write, flushed at once (a crash loses nothing written).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from twinkle.errors import ConfigurationError, DataError, MissingExtraError
from twinkle.registry import Registry


class MetricSink:
    """One destination of metrics, opened on a run folder."""

    def __init__(self, log_dir: Path, run_name: str, config: Mapping[str, Any]):
        self.log_dir, self.run_name, self.config = log_dir, run_name, dict(config)

    def write(self, values: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release the sink; writing after it is an error."""


SINKS: Registry[MetricSink] = Registry('metric sink')


@SINKS.register(name='jsonl')
class JsonlSink(MetricSink):
    """``metrics.jsonl`` in the run folder, appended to (a resumed run goes on in the same file)."""

    def __init__(self, log_dir: Path, run_name: str, config: Mapping[str, Any]):
        super().__init__(log_dir, run_name, config)
        self.path = log_dir / 'metrics.jsonl'
        self._file = self.path.open('a', encoding='utf-8')

    def write(self, values: Mapping[str, float], step: int) -> None:
        line = {'step': step, 'time': round(time.time(), 3), **{k: _json_number(v) for k, v in values.items()}}
        self._file.write(json.dumps(line) + '\n')
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@SINKS.register(name='tensorboard')
class TensorBoardSink(MetricSink):
    """Scalars in TensorBoard event files under ``tensorboard/`` in the run folder."""

    def __init__(self, log_dir: Path, run_name: str, config: Mapping[str, Any]):
        super().__init__(log_dir, run_name, config)
        tensorboard = _library('tensorboard', 'torch.utils.tensorboard')
        self._writer = tensorboard.SummaryWriter(log_dir=str(log_dir / 'tensorboard'))
        if self.config:
            self._writer.add_text('config', f'```\n{json.dumps(self.config, indent=2, default=str)}\n```', 0)

    def write(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@SINKS.register(name='wandb')
class WandbSink(MetricSink):
    """A Weights & Biases run in ``wandb/`` under the run folder, in project ``WANDB_PROJECT``
    (default ``twinkle``); offline unless ``WANDB_MODE`` says otherwise (``online`` with a login)."""

    def __init__(self, log_dir: Path, run_name: str, config: Mapping[str, Any]):
        super().__init__(log_dir, run_name, config)
        wandb = _library('wandb', 'wandb')
        self._run = wandb.init(
            dir=str(log_dir),
            project=os.environ.get('WANDB_PROJECT', 'twinkle'),
            name=run_name,
            config=self.config,
            mode=os.environ.get('WANDB_MODE', 'offline'),
            reinit='create_new',
        )

    def write(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class MetricWriter:
    """Metrics to several sinks at once, by name: ``'tensorboard'``, ``'wandb'``, ``'jsonl'``
    (``SINKS.names()``), or ``MetricSink`` subclasses. ``log_dir`` is the run's folder (made if
    missing); ``config`` (the run's settings) goes to the sinks that record one.

    ``write(values, step, prefix='train')`` sends ``{f'{prefix}/{name}': value}``. Steps of one
    prefix must rise: a step written twice or going back is refused, as the sinks would
    otherwise drop or misplace it. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        sinks: str | Iterable[str | type[MetricSink]],
        log_dir: str | Path,
        *,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ):
        names = [sinks] if isinstance(sinks, str) else list(sinks)
        if not names:
            raise ConfigurationError(f'MetricWriter needs at least one sink; the sinks are {SINKS.names()}')
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name or self.log_dir.name
        classes = [SINKS.get(name) if isinstance(name, str) else name for name in names]
        self.sinks: list[MetricSink] = []
        try:
            for cls in classes:
                self.sinks.append(cls(self.log_dir, self.run_name, dict(config or {})))
        except BaseException:
            self.close()
            raise
        self._last_step: dict[str, int] = {}

    def write(self, values: Mapping[str, float], step: int, prefix: str = 'train') -> None:
        if not self.sinks:
            raise ConfigurationError('this MetricWriter is closed')
        last = self._last_step.get(prefix)
        if last is not None and step <= last:
            raise DataError(f'{prefix!r} metrics for step {step} come after step {last}; steps must rise')
        self._last_step[prefix] = step
        named = {f'{prefix}/{name}' if prefix else name: _number(name, value) for name, value in values.items()}
        for sink in self.sinks:
            sink.write(named, step)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def add_sink_arguments(parser: argparse.ArgumentParser, log_dir: str) -> None:
    """``--report-to SINK [SINK ...]`` (default ``jsonl``) and ``--log-dir`` (default ``log_dir``),
    the flags a training script takes for ``MetricWriter(args.report_to, args.log_dir)``."""
    parser.add_argument(
        '--report-to',
        nargs='+',
        default=['jsonl'],
        choices=SINKS.names(),
        metavar='SINK',
        help=f'where metrics go, several at once: {", ".join(SINKS.names())} (default: jsonl)',
    )
    parser.add_argument('--log-dir', default=log_dir, help=f'the run folder the sinks write in (default: {log_dir})')


def _library(sink: str, module: str) -> Any:
    """The module a sink writes with, or ``MissingExtraError`` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtraError(
            f"the {sink!r} sink needs the {sink} package ({error}): pip install 'twinkle-train[logging]'"
        ) from None


def _number(name: str, value: Any) -> float:
    """A metric value as a float: a number, or a one-element tensor or array."""
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise DataError(f'metric {name!r} must be a number; got {type(value).__name__} {value!r:.80}') from error


def _json_number(value: float) -> float | str:
    """NaN and infinities as JSON strings ('nan', 'inf', '-inf'): JSON has no number for them."""
    return value if math.isfinite(value) else str(value)
