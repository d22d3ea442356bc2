"""How fast does ``TorchSampler`` generate, against plain ``transformers`` ``generate`` on the
same prompts, and how long does one trainer-to-sampler weight sync take?

Generation: the same model weights, the same encoded prompts (GSM8K questions through the chat
template), ``--num-samples`` sequences per prompt, ``--max-tokens`` new tokens each with the
end-of-sequence token ignored (so both produce exactly the same number of tokens and neither
gains by stopping early), multinomial sampling at temperature 1. The baseline is
``model.generate(do_sample=True, num_return_sequences=n)`` on the left-padded batch, which
returns tokens only; ``TorchSampler`` also returns each token's logprob and the training
feature of every sequence, and that work is inside its timing. The two alternate for
``--repeats`` rounds after a warm-up round each; the figure is the median.

* ``tokens_per_s``: generated tokens over wall time, per system.
* ``speed_ratio`` = TorchSampler tokens/s / generate tokens/s (above 1: TorchSampler faster).

Weight sync: a ``TransformersModel`` with a LoRA adapter (r=16, all-linear) and a
``TorchSampler`` of the same model; the median time of ``sync_weights`` with
``merge_and_sync=True`` (merged matrices) and ``False`` (adapter tensors only), after the first
sync of each kind, with the bytes each moves.

Usage::

    .venv/bin/python benchmarks/sampler_throughput.py            # writes benchmarks/results/sampler.json
    .venv/bin/python benchmarks/sampler_throughput.py --device cuda --output benchmarks/results/sampler_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from twinkle import assets
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import GSM8KProcessor
from twinkle.sampler import TorchSampler


@dataclass
class Settings:
    # Embedded model name (twinkle.assets.MODELS) or a local model directory.
    model: str = 'small-qwen3'
    # Prompts per call and sequences per prompt.
    prompts: int = 8
    num_samples: int = 4
    # New tokens per sequence.
    max_tokens: int = 64
    # Timed rounds per system (after one untimed warm-up round each).
    repeats: int = 5
    # Timed weight syncs per mode.
    syncs: int = 5
    device: str = 'cpu'
    seed: int = 0


def encode_prompts(model_dir: str, count: int) -> list[dict[str, Any]]:
    dataset = Dataset(DatasetMeta(assets.dataset('gsm8k'), data_slice=range(count)))
    dataset.set_template('Template', model_id=model_dir, max_length=1024)
    dataset.map(GSM8KProcessor())
    dataset.encode(add_generation_prompt=True)
    return [dataset[i] for i in range(len(dataset))]


def time_generate(model: Any, prompts: list[dict], settings: Settings, pad: int) -> float:
    width = max(len(p['input_ids']) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt['input_ids']) :] = torch.tensor(prompt['input_ids'])
        mask[i, width - len(prompt['input_ids']) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    started = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=settings.max_tokens,
        min_new_tokens=settings.max_tokens,
        num_return_sequences=settings.num_samples,
        pad_token_id=pad,
        eos_token_id=None,
    )
    _sync(model.device)
    elapsed = time.perf_counter() - started
    assert out.shape[1] - width == settings.max_tokens
    return elapsed


def time_sampler(sampler: TorchSampler, prompts: list[dict], settings: Settings) -> float:
    params = SamplingParams(
        max_tokens=settings.max_tokens, num_samples=settings.num_samples, temperature=1.0, ignore_eos=True
    )
    started = time.perf_counter()
    responses = sampler.sample(prompts, params)
    elapsed = time.perf_counter() - started
    assert all(len(s.tokens) == settings.max_tokens for r in responses for s in r.sequences)
    return elapsed


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize()


def generation(model_dir: str, settings: Settings) -> dict[str, Any]:
    prompts = encode_prompts(model_dir, settings.prompts)
    sampler = TorchSampler(model_dir, device=settings.device)
    baseline = AutoModelForCausalLM.from_pretrained(model_dir, dtype=next(sampler.model.parameters()).dtype)
    baseline = baseline.to(settings.device).eval()
    pad = sampler.template.pad_token_id
    tokens = settings.prompts * settings.num_samples * settings.max_tokens
    times: dict[str, list[float]] = {'torch_sampler': [], 'transformers_generate': []}
    runners = {
        'torch_sampler': lambda: time_sampler(sampler, prompts, settings),
        'transformers_generate': lambda: time_generate(baseline, prompts, settings, pad),
    }
    with torch.no_grad():
        for run in runners.values():
            run()  # warm-up
        for repeat in range(settings.repeats):
            order = list(runners) if repeat % 2 == 0 else list(reversed(runners))
            for name in order:
                times[name].append(runners[name]())
    figures = {
        name: {'median_s': statistics.median(t), 'tokens_per_s': tokens / statistics.median(t), 'runs_s': t}
        for name, t in times.items()
    }
    ratio = figures['torch_sampler']['tokens_per_s'] / figures['transformers_generate']['tokens_per_s']
    return {'generated_tokens_per_call': tokens, 'systems': figures, 'speed_ratio': ratio}


def weight_sync(model_dir: str, settings: Settings) -> dict[str, Any]:
    model = TransformersModel(model_dir, device=settings.device)
    model.add_adapter_to_model('policy', LoraConfig(r=16, lora_alpha=32, target_modules='all-linear'))
    sampler = TorchSampler(model_dir, device=settings.device)
    manager = CheckpointEngineManager(model, sampler)
    result = {}
    for merge in (True, False):
        first = manager.sync_weights(merge_and_sync=merge)
        runs = [manager.sync_weights(merge_and_sync=merge) for _ in range(settings.syncs)]
        result['merged' if merge else 'adapter_only'] = {
            'first_sync_s': first.seconds,
            'first_sync_bytes': first.bytes,
            'median_s': statistics.median(r.seconds for r in runs),
            'bytes': runs[-1].bytes,
        }
    result['model_bytes'] = sum(p.numel() * p.element_size() for p in sampler.model.parameters())
    return result


def environment(settings: Settings) -> dict[str, Any]:
    return {
        'python': platform.python_version(),
        'torch': torch.__version__,
        'transformers': transformers.__version__,
        'cpu_count': os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'load_average': os.getloadavg(),
        'device': torch.cuda.get_device_name() if settings.device == 'cuda' else platform.processor() or 'cpu',
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    for name, default in asdict(Settings()).items():
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(default), default=default)
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'sampler.json')
    args = vars(parser.parse_args())
    output = args.pop('output')
    settings = Settings(**args)
    warnings.filterwarnings('ignore')
    transformers.logging.set_verbosity_error()
    torch.manual_seed(settings.seed)
    model_dir = assets.tiny_model(settings.model) if settings.model in assets.MODELS else settings.model
    gen = generation(model_dir, settings)
    sync = weight_sync(model_dir, settings)
    result = {
        'settings': asdict(settings),
        'generation': gen,
        'weight_sync': sync,
        'environment': environment(settings),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    systems = gen['systems']
    print(f'{settings.model} on {settings.device}: {gen["generated_tokens_per_call"]} tokens per call')
    for name, figures in systems.items():
        print(f'  {name:24s} {figures["tokens_per_s"]:10.0f} tokens/s  (median {figures["median_s"]:.3f} s)')
    print(f'  speed ratio (TorchSampler / generate): {gen["speed_ratio"]:.2f}')
    for mode in ('merged', 'adapter_only'):
        figures = sync[mode]
        print(f'  weight sync {mode:13s} {figures["median_s"] * 1000:8.1f} ms  {figures["bytes"] / 1e6:8.2f} MB moved')
    print(f'wrote {output}')


if __name__ == '__main__':
    main()
