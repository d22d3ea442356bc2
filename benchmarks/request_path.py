"""Where a small request's milliseconds go, against a bare ``GET /healthz``.

``server_overhead.py`` measures what a small request costs through the server (``get_train_configs()``
on a run, one POST with ``?wait=``); this benchmark splits that time into the steps of its path. The
server is a real ``twinkle-server serve`` subprocess (``ServerProcess`` of ``server_overhead.py``), started
through this file's ``--serve`` mode: it wraps a few of the server's functions so that each records
``time.perf_counter()`` as it starts or ends, then runs the CLI unchanged. ``perf_counter`` is the
machine's monotonic clock, the same in the client's process, so the client's marks and the server's
line up. The client sends one request at a time (``--calls`` of each kind, kinds alternating over
``--rounds``); each request's marks are the server's between the client's send and its answer.

The steps (the medians of their gaps, each request's own):

* ``client sends``: the client's call until the server's first read of the request (``twinkle_client``,
  httpx, the loopback socket);
* ``HTTP in``: h11 and uvicorn read the request, the outer middleware and ``HttpLimits`` until its key lookup;
* ``key lookup``: the tenant of the API key, from the store (``Tenants.for_key``);
* ``routing, body, dependencies``: the rest of ``HttpLimits``, the route's match, the body read and
  parsed, FastAPI's dependencies and parameters, until the endpoint runs;
* ``run lookup``: the run's record from the store (``Service.adapter_of``);
* ``future recorded, queued``: the future's row written, the job queued (``Service.submit``);
* ``to the worker``: the worker thread wakes and takes the job;
* ``future marked running``: its row updated on the worker (``on_start``);
* ``the operation``: what the same local call does (``TransformersModel.get_train_configs``);
* ``future finished, usage``: its row updated with the result, the tenant's usage added (``on_finish``);
* ``back to the event loop``: the worker wakes the loop waiting on the job;
* ``answer``: the future read back from the store and encoded (MessagePack for the native client);
* ``HTTP out``: the response through the middleware and h11 to the socket;
* ``client reads``: the client's read of the answer and its decoding.

A bare GET has ``client sends``, ``HTTP in``, ``routing, body, dependencies`` (to its endpoint), its
endpoint (``answer``), ``HTTP out`` and ``client reads``. ``added_ms`` of a step is its median for
the small request less that for the bare GET. The marks cost a few microseconds each (a list append
of a clock read), within the noise of the steps they split.

Usage::

    .venv/bin/python benchmarks/request_path.py    # ~1 min on 2 idle cores; writes results/request_path.json
    ... --model small-qwen3 --calls 200 --rounds 5
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import functools
import itertools
import json
import os
import runpy
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Set in the server's environment: where its marks are written when it stops.
MARKS_ENV = 'TWINKLE_BENCH_MARKS'
#: The steps of a request in order: (name, the mark it starts at). A step ends where the next found one starts.
STEPS = [
    ('client sends', 'client_out'),
    ('HTTP in', 'http_in'),
    ('key lookup', 'key'),
    ('routing, body, dependencies', 'key_end'),
    ('run lookup', 'run'),
    ('(endpoint, before the queue)', 'run_end'),
    ('future recorded, queued', 'queue'),
    ('to the worker', 'queued'),
    ('future marked running', 'worker'),
    ('the operation', 'operation'),
    ('future finished, usage', 'operation_end'),
    ('back to the event loop', 'settled'),
    ('answer', 'resumed'),
    ('HTTP out', 'endpoint_end'),
    ('client reads', 'http_out'),
]
#: A bare GET's marks: its endpoint runs from ``endpoint`` (its answer) with nothing before it.
GET_STEPS = [
    ('client sends', 'client_out'),
    ('HTTP in', 'http_in'),
    ('routing, body, dependencies', 'limits'),
    ('answer', 'endpoint'),
    ('HTTP out', 'endpoint_end'),
    ('client reads', 'http_out'),
]


# ---- the server side: marks around its functions --------------------------------------------------
def serve_marked(cli_args: list[str]) -> None:
    """Run ``twinkle-server`` with marks around the functions of a request's path; write them at exit."""
    marks: list[tuple[str, float]] = []
    mark = marks.append
    clock = time.perf_counter

    def around(owner: object, name: str, start: str | None, end: str | None) -> None:
        fn = getattr(owner, name)  # AttributeError: the server's code moved; this list must follow it

        @functools.wraps(fn)
        def marked(*args: Any, **kwargs: Any) -> Any:
            if start:
                mark((start, clock()))
            try:
                return fn(*args, **kwargs)
            finally:
                if end:
                    mark((end, clock()))

        setattr(owner, name, marked)

    def around_async(owner: object, name: str, start: str, end: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        async def marked(*args: Any, **kwargs: Any) -> Any:
            mark((start, clock()))
            try:
                return await fn(*args, **kwargs)
            finally:
                mark((end, clock()))

        setattr(owner, name, marked)

    import fastapi.routing
    from uvicorn.protocols.http import h11_impl

    from twinkle.server.api import request_limits
    from twinkle.server.execution.scheduling import scheduler
    from twinkle.server.service import Service
    from twinkle.server.store import runs, tenants

    around(request_limits.IdleClosingH11Protocol, 'data_received', 'http_in', None)
    around_async(request_limits.HttpLimits, '__call__', 'limits', 'limits_end')
    around(tenants.Tenants, 'for_key', 'key', 'key_end')
    around_async(fastapi.routing, 'run_endpoint_function', 'endpoint', 'endpoint_end')
    around(runs.Runs, 'get', 'run', 'run_end')
    around(Service, 'submit', 'queue', 'queued')
    around(scheduler.Scheduler, '_run', 'worker', None)
    around(scheduler.Scheduler, '_execute', 'operation', 'operation_end')
    around(scheduler.Job, '_settle', 'settled', None)
    around(scheduler, '_resolve', 'resumed', None)
    around_async(h11_impl.RequestResponseCycle, 'send', 'sending', 'http_out')

    @atexit.register
    def write() -> None:
        Path(os.environ[MARKS_ENV]).write_text(json.dumps(marks))

    def stopped(signum: int, frame: object) -> None:
        """uvicorn raises the SIGTERM it caught again once it stopped: the marks, then the default end."""
        write()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, stopped)

    sys.argv = ['twinkle-server', *cli_args]
    runpy.run_module('twinkle.server.cli', run_name='__main__')


# ---- the client side ------------------------------------------------------------------------------
def timed(call: Callable[[], object], count: int, into: list[tuple[float, float]]) -> None:
    for _ in range(count):
        began = time.perf_counter()
        call()
        into.append((began, time.perf_counter()))  # every mark a step starts at comes before the answer


def step_gaps(
    windows: list[tuple[float, float]], marks: list[tuple[str, float]], steps: list[tuple[str, str]]
) -> tuple[dict[str, list[float]], int]:
    """Each step's duration in each request, in ms (from its mark to the next step's), over the requests
    whose marks are all there and in the order of ``steps``; and how many requests were left out (a job
    settled before the loop waited on it leaves no ``resumed`` mark; a chore's call may land out of order)."""
    gaps: dict[str, list[float]] = {name: [] for name, _ in steps}
    marks = sorted(marks, key=lambda m: m[1])
    times = [t for _, t in marks]
    left_out = 0
    for began, ended in windows:
        inside = marks[bisect.bisect_left(times, began) : bisect.bisect_right(times, ended)]
        seen: dict[str, float] = {'client_out': began}
        for name, at in inside:
            if name == 'http_out':
                seen[name] = at  # the last send: the body's
            else:
                seen.setdefault(name, at)
        if any(mark not in seen for _, mark in steps):
            left_out += 1
            continue
        points = [(name, seen[mark]) for name, mark in steps] + [('end', ended)]
        if any(following < at for (_, at), (_, following) in itertools.pairwise(points)):
            left_out += 1
            continue
        for (name, at), (_, following) in itertools.pairwise(points):
            gaps[name].append((following - at) * 1e3)
    return gaps, left_out


def summarize(gaps: dict[str, list[float]]) -> dict[str, float]:
    """The median of each step."""
    return {name: statistics.median(values) for name, values in gaps.items() if values}


def measure(model: str, calls: int, rounds: int, workdir: Path) -> dict[str, Any]:
    from server_overhead import RemoteLoop, ServerProcess
    from server_overhead import Settings as ServerSettings

    from twinkle_client import TwinkleClient

    unused = {'steps': 1, 'warmup': 1, 'repeats': 1, 'tenants': [1], 'tenant_steps': 1, 'tenant_rounds': 1}
    settings = ServerSettings(model=model, device='cpu', calls=calls, call_repeats=rounds, **unused)
    server = ServerProcess(settings, workdir)
    server.args = [sys.executable, __file__, '--serve', *server.args[3:]]  # this file's --serve, then the CLI's
    server.env[MARKS_ENV] = str(workdir / 'marks.json')
    key = server.add_key('bench')
    windows: dict[str, list[tuple[float, float]]] = {'small request': [], 'bare GET': []}
    with server as url:
        client = TwinkleClient(url, key)
        model_calls = RemoteLoop(client, settings, seed=0).model.get_train_configs
        kinds = {'small request': model_calls, 'bare GET': lambda: client.http.get('/healthz')}
        for call in kinds.values():  # connections opened, code paths warm
            timed(call, 50, [])
        for round_ in range(rounds):
            for name in kinds if round_ % 2 == 0 else list(kinds)[::-1]:
                timed(kinds[name], calls, windows[name])
    marks = [tuple(m) for m in json.loads((workdir / 'marks.json').read_text())]
    small, small_out = step_gaps(windows['small request'], marks, STEPS)
    bare, bare_out = step_gaps(windows['bare GET'], marks, GET_STEPS)
    totals = {name: statistics.median((b - a) * 1e3 for a, b in spans) for name, spans in windows.items()}
    return {
        'small_request_ms': summarize(small),
        'bare_get_ms': summarize(bare),
        'total_ms': totals,
        # Requests of each kind whose marks were not all there, in order (their steps are not in the medians).
        'left_out': {'small request': small_out, 'bare GET': bare_out},
        'requests': {name: len(spans) for name, spans in windows.items()},
    }


def print_summary(result: dict[str, Any]) -> None:
    small, bare, totals = result['small_request_ms'], result['bare_get_ms'], result['total_ms']
    print(f'{"step":<32} {"small request":>14} {"bare GET":>10} {"added":>8}   (medians, ms)')
    for name, _ in STEPS:
        if name in small:
            added = small[name] - bare.get(name, 0.0)
            print(f'{name:<32} {small[name]:>14.3f} {bare.get(name, 0.0):>10.3f} {added:>+8.3f}')
    added = totals['small request'] - totals['bare GET']
    print(f'{"whole request":<32} {totals["small request"]:>14.3f} {totals["bare GET"]:>10.3f} {added:>+8.3f}')
    left_out, requests = result['left_out'], result['requests']
    print(
        ', '.join(
            f'{name}: {left_out[name]} of {requests[name]} left out (marks missing or out of order)'
            for name in requests
        )
    )


def main() -> None:
    if sys.argv[1:2] == ['--serve']:
        serve_marked(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='tiny-qwen3', help='embedded model name or a local model directory')
    parser.add_argument('--calls', type=int, default=200, help='calls of each kind per round')
    parser.add_argument('--rounds', type=int, default=3, help='rounds, the kinds alternating')
    parser.add_argument('--output', default='benchmarks/results/request_path.json')
    args = parser.parse_args()
    if min(args.calls, args.rounds) < 1:
        parser.error('--calls and --rounds: at least 1')
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix='twinkle-request-path-') as workdir:
        figures = measure(args.model, args.calls, args.rounds, Path(workdir))
    result = {
        'benchmark': 'request_path',
        'settings': vars(args),
        'environment': {'cpus': os.cpu_count(), 'load_before': load_before, 'python': sys.version.split()[0]},
        'figures': figures,
    }
    print_summary(figures)
    Path(args.output).write_text(json.dumps(result, indent=2) + '\n')
    print(f'wrote {args.output}')


if __name__ == '__main__':
    main()
