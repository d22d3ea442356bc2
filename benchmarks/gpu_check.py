"""One short check of the Megatron backend, and of the Transformers backend's bf16 path, on a lent GPU.

CPU tests cover megatron-core only through ``twinkle.model.megatron.compat`` (gloo, CPU tensors); this
script runs what they cannot, in one process, in a few minutes on one GPU:

* ``compat``: ``compat.install()`` is a no-op (False) where CUDA is present, so megatron runs unpatched;
* ``parity``: ``MegatronModel`` (NCCL world of one, ``state.initialize``) against ``TransformersModel`` on the
  same rows and weights, per model (tiny-qwen3, small-qwen3), precision (fp32, bf16 autocast) and training
  (every weight; a LoRA adapter saved by the Transformers model and loaded by the Megatron one): the loss, the
  label tokens' logprobs before the step, the gradient norm of one SGD step and the loss after it;
* ``throughput``: tokens/s of LoRA and full training steps (AdamW, clip 1.0, bf16) of both backends on
  small-qwen3, blocks alternating (one GPU, megatron's local layer spec: no Transformer Engine);
* ``transformers_bf16_lora``: ``TransformersModel`` with its default precision (bf16 on a GPU) training a
  LoRA adapter on tiny-qwen3, and two adapters in one mixed pass.

Each result is a JSON line on stdout, appended to ``$OUT/gpu_check.jsonl`` as it comes when ``OUT`` is set;
at the end all of them go to ``$OUT/gpu_check.json`` (or ``--output``). A check that raises is recorded with
its traceback and the others still run; the exit code is 1 if any failed or missed its bound. On a machine
without CUDA it runs the same code on the CPU (gloo, shorter rows, fp32 throughput) as a dry run of the script
itself: the bounds are not checked, and megatron under bf16 autocast is skipped (``CPU_BF16`` says why).

    TWINKLE_HOME=$(mktemp -d) PYTHONPATH=src python benchmarks/gpu_check.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig

from twinkle import assets
from twinkle.model import TransformersModel
from twinkle.model.base import AdapterCall

CUDA = torch.cuda.is_available()
#: What each comparison is held to on a GPU: (fp32, bf16) bounds on the loss difference, relative to the loss.
LOSS_BOUND = {'no': 1e-4, 'bf16': 1e-2}
#: The largest difference of one label token's logprob.
LOGP_BOUND = {'no': 1e-3, 'bf16': 0.25}
#: The gradient norms' relative difference.
NORM_BOUND = {'no': 1e-3, 'bf16': 5e-2}
#: The throughput checks' precision: bf16 on a GPU; fp32 on the CPU (see ``CPU_BF16``).
BENCH_PRECISION = 'bf16' if CUDA else 'no'
#: Why megatron under bf16 autocast is not run on the CPU: its linear layers' backward (``tensor_parallel/
#: layers.py``, ``custom_bwd``) restores the forward's autocast for CUDA only, so on the CPU a bf16 gradient
#: meets the fp32 weight ("expected m1 and m2 to have the same dtype"); ``compat`` does not cover it.
CPU_BF16 = 'megatron-core restores autocast in its linear layers backward for CUDA only (custom_bwd)'
RESULTS: list[dict[str, Any]] = []
FAILED: list[str] = []


def emit(record: dict[str, Any]) -> None:
    """Print one result as a JSON line (flushed: the run may be cut off) and keep it for the file."""
    RESULTS.append(record)
    line = json.dumps(record, default=str)
    print(line, flush=True)
    if os.environ.get('OUT'):  # each line as it comes: a run killed at its time limit still leaves them
        with open(Path(os.environ['OUT']) / 'gpu_check.jsonl', 'a') as stream:
            stream.write(line + '\n')


@contextlib.contextmanager
def check(name: str, **labels: Any) -> Iterator[dict[str, Any]]:
    """A record for one check: filled by the body, emitted at the end; an exception is recorded, not raised."""
    record: dict[str, Any] = {'check': name, **labels}
    start = time.perf_counter()
    try:
        yield record
    except Exception as error:
        record['error'] = f'{type(error).__name__}: {error}'
        record['traceback'] = traceback.format_exc()[-3000:]
        record['ok'] = False
    record['seconds'] = round(time.perf_counter() - start, 2)
    if record.get('ok') is False:
        FAILED.append(f'{name} {labels}')
    emit(record)
    release()


def release() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def rows(count: int, length: int, seed: int, vocab: int = 4096) -> list[dict[str, Any]]:
    """``count`` rows of lengths from ``length // 2`` to ``length`` (right padding), the first two labels ignored."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = max(4, length - (i * length) // (2 * max(1, count)))
        ids = torch.randint(10, vocab, (n,), generator=generator).tolist()
        out.append({'input_ids': ids, 'labels': [-100] * 2 + ids[2:]})
    return out


def environment() -> dict[str, Any]:
    import peft
    import transformers

    info: dict[str, Any] = {
        'check': 'environment',
        'python': platform.python_version(),
        'torch': torch.__version__,
        'transformers': transformers.__version__,
        'peft': peft.__version__,
        'cuda': CUDA,
        'twinkle_home': os.environ['TWINKLE_HOME'],
    }
    try:
        from importlib.metadata import version

        info['megatron_core'] = version('megatron-core')
    except Exception as error:
        info['megatron_core'] = f'missing: {error}'
    if CUDA:
        info['gpu'] = torch.cuda.get_device_name()
        info['cuda_runtime'] = torch.version.cuda
        info['bf16_supported'] = torch.cuda.is_bf16_supported()
    else:
        info['cpu_count'] = os.cpu_count()
    return info


# ---------------------------------------------------------------------------------------------------- checks


def check_compat() -> None:
    with check('compat') as record:
        from twinkle.model.megatron import compat

        patched = compat.install()
        record['install_returned'] = patched
        record['expected'] = not CUDA
        record['ok'] = patched == (not CUDA)


def build_pair(path: str, precision: str, lora: bool, workdir: Path) -> tuple[TransformersModel, Any]:
    """The Transformers model and the Megatron one on the same weights (and, with ``lora``, the same adapter:
    random A and B saved by the Transformers model, loaded by the Megatron one), both on SGD."""
    from twinkle.model.megatron import MegatronModel

    torch.manual_seed(0)
    moe = 'moe' in Path(path).name
    # A mixture of experts: MegatronModel trains without the router's load-balancing loss, so both do.
    extra = {'router_aux_loss_coef': 0.0} if moe else {}
    hf = TransformersModel(model_id=path, mixed_precision=precision, **extra)  # type: ignore[arg-type]
    mg = MegatronModel(model_id=path, mixed_precision=precision)  # type: ignore[arg-type]
    if lora:
        # init_lora_weights=False: B is not zero, so every LoRA weight has a gradient at the first step.
        # On a mixture of experts LoRA targets attention (megatron's experts take no adapters).
        targets = ['q_proj', 'k_proj', 'v_proj', 'o_proj'] if moe else 'all-linear'
        config = LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        hf.add_adapter_to_model('a', config)
        mg.add_adapter_to_model('a', hf.save('init', str(workdir)))
    for model in (hf, mg):
        model.set_optimizer('SGD', lr=0.5)
    return hf, mg


def one_step(model: Any, batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Logprobs and eval loss, then one forward_backward and SGD step (no clipping), then the loss after it."""
    before = model.forward_only(inputs=batch)
    model.calculate_loss()
    model.calculate_metric(is_training=False)
    output = model.forward_backward(inputs=batch)
    norm = model.clip_grad_and_step(max_grad_norm=math.inf)
    model.forward_only(inputs=batch)
    model.calculate_loss()
    after = model.calculate_metric(is_training=False)['loss']
    logps = before.logps.detach().float().cpu()
    return {'loss': float(output.loss), 'grad_norm': float(norm), 'loss_after': float(after), 'logps': logps}


def check_parity(model_name: str, precision: str, lora: bool, batch: list[dict[str, Any]], workdir: Path) -> None:
    labels = {'model': model_name, 'precision': precision, 'training': 'lora' if lora else 'full'}
    if precision == 'bf16' and not CUDA:
        emit({'check': 'parity', **labels, 'skipped': CPU_BF16})
        return
    with check('parity', **labels) as record:
        hf, mg = build_pair(assets.tiny_model(model_name), precision, lora, workdir / f'{model_name}-{precision}')
        record['devices'] = [str(hf.device), str(mg.device)]
        record['float32_matmul_precision'] = torch.get_float32_matmul_precision()
        want, got = one_step(hf, batch), one_step(mg, batch)
        # Both are 0 where the label is ignored, so the largest difference is over the label tokens.
        hf_logps, mg_logps = want.pop('logps'), got.pop('logps')
        record['logps_shape'] = [list(hf_logps.shape), list(mg_logps.shape)]
        record['logp_max_abs_diff'] = (hf_logps - mg_logps).abs().max().item()
        record['transformers'], record['megatron'] = want, got
        record['loss_abs_diff'] = abs(want['loss'] - got['loss'])
        record['loss_after_abs_diff'] = abs(want['loss_after'] - got['loss_after'])
        record['grad_norm_rel_diff'] = abs(want['grad_norm'] - got['grad_norm']) / max(want['grad_norm'], 1e-12)
        if CUDA:
            scale = max(1.0, abs(want['loss']))
            record['bounds'] = {'loss': LOSS_BOUND[precision], 'logp': LOGP_BOUND[precision]}
            record['bounds']['grad_norm_rel'] = NORM_BOUND[precision]
            record['ok'] = (
                record['loss_abs_diff'] <= LOSS_BOUND[precision] * scale
                and record['loss_after_abs_diff'] <= LOSS_BOUND[precision] * scale
                and record['logp_max_abs_diff'] <= LOGP_BOUND[precision]
                and record['grad_norm_rel_diff'] <= NORM_BOUND[precision]
            )
        del hf, mg


def bench_model(backend: str, path: str, lora: bool) -> Any:
    from twinkle.model.megatron import MegatronModel

    torch.manual_seed(0)
    cls = MegatronModel if backend == 'megatron' else TransformersModel
    model = cls(model_id=path, mixed_precision=BENCH_PRECISION)
    if lora:
        model.add_adapter_to_model('a', LoraConfig(r=16, lora_alpha=32, target_modules='all-linear'))
        model.set_optimizer('AdamW', lr=1e-4)
    else:
        model.set_optimizer('AdamW', lr=1e-5)
    return model


def timed_steps(model: Any, batch: list[dict[str, Any]], steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step(max_grad_norm=1.0)
        sync()
        times.append(time.perf_counter() - start)
    return times


def check_throughput(model_name: str, lora: bool, batch: list[dict[str, Any]], steps: int, repeats: int) -> None:
    """Both backends built, warmed up (3 steps), then ``repeats`` blocks of ``steps`` steps each, the order
    flipping every block; tokens/s from the median step."""
    labels = {'model': model_name, 'training': 'lora' if lora else 'full', 'precision': BENCH_PRECISION}
    with check('throughput', **labels) as record:
        record['label'] = (
            f'one {torch.cuda.get_device_name() if CUDA else "CPU"}, megatron-core local layer spec without '
            f'Transformer Engine, world of one, mixed_precision={BENCH_PRECISION!r} over fp32 weights'
        )
        path = assets.tiny_model(model_name)
        models = {name: bench_model(name, path, lora) for name in ('transformers', 'megatron')}
        tokens = sum(len(row['input_ids']) for row in batch)
        record['rows'], record['tokens_per_step'] = len(batch), tokens
        times: dict[str, list[float]] = {name: [] for name in models}
        for model in models.values():
            timed_steps(model, batch, 3)
        order = list(models)
        for _ in range(repeats):
            for name in order:
                times[name] += timed_steps(models[name], batch, steps)
            order.reverse()
        for name, values in times.items():
            median = statistics.median(values)
            record[name] = {'median_step_s': median, 'tokens_per_s': tokens / median, 'steps': len(values)}
        record['megatron_over_transformers'] = (
            record['megatron']['tokens_per_s'] / record['transformers']['tokens_per_s']
        )
        if CUDA:
            record['max_memory_allocated_gib'] = torch.cuda.max_memory_allocated() / 2**30
        record['ok'] = True
        del models


def check_transformers_bf16_lora(batch: list[dict[str, Any]]) -> None:
    """The default precision (bf16 autocast on a GPU) with LoRA: the loss of a repeated batch falls over five
    AdamW steps; then two adapters in one mixed pass, each stepped."""
    with check('transformers_bf16_lora', model='tiny-qwen3') as record:
        torch.manual_seed(0)
        model = TransformersModel(model_id=assets.tiny_model('tiny-qwen3'))
        record['mixed_precision'] = model.mixed_precision
        record['device'] = str(model.device)
        model.add_adapter_to_model('a', LoraConfig(r=8, lora_alpha=16, target_modules='all-linear'))
        model.set_optimizer('AdamW', lr=1e-2)
        losses = []
        for _ in range(5):
            losses.append(float(model.forward_backward(inputs=batch, adapter_name='a').loss))
            model.clip_grad_and_step(adapter_name='a')
        record['losses'] = losses
        out = model.forward_only(inputs=batch, adapter_name='a')
        record['logits_dtype'], record['logps_dtype'] = str(out.logits.dtype), str(out.logps.dtype)
        model.calculate_loss(adapter_name='a')
        model.calculate_metric(is_training=False, adapter_name='a')
        model.add_adapter_to_model('b', LoraConfig(r=4, lora_alpha=8, target_modules='all-linear'))
        model.set_optimizer('AdamW', lr=1e-2, adapter_name='b')
        half = len(batch) // 2 or 1
        calls = [AdapterCall('a', batch[:half]), AdapterCall('b', batch[half:] or batch)]
        mixed = model.forward_backward_mixed(calls)
        record['mixed_losses'] = [getattr(o, 'loss', repr(o)) for o in mixed]
        for name in ('a', 'b'):
            model.clip_grad_and_step(adapter_name=name)
        finite = all(math.isfinite(v) for v in losses) and all(isinstance(v, float) for v in record['mixed_losses'])
        expected = 'bf16' if CUDA and torch.cuda.is_bf16_supported() else 'no'
        record['ok'] = finite and losses[-1] < losses[0] and model.mixed_precision == expected
        del model


# ---------------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', default='tiny-qwen3,small-qwen3', help='models of the parity checks')
    parser.add_argument('--bench-model', default='small-qwen3')
    parser.add_argument('--bench-rows', type=int, default=16 if CUDA else 2)
    parser.add_argument('--bench-length', type=int, default=512 if CUDA else 64)
    parser.add_argument('--bench-steps', type=int, default=10 if CUDA else 2, help='timed steps per block')
    parser.add_argument('--bench-repeats', type=int, default=3 if CUDA else 1, help='blocks per backend')
    parser.add_argument('--skip', default='', help='comma-separated checks to skip: parity,throughput,transformers')
    parser.add_argument('--output', default=None, help='default: $OUT/gpu_check.json when OUT is set')
    return parser.parse_args()


def run_all(args: argparse.Namespace, workdir: Path) -> None:
    """The checks, the most telling first (the first model's parity, the Transformers bf16 path, throughput,
    then the other models' parity), so that a run cut short still answers the main questions."""
    skip = set(filter(None, args.skip.split(',')))
    emit(environment())
    check_compat()
    parity_batch = rows(4, 48 if CUDA else 24, seed=1)
    models = [m for m in args.models.split(',') if m] if 'parity' not in skip else []

    def parity(model_name: str) -> None:
        for precision in ('no', 'bf16'):
            for lora in (False, True):
                check_parity(model_name, precision, lora, parity_batch, workdir)

    if models:
        parity(models[0])
    if 'transformers' not in skip:
        check_transformers_bf16_lora(rows(4, 32, seed=2))
    if 'throughput' not in skip:
        bench_batch = rows(args.bench_rows, args.bench_length, seed=3)
        for lora in (True, False):
            check_throughput(args.bench_model, lora, bench_batch, args.bench_steps, args.bench_repeats)
    for model_name in models[1:]:
        parity(model_name)


def main() -> int:
    args = parse_args()
    if not os.environ.get('TWINKLE_HOME'):  # the assets are built there, offline (twinkle reads it at each use)
        os.environ['TWINKLE_HOME'] = tempfile.mkdtemp(prefix='twinkle-home-')
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix='gpu-check-') as tmp:
        run_all(args, Path(tmp))
    summary = {'check': 'summary', 'failed': FAILED, 'ok': not FAILED, 'seconds': round(time.perf_counter() - start, 1)}
    emit(summary)
    output = args.output or (str(Path(os.environ['OUT']) / 'gpu_check.json') if os.environ.get('OUT') else None)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(RESULTS, indent=1, default=str))
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if not FAILED else 1


if __name__ == '__main__':
    sys.exit(main())
