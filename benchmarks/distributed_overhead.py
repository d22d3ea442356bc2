"""What do twinkle's two multi-process runtimes cost per training step on CPU: a model behind
Ray's actor dispatch, and data parallel over two torchrun processes?

Both parts train the same LoRA step as ``lora_overhead.py`` (r=16, alpha=32, ``all-linear``,
AdamW lr 1e-4, clipping at 1.0): ``forward_backward(inputs=batch)`` then
``clip_grad_and_step()``, on fixed batches of self-cognition rows encoded once. After
``--warmup`` untimed steps per side, the two sides of a part take turns in blocks of ``--steps``
(A B, B A, A B, ...) for ``--repeats`` blocks; step ``k`` of either side trains batch ``k``.

1. **Ray dispatch.** A ``TransformersModel`` built with ``remote_group='model'`` in
   ``twinkle.initialize(mode='ray')`` (one actor, one rank, on a private local Ray started
   here) against the same model built in this process, both with ``--threads`` torch threads
   and the same adapter seed. ``lazy_collect=False``: each call waits for its result, as the
   local call does, so a step's time is its own. Beside the step, ``lr_step()`` between steps
   (no scheduler, no pending boundary: a method that does nothing) through the proxy and
   directly, in alternating blocks of ``--calls``: the floor of one dispatched call.
2. **Two processes against one.** The same global batch and steps in this process (``--threads``
   threads) and in ``--ranks`` processes under ``torch.distributed.run --standalone`` (this file
   with ``--worker DIR``; ``--threads / --ranks`` threads each, gloo; a mesh
   ``dp_size=--ranks``, each rank its contiguous shard of every batch). The processes wait
   between their blocks, polling for this process's go-file, and write each rank's step times
   and losses to a JSON file in the temporary ``DIR``; a step's time is the slower rank's.
   The losses of every step must agree within 1e-5 (relative above 1): data parallel computes
   the loss of the global batch.

Figures:

* ``step_ratio``: median over steps of candidate step time / baseline step time on the same
  batch (ray / local; two processes / one); ``*_iqr``: the middle half of those ratios.
* ``added_ms_per_step``: median over steps of candidate step time - baseline step time on the
  same batch; ``added_ms_per_call``: the same over the step's two calls. On CPU a step of
  ``small-qwen3`` varies by more than Ray adds to it, so these say little there; the no-op
  call's ``added_ms`` (median proxy call - median direct call) is the dispatch floor.
* ``tokens_per_s`` and ``throughput_ratio`` (candidate / baseline tokens/s) as in
  ``lora_overhead.py``.
* ``quiet_step_ratio``: the lower quartile of the candidate's step times over the baseline's,
  what the two give in their least disturbed steps. On a shared CPU another process's load
  slows one process of 2 threads far more than 2 processes of 1 (every parallel region waits
  for its slower thread), so the per-step median can favour the two processes by more than
  the runtimes differ; where the two ratios part, prefer this one.

Usage::

    .venv/bin/python benchmarks/distributed_overhead.py    # ~1.5 min on 2 idle cores
    ... --repeats 30 --output /tmp/distributed_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import ray
import torch
import transformers
from lora_overhead import DISTURBED, Batch, Trace, TwinkleLoop, benchmark, encode_batches, lora_config, run_steps
from lora_overhead import Settings as TrainingSettings
from lora_overhead import environment as training_environment
from lora_overhead import summarize as summarize_traces
from server_overhead import time_calls

import twinkle
from twinkle import DeviceGroup, DeviceMesh, assets
from twinkle.infra import distributed
from twinkle.infra.ray.dispatch import shard_bounds
from twinkle.model import TransformersModel

LOSS_TOLERANCE = 1e-5
GROUP = 'model'
CALLS_PER_STEP = 2  # forward_backward, clip_grad_and_step
POLL_S = 0.005
WORKER_ENV = {'TWINKLE_OFFLINE': '1', 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_DISABLE_PROGRESS_BARS': '1'}


@dataclass
class Settings:
    # Embedded model name (twinkle.assets.MODELS) or a local model directory. CPU only.
    model: str
    # Timed steps per block, untimed steps per side before timing, blocks per side (both parts).
    steps: int
    warmup: int
    repeats: int
    # No-op call: calls per block and blocks per side.
    calls: int
    call_repeats: int
    # Torch threads of one process (and of the Ray actor); each torchrun rank gets threads // ranks.
    threads: int = 2
    ranks: int = 2
    # Rows per (global) batch, and the longest encoded row.
    batch_size: int = 8
    max_length: int = 256
    # LoRA and optimizer settings shared by every model.
    lora_r: int = 16
    lora_alpha: int = 32
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = 0
    # Seconds the torchrun processes may take to start, or to finish a block.
    timeout_s: float = 300.0

    @property
    def rank_threads(self) -> int:
        return max(1, self.threads // self.ranks)

    def training(self) -> TrainingSettings:
        """The settings ``lora_overhead``'s loop and block alternation read (float32 on CPU)."""
        fixed = {'device': 'cpu', 'mixed_precision': 'no'}
        shared = {name: getattr(self, name) for name in TrainingSettings.__dataclass_fields__ if name not in fixed}
        return TrainingSettings(**fixed, **shared)


# ---- 1. Ray dispatch ------------------------------------------------------------------------------
def _prepare_actor(model: TransformersModel, threads: int, seed: int) -> int:
    """Runs in the actor (``remote_execute``): its thread count (Ray gives an actor with a
    fraction of a CPU one thread) and the adapter seed ``TwinkleLoop`` also uses."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return torch.get_num_threads()


class RayLoop:
    """``TwinkleLoop``'s training on a ``TransformersModel`` that is one Ray actor."""

    def __init__(self, model_dir: str, settings: Settings):
        self.max_grad_norm = settings.max_grad_norm
        self.model = TransformersModel(model_id=model_dir, device='cpu', mixed_precision='no', remote_group=GROUP)
        self.threads = self.model.remote_execute(_prepare_actor, settings.threads, settings.seed)
        self.model.add_adapter_to_model('default', lora_config(settings.training()))
        self.model.set_optimizer('AdamW', lr=settings.lr)

    def step(self, batch: Batch) -> float:
        output = self.model.forward_backward(inputs=batch)
        self.model.clip_grad_and_step(self.max_grad_norm)
        return output.loss


def noop_latency(local: TransformersModel, remote: Any, settings: Settings) -> dict[str, list[float]]:
    """Seconds per ``lr_step()`` call, direct and through the proxy, in alternating blocks."""
    times: dict[str, list[float]] = {'local': [], 'ray': []}
    calls = {'local': lambda: local.lr_step(), 'ray': lambda: remote.lr_step()}
    for name in times:  # one untimed block each
        time_calls(calls[name], settings.calls, [])
    for repeat in range(settings.call_repeats):
        for name in list(times) if repeat % 2 == 0 else list(times)[::-1]:
            time_calls(calls[name], settings.calls, times[name])
    return times


def ray_dispatch(settings: Settings, batches: list[Batch], model_dir: str) -> dict[str, Any]:
    """Part 1 on a private single-node Ray (``address='local'``: never someone else's cluster)."""
    ray.init(address='local', num_cpus=settings.ranks, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _prepare_actor, even if imported
    try:
        twinkle.initialize(mode='ray', groups=[DeviceGroup(GROUP, 1, 'cpu')], lazy_collect=False, seed=settings.seed)
        local, remote = TwinkleLoop(model_dir, settings.training()), RayLoop(model_dir, settings)
        traces = benchmark({'local': local, 'ray': remote}, batches, settings.training())
        noop = noop_latency(local.model, remote.model, settings)
    finally:
        twinkle.initialize(mode='local', seed=None)  # gives the group's CPU back; the actor ends
        ray.shutdown()
    return {'traces': traces, 'noop_s': noop, 'actor_threads': remote.threads}


def summarize_pair(traces: dict[str, Trace], baseline: str, candidate: str) -> dict[str, Any]:
    """``lora_overhead.summarize``'s figures as ratios (1.0 = parity), plus the quiet-step ratio."""
    figures = summarize_traces(traces, baseline=baseline, candidate=candidate)
    loops = figures['loops']
    steps = [traces[candidate].step_s, traces[baseline].step_s]
    quiet = {name: statistics.quantiles(traces[name].step_s, n=4)[0] for name in (baseline, candidate)}
    for name, step_s in quiet.items():
        loops[name]['quiet_step_s'] = step_s
    return {
        'loops': loops,
        'step_ratio': 1 + figures['overhead_pct'] / 100,
        'step_ratio_iqr': [1 + pct / 100 for pct in figures['overhead_pct_iqr']],
        'quiet_step_ratio': quiet[candidate] / quiet[baseline],
        'throughput_ratio': figures['throughput_ratio'],
        'added_ms_per_step': 1000 * statistics.median(c - b for c, b in zip(*steps, strict=True)),
        'disturbed_pairs': figures['disturbed_pairs'],
        'max_loss_abs_diff': figures['max_loss_abs_diff'],
    }


def summarize_ray(traces: dict[str, Trace], noop: dict[str, list[float]]) -> dict[str, Any]:
    figures = summarize_pair(traces, baseline='local', candidate='ray')
    noop_ms = {f'{name}_ms': 1000 * statistics.median(values) for name, values in noop.items()}
    return {
        **figures,
        'added_ms_per_call': figures['added_ms_per_step'] / CALLS_PER_STEP,
        'noop_call': {**noop_ms, 'added_ms': noop_ms['ray_ms'] - noop_ms['local_ms']},
    }


# ---- 2. two processes against one ---------------------------------------------------------------
class TorchrunWorkers:
    """``--ranks`` processes of this file in ``--worker`` mode under ``torch.distributed.run``;
    ``with`` starts them and ends them however the block ends. ``run_block(i)`` lets them run
    their block ``i`` (0: the warmup) and waits until every rank has finished it."""

    def __init__(self, settings: Settings, batches: list[Batch], model_dir: str, workdir: Path):
        self.workdir, self.ranks, self.timeout_s = workdir, settings.ranks, settings.timeout_s
        blocks = [(0, settings.warmup)]
        blocks += [(settings.warmup + r * settings.steps, settings.steps) for r in range(settings.repeats)]
        spec = {'training': asdict(settings.training()), 'model_dir': model_dir, 'blocks': blocks}
        (workdir / 'worker.json').write_text(json.dumps(spec))
        (workdir / 'batches.json').write_text(json.dumps(batches))
        self.args = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={self.ranks}']
        self.args += [str(Path(__file__).resolve()), '--worker', str(workdir)]
        self.env = {**os.environ, **WORKER_ENV, 'OMP_NUM_THREADS': str(settings.rank_threads)}
        self.log_path = workdir / 'torchrun.log'
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> TorchrunWorkers:
        with self.log_path.open('w') as log:
            self.process = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def run_block(self, index: int) -> None:
        (self.workdir / f'go-{index}').touch()
        deadline = time.monotonic() + self.timeout_s
        while not all((self.workdir / f'done-{index}-{rank}').exists() for rank in range(self.ranks)):
            if self.process.poll() is not None:
                raise RuntimeError(f'torchrun exited ({self.process.returncode}) in block {index}:\n{self.log_tail()}')
            if time.monotonic() > deadline:
                raise RuntimeError(f'torchrun took over {self.timeout_s:.0f} s for block {index}:\n{self.log_tail()}')
            time.sleep(POLL_S)

    def finish(self) -> list[dict[str, list]]:
        """Each rank's trace (every step, the warmup included), once the processes have exited."""
        returncode = self.process.wait(timeout=self.timeout_s)
        if returncode != 0:
            raise RuntimeError(f'torchrun exited with {returncode}:\n{self.log_tail()}')
        return json.loads((self.workdir / 'ranks.json').read_text())

    def log_tail(self, lines: int = 30) -> str:
        return '\n'.join(self.log_path.read_text(errors='replace').splitlines()[-lines:])


def data_parallel(settings: Settings, batches: list[Batch], model_dir: str, workdir: Path) -> dict[str, Trace]:
    """Part 2: one process (here) and the torchrun ranks take turns, block by block."""
    twinkle.initialize(mode='local', seed=settings.seed)
    training, device = settings.training(), torch.device('cpu')
    with TorchrunWorkers(settings, batches, model_dir, workdir) as workers:
        one = TwinkleLoop(model_dir, training)
        trace = Trace([], [], [])
        run_steps(one, batches, 0, settings.warmup, device, trace)  # meanwhile the ranks start up
        trace.step_s.clear()
        trace.step_tokens.clear()
        workers.run_block(0)
        sides = ['one_process', 'two_process']
        for repeat in range(settings.repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                if side == 'one_process':
                    run_steps(one, batches, settings.warmup + repeat * settings.steps, settings.steps, device, trace)
                else:
                    workers.run_block(repeat + 1)
        ranks = workers.finish()
    return {'one_process': trace, 'two_process': merge_ranks(ranks, settings.warmup)}


def merge_ranks(ranks: list[dict[str, list]], warmup: int) -> Trace:
    """One trace of the ranks: rank 0's (global) losses; each timed step the slower rank's time
    and every rank's tokens (the global batch)."""
    step_s = [max(times) for times in zip(*(rank['step_s'] for rank in ranks), strict=True)]
    tokens = [sum(counts) for counts in zip(*(rank['step_tokens'] for rank in ranks), strict=True)]
    return Trace(ranks[0]['losses'], step_s[warmup:], tokens[warmup:])


def losses_agree(actual: list[float], expected: list[float]) -> bool:
    return all(abs(a - e) <= LOSS_TOLERANCE * max(1.0, abs(e)) for a, e in zip(actual, expected, strict=True))


def summarize_data_parallel(traces: dict[str, Trace]) -> dict[str, Any]:
    figures = summarize_pair(traces, baseline='one_process', candidate='two_process')
    one, two = traces['one_process'].losses, traces['two_process'].losses
    return {**figures, 'losses_match': losses_agree(two, one)}


# ---- the torchrun worker ------------------------------------------------------------------------
def worker(workdir: Path) -> None:
    """One rank of part 2: train each block of the schedule when its go-file appears."""
    spec = json.loads((workdir / 'worker.json').read_text())
    settings = TrainingSettings(**spec['training'])
    torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))
    mesh = DeviceMesh.from_sizes(dp_size=distributed.world_size(), device_type='cpu')
    twinkle.initialize(mode='local', seed=settings.seed, global_device_mesh=mesh)
    rank, world = distributed.rank(), distributed.world_size()
    shards = []
    for batch in json.loads((workdir / 'batches.json').read_text()):
        start, end = shard_bounds(len(batch), distributed.data_rank(mesh), world)
        shards.append(batch[start:end])
    loop = TwinkleLoop(spec['model_dir'], settings)
    trace = Trace([], [], [])
    for index, (first, count) in enumerate(spec['blocks']):
        while not (workdir / f'go-{index}').exists():
            time.sleep(POLL_S)
        distributed.barrier()  # both ranks start the block together: no poll delay in a step's time
        run_steps(loop, shards, first, count, torch.device('cpu'), trace)
        (workdir / f'done-{index}-{rank}').touch()
    ranks = distributed.all_gather_object(asdict(trace))
    if distributed.is_main():
        (workdir / 'ranks.json').write_text(json.dumps(ranks))


# ---- report ---------------------------------------------------------------------------------------
def environment(settings: Settings, load_before: float, actor_threads: int) -> dict[str, Any]:
    return {
        **training_environment(settings.training()),
        'ray': ray.__version__,
        'ray_actor_threads': actor_threads,
        'torchrun_rank_threads': settings.rank_threads,
        # The benchmark runs about `threads` threads at a time: more means other load.
        'load_average_1min_before': load_before,
    }


def print_part(figures: dict[str, Any]) -> None:
    """Each side's step time and tokens/s, then the step ratio of the second side over the first."""
    for name, loop in figures['loops'].items():
        median, quiet = 1000 * loop['median_step_s'], 1000 * loop['quiet_step_s']
        print(
            f'  {name:12s} median step {median:7.1f} ms (quiet {quiet:6.1f} ms)   {loop["tokens_per_s"]:5.0f} tokens/s'
        )
    low, high = figures['step_ratio_iqr']
    print(
        f'  step ratio {"/".join(reversed(figures["loops"]))} {figures["step_ratio"]:.3f} (middle half {low:.3f} ..'
        f' {high:.3f}; quiet steps {figures["quiet_step_ratio"]:.3f}), tokens/s ratio {figures["throughput_ratio"]:.3f}'
    )


def print_summary(result: dict[str, Any]) -> None:
    s, env, fig = result['settings'], result['environment'], result['figures']
    ray_fig, dp = fig['ray'], fig['data_parallel']
    timed = f'{s["repeats"]} x {s["steps"]} timed steps per side'
    print(f'\nDistributed overhead: {s["model"]} on cpu ({env["device"]}), batch {s["batch_size"]}, {timed}')
    print(f'1. Ray: one actor ({env["ray_actor_threads"]} threads) vs this process ({s["threads"]} threads):')
    print_part(ray_fig)
    print(f'  added {ray_fig["added_ms_per_step"]:+.1f} ms per step, {ray_fig["added_ms_per_call"]:+.1f} ms per call')
    noop = ray_fig['noop_call']
    print(
        f'  no-op lr_step(): direct {noop["local_ms"]:.3f} ms, through the proxy {noop["ray_ms"]:.3f} ms'
        f' ({noop["added_ms"]:+.3f} ms); max |loss diff| {ray_fig["max_loss_abs_diff"]:.1e}'
    )
    rank_threads = env['torchrun_rank_threads']
    print(f'2. {s["ranks"]} torchrun processes ({rank_threads} thread(s) each, gloo) vs one ({s["threads"]} threads):')
    print_part(dp)
    match = 'match' if dp['losses_match'] else 'DIFFER'
    print(f'  losses {match} at every step (max |diff| {dp["max_loss_abs_diff"]:.1e}; tolerance {LOSS_TOLERANCE:.0e})')
    pairs = s['repeats'] * s['steps']
    for part, figures in (('Ray', ray_fig), ('data parallel', dp)):
        if figures['disturbed_pairs'] > pairs // 10:
            print(
                f'  warning ({part}): {figures["disturbed_pairs"]} of {pairs} step pairs ran over {DISTURBED}x the'
                f' median (load average {env["load_average_1min_before"]:.1f} before, {env["load_average_1min"]:.1f}'
                f' after, on {env["cpu_count"]} CPUs): a busy machine'
            )


def parse_args() -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='small-qwen3', help='embedded model name or a local model directory')
    parser.add_argument('--steps', type=int, default=2, help='timed steps per block')
    parser.add_argument('--warmup', type=int, default=2, help='untimed steps per side before timing')
    parser.add_argument('--repeats', type=int, default=16, help='timed blocks per side, in each part')
    parser.add_argument('--calls', type=int, default=50, help='no-op calls per block')
    parser.add_argument('--call-repeats', type=int, default=6, help='no-op blocks per side')
    parser.add_argument('--threads', type=int, default=2, help='torch threads of one process')
    parser.add_argument('--ranks', type=int, default=2, help='torchrun processes (data parallel ranks)')
    parser.add_argument('--batch-size', type=int, default=8, help='global batch: a multiple of --ranks')
    parser.add_argument('--max-length', type=int, default=256)
    parser.add_argument('--output', default='benchmarks/results/distributed_overhead.json')
    parser.add_argument('--worker', metavar='DIR', help='internal: run as one torchrun rank of part 2')
    args = parser.parse_args()
    fields = ['steps', 'warmup', 'repeats', 'calls', 'call_repeats', 'threads', 'ranks']
    if min(getattr(args, name) for name in fields) < 1:
        parser.error(f'{", ".join("--" + name.replace("_", "-") for name in fields)} must be at least 1')
    if args.batch_size % args.ranks:
        parser.error(f'--batch-size {args.batch_size} must be a multiple of --ranks {args.ranks}')
    settings = Settings(**{name: getattr(args, name) for name in ['model', *fields, 'batch_size', 'max_length']})
    return args, settings


def main() -> None:
    args, settings = parse_args()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings('ignore', category=FutureWarning)  # deprecations inside peft/transformers
    if args.worker:
        worker(Path(args.worker))
        return
    load_before = os.getloadavg()[0]
    torch.set_num_threads(settings.threads)
    model_dir = assets.tiny_model(settings.model) if settings.model in assets.MODELS else settings.model
    batches = encode_batches(model_dir, settings.batch_size, settings.max_length, settings.seed)
    began = time.perf_counter()
    ray_run = ray_dispatch(settings, batches, model_dir)
    phase_s = {'ray': time.perf_counter() - began}
    with tempfile.TemporaryDirectory(prefix='twinkle-dist-bench-') as workdir:
        dp_traces = data_parallel(settings, batches, model_dir, Path(workdir))
    phase_s['data_parallel'] = time.perf_counter() - began - phase_s['ray']
    traces = {'ray': ray_run['traces'], 'data_parallel': dp_traces}
    result = {
        'benchmark': 'distributed_overhead',
        'settings': asdict(settings),
        'environment': environment(settings, load_before, ray_run['actor_threads']),
        'figures': {
            'ray': summarize_ray(ray_run['traces'], ray_run['noop_s']),
            'data_parallel': summarize_data_parallel(dp_traces),
        },
        'losses': {part: {side: t.losses for side, t in sides.items()} for part, sides in traces.items()},
        'step_s': {part: {side: t.step_s for side, t in sides.items()} for part, sides in traces.items()},
        'noop_call_s': ray_run['noop_s'],
        # Wall time of each part, start-up (Ray, the actor, the torchrun processes) included.
        'phase_s': phase_s,
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print_summary(result)
    print(f'  results: {output}')


if __name__ == '__main__':
    main()
