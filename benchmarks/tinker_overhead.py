"""What does training through the official Tinker SDK cost, against twinkle's own client and
against the local API?

One training step, three ways, in one run, on the same batches in the same order:

* ``local`` (the baseline): ``TransformersModel.forward_backward`` then ``clip_grad_and_step``
  in this process (as ``lora_overhead.py``'s twinkle loop);
* ``native``: the same calls through ``twinkle_client``'s ``MultiLoraTransformersModel`` (as
  ``server_overhead.py``'s remote loop);
* ``tinker``: the unpatched ``tinker`` SDK (``init_tinker_compat_client``): the rows converted
  with ``input_feature_to_datum``, ``forward_backward(data, 'cross_entropy')`` and
  ``optim_step(AdamParams(...))`` submitted together, then both results awaited, as the seed
  documents' Tinker scripts do.

The two remote paths talk to one ``twinkle-server serve`` subprocess on loopback
(``server_overhead.ServerProcess``; each path has its own tenant key). All three do the same
arithmetic: LoRA r=8, alpha=32 on every linear layer of attention and MLP (``all-linear``; the
Tinker client asks for ``train_unembed=False`` to match), the token-sum cross-entropy that
Tinker's ``cross_entropy`` computes (``CrossEntropyLoss(reduction='sum')`` on the twinkle
paths), gradients clipped to norm 1.0, and AdamW with torch's defaults (lr 1e-4, betas 0.9 /
0.999, eps 1e-8, decoupled weight decay 0.01). The adapters start from the same seed, so the
first-step losses agree (a fresh adapter's LoRA B is zero). Losses are reported per trained
token. The data are fixed batches of self-cognition rows encoded once (``lora_overhead``), on
``small-qwen3`` by default. After ``--warmup`` untimed steps each, the paths take turns in
blocks of ``--steps`` (local, native, tinker, then tinker, native, local, ...) for
``--repeats`` blocks; step ``k`` of any path trains batch ``k``.

Figures, per remote path against ``local`` (``lora_overhead.summarize``):

* ``median_step_s``, ``tokens_per_s``: per path;
* ``step_ratio``: median over steps of path_step_time / local_step_time on the same batch
  (``overhead_pct`` = (step_ratio - 1) * 100), and ``added_ms_per_step``: median step time
  minus the local median;
* ``tinker_vs_native``: the same figures of the Tinker path against the native client.

Usage::

    .venv/bin/python benchmarks/tinker_overhead.py      # ~1 min on 2 idle cores; writes results/tinker_overhead.json
    ... --model tiny-qwen3 --repeats 20 --output /tmp/tinker_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import tinker
import torch
import transformers
from lora_overhead import DISTURBED, Batch, Trace, TwinkleLoop, benchmark, encode_batches, summarize
from lora_overhead import Settings as TrainingSettings
from server_overhead import TARGET_OVERHEAD_PCT, RemoteLoop, ServerProcess
from server_overhead import environment as server_environment
from tinker import types

from twinkle import assets
from twinkle.server.common import input_feature_to_datum
from twinkle_client import TwinkleClient, init_tinker_compat_client

DEFAULT_MODEL = 'small-qwen3' if 'small-qwen3' in assets.MODELS else 'tiny-qwen3'
BASELINE = 'local'


@dataclass
class Settings:
    # Embedded model name (twinkle.assets.MODELS) or a local model directory, served and trained locally.
    model: str
    # 'cpu' or 'cuda', for the local model and the server alike.
    device: str
    # Timed steps per block, untimed steps per path before timing, blocks per path.
    steps: int
    warmup: int
    repeats: int
    # Rows per batch, and the longest encoded row.
    batch_size: int = 8
    max_length: int = 256
    # LoRA and optimizer settings shared by every path (alpha is the server's Tinker default).
    lora_r: int = 8
    lora_alpha: int = 32
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    seed: int = 0
    # Seconds to wait for the server subprocess to answer /healthz.
    startup_timeout_s: float = 300.0

    @property
    def mixed_precision(self) -> str:
        """What the server picks for its device (it takes no setting), so the local model matches."""
        return 'bf16' if self.device == 'cuda' and torch.cuda.is_bf16_supported() else 'no'

    def training(self) -> TrainingSettings:
        """The settings ``lora_overhead``'s loop and block alternation read (and ``server_overhead``'s
        remote loop, server process and environment, which take this object too)."""
        return TrainingSettings(**{name: getattr(self, name) for name in TrainingSettings.__dataclass_fields__})

    def adam(self) -> types.AdamParams:
        """torch's AdamW defaults, which ``set_optimizer('AdamW', lr=...)`` gives the twinkle paths."""
        torch_defaults = {'beta1': 0.9, 'beta2': 0.999, 'eps': 1e-8, 'weight_decay': 0.01}
        return types.AdamParams(learning_rate=self.lr, grad_clip_norm=self.max_grad_norm, **torch_defaults)


# ---- the three paths ------------------------------------------------------------------------------
class TokenSumLoss:
    """Mixin for the twinkle loops: Tinker's token-sum cross-entropy, reported per trained token."""

    model: Any
    max_grad_norm: float

    def use_token_sum(self) -> None:
        self.model.set_loss('CrossEntropyLoss', reduction='sum')

    def step(self, batch: Batch) -> float:
        output = self.model.forward_backward(inputs=batch)
        self.model.clip_grad_and_step(self.max_grad_norm)
        return output.loss / max(output.num_tokens, 1)


class LocalLoop(TokenSumLoss, TwinkleLoop):
    def __init__(self, model_dir: str, settings: Settings):
        super().__init__(model_dir, settings.training())
        self.use_token_sum()


class NativeLoop(TokenSumLoss, RemoteLoop):
    def __init__(self, client: TwinkleClient, settings: Settings):
        super().__init__(client, settings, seed=settings.seed)
        self.use_token_sum()


class TinkerLoop:
    """The seed documents' Tinker training step through the SDK."""

    def __init__(self, service: tinker.ServiceClient, settings: Settings):
        self.adam = settings.adam()
        self.client = service.create_lora_training_client(
            base_model=settings.model, rank=settings.lora_r, seed=settings.seed, train_unembed=False
        ).result()

    def step(self, batch: Batch) -> float:
        data = [input_feature_to_datum(row) for row in batch]
        fwdbwd_future = self.client.forward_backward(data, 'cross_entropy')
        optim_future = self.client.optim_step(self.adam)
        loss_sum = fwdbwd_future.result().metrics['loss:sum']
        optim_future.result()
        tokens = sum(float(datum.loss_fn_inputs['weights'].to_numpy().sum()) for datum in data)
        return loss_sum / max(tokens, 1.0)


# ---- report ---------------------------------------------------------------------------------------
def against(traces: dict[str, Trace], baseline: str, candidate: str) -> dict[str, Any]:
    """``lora_overhead.summarize`` of ``candidate`` against ``baseline``, without the per-loop
    figures (kept once, under ``loops``), plus the step ratio and the milliseconds added per step."""
    figures = summarize(traces, baseline=baseline, candidate=candidate, target_pct=TARGET_OVERHEAD_PCT)
    loops = figures.pop('loops')
    added = 1000 * (loops[candidate]['median_step_s'] - loops[baseline]['median_step_s'])
    return {'step_ratio': 1 + figures['overhead_pct'] / 100, 'added_ms_per_step': added, **figures}


def summarize_paths(traces: dict[str, Trace]) -> dict[str, Any]:
    return {
        'loops': summarize(traces, baseline=BASELINE, candidate='tinker')['loops'],
        'native': against(traces, BASELINE, 'native'),
        'tinker': against(traces, BASELINE, 'tinker'),
        'tinker_vs_native': against(traces, 'native', 'tinker'),
    }


def print_summary(result: dict[str, Any]) -> None:
    s, env, fig = result['settings'], result['environment'], result['figures']
    print(
        f'\nTinker overhead: {s["model"]} on {s["device"]} ({env["device"]}, {env["torch_threads"]} threads), '
        f'batch {s["batch_size"]}, LoRA r={s["lora_r"]}, {s["repeats"]} x {s["steps"]} timed steps per path'
        f' after {s["warmup"]} warmup; server in a subprocess on loopback'
    )
    for name, loop in fig['loops'].items():
        line = f'  {name:7s} median step {1000 * loop["median_step_s"]:8.1f} ms   {loop["tokens_per_s"]:8.0f} tokens/s'
        if name != BASELINE:
            path = fig[name]
            low, high = path['overhead_pct_iqr']
            line += (
                f'   x{path["step_ratio"]:.3f} of local ({path["overhead_pct"]:+.1f}%, middle half {low:+.1f}% ..'
                f' {high:+.1f}%; {path["added_ms_per_step"]:+.1f} ms per step)'
            )
        print(line)
    versus = fig['tinker_vs_native']
    print(
        f'  tinker against native: x{versus["step_ratio"]:.3f} per step ({versus["added_ms_per_step"]:+.1f} ms);'
        f' the {TARGET_OVERHEAD_PCT:.0f}% target of server_overhead is'
        f' {"met" if fig["tinker"]["within_target"] else "MISSED"} by tinker'
    )
    disturbed = max(fig[name]['disturbed_pairs'] for name in ('native', 'tinker'))
    if disturbed > len(result['step_s'][BASELINE]) // 10:
        print(
            f'  warning: up to {disturbed} of {len(result["step_s"][BASELINE])} step pairs ran over {DISTURBED}x the'
            f' median (load average {env["load_average_1min_before"]:.1f} before, {env["load_average_1min"]:.1f}'
            f' after, on {env["cpu_count"]} CPUs): a busy machine; the medians resist it, the means do not'
        )
    first = {name: loop['first_loss'] for name, loop in fig['loops'].items()}
    match = 'match' if fig['native']['losses_match'] and fig['tinker']['losses_match'] else 'DIFFER'
    diffs = max(fig[name]['max_loss_abs_diff'] for name in ('native', 'tinker'))
    print(
        f'  first-step loss per token: {", ".join(f"{k} {v:.6f}" for k, v in first.items())} ({match};'
        f' max |diff| from local over all steps {diffs:.1e})'
    )


def parse_args() -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default=DEFAULT_MODEL, help='embedded model name or a local model directory')
    parser.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    parser.add_argument('--steps', type=int, default=2, help='timed steps per block')
    parser.add_argument('--warmup', type=int, default=3, help='untimed steps per path before timing')
    parser.add_argument('--repeats', type=int, default=5, help='timed blocks per path')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--max-length', type=int, default=256)
    parser.add_argument('--output', default='benchmarks/results/tinker_overhead.json')
    args = parser.parse_args()
    if args.device == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: no CUDA device is available')
    if min(args.steps, args.warmup, args.repeats) < 1:
        parser.error('--steps, --warmup and --repeats must be at least 1')
    names = ['model', 'device', 'steps', 'warmup', 'repeats', 'batch_size', 'max_length']
    return Settings(**{name: getattr(args, name) for name in names}), Path(args.output)


def measure(settings: Settings, batches: list[Batch], model_dir: str, workdir: Path) -> dict[str, Any]:
    began = time.perf_counter()
    server = ServerProcess(settings, workdir)
    native_key, tinker_key = server.add_key('native'), server.add_key('tinker')
    with server as url, init_tinker_compat_client(url, tinker_key) as service:
        loops = {
            BASELINE: LocalLoop(model_dir, settings),
            'native': NativeLoop(TwinkleClient(url, native_key), settings),
            'tinker': TinkerLoop(service, settings),
        }
        start_s = time.perf_counter() - began
        traces = benchmark(loops, batches, settings.training())
    return {
        'figures': summarize_paths(traces),
        'losses': {name: trace.losses for name, trace in traces.items()},
        'step_s': {name: trace.step_s for name, trace in traces.items()},
        # Wall time of each part (start: keys, server start, the three paths built).
        'phase_s': {'start': start_s, 'training': time.perf_counter() - began - start_s},
    }


def main() -> None:
    settings, output = parse_args()
    load_before = os.getloadavg()[0]
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings('ignore', category=FutureWarning)  # deprecations inside peft/transformers
    model_dir = assets.tiny_model(settings.model) if settings.model in assets.MODELS else settings.model
    batches = encode_batches(model_dir, settings.batch_size, settings.max_length, settings.seed)
    with tempfile.TemporaryDirectory(prefix='twinkle-tinker-bench-') as workdir:
        measured = measure(settings, batches, model_dir, Path(workdir))
    result = {
        'benchmark': 'tinker_overhead',
        'settings': asdict(settings),
        'environment': {**server_environment(settings, load_before), 'tinker': tinker.__version__},
        **measured,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print_summary(result)
    print(f'  results: {output}')


if __name__ == '__main__':
    main()
