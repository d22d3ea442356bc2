"""What the native API's binary body (MessagePack, ``TwinkleClient(binary=True)``) saves against
JSON on a request whose tokens make it large: an RL-sized ``forward_only`` that sends 8 rows of
1,024 token ids and labels and gets back a logprob per token.

A real ``twinkle-server serve`` subprocess on loopback serves ``tiny-qwen3``; one run, two clients
with the same key, one speaking MessagePack and one JSON. Each request waits for its answer
(``?wait=``), as the client's ``call`` does. What HTTP and the encodings add is the round trip less
the server's own time for the request (its future's ``finished_at - created_at``, the queue and
the forward pass): ``wire_ms``. The two clients take turns in blocks of ``--calls`` for
``--repeats`` blocks (order reversed every block) after an untimed round each.

Beside it, in this process, each leg of the encoding on the same batch and answer: the client
writing the body, the server reading and validating it (as its route does), the server writing the
answer (FastAPI's pydantic writer for JSON, ``binary.pack`` for MessagePack) and the client reading
it (``codec_ms``, medians of 50).

Usage::

    .venv/bin/python benchmarks/binary_body.py    # ~1 min on 2 idle cores; writes results/binary_body.json
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch
from machine import describe, settings_from_args
from peft import LoraConfig
from server_overhead import ServerProcess

from twinkle import assets
from twinkle.server.api.binary import pack, unpack
from twinkle.wire import OPERATIONS, FutureAccepted
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel


@dataclass
class Settings:
    model: str = 'tiny-qwen3'
    device: str = 'cpu'
    rows: int = 8
    seq_len: int = 1024
    calls: int = 5
    repeats: int = 6
    seed: int = 0
    startup_timeout_s: float = 300.0


def batch(settings: Settings, vocab: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(settings.seed)
    rows = []
    for _ in range(settings.rows):
        ids = torch.randint(0, vocab, (settings.seq_len,), generator=gen).tolist()
        rows.append({'input_ids': ids, 'labels': [-100, *ids[1:]]})
    return {'inputs': rows}


def timed_request(client: TwinkleClient, path: str, body: dict[str, Any]) -> tuple[float, float]:
    """(round trip, the server's own time) in seconds of one waited compute request."""
    began = time.perf_counter()
    answer = FutureAccepted.model_validate(client.request('POST', path, json=body, params={'wait': 60}))
    round_trip = time.perf_counter() - began
    future = answer.future
    if future is None or future.status != 'done' or future.finished_at is None:
        raise RuntimeError(f'the request did not finish within its wait: {answer}')
    return round_trip, future.finished_at - future.created_at


def round_trips(clients: dict[str, TwinkleClient], path: str, body: dict[str, Any], settings: Settings) -> dict:
    times: dict[str, dict[str, list[float]]] = {name: {'round_trip': [], 'server': []} for name in clients}
    names = list(clients)
    for name in names:  # untimed: connections open, code paths warm
        timed_request(clients[name], path, body)
    for repeat in range(settings.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            for _ in range(settings.calls):
                trip, server = timed_request(clients[name], path, body)
                times[name]['round_trip'].append(trip)
                times[name]['server'].append(server)
    return times


def median_ms(call: Callable[[], object], count: int = 50) -> float:
    times = []
    for _ in range(count):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def codec_costs(body: dict[str, Any], answer: FutureAccepted) -> dict[str, dict[str, float]]:
    """Milliseconds of each leg of the encoding, per request, JSON against MessagePack."""
    spec = OPERATIONS['forward_only']
    as_json, as_msgpack = json.dumps(body).encode(), msgpack.packb(body)
    reply_json, reply_msgpack = answer.model_dump_json().encode(), pack(answer)
    return {
        'json': {
            'client_writes_body': median_ms(lambda: json.dumps(body).encode()),
            'server_reads_body': median_ms(lambda: spec.model_validate(json.loads(as_json))),
            'server_writes_answer': median_ms(lambda: answer.model_dump_json()),
            'client_reads_answer': median_ms(lambda: json.loads(reply_json)),
            'body_bytes': len(as_json),
            'answer_bytes': len(reply_json),
        },
        'msgpack': {
            'client_writes_body': median_ms(lambda: msgpack.packb(body)),
            'server_reads_body': median_ms(lambda: spec.model_validate(unpack(as_msgpack))),
            'server_writes_answer': median_ms(lambda: pack(answer)),
            'client_reads_answer': median_ms(lambda: msgpack.unpackb(reply_msgpack)),
            'body_bytes': len(as_msgpack),
            'answer_bytes': len(reply_msgpack),
        },
    }


def summarize(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    figures = {}
    for name, legs in times.items():
        wire = [trip - server for trip, server in zip(legs['round_trip'], legs['server'], strict=True)]
        figures[name] = {
            'round_trip_ms': 1000 * statistics.median(legs['round_trip']),
            'server_ms': 1000 * statistics.median(legs['server']),
            'wire_ms': 1000 * statistics.median(wire),
        }
    return figures


def main() -> None:
    settings, output_path = settings_from_args(
        Settings(), __doc__.split('\n\n')[0], 'benchmarks/results/binary_body.json'
    )
    model_dir = assets.tiny_model(settings.model)
    vocab = json.loads((Path(model_dir) / 'config.json').read_text())['vocab_size']
    body = batch(settings, vocab)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(settings, Path(tmp))  # type: ignore[arg-type]
        key = server.add_key('bench')
        with server as url:
            clients = {'msgpack': TwinkleClient(url, key), 'json': TwinkleClient(url, key, binary=False)}
            model = MultiLoraTransformersModel(client=clients['msgpack'])
            run_id = model.add_adapter_to_model('default', LoraConfig(r=16, target_modules='all-linear'), seed=0)
            path = f'/twinkle/v1/runs/{run_id}/ops/forward_only'
            times = round_trips(clients, path, body, settings)
            answer = FutureAccepted.model_validate(
                clients['json'].request('POST', path, json=body, params={'wait': 60})
            )
    figures: dict[str, Any] = summarize(times)
    figures['codec_ms'] = codec_costs(body, answer)
    figures['wire_ratio'] = figures['json']['wire_ms'] / figures['msgpack']['wire_ms']
    figures['wire_saved_ms'] = figures['json']['wire_ms'] - figures['msgpack']['wire_ms']
    result = {
        'benchmark': 'binary_body',
        'settings': asdict(settings),
        'environment': {**describe(), 'load_average_1min_before': load_before},
        'figures': figures,
    }
    output = Path(output_path)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + '\n')
    tokens = settings.rows * settings.seq_len
    print(f'forward_only of {settings.rows} x {settings.seq_len} tokens ({tokens} logprobs back), {settings.model}:')
    for name in ('json', 'msgpack'):
        f = figures[name]
        trip, server, wire = f['round_trip_ms'], f['server_ms'], f['wire_ms']
        print(f'  {name:8s} round trip {trip:7.1f} ms, server {server:7.1f} ms, wire {wire:6.1f} ms')
    ratio, saved = figures['wire_ratio'], figures['wire_saved_ms']
    print(f'  the wire costs x{ratio:.2f} as much in JSON ({saved:.1f} ms saved per request)')
    for name, legs in figures['codec_ms'].items():
        print(f'  {name:8s} ' + ', '.join(f'{leg} {value:.2f}' for leg, value in legs.items()))
    print(f'wrote {output}')


if __name__ == '__main__':
    main()
