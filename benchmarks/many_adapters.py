"""A thousand adapters on one server: adapters tier between the model, host memory and disk (issue 34, point 5).

A ``twinkle-server serve`` subprocess on ``--model`` keeps at most ``--max-adapters`` adapters on the
model (``limits.max_adapters``; each tenant at most ``--per-tenant``); the others are released with
their whole state (weights, optimizer, counters) to host memory (``--memory-mib`` of them,
``memory_state_bytes``), the least recently released on to disk, and restored when their run is used
again. ``--runs`` runs are made, spread over ``--tenants`` tenants; then, twice, every run trains one
step (``forward_backward`` of one ``--seq-len``-token row, ``clip_grad_and_step``) in a random order.
Reported, after making the runs and after each round: the server's resident set (``VmRSS``), the
disk its data directory takes, the host memory its released states take, the p50 and p99 step
latency (client side, both requests), and the share of steps whose run was off the model (released)
when the step came, so the step reloaded it, and of those from host memory.

Usage::

    .venv/bin/python benchmarks/many_adapters.py            # 1,000 runs; results/many_adapters.json
    .venv/bin/python benchmarks/many_adapters.py --runs 100 --output /tmp/many.json
    .venv/bin/python benchmarks/many_adapters.py --memory-mib 0 --output benchmarks/results/many_adapters_memory_0.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peft import LoraConfig
from server_overhead import ServerProcess

from twinkle.model.checkpoint.files import folder_size
from twinkle.server.config import ServerConfig
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

MIB = 2**20


@dataclass
class Settings:
    model: str = 'tiny-qwen3'
    runs: int = 1000
    tenants: int = 10
    max_adapters: int = 32
    per_tenant: int = 8
    lora_r: int = 8
    seq_len: int = 32
    seed: int = 0
    device: str = 'cpu'
    memory_mib: float = 1024.0
    startup_timeout_s: float = 300.0


class Server(ServerProcess):
    """The server with its adapter limits in its config file."""

    def __init__(self, settings: Settings, workdir: Path):
        super().__init__(settings, workdir)
        limits = {'max_adapters': settings.max_adapters, 'max_adapters_per_tenant': settings.per_tenant}
        memory_bytes = int(settings.memory_mib * MIB)
        server_config = {'device': settings.device, 'limits': limits, 'memory_state_bytes': memory_bytes}
        (workdir / 'server.json').write_text(json.dumps(server_config))
        self.data_dir = workdir / 'data'
        where = ServerConfig.build(
            base_model=settings.model, data_dir=str(self.data_dir), memory_state_bytes=memory_bytes
        )
        self.memory_dir = where.memory_dir

    def in_memory(self, tenant_id: str, run_id: str) -> bool:
        """Whether the run's kept state is in host memory (a folder there is the one the store names)."""
        return self.memory_dir is not None and any((self.memory_dir / tenant_id / run_id).glob('state@*'))

    def memory_mib(self) -> float:
        if self.memory_dir is None or not self.memory_dir.is_dir():
            return 0.0
        return folder_size(self.memory_dir) / MIB

    def rss_mib(self) -> float:
        assert self.process is not None
        status = Path(f'/proc/{self.process.pid}/status').read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith('VmRSS'))) / 1024

    def disk_mib(self) -> float:
        done = subprocess.run(['du', '-sk', str(self.data_dir)], capture_output=True, text=True, check=True)
        return int(done.stdout.split()[0]) / 1024


def snapshot(
    server: Server, label: str, latencies: list[float], reloads: int, steps: int, from_memory: int = 0
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        'after': label,
        'rss_mib': round(server.rss_mib(), 1),
        'disk_mib': round(server.disk_mib(), 1),
        'memory_mib': round(server.memory_mib(), 1),
    }
    if latencies:
        ordered = sorted(latencies)
        figures |= {
            'step_p50_ms': round(1000 * statistics.median(ordered), 1),
            'step_p99_ms': round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
            'reloaded_share': round(reloads / steps, 3),
            'reloaded_from_memory_share': round(from_memory / max(reloads, 1), 3),
        }
    print(figures, flush=True)
    return figures


def main(settings: Settings, output: Path) -> None:
    rng = random.Random(settings.seed)
    with tempfile.TemporaryDirectory(prefix='many-adapters-') as scratch:
        server = Server(settings, Path(scratch))
        keys = [server.add_key(f'tenant-{i}') for i in range(settings.tenants)]
        with server as url:
            clients = [TwinkleClient(url, key) for key in keys]
            models = [MultiLoraTransformersModel(client=client) for client in clients]
            config = LoraConfig(r=settings.lora_r, lora_alpha=2 * settings.lora_r, target_modules='all-linear')
            runs: list[tuple[MultiLoraTransformersModel, str]] = []
            began = time.perf_counter()
            for index in range(settings.runs):
                model = models[index % settings.tenants]
                name = f'run-{index}'
                model.add_adapter_to_model(name, config, seed=index)
                model.set_optimizer('AdamW', lr=1e-3, adapter_name=name)
                runs.append((model, name))
            made_s = time.perf_counter() - began
            print(f'{settings.runs} runs made in {made_s:.0f} s', flush=True)
            figures = [snapshot(server, 'making the runs', [], 0, 0)]
            vocab = 4000
            for round_index in range(2):
                order = list(range(len(runs)))
                rng.shuffle(order)
                latencies, reloads, from_memory = [], 0, 0
                for index in order:
                    model, name = runs[index]
                    row = [rng.randrange(vocab) for _ in range(settings.seq_len)]
                    run = model.client.get_training_run(model.runs[name])
                    released = run.status == 'released'
                    from_memory += released and server.in_memory(run.tenant_id, run.id)
                    start = time.perf_counter()
                    model.forward_backward(inputs=[{'input_ids': row, 'labels': row}], adapter_name=name)
                    model.clip_grad_and_step(adapter_name=name)
                    latencies.append(time.perf_counter() - start)
                    reloads += released
                label = f'round {round_index + 1}'
                figures.append(snapshot(server, label, latencies, reloads, len(order), from_memory))
    result = {'settings': asdict(settings), 'runs_made_s': round(made_s, 1), 'figures': figures}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print(f'wrote {output}')


def parse_args() -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    defaults = Settings()
    for name, value in asdict(defaults).items():
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(value), default=value)
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'many_adapters.json')
    args = vars(parser.parse_args())
    output = args.pop('output')
    return Settings(**args), output


if __name__ == '__main__':
    main(*parse_args())
