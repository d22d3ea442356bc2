"""Packed against padded training on rows of skewed lengths, in real (non-pad) tokens per second.

The rows are a self-cognition + GSM8K mix: ``--long-share`` of them long conversations of 2 to
10 GSM8K problems with their worked answers, the rest short self-cognition chats, encoded once
for ``small-qwen3``.
Both sides train the same LoRA step (r=16, 'all-linear', AdamW) over the same rows in the same
order, one pass (an epoch) per round, the sides alternating:

* ``padded``: batches of ``--batch`` rows, padded to the longest (``InputProcessor()``);
* ``packed``: the same rows packed first-fit-decreasing into sequences of ``--max-length``
  tokens (``PackingDataset``), batches of ``--packed-batch`` sequences collated padding-free
  (``InputProcessor(padding_free=True)``).

Figures: real tokens per second of each side (the tokens of the rows over the median epoch
time), ``packed_over_padded`` (the aim is at least 1.5), the padded side's share of pad
tokens, and the packed sequences' fill.

Usage::

    .venv/bin/python benchmarks/packing.py    # writes benchmarks/results/packing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import machine
import torch
from peft import LoraConfig

from twinkle import assets
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta, PackingDataset
from twinkle.model import TransformersModel
from twinkle.preprocessor import GSM8KProcessor, SelfCognitionProcessor


def mixed_rows(count: int, long_share: float, model_dir: str, max_length: int) -> list[dict]:
    """``count`` encoded rows: a ``long_share`` of them long conversations of 2 to 10 GSM8K
    problems with their worked answers (seeded), the rest short self-cognition chats; the long
    ones evenly spread."""
    from twinkle.template import Template

    template = Template(model_dir, max_length=max_length, truncation_strategy='right')
    long_count = round(count * long_share)
    problems = Dataset(DatasetMeta(assets.dataset('gsm8k'), data_slice=range(10 * long_count))).map(GSM8KProcessor())
    chats = Dataset(DatasetMeta(assets.dataset('self-cognition'), data_slice=range(count - long_count)))
    chats.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    generator = torch.Generator().manual_seed(0)
    turns = iter(row['messages'] for row in problems)
    longs = []
    for _ in range(long_count):
        size = int(torch.randint(2, 11, (1,), generator=generator))
        longs.append({'messages': [message for _ in range(size) for message in next(turns)]})
    step = count / max(1, long_count)
    places = {round(i * step) for i in range(long_count)}
    sources, long_rows, short_rows = [], iter(longs), iter(chats)
    for index in range(count):
        sources.append(next(long_rows) if index in places else next(short_rows))
    rows = []
    for source in sources:
        feature = template.encode({'messages': source['messages']})
        rows.append({'input_ids': feature['input_ids'], 'labels': feature['labels']})
    return rows


def trainer(model_dir: str, padding_free: bool) -> TransformersModel:
    model = TransformersModel(model_dir, device='cpu')
    torch.manual_seed(0)
    model.add_adapter_to_model('a', LoraConfig(r=16, lora_alpha=32, target_modules='all-linear'))
    model.set_optimizer('AdamW', lr=1e-4, adapter_name='a')
    if padding_free:
        model.set_processor('InputProcessor', padding_free=True, adapter_name='a')
    return model


def epoch(model: TransformersModel, batches: list[list[dict]]) -> float:
    started = time.perf_counter()
    for batch in batches:
        model.forward_backward(inputs=batch, adapter_name='a')
        model.clip_grad_and_step(adapter_name='a')
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='small-qwen3')
    parser.add_argument('--rows', type=int, default=192)
    parser.add_argument('--long-share', type=float, default=0.25, help='share of long (multi-problem GSM8K) rows')
    parser.add_argument('--batch', type=int, default=16, help='rows per padded batch')
    parser.add_argument('--max-length', type=int, default=1024, help='tokens per packed sequence')
    parser.add_argument('--packed-batch', type=int, default=2, help='packed sequences per batch')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'packing.json')
    args = parser.parse_args()
    model_dir = assets.tiny_model(args.model)
    rows = mixed_rows(args.rows, args.long_share, model_dir, max_length=args.max_length)
    packed = PackingDataset(rows, max_length=args.max_length)
    sides = {
        'padded': (trainer(model_dir, False), list(DataLoader(rows, batch_size=args.batch))),
        'packed': (trainer(model_dir, True), list(DataLoader(packed, batch_size=args.packed_batch))),
    }
    for model, batches in sides.values():  # warm-up: one batch each
        epoch(model, batches[:1])
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for name in order:
            seconds[name].append(epoch(*sides[name]))
    real = sum(len(r['input_ids']) for r in rows)
    padded_slots = sum(len(batch) * max(len(r['input_ids']) for r in batch) for batch in sides['padded'][1])
    figures = {
        name: {'median_epoch_s': statistics.median(s), 'real_tokens_per_s': real / statistics.median(s), 'epochs_s': s}
        for name, s in seconds.items()
    }
    result = {
        'settings': vars(args) | {'output': str(args.output)},
        'rows': len(rows),
        'real_tokens': real,
        'lengths': {
            'min': min(len(r['input_ids']) for r in rows),
            'median': statistics.median(len(r['input_ids']) for r in rows),
            'max': max(len(r['input_ids']) for r in rows),
        },
        'padded_pad_share': 1 - real / padded_slots,
        'packed_sequences': len(packed),
        'packed_fill': packed.fill,
        'systems': figures,
        'packed_over_padded': figures['packed']['real_tokens_per_s'] / figures['padded']['real_tokens_per_s'],
        'environment': machine.describe(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + '\n')
    lengths = result['lengths']
    print(f'{args.model}, {len(rows)} rows ({real} real tokens, lengths {lengths}), median of {args.rounds} epochs')
    print(f'  padded ({args.batch} rows a batch, {result["padded_pad_share"]:.0%} of the slots padding)')
    shape = f'{len(packed)} sequences of up to {args.max_length}, {packed.fill:.0%} full'
    print(f'  packed ({shape}, {args.packed_batch} a batch)')
    for name, system in figures.items():
        print(f'  {name:7s} {system["real_tokens_per_s"]:8.0f} real tokens/s  (epoch {system["median_epoch_s"]:.1f} s)')
    print(f'  packed_over_padded: x{result["packed_over_padded"]:.2f}')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
