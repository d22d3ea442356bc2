"""What keeping a run's state with every step costs: a LoRA step through the server, its state kept with
each step's answer in host memory (the default), or on disk, against no kept state at all.

Three ``twinkle-server serve`` processes on loopback, one per setting, each with one tenant training one
LoRA run (r=16, ``all-linear``, AdamW) on the same batches from the same seed:

- ``memory``: ``save_state_every_steps: 1`` and the memory tier (``memory_state_bytes``, 1 GiB): what a
  server does by default, so that no answered step is lost with a worker;
- ``disk``: ``save_state_every_steps: 1``, ``memory_state_bytes: 0``: each state fsynced to disk;
- ``none``: ``save_state_every_steps: null``: nothing kept but at releases (a crash loses every step
  since the run was made).

A step is ``forward_backward`` then ``clip_grad_and_step``, each one request that waits for its answer. The
three take turns in blocks of ``--steps`` (rotating which goes first) for ``--repeats`` blocks, after
``--warmup`` untimed steps each; every step ``k`` trains batch ``k``. Figures: the median step time of
each, its ratio to ``none``, the bytes of one kept state, and ``max_loss_diff``: the largest absolute
difference between the ``memory`` and ``none`` runs' losses, step for step (keeping a state should
change none of them: 0.0).

Usage::

    .venv/bin/python benchmarks/kept_state.py                   # writes results/kept_state.json
    .venv/bin/python benchmarks/kept_state.py --model wide-qwen3
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from machine import describe, settings_from_args
from peft import LoraConfig
from server_overhead import ServerProcess

from twinkle.model.checkpoint import files as ckpt
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each setting's server configuration beside its device.
VARIANTS: dict[str, dict[str, Any]] = {
    'memory': {'save_state_every_steps': 1},
    'disk': {'save_state_every_steps': 1, 'memory_state_bytes': 0},
    'none': {'save_state_every_steps': None},
}


@dataclass
class Settings:
    model: str = 'small-qwen3'
    device: str = 'cpu'
    steps: int = 4
    warmup: int = 2
    repeats: int = 6
    batch_size: int = 8
    seq_len: int = 128
    lora_r: int = 16
    startup_timeout_s: float = 300.0


class Server(ServerProcess):
    """``ServerProcess`` with one of ``VARIANTS``' configurations."""

    def __init__(self, settings: Settings, workdir: Path, options: dict[str, Any]):
        workdir.mkdir(parents=True)
        super().__init__(settings, workdir)  # type: ignore[arg-type]
        (workdir / 'server.json').write_text(json.dumps({'device': settings.device, **options}))


def batches(settings: Settings, count: int) -> list[list[dict[str, list[int]]]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        rows = [torch.randint(0, 4000, (settings.seq_len,), generator=gen).tolist() for _ in range(settings.batch_size)]
        out.append([{'input_ids': row, 'labels': [-100, *row[1:]]} for row in rows])
    return out


class Loop:
    """One tenant's run on one server, and its step times."""

    def __init__(self, url: str, key: str, settings: Settings):
        self.model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
        lora = LoraConfig(r=settings.lora_r, lora_alpha=2 * settings.lora_r, target_modules='all-linear')
        self.model.add_adapter_to_model('default', lora, seed=0)
        self.model.set_optimizer('AdamW', lr=1e-4)
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, batch: list[dict[str, list[int]]], timed: bool = True) -> None:
        started = time.perf_counter()
        self.losses.append(self.model.forward_backward(inputs=batch).loss)
        self.model.clip_grad_and_step()
        if timed:
            self.times.append(time.perf_counter() - started)


def state_bytes(workdir: Path) -> int | None:
    """The size of one kept state on the ``disk`` server (its one run's)."""
    states = list(workdir.glob('disk/data/checkpoints/*/*/state@*'))
    return ckpt.folder_size(states[0]) if states else None


def main() -> None:
    settings, output = settings_from_args(Settings(), __doc__.splitlines()[0], 'benchmarks/results/kept_state.json')
    data = batches(settings, settings.warmup + settings.steps * settings.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        servers = {name: Server(settings, workdir / name, options) for name, options in VARIANTS.items()}
        keys = {name: server.add_key('alice') for name, server in servers.items()}
        urls = {name: server.__enter__() for name, server in servers.items()}
        try:
            loops = {name: Loop(urls[name], keys[name], settings) for name in VARIANTS}
            for loop in loops.values():
                for batch in data[: settings.warmup]:
                    loop.step(batch, timed=False)
            names = list(VARIANTS)
            for block in range(settings.repeats):
                start = settings.warmup + block * settings.steps
                for name in names[block % 3 :] + names[: block % 3]:
                    for batch in data[start : start + settings.steps]:
                        loops[name].step(batch)
            size = state_bytes(workdir)
        finally:
            for server in servers.values():
                server.__exit__()
    medians = {name: statistics.median(loop.times) for name, loop in loops.items()}
    result = {
        'settings': settings.__dict__,
        'median_step_ms': {name: 1000 * value for name, value in medians.items()},
        'ratio_to_none': {name: medians[name] / medians['none'] for name in VARIANTS},
        'state_bytes': size,
        'max_loss_diff': max(abs(a - b) for a, b in zip(loops['memory'].losses, loops['none'].losses, strict=True)),
        'machine': describe(),
        'date': time.strftime('%Y-%m-%d'),
    }
    print(json.dumps(result, indent=1))
    Path(output).write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
