"""Streaming a JSONL file larger than memory budgets allow: resident memory against rows read.

The benchmark writes a JSONL file of ``--gigabytes`` (chat rows of about ``--row-bytes`` bytes,
distinct texts cycled with a row number) to a temporary folder, then streams it with
``IterableDataset`` through ``map`` (the row to a conversation) and ``encode`` (the
``tiny-qwen3`` template) and a ``DataLoader`` of batches of 64, as training reads it. Every
``--every`` rows it records the process's resident memory (``VmRSS``). Flat is the aim: memory
must not grow with the rows read.

Figures: RSS at the start (after the first batch), at the end and its peak, the growth per
million rows (a least-squares slope over the samples), rows and bytes per second. The file is
deleted afterwards.

Usage::

    .venv/bin/python benchmarks/streaming_memory.py    # 2 GB; writes benchmarks/results/streaming_memory.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import machine

from twinkle import assets
from twinkle.dataloader import DataLoader
from twinkle.dataset import IterableDataset

WORDS = ['the', 'a', 'model', 'learns', 'to', 'answer', 'questions', 'about', 'data', 'training', 'with', 'adapters']


def write_jsonl(path: Path, gigabytes: float, row_bytes: int) -> int:
    """Rows until the file holds ``gigabytes``; returns how many."""
    generator = random.Random(0)
    texts = [' '.join(generator.choices(WORDS, k=row_bytes // 5)) for _ in range(997)]
    target, written, rows = int(gigabytes * 2**30), 0, 0
    with path.open('w') as handle:
        while written < target:
            chunk = []
            for _ in range(1000):
                text = texts[rows % len(texts)]
                chunk.append(json.dumps({'id': rows, 'question': f'question {rows}?', 'answer': text}) + '\n')
                rows += 1
            block = ''.join(chunk)
            handle.write(block)
            written += len(block)
    return rows


def rss_mb() -> float:
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
    raise RuntimeError('no VmRSS in /proc/self/status')


def as_chat(row: dict) -> dict:
    return {'messages': [{'role': 'user', 'content': row['question']}, {'role': 'assistant', 'content': row['answer']}]}


def slope_per_million(samples: list[tuple[int, float]]) -> float:
    """Least-squares MB per million rows."""
    xs, ys = [x / 1e6 for x, _ in samples], [y for _, y in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--gigabytes', type=float, default=2.0)
    parser.add_argument('--row-bytes', type=int, default=1024)
    parser.add_argument('--every', type=int, default=50_000, help='rows between memory samples')
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'streaming_memory.json')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / 'big.jsonl'
        started = time.perf_counter()
        rows_written = write_jsonl(path, args.gigabytes, args.row_bytes)
        write_s, size = time.perf_counter() - started, path.stat().st_size
        stream = IterableDataset(path).map(as_chat)
        stream.set_template('Template', model_id=assets.tiny_model(), max_length=512, truncation_strategy='right')
        stream.encode()
        samples: list[tuple[int, float]] = []
        rows, tokens, next_sample = 0, 0, 0
        started = time.perf_counter()
        for batch in DataLoader(stream, batch_size=64):
            rows += len(batch)
            tokens += sum(len(row['input_ids']) for row in batch)
            if rows >= next_sample:
                samples.append((rows, rss_mb()))
                next_sample += args.every
        read_s = time.perf_counter() - started
        samples.append((rows, rss_mb()))
    peak = max(mb for _, mb in samples)
    result = {
        'settings': vars(args) | {'output': str(args.output)},
        'file_bytes': size,
        'rows': rows,
        'rows_written': rows_written,
        'tokens': tokens,
        'write_s': write_s,
        'read_s': read_s,
        'rows_per_s': rows / read_s,
        'mb_per_s': size / 2**20 / read_s,
        'rss_mb_first': samples[0][1],
        'rss_mb_last': samples[-1][1],
        'rss_mb_peak': peak,
        'rss_mb_growth_per_million_rows': slope_per_million(samples[1:]),
        'samples_rows_rss_mb': samples,
        'environment': machine.describe(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + '\n')
    print(
        f'{size / 2**30:.2f} GB JSONL, {rows:,} rows ({tokens:,} tokens) streamed, mapped and encoded in {read_s:.0f} s'
    )
    print(f'  {result["rows_per_s"]:,.0f} rows/s, {result["mb_per_s"]:.1f} MB/s')
    first, last = samples[0][1], samples[-1][1]
    print(f'  resident memory: {first:.0f} MB after the first batch, {last:.0f} MB at the end, peak {peak:.0f} MB')
    print(f'  growth: {result["rss_mb_growth_per_million_rows"]:+.1f} MB per million rows')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
