"""How much slower are image rows through twinkle than through Transformers alone, in a LoRA SFT
step and in sampling?

Each of ``--models`` is measured in turn: by default the embedded ``tiny-qwen3.5-vl`` (Qwen3.5's
hybrid layers, tiny: a framework's fixed costs weigh most there) and ``small-qwen3-vl``, built
in-process into a temporary folder (small-qwen3's 8 layers of width 512 behind a 4-block tower, as
Qwen3-VL). torch runs on ``--threads`` threads (1 by default: steadier on a shared machine).

SFT: both loops train the same vision-language model with LoRA
r=16, alpha=32 on the same linear layers (twinkle's ``'all-linear'``: the language model's, the
vision tower frozen), AdamW lr 1e-4 and gradient clipping at 1.0, from the same weights, on the
same batches of ``shapes`` rows (a 64 x 64 picture, a question, its answer), each encoded once by
``VisionTemplate``:

* ``twinkle``: ``model.forward_backward(inputs=batch)`` then ``model.clip_grad_and_step()``
  (collation, the image fields, multimodal RoPE positions from ``mrope_positions``, per sequence).
* ``raw``: right-pad the tokens, concatenate the pixels and grids, ``model(**inputs)`` of a peft
  model (transformers computes the multimodal positions itself from ``mm_token_type_ids``),
  cross-entropy on the pre-shifted labels summed over the trained-token count, ``backward``,
  ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``.

The loops take turns in short blocks after a warm-up (``lora_overhead.benchmark``); the first
step's losses must agree within 1e-4. ``image_rows_per_s`` is rows of the batch over the median
step time; ``overhead_pct`` the median per-step ratio twinkle / raw, minus one.

Sampling: the same weights, the same prompts (the ``shapes`` questions with their pictures, each
``--num-samples`` times), ``--max-tokens`` new tokens each with the end of sequence ignored,
multinomial at temperature 1: ``TorchSampler.sample`` (which also returns every token's logprob
and each sequence's training row with its images) against ``model.generate`` on the left-padded
batch with the pixels, grids and ``mm_token_type_ids``. The prompts go to ``generate`` repeated
rather than with ``num_return_sequences``, which repeats ``pixel_values`` patch by patch, not
image by image. Rounds alternate after a warm-up each; the figures are medians.
``speed_ratio`` = TorchSampler sequences/s over generate's (above 1: TorchSampler faster).

Usage::

    .venv/bin/python benchmarks/vlm_overhead.py           # writes benchmarks/results/vlm_overhead.json
    .venv/bin/python benchmarks/vlm_overhead.py --models tiny-qwen3-vl --threads 0 --output /tmp/vlm.json
    .venv/bin/python benchmarks/vlm_overhead.py --device cuda --output benchmarks/results/vlm_overhead_cuda.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from lora_overhead import Batch, Loop, autocast, benchmark, environment, summarize
from lora_overhead import Settings as TrainingSettings
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForImageTextToText

from twinkle import assets
from twinkle.assets.vlm import VLM_RECIPES, VisionRecipe, write_vlm
from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.model import TransformersModel
from twinkle.model.lora import multi as multi_lora
from twinkle.processor import InputProcessor
from twinkle.sampler import TorchSampler
from twinkle.template import VisionTemplate

#: A larger VLM built in-process (nothing is saved beyond a temporary folder): small-qwen3's language
#: model (8 layers of width 512) behind a 4-block vision tower of width 128, as Qwen3-VL.
SMALL_VLM = 'small-qwen3-vl'
SMALL_VLM_RECIPE = VisionRecipe(
    'small-qwen3',
    'Qwen3VLForConditionalGeneration',
    depth=4,
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    deepstack_visual_indexes=(1,),
    mrope_section=(12, 10, 10),  # of head_dim 64's 32 rotary frequencies, as Qwen3-VL's 24/20/20 of 64
)


@dataclass
class Settings:
    # Vision-language models, comma-separated: embedded (tiny-qwen3.5-vl, tiny-qwen3-vl), small-qwen3-vl
    # (built in-process) or local model directories.
    models: str = f'tiny-qwen3.5-vl,{SMALL_VLM}'
    device: str = 'cpu'
    # SFT: image rows per batch, timed steps per block, blocks per loop, untimed steps per loop.
    batch_size: int = 8
    steps: int = 2
    repeats: int = 10
    warmup: int = 2
    # Sampling: image prompts per call, sequences per prompt, new tokens each, timed rounds per system.
    prompts: int = 8
    num_samples: int = 2
    max_tokens: int = 16
    rounds: int = 6
    seed: int = 0
    # torch's CPU threads (0: torch's default). One thread keeps timings steady on a machine others share:
    # with two threads on two busy cores, single steps of either loop took 5 to 50 times their median.
    threads: int = 1


# ---- data -----------------------------------------------------------------------------------------
def shape_rows(count: int) -> list[dict[str, Any]]:
    """The first ``count`` rows of the shapes dataset: one picture and a question, with its answer."""
    rows = assets.resolve_images(assets.dataset('shapes', 'train'))
    if len(rows) < count:
        raise SystemExit(f'the shapes dataset has {len(rows)} rows; asked for {count}')
    return rows[:count]


def sft_batches(template: VisionTemplate, settings: Settings) -> list[Batch]:
    """Batches of encoded image rows (the encoding is outside both loops' timing)."""
    features = [template.encode(row) for row in shape_rows(4 * settings.batch_size)]
    rows = [dict(feature) for feature in features if feature is not None]
    return [
        rows[i : i + settings.batch_size] for i in range(0, len(rows) - settings.batch_size + 1, settings.batch_size)
    ]


# ---- SFT: the raw loop ----------------------------------------------------------------------------
class RawVisionLoop:
    """Transformers + peft on the same LoRA layers as twinkle's adapter (named one by one)."""

    def __init__(self, model_dir: str, targets: list[str], settings: TrainingSettings, pad_token_id: int):
        self.device = torch.device(settings.device)
        self.settings = settings
        base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation='sdpa')
        config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, target_modules=targets)
        torch.manual_seed(settings.seed)
        self.model = get_peft_model(base.to(self.device), config)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.lr)
        self.pad_token_id = pad_token_id

    def collate(self, batch: Batch) -> dict[str, torch.Tensor]:
        width = max(len(row['input_ids']) for row in batch)
        pads = {'input_ids': self.pad_token_id, 'labels': IGNORE_INDEX, 'attention_mask': 0, 'mm_token_type_ids': 0}
        tensors = {
            name: torch.tensor([row[name] + [pad] * (width - len(row[name])) for row in batch])
            for name, pad in pads.items()
        }
        tensors['pixel_values'] = torch.cat([row['pixel_values'] for row in batch])
        tensors['image_grid_thw'] = torch.tensor([grid for row in batch for grid in row['image_grid_thw']])
        return {name: value.to(self.device, non_blocking=True) for name, value in tensors.items()}

    def step(self, batch: Batch) -> float:
        tensors = self.collate(batch)
        labels = tensors.pop('labels')
        with autocast(self.device, self.settings.mixed_precision):
            logits = self.model(**tensors, use_cache=False).logits
        loss_sum = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction='sum'
        )
        loss = loss_sum / (labels != IGNORE_INDEX).sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.settings.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


class TwinkleVisionLoop:
    """The same training through ``TransformersModel`` (its ``'all-linear'`` stops at the tower)."""

    def __init__(self, model_dir: str, settings: TrainingSettings):
        self.max_grad_norm = settings.max_grad_norm
        self.model = TransformersModel(
            model_id=model_dir, device=settings.device, mixed_precision=settings.mixed_precision
        )
        torch.manual_seed(settings.seed)
        config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, target_modules='all-linear')
        self.model.add_adapter_to_model('default', config)
        self.model.set_optimizer('AdamW', lr=settings.lr)

    def step(self, batch: Batch) -> float:
        output = self.model.forward_backward(inputs=batch)
        self.model.clip_grad_and_step(self.max_grad_norm)
        return float(output.loss)


def sft(model_dir: str, settings: Settings) -> dict[str, Any]:
    precision = 'bf16' if settings.device == 'cuda' and torch.cuda.is_bf16_supported() else 'no'
    training = TrainingSettings(
        model_dir, settings.device, precision, settings.steps, settings.warmup, settings.repeats, settings.batch_size, 0
    )
    template = VisionTemplate(model_dir)
    batches = sft_batches(template, settings)
    twinkle_loop = TwinkleVisionLoop(model_dir, training)
    targets = multi_lora.adapter_linear_paths(twinkle_loop.model.model, 'default')
    loops: dict[str, Loop] = {
        'raw': RawVisionLoop(model_dir, targets, training, template.pad_token_id),
        'twinkle': twinkle_loop,
    }
    traces = benchmark(loops, batches, training)
    figures = summarize(traces)
    images = sum(len(row['image_grid_thw']) for row in batches[0])
    for name, trace in traces.items():
        rows_per_s = [settings.batch_size / s for s in trace.step_s]
        figures['loops'][name]['image_rows_per_s'] = statistics.median(rows_per_s)
        figures['loops'][name]['images_per_s'] = statistics.median(images / s for s in trace.step_s)
    figures['image_rows_ratio'] = (
        figures['loops']['twinkle']['image_rows_per_s'] / figures['loops']['raw']['image_rows_per_s']
    )
    figures['lora_layers'] = len(targets)
    figures['tower_adapted'] = any(multi_lora.is_vision_path(path) for path in targets)
    return {'figures': figures, 'step_s': {name: t.step_s for name, t in traces.items()}}


# ---- sampling -------------------------------------------------------------------------------------
def time_sampler(sampler: TorchSampler, prompts: list[dict[str, Any]], settings: Settings) -> float:
    params = SamplingParams(
        max_tokens=settings.max_tokens, num_samples=settings.num_samples, temperature=1.0, ignore_eos=True
    )
    started = time.perf_counter()
    responses = sampler.sample(prompts, params)
    _sync(settings.device)
    elapsed = time.perf_counter() - started
    assert all(len(s.tokens) == settings.max_tokens for r in responses for s in r.sequences)
    return elapsed


def generate_inputs(prompts: list[dict[str, Any]], settings: Settings, pad: int) -> dict[str, torch.Tensor]:
    """The prompts, each ``num_samples`` times, left-padded with their images in row order."""
    rows = [prompt for prompt in prompts for _ in range(settings.num_samples)]
    batch = InputProcessor(padding_side='left')(rows, pad)  # type: ignore[arg-type]
    keys = ('input_ids', 'attention_mask', 'pixel_values', 'image_grid_thw', 'mm_token_type_ids')
    return {key: batch[key].to(settings.device) for key in keys}


def time_generate(model: Any, inputs: dict[str, torch.Tensor], settings: Settings, pad: int) -> float:
    started = time.perf_counter()
    out = model.generate(
        **inputs,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=settings.max_tokens,
        min_new_tokens=settings.max_tokens,
        pad_token_id=pad,
        eos_token_id=None,
    )
    _sync(settings.device)
    elapsed = time.perf_counter() - started
    assert out.shape[1] - inputs['input_ids'].shape[1] == settings.max_tokens
    return elapsed


def _sync(device: str) -> None:
    if device == 'cuda':
        torch.cuda.synchronize()


def sampling(model_dir: str, settings: Settings) -> dict[str, Any]:
    sampler = TorchSampler(model_dir, device=settings.device)
    template = sampler.template
    prompts = []
    for row in shape_rows(settings.prompts):
        feature = template.encode({'messages': row['messages'][:1]}, add_generation_prompt=True)
        if feature is not None:
            prompts.append(dict(feature))
    dtype = next(sampler.model.parameters()).dtype
    baseline = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(settings.device).eval()
    pad = template.pad_token_id
    inputs = generate_inputs(prompts, settings, pad)
    runners = {
        'torch_sampler': lambda: time_sampler(sampler, prompts, settings),
        'transformers_generate': lambda: time_generate(baseline, inputs, settings, pad),
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.no_grad():
        for run in runners.values():
            run()  # warm-up
        for repeat in range(settings.rounds):
            for name in list(runners) if repeat % 2 == 0 else list(reversed(runners)):
                times[name].append(runners[name]())
    sequences = len(prompts) * settings.num_samples
    systems = {
        name: {
            'median_s': statistics.median(t),
            'image_rows_per_s': sequences / statistics.median(t),
            'tokens_per_s': sequences * settings.max_tokens / statistics.median(t),
            'runs_s': t,
        }
        for name, t in times.items()
    }
    ratio = systems['torch_sampler']['image_rows_per_s'] / systems['transformers_generate']['image_rows_per_s']
    return {'sequences_per_call': sequences, 'systems': systems, 'speed_ratio': ratio}


# ---- report ---------------------------------------------------------------------------------------
def print_summary(name: str, settings: Settings, result: dict[str, Any]) -> None:
    s = asdict(settings)
    fig, gen = result['sft']['figures'], result['sampling']
    print(f'\nVLM overhead: {name} on {s["device"]} ({torch.get_num_threads()} threads)')
    print(f'  SFT, batch {s["batch_size"]} image rows, LoRA r=16 on {fig["lora_layers"]} language-model layers:')
    for name, loop in fig['loops'].items():
        print(
            f'    {name:8s} median step {1000 * loop["median_step_s"]:8.1f} ms   '
            f'{loop["image_rows_per_s"]:8.1f} image rows/s'
        )
    low, high = fig['overhead_pct_iqr']
    print(
        f'    ratio twinkle / raw image rows/s: {fig["image_rows_ratio"]:.3f}; overhead {fig["overhead_pct"]:+.1f}% '
        f'(middle half {low:+.1f}% .. {high:+.1f}%); first-step loss |diff| {fig["first_loss_abs_diff"]:.1e}'
    )
    print(f'  sampling, {gen["sequences_per_call"]} image sequences of {s["max_tokens"]} tokens per call:')
    for name, system in gen['systems'].items():
        print(
            f'    {name:22s} {system["image_rows_per_s"]:8.2f} image rows/s  {system["tokens_per_s"]:8.0f} tokens/s  '
            f'(median {system["median_s"]:.3f} s)'
        )
    print(f'    ratio TorchSampler / generate: {gen["speed_ratio"]:.3f}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    for name, default in asdict(Settings()).items():
        parser.add_argument(f'--{name.replace("_", "-")}', type=type(default), default=default)
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'vlm_overhead.json')
    args = vars(parser.parse_args())
    output = args.pop('output')
    settings = Settings(**args)
    if settings.device == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: no CUDA device is available')
    warnings.filterwarnings('ignore')
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(settings.seed)
    if settings.threads > 0:
        torch.set_num_threads(settings.threads)
    started = time.perf_counter()
    result: dict[str, Any] = {'benchmark': 'vlm_overhead', 'settings': asdict(settings), 'models': {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name in settings.models.split(','):
            model_dir = model_folder(name, Path(scratch))
            began = time.perf_counter()
            figures = {'sft': sft(model_dir, settings), 'sampling': sampling(model_dir, settings)}
            result['models'][name] = {**figures, 'wall_s': time.perf_counter() - began}
            print_summary(name, settings, figures)
    result['environment'] = environment(TrainingSettings('', settings.device, 'no', 1, 1, 1, 1, 0))
    result['wall_s'] = time.perf_counter() - started
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print(
        f'results: {output} ({result["wall_s"]:.0f} s; load average {result["environment"]["load_average_1min"]:.1f})'
    )


def model_folder(name: str, scratch: Path) -> str:
    """The folder of model ``name``: an embedded one, the small VLM written under ``scratch``, or a path."""
    if name in assets.MODELS:
        return assets.tiny_model(name)
    if name == SMALL_VLM:
        VLM_RECIPES.setdefault(SMALL_VLM, SMALL_VLM_RECIPE)  # write_vlm builds a VLM by its recipe's name
        folder = scratch / SMALL_VLM
        folder.mkdir()
        write_vlm(SMALL_VLM, folder)
        return str(folder)
    return name


if __name__ == '__main__':
    main()
