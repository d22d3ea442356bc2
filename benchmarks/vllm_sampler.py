"""How fast does ``vLLMSampler`` sample, against vLLM's own ``LLM.generate`` and ``TorchSampler``
on the same prompts, with and without a LoRA adapter?

One run, one model, the same weights in all three (float32, so the three sample the same model;
``--dtype auto`` lets vLLM pick): GSM8K questions through the chat template, ``--num-samples``
sequences per prompt, ``--max-tokens`` new tokens each with the end-of-sequence token ignored
(every system makes exactly the same number of tokens), temperature 1.

* ``raw vLLM``: ``llm.generate(prompts, SamplingParams(n=num_samples, logprobs=0))`` on the very
  engine the ``vLLMSampler`` holds, as a user of vLLM would call it; with LoRA, its
  ``LoRARequest``. It returns vLLM's outputs, nothing more.
* ``vLLMSampler``: ``sample(prompts, SamplingParams(num_samples=..., seed=...))``: one request per
  sequence (each with its own seed), and the ``SampleResponse`` s with logprobs, decoded text and
  training features.
* ``TorchSampler``: the same weights in plain PyTorch (its own copy), the adapter synced in.

The three alternate for ``--repeats`` rounds after an untimed warm-up round each; each figure is
the median. ``overhead`` = vLLMSampler's median time / raw vLLM's - 1 (the target: under 5 %).

Usage (vLLM's environment: ``make setup-vllm``)::

    .venv-vllm/bin/python benchmarks/vllm_sampler.py    # writes benchmarks/results/vllm_sampler.json
"""

from __future__ import annotations

import os

# Both samplers on every core: vLLM's CPU engine otherwise drops to one torch thread for serving
# ("Reducing Torch threads ... Set OMP_NUM_THREADS in the external environment to override").
os.environ.setdefault('OMP_NUM_THREADS', str(os.cpu_count() or 1))

import argparse
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from sampler_throughput import encode_prompts  # the same GSM8K prompts (this folder is on the path)

from twinkle import assets
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.model.lora import multi as multi_lora
from twinkle.sampler import TorchSampler, vLLMSampler


@dataclass
class Settings:
    # Embedded model name (twinkle.assets.MODELS) or a local model directory.
    model: str = 'small-qwen3'
    # Prompts per call and sequences per prompt.
    prompts: int = 8
    num_samples: int = 4
    # New tokens per sequence.
    max_tokens: int = 64
    # Timed rounds per system and case (after one untimed warm-up round each).
    repeats: int = 5
    # The LoRA adapter's rank (on every linear layer).
    lora_rank: int = 16
    # The engine's dtype: float32 as the torch sampler holds it, or vLLM's 'auto'.
    dtype: str = 'float32'
    seed: int = 0


def timed(call: Callable[[], int]) -> tuple[float, int]:
    """(seconds, tokens generated) of one call."""
    started = time.perf_counter()
    tokens = call()
    return time.perf_counter() - started, tokens


def systems(
    sampler: vLLMSampler, torch_sampler: TorchSampler, prompts: list[dict], settings: Settings, adapter: str | None
) -> dict[str, Callable[[], int]]:
    """The three ways to sample the prompts, each returning the tokens it made."""
    from vllm import SamplingParams as RawParams

    raw_params = RawParams(
        n=settings.num_samples, max_tokens=settings.max_tokens, temperature=1.0, ignore_eos=True, logprobs=0
    )
    raw_lora = sampler._adapters[adapter].request if adapter else None
    ours = SamplingParams(
        max_tokens=settings.max_tokens, num_samples=settings.num_samples, ignore_eos=True, seed=settings.seed
    )

    token_prompts = [{'prompt_token_ids': p['input_ids']} for p in prompts]

    def raw() -> int:
        outputs = sampler.llm.generate(token_prompts, raw_params, lora_request=raw_lora, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def wrapped() -> int:
        responses = sampler.sample(prompts, ours, adapter_name=adapter)
        return sum(len(s.tokens) for r in responses for s in r.sequences)

    def torch_side() -> int:
        responses = torch_sampler.sample(prompts, ours, adapter_name=adapter)
        return sum(len(s.tokens) for r in responses for s in r.sequences)

    return {'raw vLLM': raw, 'vLLMSampler': wrapped, 'TorchSampler': torch_side}


def run_case(calls: dict[str, Callable[[], int]], repeats: int) -> dict[str, Any]:
    for call in calls.values():
        call()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in calls}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, call in calls.items():
            seconds, tokens[name] = timed(call)
            times[name].append(seconds)
    figures = {
        name: {
            'median_s': statistics.median(times[name]),
            'tokens_per_s': tokens[name] / statistics.median(times[name]),
            'tokens': tokens[name],
            'rounds_s': times[name],
        }
        for name in calls
    }
    raw, wrapped = figures['raw vLLM']['median_s'], figures['vLLMSampler']['median_s']
    return {
        'systems': figures,
        'overhead': wrapped / raw - 1,
        'vllm_over_torch': figures['vLLMSampler']['tokens_per_s'] / figures['TorchSampler']['tokens_per_s'],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    for name, default in asdict(Settings()).items():
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(default), default=default)
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'vllm_sampler.json')
    args = vars(parser.parse_args())
    output = args.pop('output')
    settings = Settings(**args)
    warnings.filterwarnings('ignore')
    model_dir = assets.tiny_model(settings.model) if settings.model in assets.MODELS else settings.model
    prompts = [{'input_ids': row['input_ids']} for row in encode_prompts(model_dir, settings.prompts)]

    engine = {'enable_lora': True, 'max_lora_rank': settings.lora_rank, 'dtype': settings.dtype}
    sampler = vLLMSampler(model_dir, engine_args=engine)
    torch_sampler = TorchSampler(model_dir, device='cpu')
    trainer = TransformersModel(model_dir, device='cpu')
    torch.manual_seed(settings.seed)
    lora = LoraConfig(r=settings.lora_rank, lora_alpha=2 * settings.lora_rank, target_modules='all-linear')
    lora.init_lora_weights = False
    trainer.add_adapter_to_model('policy', lora)
    CheckpointEngineManager(trainer, torch_sampler).sync_weights(merge_and_sync=False)
    sampler.load_adapter_weights('policy', multi_lora.peft_state_dict(trainer.model, 'policy'), lora)

    cases = {}
    for case, adapter in (('base model', None), ('LoRA adapter', 'policy')):
        cases[case] = run_case(systems(sampler, torch_sampler, prompts, settings, adapter), settings.repeats)
    sampler.close()

    import vllm

    result = {
        'settings': asdict(settings),
        'cases': cases,
        'environment': {
            'python': platform.python_version(),
            'torch': torch.__version__,
            'vllm': vllm.__version__,
            'cpu_count': os.cpu_count(),
            'torch_threads': torch.get_num_threads(),
            'omp_num_threads': os.environ.get('OMP_NUM_THREADS'),
            'load_average': os.getloadavg(),
        },
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    tokens = settings.prompts * settings.num_samples * settings.max_tokens
    print(f'{settings.model} ({settings.dtype}): {tokens} tokens per call, median of {settings.repeats} rounds')
    for case, figures in cases.items():
        print(f'  {case}:')
        for name, system in figures['systems'].items():
            print(f'    {name:14s} {system["tokens_per_s"]:9.0f} tokens/s  (median {system["median_s"]:.3f} s)')
        overhead, speedup = figures['overhead'], figures['vllm_over_torch']
        print(f'    vLLMSampler over raw vLLM: {overhead:+.1%}; against TorchSampler: x{speedup:.2f} tokens/s')
    print(f'wrote {output}')


if __name__ == '__main__':
    main()
