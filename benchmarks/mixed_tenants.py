"""Many tenants, one pass: what mixed-adapter batching buys a shared training server.

Three ways to train the same tokens, on real ``twinkle-server serve`` subprocesses (loopback,
own data directories, ``TWINKLE_OFFLINE=1``), all on one run:

* **mixed**: ``--tenants`` tenants, each with its own key, client thread and rank-``--lora-r``
  adapter, each sending one ``--seq-len``-token sequence per step (``forward_backward`` then
  ``clip_grad_and_step``), all at once, to a server that runs waiting requests of different
  tenants as one pass (``mixed_batches: true``, the default).
* **one adapter at a time** (a): the same tenants and requests against a server started with
  ``mixed_batches: false``, which runs one request per pass (the reference release's way).
* **one tenant, combined batch** (b): a single tenant sends all ``--tenants`` sequences as one
  ``forward_backward`` per step (on the second server: alone, it has nothing to mix): the most
  one pass can do.

Each round runs the three in turn (``--steps`` steps each; the first round is warm-up and not
counted); tokens/s is trained tokens over wall time, median over ``--rounds`` rounds. The aims:
mixed >= 2x (a), and >= 0.9x (b). The mixed server's ``/metrics`` then give the mean number of
requests in the pass that ran each of its tenants' ``forward_backward`` requests (8 at best).

Memory: a fresh server's resident set (``VmRSS``) with 1, 8 and 32 adapters (rank 16, AdamW,
one step each so the optimizer state exists), read once the idle server has given freed heap
memory back (``release_memory_after_idle_s``), against what an adapter should cost: its
parameters plus AdamW's two moments, in float32. Then the same 32 adapters on a server that
keeps at most ``hot_optimizers`` (4) optimizer states in memory and spills the rest to disk.

Usage::

    .venv/bin/python benchmarks/mixed_tenants.py --rounds 5  # ~12 min on 2 CPU cores; results/mixed_tenants.json
    ... --model tiny-qwen3 --output /tmp/mixed_tiny.json   # a model too small to fill the device
    ... --ranks 2 --no-memory --output benchmarks/results/mixed_tenants_2ranks.json   # on a 2-rank group
    ... --mix-wait-ms 30 0 --without-state-saves    # beside it: no wait, and no periodic state saves
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from peft import LoraConfig
from server_overhead import ServerProcess

from twinkle import assets
from twinkle.model import TransformersModel
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

MIB = 2**20
#: The operations whose requests per pass the mixed servers report.
STEP_OPERATIONS = ('forward_backward', 'clip_grad_and_step')


@dataclass
class Settings:
    # Embedded model name (twinkle.assets.MODELS) or a local model directory.
    model: str = 'small-qwen3'
    # 'cpu' or 'cuda', for every server.
    device: str = 'cpu'
    # Concurrent tenants, and the tokens of the one sequence each sends per step.
    tenants: int = 8
    seq_len: int = 128
    # Steps per mode per round, and rounds (plus one warm-up round).
    steps: int = 4
    rounds: int = 3
    # Adapter counts at which the server's memory is read; optimizer states a spilling server keeps.
    adapter_counts: list[int] = field(default_factory=lambda: [1, 8, 32])
    hot_optimizers: int = 4
    lora_r: int = 16
    # The mixed server's mix_wait_ms (how long a request waits for the tenants its last two passes
    # held); the first value is the server default's row, the others are run beside it.
    mix_wait_ms: list[float] = field(default_factory=lambda: [30.0])
    # The model group of every server: worker ranks, and how many of them shard it with FSDP2
    # (1 rank: the model in the server's process, as by default).
    ranks: int = 1
    fsdp_size: int = 1
    # Also a mixed server with save_state_every_steps: null (no periodic saves of each run's state).
    without_state_saves: bool = False
    lora_alpha: int = 32
    lr: float = 1e-4
    # Seconds to wait for a server subprocess to answer /healthz.
    startup_timeout_s: float = 300.0


#: The admin key of the servers it starts, whose /metrics it reads.
METRICS_KEY = 'bench-admin-' + 'k' * 32
METRICS_AUTH = {'Authorization': f'Bearer {METRICS_KEY}'}


class Server(ServerProcess):
    """``ServerProcess`` with more ``ServerConfig`` fields in its config file."""

    def __init__(self, settings: Settings, workdir: Path, **config: Any):
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(settings, workdir)
        group = {'ranks': settings.ranks, 'fsdp_size': settings.fsdp_size}
        metrics = {'admin_api_key': METRICS_KEY}  # /metrics answers the admin key only
        (workdir / 'server.json').write_text(json.dumps({'device': settings.device, **group, **metrics, **config}))

    def rss_mib(self) -> float:
        status = Path(f'/proc/{self.process.pid}/status').read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith('VmRSS'))) / 1024


def sequences(settings: Settings, vocab: int, tenant: int, steps: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(1000 + tenant)
    rows = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (settings.seq_len,), generator=gen).tolist()
        rows.append({'input_ids': ids, 'labels': ids})
    return rows


def tenant_model(url: str, key: str, settings: Settings) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel(settings.model, client=TwinkleClient(url, key))
    config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, target_modules='all-linear')
    model.add_adapter_to_model('default', config, seed=0)
    model.set_optimizer('AdamW', lr=settings.lr)
    return model


def train(model: MultiLoraTransformersModel, batches: list[list[dict]]) -> None:
    for batch in batches:
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step(1.0)


def concurrent(models: list[MultiLoraTransformersModel], rows: list[list[dict]]) -> float:
    """Every tenant trains its own rows, one sequence per step, in its own thread; wall seconds."""
    errors: list[BaseException] = []

    def tenant(model: MultiLoraTransformersModel, own: list[dict]) -> None:
        try:
            train(model, [[row] for row in own])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=tenant, args=pair) for pair in zip(models, rows, strict=True)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def combined(model: MultiLoraTransformersModel, rows: list[list[dict]]) -> float:
    """One tenant sends every tenant's sequence of a step as one batch; wall seconds."""
    started = time.perf_counter()
    train(model, [list(step) for step in zip(*rows, strict=True)])
    return time.perf_counter() - started


def throughput(settings: Settings, workdir: Path, vocab: int) -> tuple[dict[str, list[float]], float]:
    """Wall seconds of each mode per counted round, and the mixed server's mean requests per pass."""
    mixed = {mixed_mode(settings, ms): {'mix_wait_ms': ms} for ms in settings.mix_wait_ms}
    if settings.without_state_saves:  # what the periodic saves of each run's state cost the mixed server
        mixed['mixed_no_state_saves'] = {'mix_wait_ms': settings.mix_wait_ms[0], 'save_state_every_steps': None}
    servers = {mode: Server(settings, workdir / mode, **config) for mode, config in mixed.items()}
    servers['single'] = Server(settings, workdir / 'single', mixed_batches=False)
    tokens = settings.tenants * settings.seq_len * settings.steps
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(server) for name, server in servers.items()}
        tenants = {
            name: [tenant_model(urls[name], servers[name].add_key(f't{i}'), settings) for i in range(settings.tenants)]
            for name in servers
        }
        one = tenant_model(urls['single'], servers['single'].add_key('combined'), settings)  # nothing to mix
        times: dict[str, list[float]] = {mode: [] for mode in [*mixed, 'one_adapter_at_a_time', 'one_tenant_combined']}
        for round_index in range(settings.rounds + 1):
            rows = [sequences(settings, vocab, 100 * round_index + t, settings.steps) for t in range(settings.tenants)]
            seconds = {mode: concurrent(tenants[mode], rows) for mode in mixed}
            seconds['one_adapter_at_a_time'] = concurrent(tenants['single'], rows)
            seconds['one_tenant_combined'] = combined(one, rows)
            label = 'warm-up' if round_index == 0 else f'round {round_index}'
            print(f'  {label}: ' + ', '.join(f'{k} {tokens / v:7.0f} tokens/s' for k, v in seconds.items()))
            if round_index:
                for name, value in seconds.items():
                    times[name].append(value)
        shares = {mode: {op: mean_pass_jobs(urls[mode], op) for op in STEP_OPERATIONS} for mode in mixed}
        return times, shares


def mixed_mode(settings: Settings, ms: float) -> str:
    """The name of the mixed server's row with ``mix_wait_ms=ms``: 'mixed' for the first."""
    return 'mixed' if ms == settings.mix_wait_ms[0] else f'mixed_wait_{ms:g}ms'


def mean_pass_jobs(url: str, operation: str) -> float:
    """Requests per pass, averaged over a mixed server's ``operation`` requests (/metrics)."""
    values = {}
    for line in httpx.get(f'{url}/metrics', headers=METRICS_AUTH).text.splitlines():
        for part in ('sum', 'count'):
            if line.startswith(f'twinkle_pass_jobs_{part}{{operation="{operation}"}}'):
                values[part] = float(line.split()[-1])
    return values['sum'] / values['count']


def adapter_bytes(settings: Settings, model_dir: str) -> dict[str, int]:
    """What one adapter should cost: its float32 parameters, and AdamW's two moments of each.
    Also, measured in this process, the Python objects that come with an adapter (its modules
    and parameters, its optimizer; ``tracemalloc`` sees these, not tensor storage)."""
    model = TransformersModel(model_id=model_dir, device='cpu')
    row = [{'input_ids': list(range(1, 17)), 'labels': list(range(1, 17))}]

    def add(name: str) -> None:
        config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, target_modules='all-linear')
        model.add_adapter_to_model(name, config)
        model.set_optimizer('AdamW', lr=settings.lr, adapter_name=name)
        model.forward_backward(inputs=row, adapter_name=name)
        model.clip_grad_and_step(1.0, adapter_name=name)

    add('probe')
    params = sum(p.numel() * p.element_size() for p in model.groups['probe'].params)
    tracemalloc.start()
    for index in range(4):
        add(f'traced{index}')
    python_objects = tracemalloc.get_traced_memory()[0] // 4
    tracemalloc.stop()
    return {'parameters': params, 'adam_moments': 2 * params, 'python_objects': python_objects}


def memory(settings: Settings, workdir: Path, limits_extra: dict[str, Any] | None = None) -> dict[int, float]:
    """Server RSS (MiB) after 0 and each of ``adapter_counts`` adapters, each trained one step."""
    most = max(settings.adapter_counts)  # one tenant holds them all: past its limit it would release its oldest
    limits = {'max_adapters': most, 'max_adapters_per_tenant': most, **(limits_extra or {})}
    server = Server(settings, workdir, limits=limits)
    key = server.add_key('memory')
    rss: dict[int, float] = {}
    vocab_rows = sequences(settings, 1000, 0, 1)
    with server as url:
        model = MultiLoraTransformersModel(settings.model, client=TwinkleClient(url, key))
        rss[0] = server.rss_mib()
        for count in range(1, max(settings.adapter_counts) + 1):
            name = f'a{count}'
            config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, target_modules='all-linear')
            releases = memory_releases(url)
            model.add_adapter_to_model(name, config, seed=count)
            model.set_optimizer('AdamW', lr=settings.lr, adapter_name=name)
            model.forward_backward(inputs=vocab_rows, adapter_name=name)
            model.clip_grad_and_step(1.0, adapter_name=name)
            if count in settings.adapter_counts:
                wait_for_memory_release(url, releases)
                rss[count] = server.rss_mib()
    return rss


def memory_releases(url: str) -> float:
    for line in httpx.get(f'{url}/metrics', headers=METRICS_AUTH).text.splitlines():
        if line.startswith('twinkle_memory_releases_total '):
            return float(line.split()[-1])
    return 0.0


def wait_for_memory_release(url: str, seen: float, timeout_s: float = 30.0) -> None:
    """Until the idle server has given its freed heap back (``release_memory_after_idle_s``) more
    than ``seen`` times: its memory at rest, not with the last pass's freed activations."""
    deadline = time.monotonic() + timeout_s
    while memory_releases(url) <= seen:
        if time.monotonic() > deadline:
            raise TimeoutError(f'the server did not release memory within {timeout_s} s of going idle')
        time.sleep(0.1)


def summarize(times: dict[str, list[float]], shares: dict[str, dict[str, float]], settings: Settings) -> dict[str, Any]:
    tokens = settings.tenants * settings.seq_len * settings.steps
    rates = {name: tokens / statistics.median(values) for name, values in times.items()}
    return {
        'tokens_per_s': rates,
        'mean_requests_per_mixed_pass': shares['mixed']['forward_backward'],
        'mean_requests_per_pass': shares,
        'ratios_vs_one_tenant_combined': {mode: rates[mode] / rates['one_tenant_combined'] for mode in shares},
        'ratio_vs_one_adapter_at_a_time': rates['mixed'] / rates['one_adapter_at_a_time'],
        'ratio_vs_one_tenant_combined': rates['mixed'] / rates['one_tenant_combined'],
        # What (a) would be if mixing were free: one pass of every row cannot do better than this.
        'ceiling_vs_one_adapter_at_a_time': rates['one_tenant_combined'] / rates['one_adapter_at_a_time'],
        'aims': {'vs_one_adapter_at_a_time': 2.0, 'vs_one_tenant_combined': 0.9},
    }


def memory_summary(rss: dict[int, float], expected: dict[str, int], expected_objects: int) -> dict[str, Any]:
    """Growth per adapter between the two largest counts (8 and 32): past the first adapters,
    whose optimizer states a spilling server still keeps in memory, and its fixed costs."""
    counts = sorted(c for c in rss if c)
    first, last = counts[-2:] if len(counts) > 1 else (counts[0], counts[0])
    per_adapter = (rss[last] - rss[first]) / (last - first) if last > first else None
    return {
        'rss_mib': {str(c): rss[c] for c in sorted(rss)},
        'growth_per_adapter_mib': per_adapter,
        'growth_between': [first, last],
        'expected_per_adapter_mib': sum(expected.values()) / MIB,
        'python_objects_per_adapter_mib': expected_objects / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default=Settings.model, help='embedded model name or a local model directory')
    parser.add_argument('--device', default=Settings.device, help="'cpu' or 'cuda', for every server")
    parser.add_argument('--steps', type=int, default=Settings.steps)
    parser.add_argument('--rounds', type=int, default=Settings.rounds)
    parser.add_argument('--tenants', type=int, default=Settings.tenants)
    parser.add_argument(
        '--mix-wait-ms', type=float, nargs='+', default=Settings().mix_wait_ms,
        help="the mixed server's mix_wait_ms; the first is the 'mixed' row, others run beside it",
    )  # fmt: skip
    parser.add_argument('--ranks', type=int, default=Settings.ranks, help="every server's model group: ranks")
    parser.add_argument('--fsdp-size', type=int, default=Settings.fsdp_size, help='of those ranks, FSDP2 shards')
    parser.add_argument('--no-memory', action='store_true', help='throughput only (no memory servers)')
    parser.add_argument(
        '--without-state-saves', action='store_true',
        help='also a mixed server without the periodic saves of each run state (save_state_every_steps: null)',
    )  # fmt: skip
    parser.add_argument('--output', default='benchmarks/results/mixed_tenants.json')
    args = parser.parse_args()
    settings = Settings(
        model=args.model, device=args.device, steps=args.steps, rounds=args.rounds, tenants=args.tenants,
        mix_wait_ms=args.mix_wait_ms, ranks=args.ranks, fsdp_size=args.fsdp_size,
        without_state_saves=args.without_state_saves,
    )  # fmt: skip
    model_dir = assets.tiny_model(settings.model)
    vocab = json.loads((Path(model_dir) / 'config.json').read_text())['vocab_size']
    expected = adapter_bytes(settings, model_dir)
    tensors = {k: v for k, v in expected.items() if k != 'python_objects'}
    with tempfile.TemporaryDirectory(prefix='twinkle-mixed-') as tmp:
        workdir = Path(tmp)
        print(
            f'Throughput: {settings.tenants} tenants x one {settings.seq_len}-token sequence per step, {settings.model}'
        )
        times, shares = throughput(settings, workdir, vocab)
        result: dict[str, Any] = {
            'settings': asdict(settings),
            'environment': {'torch': torch.__version__, 'threads': torch.get_num_threads(), 'device': settings.device},
            'throughput': summarize(times, shares, settings),
        }
        if not args.no_memory:
            print('Memory: adapters of rank', settings.lora_r)
            rss = memory(settings, workdir / 'memory')
            spilled = memory(
                settings, workdir / 'memory-spill', limits_extra={'max_optimizers_in_memory': settings.hot_optimizers}
            )
            result['memory'] = memory_summary(rss, tensors, expected['python_objects'])
            result['memory_spilling'] = memory_summary(
                spilled, {'parameters': tensors['parameters']}, expected['python_objects']
            )
    result['adapter_bytes'] = expected
    result['seconds'] = times
    print_summary(result)
    Path(args.output).write_text(json.dumps(result, indent=2) + '\n')
    print(f'wrote {args.output}')


def print_summary(result: dict[str, Any]) -> None:
    fig = result['throughput']
    print('\nAggregate tokens/s (median over rounds):')
    for name, rate in fig['tokens_per_s'].items():
        print(f'  {name:22s} {rate:8.0f}')
    print(f'  mixed / one adapter at a time: x{fig["ratio_vs_one_adapter_at_a_time"]:.2f} (aim >= 2)')
    for mode, ratio in fig['ratios_vs_one_tenant_combined'].items():
        print(f'  {mode} / one tenant combined: x{ratio:.2f} (aim >= 0.9)')
    ceiling = fig['ceiling_vs_one_adapter_at_a_time']
    print(f'  one tenant combined / one adapter at a time: x{ceiling:.2f} (the most (a) can be on this device)')
    for mode, shares in fig['mean_requests_per_pass'].items():
        each = ', '.join(f'{op} {share:.2f}' for op, share in shares.items())
        print(f"  {mode}: the tenants' requests ran this many to a pass on average: {each}")
    if 'memory' not in result:
        return
    mem = result['memory']
    print('Server memory (RSS):')
    for count, mib in mem['rss_mib'].items():
        print(f'  {count:>3s} adapters: {mib:8.1f} MiB')
    print(
        f'  growth per adapter {mem["growth_per_adapter_mib"]:.2f} MiB; the adapter and its AdamW state are '
        f'{mem["expected_per_adapter_mib"]:.2f} MiB, plus {mem["python_objects_per_adapter_mib"]:.2f} MiB of '
        'Python objects (modules, parameters, optimizer; traced in-process)'
    )
    spill, hot = result['memory_spilling'], result['settings']['hot_optimizers']
    print(f'Server memory, at most {hot} optimizer states in memory (the rest spilled to disk):')
    for count, mib in spill['rss_mib'].items():
        print(f'  {count:>3s} adapters: {mib:8.1f} MiB')
    print(
        f'  growth per adapter {spill["growth_per_adapter_mib"]:.2f} MiB; the adapter alone is '
        f'{spill["expected_per_adapter_mib"]:.2f} MiB, plus up to {spill["python_objects_per_adapter_mib"]:.2f} MiB '
        'of Python objects'
    )


if __name__ == '__main__':
    main()
