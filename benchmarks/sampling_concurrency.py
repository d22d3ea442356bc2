"""Concurrent sampling requests through the Tinker SDK: the wall time of 1, 8 and 32 requests sent at
once, each of ``max_tokens`` tokens, against one request alone, from one tenant and from four.

Issue 49 point 2 measured one 64-token request at 9.2 s and 32 at once at 492 s (x53): requests were
served one after another. The torch sampler now decodes every request in flight as one batch
(``twinkle.sampler.batching``; ``slicing.py``: a request joins at the next decode step, leaves when
it ends); the aim is 32 concurrent requests in at most 3x the time of one.

A server on a thread of this process (``BackgroundServer``, loopback HTTP, the torch sampler over the
model's own weights) with four tenants, each a ``tinker.ServiceClient`` and a sampling client of the
base model. Each request is one prompt of ``prompt_len`` random tokens, ``num_samples=1``, its own
seed, temperature 1 (the embedded model's random weights seldom end a reply early: every request
samples its ``max_tokens``). ``concurrency`` requests are sent at once (the SDK's futures) and the
figure is the wall time until the last answer, the median of ``repeats`` rounds, over the median of
one request alone (``ratio``). With four tenants the requests are dealt out round robin. Beside each
figure: the tokens sampled and the largest batch the sampler decoded (from its ``step_sizes``). The
same prompts as one ``TorchSampler.sample`` call of 1, 8 and 32 rows in this process, no server
(``sampler_alone``), say what the batch itself costs; the rest is the server's per-request path.

``--sampler vllm``: the server samples through a vLLM engine beside the model (``sampler: vllm``),
every request in flight added to one generation of vLLM's own engine (``twinkle.sampler.vllm_batching``;
the largest batch is the most requests one engine step held), and ``sampler_alone`` is one
``vLLMSampler.sample`` call of as many rows; run it with vLLM installed (``make setup-vllm``).

Usage::

    .venv/bin/python benchmarks/sampling_concurrency.py    # tiny-qwen3 on the CPU; results/sampling_concurrency.json
    .venv/bin/python benchmarks/sampling_concurrency.py --model small-qwen3 --output /tmp/concurrency.json
    .venv-vllm/bin/python benchmarks/sampling_concurrency.py --sampler vllm \
        --output benchmarks/results/sampling_concurrency_vllm.json
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tinker
import torch
from machine import describe, settings_from_args
from tinker import types

from twinkle import assets
from twinkle.data_format import SamplingParams
from twinkle.sampler import TorchSampler
from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
from twinkle.server.store import Store

TENANTS = ('alice', 'bob', 'carol', 'dave')
#: The vLLM engine's arguments with ``--sampler vllm`` (the server's and the sampler alone's).
VLLM_ENGINE = {'dtype': 'float32', 'max_model_len': 1024}


@dataclass
class Settings:
    model: str = 'tiny-qwen3'
    device: str = 'cpu'
    sampler: str = 'torch'  # or 'vllm': a vLLM engine beside the model
    max_tokens: int = 64
    prompt_len: int = 32
    concurrency: str = '1,8,32'
    repeats: int = 3
    seed: int = 0
    # torch's intra-op threads: 1, as the other benchmarks on a shared machine (docs/benchmarks.md).
    threads: int = 1


class Server:
    """A server with four tenants, each with a sampling client of the base model."""

    def __init__(self, settings: Settings, data_dir: Path):
        self.model_dir = assets.tiny_model(settings.model)
        vllm = {'sampler': {'backend': 'vllm', 'group': False, 'engine_args': VLLM_ENGINE}}
        config = ServerConfig.build(
            base_model=self.model_dir, port=0, data_dir=str(data_dir), device=settings.device,
            save_state_every_steps=None, **(vllm if settings.sampler == 'vllm' else {}),
        )  # fmt: skip
        with Store(config.store_location) as store:
            self.keys = {name: store.tenants.add(name)[1] for name in TENANTS}
        self.settings, self.server = settings, BackgroundServer(config)
        self.vocab = json.loads((Path(self.model_dir) / 'config.json').read_text())['vocab_size']
        self._services: list[tinker.ServiceClient] = []

    def __enter__(self) -> Server:
        self.url = self.server.start()
        self._services = [tinker.ServiceClient(base_url=self.url, api_key=self.keys[name]) for name in TENANTS]
        self.clients = [service.create_sampling_client(base_model=self.model_dir) for service in self._services]
        return self

    def __exit__(self, *exc: object) -> None:
        for service in self._services:
            service.close('success').result(timeout=30)
        self.server.stop()

    def _host(self) -> Any:  # Any: the server's ModelHost
        return self.server.app.state.service.default.host

    def reset_largest(self) -> None:
        if self.settings.sampler == 'vllm':
            self._host().vllm.sampler.calls.widest = 0
        else:
            self._host().sampler().batch.step_sizes.clear()

    def largest(self) -> int:
        """The most rows one step decoded since ``reset_largest``: of the torch sampler's batch, or
        the requests one step of the vLLM engine held."""
        if self.settings.sampler == 'vllm':
            return int(self._host().vllm.sampler.calls.widest)
        return max(self._host().sampler().batch.step_sizes, default=0)

    def round(self, count: int, tenants: int, first_seed: int) -> tuple[float, int, int]:
        """``count`` requests at once, dealt to ``tenants`` tenants: (seconds until the last answer,
        tokens sampled, the largest batch decoded)."""
        gen = torch.Generator().manual_seed(first_seed)
        length = self.settings.prompt_len
        prompts = [torch.randint(0, self.vocab, (length,), generator=gen).tolist() for _ in range(count)]
        self.reset_largest()
        began = time.perf_counter()
        futures = []
        for i, prompt in enumerate(prompts):
            params = types.SamplingParams(max_tokens=self.settings.max_tokens, seed=first_seed + i, temperature=1.0)
            futures.append(self.clients[i % tenants].sample(types.ModelInput.from_ints(prompt), 1, params))
        responses = [future.result() for future in futures]
        seconds = time.perf_counter() - began
        tokens = sum(len(seq.tokens) for response in responses for seq in response.sequences)
        return seconds, tokens, self.largest()


def measure(server: Server, settings: Settings, count: int, tenants: int) -> dict[str, Any]:
    rounds = [server.round(count, tenants, settings.seed + 1000 * r) for r in range(settings.repeats)]
    return {
        'concurrency': count,
        'tenants': tenants,
        'wall_s': statistics.median(s for s, _, _ in rounds),
        'rounds_s': [s for s, _, _ in rounds],
        'tokens': rounds[0][1],
        'largest_batch': max(b for _, _, b in rounds),
    }


def sampler_alone(settings: Settings, counts: list[int]) -> dict[int, float]:
    """Seconds of one ``TorchSampler.sample`` call of ``count`` rows (the median of ``repeats``), on a
    sampler of its own in this process: what the batch costs without the server."""
    model_dir = assets.tiny_model(settings.model)
    sampler: Any  # a TorchSampler or a vLLMSampler
    if settings.sampler == 'vllm':
        from twinkle.sampler import vLLMSampler

        sampler = vLLMSampler(model_dir, engine_args=VLLM_ENGINE)
    else:
        sampler = TorchSampler(model_dir, device=settings.device)
    vocab = json.loads((Path(model_dir) / 'config.json').read_text())['vocab_size']
    gen = torch.Generator().manual_seed(settings.seed)
    prompts = [{'input_ids': torch.randint(0, vocab, (settings.prompt_len,), generator=gen).tolist()}
               for _ in range(max(counts))]  # fmt: skip
    params = SamplingParams(max_tokens=settings.max_tokens, seed=settings.seed, ignore_eos=True)
    sampler.sample(prompts[:1], params)  # untimed: the first forward's allocations
    seconds = {}
    for count in counts:
        times = []
        for _ in range(settings.repeats):
            began = time.perf_counter()
            sampler.sample(prompts[:count], params)
            times.append(time.perf_counter() - began)
        seconds[count] = statistics.median(times)
    if settings.sampler == 'vllm':
        sampler.close()  # its engine's memory and processes, before the server's starts
    return seconds


def main() -> None:
    settings, output_path = settings_from_args(
        Settings(), __doc__.split('\n\n')[0], 'benchmarks/results/sampling_concurrency.json'
    )
    torch.set_num_threads(settings.threads)
    counts = [int(c) for c in settings.concurrency.split(',')]
    alone = sampler_alone(settings, counts)
    with tempfile.TemporaryDirectory() as tmp, Server(settings, Path(tmp)) as server:
        server.round(1, 1, settings.seed - 1)  # untimed: the first forward's allocations, the SDK's session
        runs = [measure(server, settings, count, tenants) for tenants in (1, 4) for count in counts]
    one = next(run['wall_s'] for run in runs if run['concurrency'] == 1 and run['tenants'] == 1)
    for run in runs:
        run['ratio'] = run['wall_s'] / one
    result = {
        'benchmark': 'sampling_concurrency',
        'settings': asdict(settings),
        'environment': {**describe(), 'cuda': torch.cuda.get_device_name() if settings.device == 'cuda' else None},
        'one_request_s': one,
        'figures': runs,
        'sampler_alone': [{'rows': n, 'seconds': s, 'ratio': s / alone[min(counts)]} for n, s in alone.items()],
    }
    output = Path(output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    head = f'{settings.model} on {settings.device} ({settings.sampler} sampler)'
    print(f'{head}: requests of {settings.max_tokens} tokens; one alone {one:.2f} s')
    for run in runs:
        print(
            f'  {run["concurrency"]:3d} at once from {run["tenants"]} tenant(s): {run["wall_s"]:.2f} s '
            f'(x{run["ratio"]:.2f} one request; {run["tokens"]} tokens, largest batch {run["largest_batch"]})'
        )
    for n, seconds in alone.items():
        print(f'  sampler alone, {n:3d} rows in one call: {seconds:.2f} s (x{seconds / alone[min(counts)]:.2f})')
    print(f'wrote {output}')


if __name__ == '__main__':
    main()
