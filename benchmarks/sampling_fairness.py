"""A long sampling request beside another tenant's training: the training step's time while the
request samples against the step alone, with sampling in slices (``sampling_slice_ms``) and without.

A server on a thread of this process (``BackgroundServer``, loopback HTTP) with two tenants. Bob
trains a LoRA run: a step is a ``forward_backward`` of ``rows`` x ``seq_len`` tokens and a
``clip_grad_and_step``, two requests that each wait for their answer. First ``steps`` steps alone
(one more before them, untimed), then alice's chat completion alone: ``choices`` choices of
``max_tokens`` tokens each (the probe's n=8, max_tokens=2000; seeded, so both runs sample the same
tokens; the embedded model's random weights seldom end a reply early), then the chat again while bob
steps for as long as it samples. The figure is bob's median step started during the chat over his median step alone
(the ratio; aim: 2 or less), with the chat's own time beside and alone. The same runs again on a
server that samples whole (``sampling_slice_ms: null``), where bob's first step during the chat
waits for all of it. The runs keep no state every step (``save_state_every_steps: null``): the figure
is the scheduler's, not a disk's.

Usage::

    .venv/bin/python benchmarks/sampling_fairness.py     # tiny-qwen3 on the CPU; results/sampling_fairness.json
    .venv/bin/python benchmarks/sampling_fairness.py --slice-ms 200 --output /tmp/sampling_fairness_200.json
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from machine import describe, settings_from_args
from peft import LoraConfig

from twinkle import assets
from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
from twinkle.server.store import Store
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

MESSAGES = [{'role': 'user', 'content': 'Tell me a long story.'}]


@dataclass
class Settings:
    model: str = 'tiny-qwen3'
    device: str = 'cpu'
    slice_ms: float = 50.0
    choices: int = 8
    max_tokens: int = 2000
    rows: int = 4
    seq_len: int = 256
    steps: int = 10
    seed: int = 0
    # torch's intra-op threads: 1 by default, as on a loaded machine a team of OpenMP threads makes
    # the worker thread's decode steps several times slower than another thread's (docs/benchmarks.md).
    threads: int = 1


def rows(settings: Settings, vocab: int) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(settings.seed)
    batch = []
    for _ in range(settings.rows):
        ids = torch.randint(0, vocab, (settings.seq_len,), generator=gen).tolist()
        batch.append({'input_ids': ids, 'labels': [-100, *ids[1:]]})
    return batch


class Tenants:
    """A server with alice (who chats) and bob (who trains a run), for one ``sampling_slice_ms``."""

    def __init__(self, settings: Settings, slice_ms: float | None, data_dir: Path):
        model_dir = assets.tiny_model(settings.model)
        config = ServerConfig.build(
            base_model=model_dir, port=0, data_dir=str(data_dir), device=settings.device,
            sampling_slice_ms=slice_ms, limits={'max_sampling_s': None}, save_state_every_steps=None,
        )  # fmt: skip
        with Store(config.store_location) as store:
            self.keys = {name: store.tenants.add(name)[1] for name in ('alice', 'bob')}
        self.settings, self.model_dir, self.server = settings, model_dir, BackgroundServer(config)
        vocab = json.loads((Path(model_dir) / 'config.json').read_text())['vocab_size']
        self.batch = rows(settings, vocab)

    def __enter__(self) -> Tenants:
        self.url = self.server.start()
        self.bob = MultiLoraTransformersModel(client=TwinkleClient(self.url, self.keys['bob']))
        self.bob.add_adapter_to_model('bob', LoraConfig(r=16, target_modules='all-linear'), seed=0)
        self.bob.set_optimizer('AdamW', lr=1e-4)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def step(self) -> tuple[float, float]:
        """One training step of bob's: (its seconds, its forward_backward's seconds)."""
        began = time.perf_counter()
        self.bob.forward_backward(inputs=self.batch)
        backward = time.perf_counter() - began
        self.bob.clip_grad_and_step()
        return time.perf_counter() - began, backward

    def chat(self) -> tuple[float, int]:
        """Alice's chat completion: (its seconds, the tokens it sampled)."""
        body = {
            'model': self.model_dir, 'messages': MESSAGES, 'n': self.settings.choices,
            'max_tokens': self.settings.max_tokens, 'temperature': 1.0, 'seed': self.settings.seed,
        }  # fmt: skip
        headers = {'Authorization': f'Bearer {self.keys["alice"]}'}
        began = time.perf_counter()
        response = httpx.post(f'{self.url}/v1/chat/completions', json=body, headers=headers, timeout=3600)
        response.raise_for_status()
        return time.perf_counter() - began, response.json()['usage']['completion_tokens']


def steps_during_chat(tenants: Tenants) -> tuple[list[tuple[float, float]], tuple[float, int]]:
    """Bob's steps started while alice's chat samples, and the chat's (seconds, tokens)."""
    chat: dict[str, tuple[float, int]] = {}
    thread = threading.Thread(target=lambda: chat.setdefault('done', tenants.chat()))
    thread.start()
    time.sleep(0.5)  # the chat has begun (its prefill, its first slice)
    steps = []
    while thread.is_alive():
        steps.append(tenants.step())
    thread.join()
    return steps, chat['done']


def measure(settings: Settings, slice_ms: float | None) -> dict[str, Any]:
    """Bob's steps alone (half before the chats, half after), the chat alone, and both together."""
    with tempfile.TemporaryDirectory() as tmp, Tenants(settings, slice_ms, Path(tmp)) as tenants:
        tenants.step()  # untimed: the optimizer's state, the first pass's allocations
        alone = [tenants.step() for _ in range(settings.steps // 2)]
        chat_alone = tenants.chat()
        print(f'  slice {slice_ms} ms: chat alone {chat_alone[0]:.1f} s', flush=True)
        during, chat_during = steps_during_chat(tenants)
        alone += [tenants.step() for _ in range(settings.steps - settings.steps // 2)]
    step_alone, step_during = statistics.median(s for s, _ in alone), statistics.median(s for s, _ in during)
    return {
        'sampling_slice_ms': slice_ms,
        'step_alone_s': step_alone,
        'forward_backward_alone_s': statistics.median(b for _, b in alone),
        'steps_during_chat': len(during),
        'step_during_chat_s': step_during,
        'step_during_chat_max_s': max(s for s, _ in during),
        'forward_backward_during_chat_s': statistics.median(b for _, b in during),
        'ratio': step_during / step_alone,
        'chat_alone_s': chat_alone[0],
        'chat_during_steps_s': chat_during[0],
        'chat_tokens': chat_during[1],
    }


def main() -> None:
    settings, output_path = settings_from_args(
        Settings(), __doc__.split('\n\n')[0], 'benchmarks/results/sampling_fairness.json'
    )
    torch.set_num_threads(settings.threads)
    runs = {'sliced': measure(settings, settings.slice_ms), 'whole': measure(settings, None)}
    result = {
        'benchmark': 'sampling_fairness',
        'settings': asdict(settings),
        'environment': {**describe(), 'cuda': torch.cuda.get_device_name() if settings.device == 'cuda' else None},
        'figures': runs,
    }
    output = Path(output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    print(
        f'{settings.model} on {settings.device}: a chat of n={settings.choices} x max_tokens={settings.max_tokens} '
        f'beside a step of {settings.rows} x {settings.seq_len} tokens'
    )
    for name, run in runs.items():
        print(
            f'  {name:6s} (slice {run["sampling_slice_ms"]} ms): step {run["step_alone_s"] * 1000:.0f} ms alone, '
            f'{run["step_during_chat_s"] * 1000:.0f} ms during the chat (median of {run["steps_during_chat"]}; '
            f'x{run["ratio"]:.2f}); chat {run["chat_alone_s"]:.1f} s alone, {run["chat_during_steps_s"]:.1f} s '
            f'beside the steps ({run["chat_tokens"]} tokens)'
        )
    print(f'wrote {output}')


if __name__ == '__main__':
    main()
