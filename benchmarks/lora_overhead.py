"""How much slower is LoRA training through twinkle's ``TransformersModel`` than a plain
PyTorch + PEFT loop doing the same arithmetic?

Both loops train the same model (LoRA r=16, alpha=32, ``all-linear``, AdamW lr 1e-4, gradient
clipping at 1.0) from the same adapter initialisation on the same batches in the same order:

* ``twinkle``: ``model.forward_backward(inputs=batch)`` then ``model.clip_grad_and_step()``.
* ``raw``: pad to the longest row, forward, cross-entropy on the pre-shifted labels summed and
  divided by the trained-token count, ``backward``, ``clip_grad_norm_``, ``AdamW.step``,
  ``zero_grad``.

The data (self-cognition, encoded once with twinkle's Dataset + Template) is cut into fixed
batches; global step ``k`` of either loop trains on batch ``k``. After ``--warmup`` untimed
steps each, the loops take turns (raw, twinkle, twinkle, raw, raw, twinkle, ...: the order
flips every repeat so neither always runs first) for ``--repeats`` blocks of ``--steps`` timed
steps. Short blocks keep the two timings of a batch close in time, so a change in machine
load (another process starting) hits both. Collation is timed in both loops: it is part of
every training step.

Figures (``overhead_pct`` is the headline):

* ``median_step_s``: median wall time of one step (forward, backward, clip, optimizer step).
* ``tokens_per_s``: real (unpadded) input tokens of a step over its wall time, median over the
  timed steps (``mean_tokens_per_s``: all tokens over all time, which a burst of load from
  another process skews).
* ``throughput_ratio`` = twinkle tokens/s / raw tokens/s (1.0 = parity, below 1 = slower).
* ``overhead_pct`` = (median over steps of twinkle_step_time / raw_step_time - 1) * 100: the
  extra time twinkle spends per step, each step compared with the raw step on the same batch.
  Positive = twinkle is slower.

The losses of the two loops are compared step by step; the first step must agree within 1e-4
(both start from the same weights, so this shows they compute the same loss); later steps
drift apart only by float rounding (twinkle divides the gradient by the token count, the raw
loop divides the loss).

Usage::

    TWINKLE_HOME=/tmp/twh PYTHONPATH=src python benchmarks/lora_overhead.py
    ... --device cuda --steps 50 --output benchmarks/results/lora_overhead_cuda.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import datasets
import peft
import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from twinkle import assets
from twinkle.data_format import IGNORE_INDEX
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model.transformers import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.template import Template

Batch = list[dict[str, Any]]
LOSS_TOLERANCE = 1e-4
TARGET_OVERHEAD_PCT = 5.0


@dataclass
class Settings:
    # Embedded model name (twinkle.assets.MODELS) or a local model directory.
    model: str
    # 'cpu' or 'cuda'.
    device: str
    # Forward-pass precision of both loops: 'no' (float32) or 'bf16' autocast.
    mixed_precision: str
    # Timed steps per block, untimed steps per loop before timing, and blocks per loop.
    steps: int
    warmup: int
    repeats: int
    # Rows per batch, and the longest encoded row.
    batch_size: int
    max_length: int
    # LoRA and optimizer settings shared by both loops.
    lora_r: int = 16
    lora_alpha: int = 32
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = 0


class Loop(Protocol):
    def step(self, batch: Batch) -> float:
        """Train on one batch; return its mean loss per trained token."""
        ...


# ---- data -----------------------------------------------------------------------------------------
def encode_batches(model_dir: str, batch_size: int, max_length: int, seed: int) -> list[Batch]:
    """Every full batch of one shuffled epoch of self-cognition, encoded once, token fields only."""
    dataset = Dataset(DatasetMeta(assets.dataset('self-cognition')))
    dataset.set_template('Template', model_id=model_dir, max_length=max_length)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()
    fields = ['input_ids', 'attention_mask', 'position_ids', 'labels']
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, data_seed=seed, drop_last=True)
    return [[{name: row[name] for name in fields} for row in batch] for batch in loader]


def collate(batch: Batch, pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad every field to the longest row: input ids with the pad token, labels with
    IGNORE_INDEX, attention mask and position ids with 0."""
    width = max(len(row['input_ids']) for row in batch)
    pads = {'input_ids': pad_token_id, 'attention_mask': 0, 'position_ids': 0, 'labels': IGNORE_INDEX}
    tensors = {}
    for name, pad in pads.items():
        rows = [row[name] + [pad] * (width - len(row[name])) for row in batch]
        tensors[name] = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    return tensors


# ---- the two loops --------------------------------------------------------------------------------
def lora_config(settings: Settings) -> LoraConfig:
    return LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, target_modules='all-linear')


class RawLoop:
    """The plain PyTorch + PEFT loop."""

    def __init__(self, model_dir: str, settings: Settings):
        self.device = torch.device(settings.device)
        self.max_grad_norm = settings.max_grad_norm
        self.precision = settings.mixed_precision
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation='sdpa')
        torch.manual_seed(settings.seed)  # the LoRA A matrices are drawn here
        self.model = get_peft_model(base.to(self.device), lora_config(settings))
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.lr)
        self.pad_token_id = Template(model_dir).pad_token_id

    def step(self, batch: Batch) -> float:
        tensors = collate(batch, self.pad_token_id, self.device)
        labels = tensors.pop('labels')
        with autocast(self.device, self.precision):
            logits = self.model(**tensors, use_cache=False).logits
        loss_sum = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction='sum'
        )
        loss = loss_sum / (labels != IGNORE_INDEX).sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


class TwinkleLoop:
    """The same training through ``TransformersModel``."""

    def __init__(self, model_dir: str, settings: Settings, **model_kwargs: Any):
        self.max_grad_norm = settings.max_grad_norm
        self.model = TransformersModel(
            model_id=model_dir, device=settings.device, mixed_precision=settings.mixed_precision, **model_kwargs
        )
        torch.manual_seed(settings.seed)  # the same LoRA A matrices as RawLoop
        self.model.add_adapter_to_model('default', lora_config(settings))
        self.model.set_optimizer('AdamW', lr=settings.lr)

    def step(self, batch: Batch) -> float:
        output = self.model.forward_backward(inputs=batch)
        self.model.clip_grad_and_step(self.max_grad_norm)
        return output.loss


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == 'bf16':
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---- timing ---------------------------------------------------------------------------------------
@dataclass
class Trace:
    """What one loop did: the loss of every step, and the wall time and input tokens of each
    timed step."""

    losses: list[float]
    step_s: list[float]
    step_tokens: list[int]


def run_steps(loop: Loop, batches: list[Batch], first: int, count: int, device: torch.device, trace: Trace) -> None:
    """Global steps ``first .. first + count - 1`` (step k trains batch k mod len(batches))."""
    for k in range(first, first + count):
        batch = batches[k % len(batches)]
        began = time.perf_counter()
        trace.losses.append(loop.step(batch))
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
        trace.step_s.append(time.perf_counter() - began)
        trace.step_tokens.append(sum(len(row['input_ids']) for row in batch))


def benchmark(loops: dict[str, Loop], batches: list[Batch], settings: Settings) -> dict[str, Trace]:
    """Warm up each loop, then alternate timed blocks: A B, B A, A B, ... (step k of both
    loops trains the same batch)."""
    device = torch.device(settings.device)
    traces = {name: Trace([], [], []) for name in loops}
    for name, loop in loops.items():
        run_steps(loop, batches, 0, settings.warmup, device, traces[name])
        traces[name].step_s.clear()
        traces[name].step_tokens.clear()
    names = list(loops)
    for repeat in range(settings.repeats):
        first = settings.warmup + repeat * settings.steps
        for name in names if repeat % 2 == 0 else names[::-1]:
            run_steps(loops[name], batches, first, settings.steps, device, traces[name])
    return traces


# ---- report ---------------------------------------------------------------------------------------
DISTURBED = 1.5  # a step slower than this many times its loop's median was disturbed (load)


def loop_figures(trace: Trace) -> dict[str, float]:
    per_step = [n / t for n, t in zip(trace.step_tokens, trace.step_s, strict=True)]
    return {
        'median_step_s': statistics.median(trace.step_s),
        'tokens_per_s': statistics.median(per_step),
        'mean_tokens_per_s': sum(trace.step_tokens) / sum(trace.step_s),
        'first_loss': trace.losses[0],
        'last_loss': trace.losses[-1],
    }


def summarize(
    traces: dict[str, Trace],
    baseline: str = 'raw',
    candidate: str = 'twinkle',
    target_pct: float = TARGET_OVERHEAD_PCT,
) -> dict[str, Any]:
    """Figures of ``candidate`` against ``baseline``, step by step on the same batches."""
    raw, tw = traces[baseline], traces[candidate]
    per_loop = {name: loop_figures(trace) for name, trace in traces.items()}
    ratios = [t / r for t, r in zip(tw.step_s, raw.step_s, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    slow_raw, slow_tw = (DISTURBED * per_loop[name]['median_step_s'] for name in (baseline, candidate))
    disturbed = sum(r > slow_raw or t > slow_tw for t, r in zip(tw.step_s, raw.step_s, strict=True))
    loss_diffs = [abs(a - b) for a, b in zip(raw.losses, tw.losses, strict=True)]
    overhead = (statistics.median(ratios) - 1) * 100
    return {
        'loops': per_loop,
        'throughput_ratio': per_loop[candidate]['tokens_per_s'] / per_loop[baseline]['tokens_per_s'],
        'overhead_pct': overhead,
        # The middle half of the per-step ratios: a wide range means a noisy machine.
        'overhead_pct_iqr': [(quartiles[0] - 1) * 100, (quartiles[2] - 1) * 100],
        # Step pairs where either step took over DISTURBED x its loop's median.
        'disturbed_pairs': disturbed,
        'first_loss_abs_diff': loss_diffs[0],
        'max_loss_abs_diff': max(loss_diffs),
        'losses_match': loss_diffs[0] <= LOSS_TOLERANCE,
        'within_target': overhead <= target_pct,
    }


def environment(settings: Settings) -> dict[str, Any]:
    device = torch.device(settings.device)
    return {
        'torch': torch.__version__,
        'transformers': transformers.__version__,
        'peft': peft.__version__,
        'python': platform.python_version(),
        'cpu_count': os.cpu_count(),
        # This run adds about torch_threads; more means other processes competed for the CPU.
        'load_average_1min': os.getloadavg()[0],
        'torch_threads': torch.get_num_threads(),
        'device': torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu',
    }


def print_summary(result: dict[str, Any]) -> None:
    s, env, fig = result['settings'], result['environment'], result['figures']
    print(
        f'\nLoRA overhead: {s["model"]} on {s["device"]} ({env["device"]}, {env["torch_threads"]} threads), '
        f'batch {s["batch_size"]}, {s["repeats"]} x {s["steps"]} timed steps per loop after {s["warmup"]} warmup'
    )
    for name, loop in fig['loops'].items():
        print(f'  {name:8s} median step {1000 * loop["median_step_s"]:8.1f} ms   {loop["tokens_per_s"]:9.0f} tokens/s')
    print(f'  throughput ratio (twinkle tokens/s / raw tokens/s): {fig["throughput_ratio"]:.3f}')
    verdict = 'within' if fig['within_target'] else 'OVER'
    low, high = fig['overhead_pct_iqr']
    print(
        f'  overhead (median per-step twinkle/raw - 1): {fig["overhead_pct"]:+.1f}% ({verdict} the 5% target;'
        f' middle half of steps {low:+.1f}% .. {high:+.1f}%)'
    )
    if fig['disturbed_pairs'] > len(result['step_s']['raw']) // 10:
        print(
            f'  warning: {fig["disturbed_pairs"]} of {len(result["step_s"]["raw"])} step pairs ran over {DISTURBED}x'
            f' the median (load average {env["load_average_1min"]:.1f} on {env["cpu_count"]} CPUs): a busy machine'
        )
    match = 'match' if fig['losses_match'] else 'DIFFER'
    raw_loss, twinkle_loss = (fig['loops'][name]['first_loss'] for name in ('raw', 'twinkle'))
    print(
        f'  first-step loss raw {raw_loss:.6f} twinkle {twinkle_loss:.6f}'
        f' ({match}: |diff| {fig["first_loss_abs_diff"]:.1e}; max over all steps {fig["max_loss_abs_diff"]:.1e})'
    )


def parse_args() -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='small-qwen3', help='embedded model name or a local model directory')
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    parser.add_argument('--mixed-precision', default=None, choices=['no', 'bf16'], help='default: bf16 on cuda')
    parser.add_argument('--steps', type=int, default=2, help='timed steps per block')
    parser.add_argument('--warmup', type=int, default=2, help='untimed steps per loop before timing')
    parser.add_argument('--repeats', type=int, default=20, help='timed blocks per loop (short blocks resist drift)')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--max-length', type=int, default=256)
    parser.add_argument('--output', default='benchmarks/results/lora_overhead.json')
    args = parser.parse_args()
    if args.device == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: no CUDA device is available')
    if min(args.steps, args.warmup, args.repeats) < 1:
        parser.error('--steps, --warmup and --repeats must be at least 1')
    precision = args.mixed_precision or ('bf16' if args.device == 'cuda' and torch.cuda.is_bf16_supported() else 'no')
    settings = Settings(
        args.model, args.device, precision, args.steps, args.warmup, args.repeats, args.batch_size, args.max_length
    )
    return settings, Path(args.output)


def main() -> None:
    settings, output = parse_args()
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings('ignore', category=FutureWarning)  # deprecations inside peft/transformers
    model_dir = assets.tiny_model(settings.model) if settings.model in assets.MODELS else settings.model
    batches = encode_batches(model_dir, settings.batch_size, settings.max_length, settings.seed)
    loops: dict[str, Loop] = {'raw': RawLoop(model_dir, settings), 'twinkle': TwinkleLoop(model_dir, settings)}
    traces = benchmark(loops, batches, settings)
    result = {
        'benchmark': 'lora_overhead',
        'settings': asdict(settings),
        'environment': environment(settings),
        'figures': summarize(traces),
        'losses': {name: trace.losses for name, trace in traces.items()},
        'step_s': {name: trace.step_s for name, trace in traces.items()},
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print_summary(result)
    print(f'  results: {output}')


if __name__ == '__main__':
    main()
