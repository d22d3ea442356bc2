"""SFT and GRPO step speed and memory: twinkle, with each of its speed switches on and off,
against the raw PyTorch + PEFT loop, on the models where the output layer weighs what it does in
real ones.

Models: ``wide-qwen3`` (Qwen3's 151,936 outputs on two layers of Qwen3-0.6B's width: the output
layer's real share of a step), ``small-qwen3`` and ``tiny-qwen3.5`` (4,096 outputs). The SFT step
is ``lora_overhead.py``'s, whose loops this imports: LoRA r=16, alpha=32, ``all-linear``, AdamW
1e-4, clip 1.0, batch 8 of self-cognition rows (60 to 94 tokens each, 595 real tokens per batch on
average; ``--max-length`` 128 cuts none), float32 on the CPU, the same batches in the same order
and the same adapter initialisation in every loop.

The GRPO step (``--loss grpo``; the default ``sft,grpo`` runs both) trains the same rows as
sampled completions: the first third of each row is the prompt (labels -100), the rest is labelled
with its next tokens; each row has one advantage (normal, seeded) and the sampler's logprob of each
completion token (uniform in [-3, -0.1], seeded). Clip 0.2, KL weight beta 0.04 to the base model
(the adapter off), the entropy of the trained positions as a metric, and ``GRPOLoss``'s default
aggregation (``loss_type='grpo'``: each sequence's token mean, averaged over the sequences).

* ``raw``: ``lora_overhead.RawLoop`` (pad, forward, float32 logits, cross-entropy, backward,
  clip, AdamW step); for GRPO ``RawGRPOLoop``, as a user writes it with PEFT: pad, forward, the
  float32 log-softmax gathered at the labels, the reference's the same way from a second forward
  under ``disable_adapter()`` and ``no_grad()``, ratio, clipped surrogate, k3 KL, entropy,
  backward, clip, AdamW step.
* one row per twinkle variant of ``--switches`` (default: all seven): ``lora_overhead.TwinkleLoop``
  (for GRPO ``TwinkleGRPOLoop``: ``set_loss('GRPOLoss', epsilon=0.2, beta=0.04)``,
  ``add_metric('GRPOMetric')``) with the keywords ``VARIANTS`` gives the variant: ``plain``
  (``fused_output=False, padding_free=False``), ``fused`` (the fused output layer alone),
  ``packed`` (padding-free alone: the batch's rows packed into one row), ``both`` (fused and
  packed), ``compiled`` (``compile_layers=True`` alone: each decoder layer through
  ``torch.compile``; the compiles happen in the warm-up step, whose time ``warmup_s`` records) and
  ``all`` (the three switches), and ``checkpointed`` (the fused output layer with
  ``gradient_checkpointing=True``: each decoder layer's activations recomputed in the backward rather
  than kept, for memory, not speed). A keyword
  ``TransformersModel.__init__`` does not take yet makes the row "n/a (switch missing)" rather
  than an error.

Each loop runs in its own child process, forked from a server process that has imported the
modules and run nothing (multiprocessing's ``forkserver``), so no two loops share an allocator's
high-water mark or warm caches, and no child pays the imports again: it loads the model, adds the
adapter, runs ``--warmup`` untimed steps (the optimizer state exists after the first), then
``--steps`` timed steps. Memory is the resident set's growth during a step: before each timed step
the kernel's high-water mark is reset (``/proc/self/clear_refs``, 5) and the resident set read
(VmRSS); after it, VmHWM minus that reading is the step's growth (the peak of the live tensors the
step makes: activations, logits, gradients). glibc's mmap threshold is fixed at 1 MiB first, so
freed buffers go back to the system and the resident set follows the live tensors. On CUDA the
same figure comes from ``torch.cuda.max_memory_allocated`` over the allocated bytes before the step.

Figures per step, model and loop: ``tokens_per_s`` (real tokens of a step over its wall time,
median over the timed steps), ``peak_growth_mib`` (the largest step growth), and for each twinkle
variant ``speed_ratio`` (its tokens/s over raw's: the aim is >= 1.3) and ``memory_ratio`` (its
peak growth over raw's: the aim is <= 0.5), with the first-step loss against raw's (both start
from the same weights: they must agree within 1e-4). Loops run one after another, not
interleaved, so a change in machine load between two children shows in the ratio: the JSON
records the load average, and each child's ``warmup_s`` and ``child_s`` (its whole life).

Sizes: the default (SFT and GRPO x 3 models x 8 loops = 48 children, 1 warm-up and 2 timed steps each)
took 17 minutes on 2 idle CPU cores with the first six variants, most of it on ``wide-qwen3`` and the
compiles (``--steps 1`` cuts the timed part by a third; ``--models`` and ``--switches`` pick a part).
``--quick`` (``wide-qwen3`` only, batch 4, 1 warm-up and 1 timed step, both steps: 10 children)
takes about a minute and a half: a smoke run, not figures.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/sft_speed.py            # writes benchmarks/results/sft_speed.json
    PYTHONPATH=src .venv/bin/python benchmarks/sft_speed.py --quick --output /tmp/sft_speed.json
    ... --loss grpo --switches plain,both --models wide-qwen3 --device cuda
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import multiprocessing
import multiprocessing.context
import os
import random
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
    collate,
    encode_batches,
    environment,
    loop_figures,
    run_steps,
)

from twinkle import assets
from twinkle.data_format import IGNORE_INDEX
from twinkle.model import TransformersModel

MODELS = ('wide-qwen3', 'small-qwen3', 'tiny-qwen3.5')
QUICK_MODELS = ('wide-qwen3',)  # --quick: the model the switches are for (each child's imports take ~7 s)
#: ``TransformersModel`` keywords of each twinkle variant ``--switches`` can name.
VARIANTS: dict[str, dict[str, Any]] = {
    'plain': {'fused_output': False, 'padding_free': False},
    'fused': {'fused_output': True, 'padding_free': False},
    'packed': {'fused_output': False, 'padding_free': True},
    'both': {'fused_output': True, 'padding_free': True},
    'compiled': {'fused_output': False, 'padding_free': False, 'compile_layers': True},
    'all': {'fused_output': True, 'padding_free': True, 'compile_layers': True},
    'checkpointed': {'fused_output': True, 'padding_free': False, 'gradient_checkpointing': True},
}
#: The training steps ``--loss`` can name, and how the output names them.
LOSSES = ('sft', 'grpo')
STEP_NAMES = {'sft': 'SFT step', 'grpo': 'GRPO step (logprobs, ratio, KL to the adapter-off reference, entropy)'}
# GRPO: the clip range and the KL weight (beta > 0: a reference forward with the adapter off),
# the share of each row that is prompt (labels -100), and the range of the sampler's logprobs.
GRPO_EPSILON = 0.2
GRPO_BETA = 0.04
PROMPT_SHARE = 1 / 3
OLD_LOGP_RANGE = (-3.0, -0.1)
# The aims (issue 33): twinkle's tokens/s over raw's, and its peak growth over raw's.
SPEED_AIM = 1.3
MEMORY_AIM = 0.5
MISSING = 'n/a (switch missing)'


def missing_switches(keywords: dict[str, Any]) -> list[str]:
    """The keywords of ``keywords`` that ``TransformersModel.__init__`` does not name (its
    ``**from_pretrained_kwargs`` would pass them on to transformers, not take them)."""
    accepted = inspect.signature(TransformersModel.__init__).parameters
    return [name for name in keywords if name not in accepted]


# ---- the GRPO step ---------------------------------------------------------------------------------
def grpo_batches(batches: list[Batch], seed: int) -> list[Batch]:
    """The SFT rows as GRPO rows: the first third of each row is the prompt (labels -100), the
    rest the completion, each position labelled with the next token (labels are pre-shifted).
    Each row carries its loss inputs, fixed by ``seed``: ``advantage`` (one number) and
    ``old_logps`` (the sampler's logprob of each completion token)."""
    rng = random.Random(seed)
    out = []
    for batch in batches:
        rows = []
        for row in batch:
            ids = row['input_ids']
            prompt = int(len(ids) * PROMPT_SHARE)
            labels = [IGNORE_INDEX] * prompt + ids[prompt + 1 :] + [IGNORE_INDEX]
            old_logps = [rng.uniform(*OLD_LOGP_RANGE) for _ in range(len(ids) - prompt - 1)]
            rows.append(row | {'labels': labels, 'advantage': rng.gauss(0.0, 1.0), 'old_logps': old_logps})
        out.append(rows)
    return out


def grpo_inputs(batch: Batch) -> tuple[Batch, list[float], list[list[float]]]:
    """A GRPO batch's token rows, its advantages (one per row) and old logprobs (per completion token)."""
    rows = [{k: v for k, v in row.items() if k not in ('advantage', 'old_logps')} for row in batch]
    return rows, [row['advantage'] for row in batch], [row['old_logps'] for row in batch]


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's log-probability ``[B, S]`` (any value where ignored), and the float32 log-softmax."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), log_probs


class RawGRPOLoop(RawLoop):
    """A GRPO step as a user writes it with PEFT: the policy's label logprobs, the reference's
    from a second forward with the adapter off, the clipped ratio against the sampler's logprobs,
    the k3 KL, the entropy (a metric), and GRPOLoss's default aggregation (``loss_type='grpo'``:
    each sequence's token mean, averaged over the sequences)."""

    def step(self, batch: Batch) -> float:
        rows, advantages, old_logps = grpo_inputs(batch)
        tensors = collate(rows, self.pad_token_id, self.device)
        labels = tensors.pop('labels')
        mask = labels != IGNORE_INDEX
        logps, log_probs = label_logprobs(self.model(**tensors, use_cache=False).logits, labels)
        with self.model.disable_adapter(), torch.no_grad():
            ref_logps, _ = label_logprobs(self.model(**tensors, use_cache=False).logits, labels)
        with torch.no_grad():
            trained = log_probs[mask]
            self.entropy = -(trained.exp() * trained).sum(-1).mean()
        old_flat = torch.tensor([logp for row in old_logps for logp in row], device=self.device)
        old = torch.zeros_like(logps).masked_scatter(mask, old_flat)
        advantage = torch.tensor(advantages, device=self.device).unsqueeze(1)
        ratio = torch.exp(logps - old)
        surrogate = -torch.minimum(ratio * advantage, ratio.clamp(1 - GRPO_EPSILON, 1 + GRPO_EPSILON) * advantage)
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = (surrogate + GRPO_BETA * kl) * mask
        loss = (per_token.sum(1) / mask.sum(1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


class TwinkleGRPOLoop(TwinkleLoop):
    """The same GRPO step through ``TransformersModel``: its GRPOLoss computes the reference
    logprobs itself (the adapter off), GRPOMetric takes the entropy."""

    def __init__(self, model_dir: str, settings: Settings, **model_kwargs: Any):
        super().__init__(model_dir, settings, **model_kwargs)
        self.model.set_loss('GRPOLoss', epsilon=GRPO_EPSILON, beta=GRPO_BETA)
        self.model.add_metric('GRPOMetric')

    def step(self, batch: Batch) -> float:
        rows, advantages, old_logps = grpo_inputs(batch)
        output = self.model.forward_backward(inputs=rows, advantages=advantages, old_logps=old_logps)
        self.model.clip_grad_and_step(self.max_grad_norm)
        return output.loss


def make_loop(loss: str, loop: str, model_dir: str, settings: Settings) -> Loop:
    """Loop ``loop`` (``raw`` or a variant) of the ``loss`` step."""
    raw_cls, twinkle_cls = (RawGRPOLoop, TwinkleGRPOLoop) if loss == 'grpo' else (RawLoop, TwinkleLoop)
    if loop == 'raw':
        return raw_cls(model_dir, settings)
    return twinkle_cls(model_dir, settings, **VARIANTS[loop])


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
    """Build loop ``spec['loop']`` of step ``spec['loss']`` on ``spec['model_dir']``, warm it up, time its steps."""
    ctypes.CDLL('libc.so.6').mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, so freed buffers are returned
    settings = Settings(**spec['settings'])
    batches: list[Batch] = json.loads(Path(spec['batches']).read_text())
    device = torch.device(settings.device)
    started = time.perf_counter()
    loop = make_loop(spec['loss'], spec['loop'], spec['model_dir'], settings)
    load_s = time.perf_counter() - started
    trace = Trace([], [], [])
    run_steps(loop, batches, 0, settings.warmup, device, trace)
    warmup_s = sum(trace.step_s)
    trace.step_s.clear()
    trace.step_tokens.clear()
    resident_mib = _status_kib('VmRSS') / 1024
    timed = range(settings.warmup, settings.warmup + settings.steps)
    growth = [measured_step(loop, batches, k, device, trace) for k in timed]
    return {
        'load_s': load_s,
        'warmup_s': warmup_s,
        'resident_after_warmup_mib': resident_mib,
        'step_growth_mib': [g / 2**20 for g in growth],
        'losses': trace.losses,
        'step_s': trace.step_s,
        'step_tokens': trace.step_tokens,
    }


def child_main(spec: dict[str, Any]) -> None:
    """A child's body: its output (warnings, a traceback) to its log file, its figures to ``spec['output']``."""
    log = os.open(spec['log'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings('ignore', category=FutureWarning)  # deprecations inside peft/transformers
    Path(spec['output']).write_text(json.dumps(run_child(spec)))


# ---- the parent: one child per loop ----------------------------------------------------------------
def forkserver() -> multiprocessing.context.ForkServerContext:
    """The context children are forked from: a server process that has imported this script's
    modules (torch, transformers, peft, twinkle: ~7 s a child would otherwise pay) and run nothing."""
    context = multiprocessing.get_context('forkserver')
    context.set_forkserver_preload(['lora_overhead', 'twinkle.model'])
    return context


def spawn(spec: dict[str, Any], workdir: Path, context: multiprocessing.context.ForkServerContext) -> dict[str, Any]:
    """Run one loop in a new child process; its figures, or the error with the child's output."""
    name = f'{spec["loss"]}-{Path(spec["model_dir"]).name}-{spec["loop"]}'
    spec = spec | {'output': str(workdir / f'{name}.out.json'), 'log': str(workdir / f'{name}.log')}
    child = context.Process(target=child_main, args=(spec,), name=name)
    started = time.perf_counter()
    child.start()
    child.join()
    child_s = time.perf_counter() - started
    if child.exitcode != 0:
        output = Path(spec['log']).read_text()[-4000:]
        raise RuntimeError(f'the {spec["loop"]} loop ({name}) failed (exit code {child.exitcode}):\n{output}')
    result: dict[str, Any] = json.loads(Path(spec['output']).read_text())
    return result | {'child_s': child_s}


def loop_row(run: dict[str, Any]) -> dict[str, Any]:
    """``lora_overhead.loop_figures`` of one child's steps, with its memory."""
    figures = loop_figures(Trace(run['losses'], run['step_s'], run['step_tokens']))
    growth = run['step_growth_mib']
    return figures | {
        'peak_growth_mib': max(growth),
        'resident_after_warmup_mib': run['resident_after_warmup_mib'],
        'load_s': run['load_s'],
        'warmup_s': run['warmup_s'],
        'child_s': run['child_s'],
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


def loss_batches(model_dir: str, settings: Settings, losses: list[str], workdir: Path) -> dict[str, Path]:
    """The batches each loss trains on ``model_dir``, encoded once and written for the children."""
    batches = encode_batches(model_dir, settings.batch_size, settings.max_length, settings.seed)
    batches = batches[: settings.warmup + settings.steps]
    paths = {}
    for loss in losses:
        paths[loss] = workdir / f'{loss}-{Path(model_dir).name}-batches.json'
        paths[loss].write_text(json.dumps(grpo_batches(batches, settings.seed) if loss == 'grpo' else batches))
    return paths


def bench_model(
    loss: str,
    model: str,
    model_dir: str,
    batches: Path,
    settings: Settings,
    switches: list[str],
    workdir: Path,
    context: multiprocessing.context.ForkServerContext,
) -> dict[str, Any]:
    """Every loop of the ``loss`` step on ``model``: raw first, then each twinkle variant (or its missing switch)."""
    spec = {
        'loss': loss,
        'model_dir': model_dir,
        'settings': asdict(settings) | {'model': model},
        'batches': str(batches),
    }
    raw = loop_row(spawn(spec | {'loop': 'raw'}, workdir, context))
    rows: dict[str, Any] = {'raw': raw}
    for variant in switches:
        if missing := missing_switches(VARIANTS[variant]):
            rows[variant] = {'status': MISSING, 'missing': missing, 'keywords': VARIANTS[variant]}
            continue
        try:
            row = loop_row(spawn(spec | {'loop': variant}, workdir, context))
        except RuntimeError as failed:  # a switch this model refuses: its row says why, the others run
            reason = str(failed).strip().splitlines()[-1]
            rows[variant] = {'status': 'failed', 'error': reason, 'keywords': VARIANTS[variant]}
            continue
        rows[variant] = {'status': 'ok', 'keywords': VARIANTS[variant]} | row | compare(row, raw)
    return rows


def print_model(model: str, rows: dict[str, Any]) -> None:
    print(f'  {model}:')
    for name, row in rows.items():
        if row.get('status') == MISSING:
            print(f'    {name:8s} {MISSING}: {", ".join(row["missing"])}')
            continue
        if row.get('status') == 'failed':
            print(f'    {name:8s} failed: {row["error"]}')
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
    parser.add_argument('--switches', default=','.join(VARIANTS), help=f'twinkle variants, of {list(VARIANTS)}')
    parser.add_argument('--loss', default=','.join(LOSSES), help=f'comma-separated training steps, of {list(LOSSES)}')
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    parser.add_argument('--steps', type=int, default=2, help='timed steps per loop')
    parser.add_argument('--warmup', type=int, default=1, help='untimed steps per loop before timing')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--max-length', type=int, default=128)
    parser.add_argument('--quick', action='store_true', help='smoke run: wide-qwen3 only, batch 4, 1 + 1 steps')
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'sft_speed.json')
    args = parser.parse_args()
    args.switches = [s for s in args.switches.split(',') if s]
    if unknown := [s for s in args.switches if s not in VARIANTS]:
        parser.error(f'--switches: unknown variant(s) {unknown}; valid variants are {list(VARIANTS)}')
    args.loss = [s for s in args.loss.split(',') if s]
    if not args.loss:
        parser.error(f'--loss names no step; valid steps are {list(LOSSES)}')
    if unknown := [s for s in args.loss if s not in LOSSES]:
        parser.error(f'--loss: unknown step(s) {unknown}; valid steps are {list(LOSSES)}')
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
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings('ignore', category=FutureWarning)
    # Float32 on both devices: the figures compare the arithmetic of the loops, not a precision.
    settings = Settings('', args.device, 'no', args.steps, args.warmup, 1, args.batch_size, args.max_length)
    models = args.models
    print(
        f'{"/".join(args.loss).upper()} steps, LoRA r={settings.lora_r}, batch {settings.batch_size}, {args.device}, '
        f'float32, {settings.warmup} warm-up + {settings.steps} timed steps per loop, each loop in its own process:'
    )
    figures: dict[str, Any] = {loss: {} for loss in args.loss}
    context = forkserver()
    with tempfile.TemporaryDirectory(prefix='sft_speed-') as tmp:
        for model in models:
            model_dir = assets.tiny_model(model) if model in assets.MODELS else model
            batches = loss_batches(model_dir, settings, args.loss, Path(tmp))
            for loss in args.loss:
                rows = bench_model(loss, model, model_dir, batches[loss], settings, args.switches, Path(tmp), context)
                figures[loss][model] = rows
                print_model(f'{model}, {STEP_NAMES[loss]}', rows)
    result = {
        'benchmark': 'sft_speed',
        'settings': asdict(settings)
        | {'models': models, 'losses': args.loss, 'switches': args.switches, 'variants': VARIANTS}
        | {'grpo': {'epsilon': GRPO_EPSILON, 'beta': GRPO_BETA, 'prompt_share': PROMPT_SHARE}},
        'aims': {'speed_ratio_min': SPEED_AIM, 'memory_ratio_max': MEMORY_AIM},
        'environment': environment(settings),
        'figures': figures,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + '\n')
    print(f'  results: {args.output}')


if __name__ == '__main__':
    main()
