"""SFT step speed and memory: twinkle, with each of its speed switches, against the raw PyTorch +
PEFT loop, on the models where the output layer weighs what it does in real ones.

Models: ``wide-qwen3`` (Qwen3's 151,936 outputs on two layers of Qwen3-0.6B's width: the output
layer's real share of a step), ``small-qwen3`` and ``tiny-qwen3.5`` (4,096 outputs). The step is
``lora_overhead.py``'s, whose loops this imports: LoRA r=16, alpha=32, ``all-linear``, AdamW 1e-4,
clip 1.0, batch 8 of self-cognition rows (60 to 94 tokens each, 595 real tokens per batch on
average; ``--max-length`` 128 cuts none), float32 on the CPU, the same batches in the same order
and the same adapter initialisation in every loop.

* ``raw``: ``lora_overhead.RawLoop`` (pad, forward, float32 logits, cross-entropy, backward,
  clip, AdamW step).
* one row per twinkle variant of ``--switches`` (default ``plain,fused``): ``lora_overhead.TwinkleLoop``
  with the keywords ``VARIANTS`` gives the variant (``plain``: ``fused_output=False``; ``fused``:
  ``fused_output=True``). A keyword ``TransformersModel.__init__`` does not take yet makes the row
  "n/a (switch missing)" rather than an error.

Each loop runs in its own child process (a fresh interpreter), so no two loops share an
allocator's high-water mark or warm caches: it loads the model, adds the adapter, runs
``--warmup`` untimed steps (the optimizer state exists after the first), then ``--steps`` timed
steps. Memory is the resident set's growth during a step: before each timed step the kernel's
high-water mark is reset (``/proc/self/clear_refs``, 5) and the resident set read (VmRSS);
after it, VmHWM minus that reading is the step's growth (the peak of the live tensors the step
makes: activations, logits, gradients). glibc's mmap threshold is fixed at 1 MiB first, so freed
buffers go back to the system and the resident set follows the live tensors. On CUDA the same
figure comes from ``torch.cuda.max_memory_allocated`` over the allocated bytes before the step.

Figures per model and loop: ``tokens_per_s`` (real tokens of a step over its wall time, median
over the timed steps), ``peak_growth_mib`` (the largest step growth), and for each twinkle
variant ``speed_ratio`` (its tokens/s over raw's: the aim is >= 1.3) and ``memory_ratio`` (its
peak growth over raw's: the aim is <= 0.5), with the first-step loss against raw's (both start
from the same weights: they must agree within 1e-4). Loops run one after another, not
interleaved, so a change in machine load between two children shows in the ratio: the JSON
records the load average.

Sizes: the default (3 models x 3 loops, 1 warm-up and 3 timed steps each) takes about 4 minutes
on 2 idle CPU cores, most of it on ``wide-qwen3`` and in the children's imports (about 7 s each);
``--quick`` (``wide-qwen3`` only, batch 4, 1 warm-up and 1 timed step) under a minute: a smoke
run, not figures.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/sft_speed.py            # writes benchmarks/results/sft_speed.json
    PYTHONPATH=src .venv/bin/python benchmarks/sft_speed.py --quick --output /tmp/sft_speed.json
    ... --switches plain,fused --models wide-qwen3 --device cuda
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import datasets
import torch
import transformers
from lora_overhead import (
    LOSS_TOLERANCE,
    Batch,
    Loop,
    RawLoop,
    Settings,
    Trace,
    TwinkleLoop,
    encode_batches,
    environment,
    loop_figures,
    run_steps,
)

from twinkle import assets
from twinkle.model import TransformersModel

MODELS = ('wide-qwen3', 'small-qwen3', 'tiny-qwen3.5')
QUICK_MODELS = ('wide-qwen3',)  # --quick: the model the switches are for (each child's imports take ~7 s)
#: ``TransformersModel`` keywords of each twinkle variant ``--switches`` can name.
VARIANTS: dict[str, dict[str, Any]] = {
    'plain': {'fused_output': False},
    'fused': {'fused_output': True},
}
# The aims (issue 33): twinkle's tokens/s over raw's, and its peak growth over raw's.
SPEED_AIM = 1.3
MEMORY_AIM = 0.5
MISSING = 'n/a (switch missing)'


def missing_switches(keywords: dict[str, Any]) -> list[str]:
    """The keywords of ``keywords`` that ``TransformersModel.__init__`` does not name (its
    ``**from_pretrained_kwargs`` would pass them on to transformers, not take them)."""
    accepted = inspect.signature(TransformersModel.__init__).parameters
    return [name for name in keywords if name not in accepted]


# ---- one loop, in a child process ------------------------------------------------------------------
def _status_kib(field: str) -> int:
    line = next(x for x in Path('/proc/self/status').read_text().splitlines() if x.startswith(field + ':'))
    return int(line.split()[1])


def measured_step(loop: Loop, batches: list[Batch], k: int, device: torch.device, trace: Trace) -> int:
    """Run global step ``k``; return the bytes the step grew the resident set (or, on CUDA, the
    allocated memory) to at its peak, over what it held before the step."""
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run_steps(loop, batches, k, 1, device, trace)
        return torch.cuda.max_memory_allocated(device) - before
    Path('/proc/self/clear_refs').write_text('5')  # VmHWM := VmRSS
    before = _status_kib('VmRSS')
    run_steps(loop, batches, k, 1, device, trace)
    return (_status_kib('VmHWM') - before) * 1024


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Build loop ``spec['loop']`` on ``spec['model_dir']``, warm it up, time its steps."""
    ctypes.CDLL('libc.so.6').mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, so freed buffers are returned
    settings = Settings(**spec['settings'])
    batches: list[Batch] = json.loads(Path(spec['batches']).read_text())
    device = torch.device(settings.device)
    started = time.perf_counter()
    if spec['loop'] == 'raw':
        loop: Loop = RawLoop(spec['model_dir'], settings)
    else:
        loop = TwinkleLoop(spec['model_dir'], settings, **VARIANTS[spec['loop']])
    load_s = time.perf_counter() - started
    trace = Trace([], [], [])
    run_steps(loop, batches, 0, settings.warmup, device, trace)
    trace.step_s.clear()
    trace.step_tokens.clear()
    resident_mib = _status_kib('VmRSS') / 1024
    timed = range(settings.warmup, settings.warmup + settings.steps)
    growth = [measured_step(loop, batches, k, device, trace) for k in timed]
    return {
        'load_s': load_s,
        'resident_after_warmup_mib': resident_mib,
        'step_growth_mib': [g / 2**20 for g in growth],
        'losses': trace.losses,
        'step_s': trace.step_s,
        'step_tokens': trace.step_tokens,
    }


def child_main(spec_path: Path) -> None:
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings('ignore', category=FutureWarning)  # deprecations inside peft/transformers
    spec = json.loads(spec_path.read_text())
    Path(spec['output']).write_text(json.dumps(run_child(spec)))


# ---- the parent: one child per loop ----------------------------------------------------------------
def spawn(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one loop in a fresh interpreter; its figures, or the error with the child's output."""
    name = f'{Path(spec["model_dir"]).name}-{spec["loop"]}'
    spec = spec | {'output': str(workdir / f'{name}.out.json')}
    spec_path = workdir / f'{name}.spec.json'
    spec_path.write_text(json.dumps(spec))
    command = [sys.executable, __file__, '--child', str(spec_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f'the {spec["loop"]} loop on {name} failed ({done.returncode}):\n{done.stderr[-4000:]}')
    result: dict[str, Any] = json.loads(Path(spec['output']).read_text())
    return result


def loop_row(run: dict[str, Any]) -> dict[str, Any]:
    """``lora_overhead.loop_figures`` of one child's steps, with its memory."""
    figures = loop_figures(Trace(run['losses'], run['step_s'], run['step_tokens']))
    growth = run['step_growth_mib']
    return figures | {
        'peak_growth_mib': max(growth),
        'resident_after_warmup_mib': run['resident_after_warmup_mib'],
        'load_s': run['load_s'],
    }


def compare(row: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """A twinkle row's ratios to the raw loop's, and whether they meet the aims."""
    speed = row['tokens_per_s'] / raw['tokens_per_s']
    memory = row['peak_growth_mib'] / raw['peak_growth_mib'] if raw['peak_growth_mib'] > 0 else float('nan')
    loss_diff = abs(row['first_loss'] - raw['first_loss'])
    return {
        'speed_ratio': speed,
        'memory_ratio': memory,
        'first_loss_abs_diff': loss_diff,
        'losses_match': loss_diff <= LOSS_TOLERANCE,
        'meets_speed_aim': speed >= SPEED_AIM,
        'meets_memory_aim': memory <= MEMORY_AIM,
    }


def bench_model(model: str, settings: Settings, switches: list[str], workdir: Path) -> dict[str, Any]:
    """Every loop on ``model``: raw first, then each twinkle variant (or its missing switch)."""
    model_dir = assets.tiny_model(model) if model in assets.MODELS else model
    batches = encode_batches(model_dir, settings.batch_size, settings.max_length, settings.seed)
    batches_path = workdir / f'{Path(model_dir).name}-batches.json'
    batches_path.write_text(json.dumps(batches[: settings.warmup + settings.steps]))
    spec = {'model_dir': model_dir, 'settings': asdict(settings) | {'model': model}, 'batches': str(batches_path)}
    raw = loop_row(spawn(spec | {'loop': 'raw'}, workdir))
    rows: dict[str, Any] = {'raw': raw}
    for variant in switches:
        if missing := missing_switches(VARIANTS[variant]):
            rows[variant] = {'status': MISSING, 'missing': missing, 'keywords': VARIANTS[variant]}
            continue
        row = loop_row(spawn(spec | {'loop': variant}, workdir))
        rows[variant] = {'status': 'ok', 'keywords': VARIANTS[variant]} | row | compare(row, raw)
    return rows


def print_model(model: str, rows: dict[str, Any]) -> None:
    print(f'  {model}:')
    for name, row in rows.items():
        if row.get('status') == MISSING:
            print(f'    {name:8s} {MISSING}: {", ".join(row["missing"])}')
            continue
        line = (
            f'    {name:8s} {row["tokens_per_s"]:8.0f} tokens/s  step {row["median_step_s"]:6.2f} s  '
            f'peak +{row["peak_growth_mib"]:7.1f} MiB  first loss {row["first_loss"]:.5f}'
        )
        if name != 'raw':
            match = 'match' if row['losses_match'] else 'DIFFER'
            line += f'  x{row["speed_ratio"]:.2f} speed  x{row["memory_ratio"]:.2f} memory  (losses {match})'
        print(line)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', help=f'comma-separated embedded names or model dirs (default: {",".join(MODELS)})')
    parser.add_argument('--switches', default='plain,fused', help=f'twinkle variants, of {sorted(VARIANTS)}')
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    parser.add_argument('--steps', type=int, default=3, help='timed steps per loop')
    parser.add_argument('--warmup', type=int, default=1, help='untimed steps per loop before timing')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--max-length', type=int, default=128)
    parser.add_argument('--quick', action='store_true', help='smoke run: wide-qwen3 only, batch 4, 1 + 1 steps')
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'sft_speed.json')
    parser.add_argument('--child', type=Path, help=argparse.SUPPRESS)  # internal: run one loop's spec
    args = parser.parse_args()
    if args.child is not None:
        return args
    args.switches = [s for s in args.switches.split(',') if s]
    if unknown := [s for s in args.switches if s not in VARIANTS]:
        parser.error(f'--switches: unknown variant(s) {unknown}; valid variants are {sorted(VARIANTS)}')
    if args.device == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: no CUDA device is available')
    if args.quick:
        args.steps, args.warmup, args.batch_size = 1, 1, 4
    args.models = [m for m in (args.models or ','.join(QUICK_MODELS if args.quick else MODELS)).split(',') if m]
    if min(args.steps, args.warmup) < 1:
        parser.error('--steps and --warmup must be at least 1')
    return args


def main() -> None:
    args = parse_args()
    if args.child is not None:
        child_main(args.child)
        return
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings('ignore', category=FutureWarning)
    # Float32 on both devices: the figures compare the arithmetic of the loops, not a precision.
    settings = Settings('', args.device, 'no', args.steps, args.warmup, 1, args.batch_size, args.max_length)
    models = args.models
    print(
        f'SFT step, LoRA r={settings.lora_r}, batch {settings.batch_size}, {args.device}, float32, '
        f'{settings.warmup} warm-up + {settings.steps} timed steps per loop, each loop in its own process:'
    )
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix='sft_speed-') as tmp:
        for model in models:
            figures[model] = bench_model(model, settings, args.switches, Path(tmp))
            print_model(model, figures[model])
    result = {
        'benchmark': 'sft_speed',
        'settings': asdict(settings) | {'models': models, 'switches': args.switches, 'variants': VARIANTS},
        'aims': {'speed_ratio_min': SPEED_AIM, 'memory_ratio_max': MEMORY_AIM},
        'environment': environment(settings),
        'figures': figures,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + '\n')
    print(f'  results: {args.output}')


if __name__ == '__main__':
    main()
