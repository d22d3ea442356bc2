"""What megatron-core's tensor and pipeline parallel give ``MegatronModel``: the same losses, and how
much of the model and its optimizer state each rank holds, at TP=2, PP=2 and TP2xPP2 against one process;
and at DP=2, with the project's per-parameter gradient reduction and with megatron's DDP and distributed
optimizer (``distributed_optimizer=True``, full-parameter training only: each rank holds the optimizer
state of half the weights).

Every layout trains the same batch from the same weights: ``--batch-size`` self-cognition rows
(encoded once here, up to ``--max-length`` tokens) on ``--model`` (default ``small-qwen3``: 8
layers, 8 query and 4 key-value heads of 64, hidden 512, MLP 1408, a 4096-token vocabulary and an untied
head, so every split divides: 4 layers per stage, 4 query and 2 key-value heads per tensor-parallel
rank). Each layout runs as ``torch.distributed.run --nproc_per_node=tp*pp*dp`` processes of this file
(``--worker``; gloo; one process for TP=1 too, so every layout pays the same launch), twice: full-
parameter training, then a LoRA (r=16, alpha=32, ``all-linear``); the DP=2 layouts split the batch's
rows between their ranks, and the distributed optimizer's trains the full model alone. Each takes
``--warmup`` untimed and ``--steps`` timed steps of ``forward_backward`` + ``clip_grad_and_step`` (AdamW, lr 1e-4,
clipping at 1.0) on that same batch.

Figures, per layout and training:

* ``losses``: every step's loss (rank 0's; every rank computes the global one); ``max_loss_diff``:
  the largest difference from TP=1's at the same step (the acceptance bar is 1e-5).
* ``step_s``: the median timed step, each step the slowest rank's (the ranks start a step together
  after a barrier). CPU timings over gloo say nothing about GPU speed: on a CPU the ranks share the
  same cores (one torch thread per rank by default: TP=1 computes on one core while 2 ranks use two,
  and 4 ranks on 2 cores oversubscribe) and exchange activations through shared memory, where on
  GPUs each rank has its own device and NVLink. What this layout does show is memory per rank.
* ``param_bytes``: bytes of the parameters this rank holds (its tensor-parallel slices of its
  pipeline stage's layers, adapters included); ``trainable_bytes``: of those it trains;
  ``optimizer_bytes``: bytes of this rank's optimizer state tensors (AdamW's two moments and step
  counts) after the steps. Each is the largest over the ranks, with every rank's kept in the JSON;
  ratios against TP=1 (1/2 would be a perfect split: what stays whole on every tensor-parallel rank
  keeps it above: the norms, and a LoRA's A of a column-parallel layer and B of a row-parallel one).

Usage (megatron-core's environment)::

    .venv-megatron/bin/python benchmarks/megatron_parallel.py      # ~5 min on 2 idle cores
    .venv-megatron/bin/python benchmarks/megatron_parallel.py --layouts tp1 dp2 dp2-distopt --output /tmp/dp.json
    make bench-megatron
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
import torch
from machine import describe
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh, assets
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.infra import distributed
from twinkle.preprocessor import SelfCognitionProcessor

LOSS_TOLERANCE = 1e-5
#: Layout name: (tp, pp, dp, distributed_optimizer); TP=1 first, the baseline.
LAYOUTS: dict[str, tuple[int, int, int, bool]] = {
    'tp1': (1, 1, 1, False),
    'tp2': (2, 1, 1, False),
    'pp2': (1, 2, 1, False),
    'tp2pp2': (2, 2, 1, False),
    'dp2': (1, 1, 2, False),
    'dp2-distopt': (1, 1, 2, True),
}
TRAININGS = ('full', 'lora')
WORKER_ENV = {'TWINKLE_OFFLINE': '1', 'HF_HUB_OFFLINE': '1', 'HF_DATASETS_DISABLE_PROGRESS_BARS': '1'}


def trainings(layout: str) -> tuple[str, ...]:
    """What ``layout`` trains: megatron's distributed optimizer takes the full model alone."""
    return ('full',) if LAYOUTS[layout][3] else TRAININGS


@dataclass
class Settings:
    # Embedded model name (twinkle.assets.MODELS) or a Qwen3 directory in Hugging Face format.
    model: str = 'small-qwen3'
    batch_size: int = 8
    max_length: int = 128
    warmup: int = 2
    steps: int = 5
    # Torch threads for the whole run: each of a layout's ranks gets threads // ranks, at least 1. One by
    # default: on a shared CPU a process of 2 threads stalls whenever another process takes a core (every
    # parallel region waits for its slower thread), which would slow TP=1 far more than the layouts split.
    threads: int = 1
    lora_r: int = 16
    lora_alpha: int = 32
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = 0
    timeout_s: float = 900.0


# ---- one rank -------------------------------------------------------------------------------------
def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_bytes(model: Any) -> int:
    """Bytes of every tensor in this rank's optimizer states (each adapter's, or the full model's)."""
    total = 0
    for group in model.groups.values():
        if group.optimizer is None:
            continue
        for state in group.optimizer.state.values():
            total += tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor))
    return total


def train_one(
    settings: Settings, model_dir: str, mesh: DeviceMesh | None, batch: list[dict], lora: bool, distopt: bool = False
) -> dict:
    """One training on this rank: its losses, step times and the bytes it holds."""
    from twinkle.model import MegatronModel

    model = MegatronModel(model_id=model_dir, device_mesh=mesh, seed=settings.seed, distributed_optimizer=distopt)
    if lora:
        # The adapter's draws from the seed on every layout, whatever the full-parameter run before it drew.
        torch.manual_seed(settings.seed)
        config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, target_modules='all-linear')
        model.add_adapter_to_model('default', config)
    model.set_optimizer('AdamW', lr=settings.lr)
    losses, step_s = [], []
    for _ in range(settings.warmup + settings.steps):
        if mesh is not None:
            distributed.barrier()
        began = time.perf_counter()
        losses.append(float(model.forward_backward(inputs=batch).loss))
        model.clip_grad_and_step(max_grad_norm=settings.max_grad_norm)
        step_s.append(time.perf_counter() - began)
    params = list(model.model.parameters())
    return {
        'losses': losses,
        'step_s': step_s[settings.warmup :],
        'param_bytes': tensor_bytes(params),
        'trainable_bytes': tensor_bytes(p for p in params if p.requires_grad),
        'optimizer_bytes': optimizer_bytes(model),
    }


def worker(workdir: Path, layout: str) -> None:
    """One rank of one layout: both trainings; rank 0 writes every rank's figures."""
    spec = json.loads((workdir / 'spec.json').read_text())
    settings = Settings(**spec['settings'])
    torch.set_num_threads(int(os.environ['OMP_NUM_THREADS']))
    tp, pp, dp, distopt = LAYOUTS[layout]
    mesh = DeviceMesh.from_sizes(tp_size=tp, pp_size=pp, dp_size=dp, device_type='cpu') if tp * pp * dp > 1 else None
    twinkle.initialize(mode='local', global_device_mesh=mesh, seed=settings.seed)
    # Each data-parallel rank trains its share of the rows; the losses are the whole batch's.
    batch = spec['batch'][distributed.data_rank(mesh) :: dp] if mesh is not None else spec['batch']
    runs = {
        name: train_one(settings, spec['model_dir'], mesh, batch, name == 'lora', distopt) for name in trainings(layout)
    }
    ranks = distributed.all_gather_object(runs) if mesh is not None else [runs]
    if distributed.is_main():
        (workdir / f'{layout}.json').write_text(json.dumps(ranks))


# ---- the driver -----------------------------------------------------------------------------------
def encode_batch(model_dir: str, settings: Settings) -> list[dict]:
    """The first ``batch_size`` self-cognition rows, encoded once: every layout trains on these."""
    dataset = Dataset(DatasetMeta(assets.dataset('self-cognition'), data_slice=range(settings.batch_size)))
    dataset.set_template('Template', model_id=model_dir, max_length=settings.max_length)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()
    fields = ['input_ids', 'attention_mask', 'position_ids', 'labels']
    return [{name: row[name] for name in fields} for row in dataset]


def run_layout(settings: Settings, layout: str, workdir: Path) -> list[dict]:
    """``layout``'s ranks under torchrun; every rank's figures."""
    tp, pp, dp, _ = LAYOUTS[layout]
    ranks = tp * pp * dp
    command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={ranks}']
    command += [str(Path(__file__).resolve()), '--worker', str(workdir), '--layout', layout]
    threads = max(1, settings.threads // ranks)
    env = {**os.environ, **WORKER_ENV, 'OMP_NUM_THREADS': str(threads)}
    done = subprocess.run(command, env=env, capture_output=True, timeout=settings.timeout_s)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).decode(errors='replace')[-4000:]
        raise RuntimeError(f'{layout} exited with {done.returncode}:\n{tail}')
    ranks_figures: list[dict] = json.loads((workdir / f'{layout}.json').read_text())
    return ranks_figures


def summarize(raw: dict[str, list[dict]]) -> dict[str, Any]:
    """Per layout and training: the losses, their largest difference from TP=1's, the median step
    (each step the slowest rank's), the largest bytes held by a rank, and ratios against TP=1."""
    figures: dict[str, Any] = {}
    for training in TRAININGS:
        base: dict[str, Any] = {}
        for layout, ranks in raw.items():
            if training not in ranks[0]:
                continue
            runs = [rank[training] for rank in ranks]
            steps = [max(times) for times in zip(*(run['step_s'] for run in runs), strict=True)]
            entry = {
                'ranks': len(runs),
                'losses': runs[0]['losses'],
                'step_s': statistics.median(steps),
                **{key: max(run[key] for run in runs) for key in ('param_bytes', 'trainable_bytes', 'optimizer_bytes')},
                'per_rank': {key: [run[key] for run in runs] for key in ('param_bytes', 'optimizer_bytes')},
            }
            if layout == 'tp1':
                base = entry
            diffs = [abs(a - b) for a, b in zip(entry['losses'], base['losses'], strict=True)]
            entry['max_loss_diff'] = max(diffs)
            entry['losses_match'] = all(
                d <= LOSS_TOLERANCE * max(1.0, abs(b)) for d, b in zip(diffs, base['losses'], strict=True)
            )
            entry['ratio'] = {
                key: entry[key] / base[key] for key in ('step_s', 'param_bytes', 'trainable_bytes', 'optimizer_bytes')
            }
            figures.setdefault(training, {})[layout] = entry
    return figures


def print_summary(result: dict[str, Any]) -> None:
    s = result['settings']
    print(
        f'\nMegatron TP/PP/DP against one process: {s["model"]}, one batch of {s["batch_size"]} rows, '
        f'{s["warmup"]} warm-up + {s["steps"]} timed steps, gloo, {s["threads"]} torch thread(s) per layout'
        ' (at least one a rank)'
    )
    for training, layouts in result['figures'].items():
        print(f'{training}:')
        for layout, e in layouts.items():
            r = e['ratio']
            print(
                f'  {layout:11s} {e["ranks"]} rank(s)  max |loss diff| {e["max_loss_diff"]:.1e}'
                f' ({"match" if e["losses_match"] else "DIFFER"})'
                f'  step {1000 * e["step_s"]:7.0f} ms (x{r["step_s"]:.2f})'
                f'  params/rank {e["param_bytes"] / 2**20:6.1f} MiB (x{r["param_bytes"]:.2f})'
                f'  optimizer state/rank {e["optimizer_bytes"] / 2**20:6.1f} MiB (x{r["optimizer_bytes"]:.2f})'
            )
    print(
        '  Step times are CPU over gloo, ranks sharing the cores: they say nothing about GPU speed. '
        "Megatron's point here is the memory per rank."
    )


def parse_args() -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    defaults = asdict(Settings())
    for name, default in defaults.items():
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(default), default=default)
    parser.add_argument('--output', default='benchmarks/results/megatron_parallel.json')
    parser.add_argument('--worker', metavar='DIR', help='internal: run as one rank of a layout')
    parser.add_argument('--layout', choices=list(LAYOUTS), help="internal: the worker's layout")
    parser.add_argument('--layouts', nargs='+', choices=list(LAYOUTS), default=list(LAYOUTS), help='tp1 among them')
    args = parser.parse_args()
    if 'tp1' not in args.layouts:
        parser.error('--layouts must include tp1, the baseline the others are compared with')
    args.layouts = ['tp1', *(layout for layout in args.layouts if layout != 'tp1')]
    settings = Settings(**{name: getattr(args, name) for name in defaults})
    for name in ('batch_size', 'steps', 'threads', 'max_length'):
        if getattr(settings, name) < 1:
            parser.error(f'--{name.replace("_", "-")} must be at least 1; got {getattr(settings, name)}')
    return args, settings


def main() -> None:
    args, settings = parse_args()
    warnings.filterwarnings('ignore', category=FutureWarning)
    datasets.disable_progress_bars()
    if args.worker:
        worker(Path(args.worker), args.layout)
        return
    model_dir = assets.tiny_model(settings.model) if settings.model in assets.MODELS else settings.model
    batch = encode_batch(model_dir, settings)
    raw, phase_s, load = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix='twinkle-megatron-bench-') as workdir:
        spec = {'settings': asdict(settings), 'model_dir': model_dir, 'batch': batch}
        (Path(workdir) / 'spec.json').write_text(json.dumps(spec))
        for layout in args.layouts:
            began, load[layout] = time.perf_counter(), os.getloadavg()[0]
            raw[layout] = run_layout(settings, layout, Path(workdir))
            phase_s[layout] = time.perf_counter() - began
    result = {
        'benchmark': 'megatron_parallel',
        'settings': asdict(settings),
        'environment': {**describe(), 'megatron_core': _megatron_version()},
        'tokens': sum(len(row['input_ids']) for row in batch),
        'figures': summarize(raw),
        'step_s_per_rank': {
            layout: [{t: r[t]['step_s'] for t in trainings(layout)} for r in ranks] for layout, ranks in raw.items()
        },
        # Wall time of each layout's torchrun, start-up and both trainings included.
        'phase_s': phase_s,
        # The machine's 1-minute load average as each layout started: above `threads`, others ran too.
        'load_average_before': load,
        'note': 'CPU step times over gloo with ranks sharing cores say nothing about GPU speed; see memory per rank.',
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print_summary(result)
    print(f'  results: {output}')


def _megatron_version() -> str:
    from importlib.metadata import version

    return version('megatron-core')


if __name__ == '__main__':
    main()
