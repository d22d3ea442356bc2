"""Fuzzing every operation the server publishes in ``/openapi.json`` with requests that schemathesis
derives from it: no answer may be a 5xx, every answer must be one the schema declares (its status
code, content type, headers and body), a request that fits the schema is never refused as malformed
(a 400 or 422: the schema or the check would be wrong) and one that breaks it is never accepted,
so that a client generated from the schema works.

A real server on loopback (real HTTP, a real SQLite store, the tiny model) and one tenant's key on
every request. Each operation gets ``EXAMPLES`` requests that fit its schema and as many that do
not, drawn from a fixed seed (hypothesis' ``derandomize``), so a run is repeatable; ``make fuzz``
runs many more (``TWINKLE_FUZZ_EXAMPLES``). Problems are collected over all operations, not
raised at the first, so one run lists them all.
"""

from __future__ import annotations

import copy
import os
import re
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_helpers import background_server

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

#: Operations that answer without an API key; every other one must answer 401 without a known key.
# The routes that need no API key: health, and a download link's file (the signed link is the credential:
# tests/server/tinker/test_tinker_export.py checks that an altered or expired one is a 401). The metrics need the
# admin key.
PUBLIC = {
    'GET /healthz',
    'GET /api/v1/healthz',
    'GET /api/v1/external_weights_files/{checkpoint_id}/{name}',
    'GET /api/v1/session_traces/{session_id}',
}
#: Requests per operation and generation mode (fitting the schema, and not).
EXAMPLES = int(os.environ.get('TWINKLE_FUZZ_EXAMPLES', '2'))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    # A request that fits the schema may be answered 2xx, 401, 404, 409 or 429 (a name that does not
    # exist, a run not in that state), never 400 or 422; one that does not fit is never a 2xx.
    positive_data_acceptance,
    negative_data_rejection,
]
#: Seconds one request may take; a compute request is answered at once with a future.
REQUEST_TIMEOUT_S = 60.0
# Tinker's forward_backward body is protobuf: schemathesis sends the bytes it draws as they are.
schemathesis.serializer.alias('application/x-protobuf', 'application/octet-stream')
#: Bodies a schema cannot describe: bytes that must parse as a protobuf message. A request that fits
#: the schema (any bytes) may be refused; tests/server/tinker/test_tinker_codec.py fuzzes the messages themselves.
OPAQUE_BODIES = {'application/x-protobuf'}
#: Sampling parameters of a request that fits the schema as the fuzz sends them (the sampler checks
#: each parameter's value and that the prompt and max_tokens fit the model's context).
SMALL_SAMPLING = {'max_tokens': 2}


@dataclass(frozen=True)
class Model:
    """What the served model and the server's limits allow, for the rules the schema cannot state."""

    vocab: int
    max_lora_rank: int


# ---- rules beyond the schema ---------------------------------------------------------------------------
# A request must also follow rules that JSON Schema cannot state: they relate two fields (a row's
# labels as long as its token ids), or depend on the served model and the server's limits (token ids
# in the vocabulary, the LoRA rank, what fits the context). The server refuses a request that breaks
# one with a 4xx naming it. So that a refusal of a request that fits the schema is a real mismatch,
# the fuzz makes such a request follow these rules too (as schemathesis advises: extend the
# generators to the runtime rules), each rule a function of the operation's body.
def _rows_aligned(body: dict, model: Model) -> dict:
    """Each row's labels, masks and positions as long as its token ids, the ids in the vocabulary."""
    for row in body['inputs']:
        row['input_ids'] = [token % model.vocab for token in row['input_ids']]
        row['labels'] = [label if label < 0 else label % model.vocab for label in row['labels']]
        length = len(row['input_ids'])
        for key in ('labels', 'attention_mask', 'position_ids', 'completion_mask'):
            values = row.get(key)
            if isinstance(values, list):
                row[key] = [values[i % len(values)] if values else 0 for i in range(length)]
    return body


def _prompts_in_vocab(body: dict, model: Model) -> dict:
    """Prompt token ids in the vocabulary, and small sampling parameters."""
    for prompt in body['inputs']:
        if isinstance(prompt.get('input_ids'), list):
            prompt['input_ids'] = [token % model.vocab for token in prompt['input_ids']]
    if body.get('sampling_params') is not None:
        body['sampling_params'] = dict(SMALL_SAMPLING)
    return body


def _lora_in_limits(body: dict, model: Model) -> dict:
    """A LoRA rank within the server's limit; the other LoRA fields are peft's, checked against the model."""
    rank = body.get('lora', {}).get('r')
    body['lora'] = {'r': 1 + rank % model.max_lora_rank} if type(rank) is int else {}
    return body


def _tinker_prompt(body: dict, model: Model) -> dict:
    """One text chunk of token ids in the vocabulary (the only chunks served), the options it serves,
    and a small sample."""
    tokens = [t for chunk in body['prompt']['chunks'] for t in chunk.get('tokens', []) if type(t) is int]
    body['prompt'] = {'chunks': [{'type': 'encoded_text', 'tokens': [t % model.vocab for t in tokens] or [1]}]}
    for refused in ('prompt_alt_tokens_k', 'target_prompt_logprobs', 'prompt_logprobs_last_n', 'record_stability_info'):
        body.pop(refused, None)
    body['sampling_params'] = dict(SMALL_SAMPLING)
    body['num_samples'] = 1
    body.pop('topk_prompt_logprobs', None)
    body.pop('topk_sample_logprobs', None)
    return body


def _hour_window(query: dict, model: Model) -> dict:
    """A billing window on UTC hours, starting in the past, at most 14 days long."""
    hour = 3600 * (int(time.time()) // 3600)
    start = hour - 3600 * (zlib.crc32(str(query.get('starting_on')).encode()) % 100)
    length = 3600 * (1 + zlib.crc32(str(query.get('ending_before')).encode()) % (14 * 24))
    stamp = lambda seconds: datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()  # noqa: E731
    return {**query, 'starting_on': stamp(start), 'ending_before': stamp(start + length)}


#: The same for the query of a GET.
QUERY_RULES: dict[str, Callable[[dict, Model], dict]] = {'GET /api/v1/billing/usage/events': _hour_window}

RULES: dict[str, Callable[[dict, Model], dict]] = {
    'POST /twinkle/v1/runs': _lora_in_limits,
    'POST /twinkle/v1/runs/{run_id}/ops/forward_backward': _rows_aligned,
    'POST /twinkle/v1/runs/{run_id}/ops/forward_only': _rows_aligned,
    'POST /twinkle/v1/runs/{run_id}/ops/sample': _prompts_in_vocab,
    'POST /twinkle/v1/sample': _prompts_in_vocab,
    'POST /api/v1/asample': _tinker_prompt,
}


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('schema-fuzz'), tiny_model_dir, tenants=('alice',)) as running:
        yield running


def fuzz(
    operation: schemathesis.APIOperation, mode: GenerationMode, url: str, key: str, model: Model
) -> dict[str, list[str]]:
    """Problems found on ``operation``: what failed -> examples of it (the request and the answer)."""
    problems: dict[str, list[str]] = defaultdict(list)
    rule = RULES.get(operation.label) if mode is GenerationMode.POSITIVE else None
    query_rule = QUERY_RULES.get(operation.label) if mode is GenerationMode.POSITIVE else None
    opaque = any(body.media_type in OPAQUE_BODIES for body in operation.body)
    checks = [check for check in CHECKS if not (opaque and check is positive_data_acceptance)]

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        if rule is not None:
            case.body = rule(copy.deepcopy(case.body), model)
        if query_rule is not None:
            case.query = query_rule(dict(case.query or {}), model)
        response = case.call(base_url=url, headers={'Authorization': f'Bearer {key}'}, timeout=REQUEST_TIMEOUT_S)
        try:
            case.validate_response(response, checks=checks)
        except FailureGroup as group:  # one Failure per failed check
            for failure in group.exceptions:
                _record(problems, operation, failure, response)
        except Failure as failure:
            _record(problems, operation, failure, response)

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE  # an operation without parameters has no request that breaks them
    return problems


def _record(
    problems: dict[str, list[str]], operation: schemathesis.APIOperation, failure: Failure, response: Response
) -> None:
    """Keep the first two examples of each problem: what was sent and what came back."""
    examples = problems[f'{operation.label}: {failure.title}: {_first_line(failure.message)}']
    if len(examples) < 2:
        request = response.request
        sent = (request.body or b'')[:200] if isinstance(request.body, bytes) else str(request.body or '')[:200]
        answer = response.text[:300]
        examples.append(f'HTTP {response.status_code} to {request.method} {request.url} {sent!r}: {answer}')


def _first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), '')[:160]


def test_every_operation_answers_within_its_schema(server):
    url, keys, running = server
    service = running.app.state.service
    model = Model(vocab=service.default.host.vocab_size, max_lora_rank=service.config.limits.max_lora_rank)
    schema = schemathesis.openapi.from_url(f'{url}/openapi.json')
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 30  # native, Tinker (training, sampling, REST) and OpenAI routes
    problems: dict[str, list[str]] = defaultdict(list)
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for problem, examples in fuzz(operation, mode, url, keys['alice'], model).items():
                problems[problem] += examples
    listed = '\n'.join(
        f'{problem}\n' + ''.join(f'    {example}\n' for example in examples[:2])
        for problem, examples in sorted(problems.items())
    )
    assert not problems, f'{len(problems)} problems:\n{listed}'


@pytest.mark.parametrize('auth', [{}, {'Authorization': 'Bearer tml-not-a-key-of-anyone-here-0123456789'}])
def test_every_operation_that_needs_a_key_answers_401_without_one(server, auth):
    # One request per operation (path parameters filled in, an empty JSON object as the body): the
    # key is checked before anything else, so the answer is a 401 whatever the rest of the request.
    url, _, _ = server
    schema = schemathesis.openapi.from_url(f'{url}/openapi.json')
    operations = [result.ok() for result in schema.get_all_operations()]
    wrong: dict[str, str] = {}
    for operation in operations:
        label = f'{operation.method.upper()} {operation.path}'
        if label in PUBLIC:
            continue
        path = re.sub(r'\{[^}]+\}', 'x', operation.path)
        response = httpx.request(
            operation.method.upper(), f'{url}{path}', json={}, headers=auth, timeout=REQUEST_TIMEOUT_S
        )
        if response.status_code != 401:
            wrong[label] = f'{response.status_code} {response.text[:120]}'
    assert len(operations) - len(PUBLIC) > 30
    assert not wrong, '\n'.join(f'{label}: {answer}' for label, answer in sorted(wrong.items()))
