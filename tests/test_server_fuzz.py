"""Fuzzing the HTTP API from its own OpenAPI schema: no malformed request gets a 5xx.

A real server on loopback (as in test_server.py), a real SQLite store, two tenants and a training
run. For every route in ``app.openapi()`` hypothesis sends requests with hostile path parameters
(the real ids, '..', '%2e%2e', unicode, long text), query parameters of any type, bodies of random
JSON, schema-shaped bodies with fields of the wrong type, non-JSON bytes, and missing or wrong
keys; ``/ops/{operation}`` also gets the real operation names with random arguments and rows.
Every answer must be under 500 and a 4xx must carry a JSON ``detail``. A compute request the
server accepts (202) must end 'done', or 'failed' as the user's fault: a failure it blames on
itself ('server') is an unhandled bug. Problems are collected, not raised, so one run lists them
all; each test then asserts that it found none.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig

from twinkle.loss import LOSSES
from twinkle.metric import METRICS
from twinkle.model.optim import OPTIMIZERS, SCHEDULERS
from twinkle.processor import PROCESSORS
from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
from twinkle.server.host import FEATURE_FIELDS
from twinkle.server.store import Store
from twinkle.template import TEMPLATES
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

PREFIX = '/twinkle/v1'
OPS_ROUTE = f'{PREFIX}/runs/{{run_id}}/ops/{{operation}}'
EXAMPLES_PER_ROUTE = 8
OPS_EXAMPLES = 70
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
# Path parameters sent as they are, not percent-encoded: traversal, encoded traversal, control and unicode.
RAW_PATH_VALUES = ['..', '%2e%2e', '..%2F..%2Fetc%2Fpasswd', '.', '%2F', '%00', '%', '%zz', 'é中', '\u202e', '~']
# The arguments the real operations take, and a few they do not.
ARGUMENT_NAMES = [
    'inputs', 'lr', 'max_grad_norm', 'is_training', 'disable_lora', 'reduction', 'weight_decay', 'betas',
    'padding_side', 'max_length', 'T_max', 'model_id', 'adapter_name', 'loss_cls', 'optimizer_cls',
    'scheduler_cls', 'template_cls', 'processor_cls', 'metric',
]  # fmt: skip
REGISTRIES = {
    'loss_cls': LOSSES,
    'optimizer_cls': OPTIMIZERS,
    'scheduler_cls': SCHEDULERS,
    'template_cls': TEMPLATES,
    'processor_cls': PROCESSORS,
    'metric': METRICS,
}


# ---- the server under fuzz ---------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    method: str
    template: str  # '/twinkle/v1/runs/{run_id}', as in the OpenAPI document
    path_params: list[str]
    query_params: list[str]
    body_schema: dict[str, Any] | None  # $refs resolved


@dataclass
class Target:
    url: str
    keys: dict[str, str]  # tenant name -> API key; 'alice' is the fuzzing tenant
    real: dict[str, list[str]]  # path parameter name -> real values (run id, checkpoint name, future id)
    operations: list[str]
    vocab_size: int
    routes: list[Route]
    spare: MultiLoraTransformersModel  # alice's run whose id the fuzz never learns
    http: httpx.Client
    requests: int = 0
    futures: int = 0
    # What went wrong, a few example requests each; keyed by route and kind of failure.
    problems: dict[str, list[str]] = field(default_factory=dict)

    def send(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        """One request; a dropped connection is retried once on a fresh one, then is a problem."""
        self.requests += 1
        for attempt in range(2):
            try:
                return self.http.request(method, f'{self.url}{path}', **kwargs)
            except httpx.TransportError as error:
                if attempt:
                    self.problem(f'{method} {path[:60]}: no response ({error!r})', _describe(method, path, kwargs))
        return None

    def problem(self, key: str, example: str) -> None:
        examples = self.problems.setdefault(key, [])
        if len(examples) < 3:
            examples.append(example)

    def report(self) -> str:
        lines = [f'{len(self.problems)} kinds of problem in {self.requests} requests:']
        for key, examples in self.problems.items():
            lines += [f'* {key}', *(f'    {example}' for example in examples)]
        return '\n'.join(lines)


@pytest.fixture(scope='module')
def target(tmp_path_factory, tiny_model_dir) -> Target:
    config = ServerConfig.build(
        base_model=tiny_model_dir, port=0, data_dir=str(tmp_path_factory.mktemp('fuzz')), device='cpu'
    )
    store = Store(config.db_path)
    keys = {name: store.add_tenant(name)[1] for name in ('alice', 'bob')}
    store.close()
    background = BackgroundServer(config)
    with background as url, httpx.Client(timeout=90) as http:
        alice, bob = TwinkleClient(url, keys['alice']), TwinkleClient(url, keys['bob'])
        fuzzed = MultiLoraTransformersModel(client=alice)
        run_id = fuzzed.add_adapter_to_model('fuzzed', LoraConfig(r=4, target_modules='all-linear'))
        fuzzed.save('fuzz-ckpt')
        spare = MultiLoraTransformersModel(client=alice)
        spare.add_adapter_to_model('spare', LoraConfig(r=4, lora_alpha=8, target_modules='all-linear'), seed=3)
        spare.set_optimizer('AdamW', lr=1e-2)
        bobs = MultiLoraTransformersModel(client=bob)
        bobs_run = bobs.add_adapter_to_model('bobs', LoraConfig(r=4))
        real = {
            'run_id': [run_id, bobs_run],
            'name': ['fuzz-ckpt'],
            'operation': sorted(background.app.state.service.host.operations),
            'future_id': [
                alice.submit(f'{PREFIX}/runs/{run_id}/ops/get_train_configs', {}),
                bob.submit(f'{PREFIX}/runs/{bobs_run}/ops/get_train_configs', {}),
            ],
        }
        yield Target(
            url=url,
            keys=keys,
            real=real,
            operations=real['operation'],
            vocab_size=background.app.state.service.host.vocab_size,
            routes=_routes(background.app.openapi()),
            spare=spare,
            http=http,
        )
        for client in (alice, bob):
            client.close()


def _routes(spec: dict[str, Any]) -> list[Route]:
    routes = []
    for template, methods in spec['paths'].items():
        for method, operation in methods.items():
            parameters = operation.get('parameters', [])
            body = operation.get('requestBody', {}).get('content', {}).get('application/json', {}).get('schema')
            routes.append(
                Route(
                    method=method.upper(),
                    template=template,
                    path_params=[p['name'] for p in parameters if p['in'] == 'path'],
                    query_params=[p['name'] for p in parameters if p['in'] == 'query'],
                    body_schema=None if body is None else _resolve(body, spec),
                )
            )
    return routes


def _resolve(schema: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    if '$ref' in schema:
        return spec['components']['schemas'][schema['$ref'].rsplit('/', 1)[-1]]
    return schema


# ---- what the server must answer ---------------------------------------------------------------


def check(target: Target, method: str, template: str, path: str, kwargs: dict[str, Any]) -> None:
    """Send one request and book what is wrong with the answer, following an accepted future."""
    response = target.send(method, path, **kwargs)
    if response is None:
        return
    example = f'{_describe(method, path, kwargs)} -> {response.status_code} {response.text[:160]}'
    if response.status_code >= 500:
        target.problem(f'{method} {template}: HTTP {response.status_code}', example)
    elif response.status_code >= 400 and not _has_detail(response):
        target.problem(f'{method} {template}: HTTP {response.status_code} without a JSON detail', example)
    elif response.status_code == 202:
        settle(target, response.json()['future_id'], example)


def settle(target: Target, future_id: str, example: str) -> None:
    """Wait for an accepted request; it must end 'done', or 'failed' blamed on the user."""
    target.futures += 1
    record: dict[str, Any] = {}
    for _ in range(3):
        response = target.send('GET', f'{PREFIX}/futures/{future_id}', params={'wait': 10}, headers=_auth(target))
        record = response.json() if response is not None and response.status_code == 200 else {}
        if record.get('status') in ('done', 'failed'):
            break
    if record.get('status') == 'failed' and record.get('category') != 'user':
        error = str(record.get('error'))
        kind = error.split(':', 1)[0]
        target.problem(f'{record.get("op")} future failed as category {record.get("category")!r}: {kind}', example)
        target.problems[next(reversed(target.problems))][-1] += f'\n      future error: {error[:200]}'
    elif record.get('status') not in ('done', 'failed'):
        target.problem('future never finished', f'{example}; last record {record}')


def _has_detail(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and 'detail' in body


def _describe(method: str, path: str, kwargs: dict[str, Any]) -> str:
    content = kwargs.get('content')
    headers = {k: (v[:24] + '...' if len(v) > 24 else v) for k, v in kwargs.get('headers', {}).items()}
    body = '' if content is None else f' body={content[:200]!r}'
    return f'{method} {path[:120]} params={kwargs.get("params")} headers={headers}{body}'


def _auth(target: Target, who: str = 'alice') -> dict[str, str]:
    return {'Authorization': f'Bearer {target.keys[who]}'}


# ---- what the fuzz sends -------------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # unbounded: 2**70 and -2**70 too
    st.floats(),  # NaN and infinities are sent as the bare tokens json.dumps writes
    st.sampled_from([1e308, -1e308, 'NaN', 'Infinity', '-1e999', '', '..']),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


def path_values(real: list[str]) -> st.SearchStrategy[str]:
    """A path segment, already encoded: a real id, a raw hostile one, random text or a long one."""
    random_text = st.text(min_size=1, max_size=30).map(lambda text: quote(text, safe=''))
    long_text = st.tuples(st.sampled_from(['x', '.', '%2e', 'é']), st.integers(300, 2000)).map(
        lambda unit_count: quote(unit_count[0] * unit_count[1], safe='%')
    )
    return st.one_of(st.sampled_from(real or ['none']), st.sampled_from(RAW_PATH_VALUES), random_text, long_text)


def query_values() -> st.SearchStrategy[str]:
    return st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=12)).map(str)


def auth_headers(target: Target) -> st.SearchStrategy[dict[str, Any]]:
    """Mostly the right key; else none, an unknown one, another tenant's, or a malformed header."""
    good = _auth(target)
    bad = [
        {},
        {'Authorization': 'Bearer tk-wrong'},
        _auth(target, 'bob'),
        {'Authorization': 'Basic YWxpY2U6c2VjcmV0'},
        {'Authorization': 'Bearer '},
        {'Authorization': 'Bearer ' + 'x' * 4000},
        {'Authorization': b'Bearer \xe9\xff'},
        {'X-Api-Key': target.keys['alice'][:-1]},
    ]
    return st.one_of(st.just(good), st.just(good), st.just(good), st.sampled_from(bad))


@st.composite
def wrong_typed(draw: st.DrawFn, schema: dict[str, Any]) -> Any:
    """An object shaped like ``schema`` with some fields swapped for random values (or one extra)."""
    properties = schema.get('properties', {})
    body = {name: _plausible(name, spec) for name, spec in properties.items()}
    for name in draw(st.sets(st.sampled_from(sorted(properties)))) if properties else []:
        body[name] = draw(JSON_VALUES)
    if draw(st.booleans()):
        body[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    return body


def _plausible(name: str, spec: dict[str, Any]) -> Any:
    kind = spec.get('type') or spec.get('anyOf', [{}])[0].get('type')
    plausible = {'string': 'fuzz-name', 'integer': 1, 'number': 1.0, 'boolean': False, 'object': {}, 'array': []}
    return 'twinkle://run-x/checkpoints/fuzz-ckpt' if name == 'path' else plausible.get(kind)


@st.composite
def bodies(draw: st.DrawFn, route: Route) -> dict[str, Any]:
    """httpx keyword arguments for the body: none, random JSON, a wrong-typed object, or bytes."""
    kinds = ['none', 'json', 'bytes'] + (['schema', 'schema'] if route.body_schema else [])
    kind = draw(st.sampled_from(kinds))
    if kind == 'none':
        return {}
    if kind == 'bytes':
        content = draw(st.binary(max_size=64) | st.sampled_from([b'{not json', b'\xff\xfe', b'[1,', b'{"a": }']))
    else:
        value = draw(JSON_VALUES if kind == 'json' else wrong_typed(route.body_schema))
        content = json.dumps(value).encode()
    content_type = draw(st.sampled_from(['application/json'] * 4 + ['application/json; charset=latin-1', 'text/plain']))
    return {'content': content, 'headers': {'Content-Type': content_type}}


@st.composite
def requests_for(draw: st.DrawFn, route: Route, target: Target) -> tuple[str, dict[str, Any]]:
    """The path and httpx keyword arguments of one request to ``route``."""
    path = route.template
    for name in route.path_params:
        path = path.replace(f'{{{name}}}', draw(path_values(target.real.get(name, []))))
    names = route.query_params + [draw(st.text(min_size=1, max_size=6))]
    params = {name: draw(query_values()) for name in names if draw(st.booleans())}
    kwargs = draw(bodies(route))
    kwargs['headers'] = {**kwargs.get('headers', {}), **draw(auth_headers(target))}
    return path, {**kwargs, 'params': params}


def token_values(vocab: int) -> st.SearchStrategy[Any]:
    """Mostly valid token ids (or -100, the ignored label); else negative, huge, float, bool, text, null."""
    valid = st.integers(0, vocab - 1) | st.just(-100)
    invalid = st.one_of(
        st.integers(max_value=-1), st.integers(min_value=vocab), st.floats(), st.booleans(), st.text(max_size=2)
    )
    return st.one_of(valid, valid, valid, invalid, st.none())


@st.composite
def rows(draw: st.DrawFn, vocab: int) -> dict[str, Any]:
    """An encoded row whose columns may be missing, of mismatched lengths, empty or out of range."""
    length = draw(st.integers(0, 6))
    columns = draw(st.sets(st.sampled_from(FEATURE_FIELDS))) | ({'input_ids'} if draw(st.booleans()) else set())
    row = {}
    for column in sorted(columns):
        size = draw(st.sampled_from([length, length, length, length + 1, max(length - 1, 0)]))
        tokens = st.integers(0, vocab - 1) if draw(st.booleans()) else token_values(vocab)
        row[column] = draw(st.lists(tokens, min_size=size, max_size=size))
    return row


def argument_values(name: str, vocab: int) -> st.SearchStrategy[Any]:
    if name == 'inputs':
        return st.one_of(st.lists(rows(vocab), max_size=3), rows(vocab), JSON_VALUES)
    if name in REGISTRIES:
        return st.sampled_from(REGISTRIES[name].names()) | JSON_SCALARS
    return JSON_VALUES


@st.composite
def operation_requests(draw: st.DrawFn, target: Target) -> tuple[str, dict[str, Any]]:
    """A call of a real (or random) operation on the real (or a random) run, with random arguments."""
    run_id = draw(st.sampled_from(target.real['run_id'][:1] * 4) | path_values([]))
    operation = draw(st.sampled_from(target.operations) | path_values([]))
    names = draw(st.lists(st.sampled_from(ARGUMENT_NAMES) | st.text(max_size=8), max_size=4, unique=True))
    kwargs = {name: draw(argument_values(name, target.vocab_size)) for name in names}
    headers = {'Content-Type': 'application/json', **draw(auth_headers(target))}
    return f'{PREFIX}/runs/{run_id}/ops/{operation}', {'content': json.dumps(kwargs).encode(), 'headers': headers}


# ---- the tests -----------------------------------------------------------------------------------


def test_every_route_answers_malformed_requests_with_a_4xx(target):
    assert {route.template for route in target.routes} >= {f'{PREFIX}/runs/{{run_id}}', OPS_ROUTE}
    for route in target.routes:

        @FUZZ
        @settings(max_examples=EXAMPLES_PER_ROUTE)
        @given(request=requests_for(route, target))
        def fuzz_route(request: tuple[str, dict[str, Any]]) -> None:
            path, kwargs = request
            check(target, route.method, route.template, path, kwargs)

        fuzz_route()
    assert not target.problems, target.report()


def test_operations_with_random_arguments_are_refused_or_fail_as_the_users_fault(target):
    @FUZZ
    @settings(max_examples=OPS_EXAMPLES)
    @given(request=operation_requests(target))
    def fuzz_operation(request: tuple[str, dict[str, Any]]) -> None:
        path, kwargs = request
        check(target, 'POST', OPS_ROUTE, path, kwargs)

    fuzz_operation()
    assert not target.problems, target.report()


def test_after_the_fuzz_the_server_answers_and_still_trains(target):
    print(f'\nfuzz: {target.requests} requests sent, {target.futures} accepted futures followed')
    assert target.http.get(f'{target.url}/healthz').json() == {'status': 'ok'}
    # Five tokens; the first label is ignored (-100), so the loss is over the 4 shifted targets.
    row = {'input_ids': [11, 12, 13, 14, 15], 'labels': [-100, 12, 13, 14, 15]}
    before = target.spare.forward_only(inputs=[row]).loss
    output = target.spare.forward_backward(inputs=[row])
    assert output.loss == pytest.approx(before) and math.isfinite(output.loss)
    assert target.spare.clip_grad_and_step() > 0
    # One AdamW step (lr 1e-2) on the very row it was computed from must lower that row's loss.
    assert target.spare.forward_only(inputs=[row]).loss < before
