"""The native API's binary bodies (issue 33, point 4): MessagePack beside JSON, chosen by content type.

A client speaking MessagePack and one speaking JSON train twin runs to the same numbers; a raw
MessagePack request is answered in MessagePack when it asks, in JSON when it does not; a body that is
not MessagePack is a 400 that says so, and a MessagePack body is validated as its JSON would be.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgpack
import pytest
from peft import LoraConfig
from server_helpers import background_server, token_rows

from twinkle.wire import MSGPACK
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

OPS = '/twinkle/v1/runs/{run}/ops/{op}'


@pytest.fixture(scope='module')
def served(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, str]]:
    with background_server(tmp_path_factory.mktemp('binary'), tiny_model_dir, tenants=('alice',)) as running:
        url, keys, _ = running
        yield url, keys['alice']


@pytest.fixture(scope='module')
def run_id(served) -> str:
    url, key = served
    model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
    return model.add_adapter_to_model('probe', LoraConfig(r=4, target_modules='all-linear'), seed=5)


def post(served, path: str, content: bytes, content_type: str, accept: str | None = None) -> httpx.Response:
    url, key = served
    headers = {'Authorization': f'Bearer {key}', 'Content-Type': content_type}
    if accept is not None:
        headers['Accept'] = accept
    return httpx.post(f'{url}{path}', content=content, headers=headers, params={'wait': 60}, timeout=120)


def test_a_binary_and_a_json_client_train_twin_runs_to_the_same_numbers(served):
    url, key = served
    binary, plain = TwinkleClient(url, key), TwinkleClient(url, key, binary=False)
    assert binary.binary and not plain.binary
    figures = []
    for client in (binary, plain):
        model = MultiLoraTransformersModel(client=client)
        model.add_adapter_to_model('twin', LoraConfig(r=4, target_modules='all-linear'), seed=11)
        model.set_optimizer('AdamW', lr=1e-3)
        trained = model.forward_backward(inputs=token_rows(1, [12, 7]))
        model.clip_grad_and_step()
        scored = model.forward_only(inputs=token_rows(2, [9, 5]))
        figures.append((trained.loss, scored.loss, scored.logps))
    # Both encodings carry float64 exactly, and the twins ran the same computation one after the other.
    assert figures[0] == figures[1]
    assert len(figures[0][2]) == 2 and len(figures[0][2][0]) == 9


def test_a_msgpack_request_is_answered_in_what_it_accepts(served, run_id):
    path = OPS.format(run=run_id, op='forward_only')
    body = {'inputs': token_rows(3, [16])}
    packed = msgpack.packb(body)
    as_json = post(served, path, json.dumps(body).encode(), 'application/json')
    both = post(served, path, packed, MSGPACK, accept=f'{MSGPACK}, application/json;q=0.5')
    json_back = post(served, path, packed, 'application/x-msgpack', accept='application/json')
    refused_binary = post(served, path, packed, MSGPACK, accept=f'{MSGPACK};q=0, application/json')
    assert [a.status_code for a in (as_json, both, json_back, refused_binary)] == [202] * 4
    assert both.headers['content-type'] == MSGPACK
    assert [a.headers['content-type'] for a in (as_json, json_back, refused_binary)] == ['application/json'] * 3
    answers = [msgpack.unpackb(both.content), as_json.json(), json_back.json(), refused_binary.json()]
    results = [answer['future']['result'] for answer in answers]
    assert all(answer['future']['status'] == 'done' for answer in answers), answers
    assert results[0]['logps'] == results[1]['logps'] == results[2]['logps'] == results[3]['logps']
    assert len(both.content) < len(as_json.content)

    # A future poll answers in MessagePack too.
    url, key = served
    future_id = msgpack.unpackb(both.content)['future_id']
    headers = {'Authorization': f'Bearer {key}', 'Accept': MSGPACK}
    polled = httpx.get(f'{url}/twinkle/v1/futures/{future_id}', headers=headers, timeout=60)
    assert polled.status_code == 200 and polled.headers['content-type'] == MSGPACK
    assert msgpack.unpackb(polled.content)['result'] == results[0]


@pytest.mark.parametrize(
    ('content', 'reason'),
    [
        (b'\xc1', 'a byte that starts no MessagePack value'),  # a byte MessagePack never uses
        (msgpack.packb({'inputs': []}) + b'\x00', 'more bytes follow its value'),
        (msgpack.packb({1: 2}), 'a map key that is not a string'),  # JSON objects have string keys
        (msgpack.packb({'inputs': []})[:-1] + b'\xa1', 'it ends inside a value'),  # cut short
        (b'\xa2\xff\xfe', 'a string that is not UTF-8'),
        (b'\x91' * 5000, 'values nested too deep'),
    ],
    ids=['format', 'extra bytes', 'integer key', 'truncated', 'bad utf-8', 'deep'],
)
def test_a_body_that_is_not_msgpack_is_a_400_that_says_so(served, run_id, content, reason):
    answer = post(served, OPS.format(run=run_id, op='forward_only'), content, MSGPACK, accept=MSGPACK)
    assert answer.status_code == 400, answer.text
    assert answer.headers['content-type'] == 'application/json'  # errors stay JSON
    detail = answer.json()['detail']
    assert detail.startswith(f'the body is not valid MessagePack: {reason}'), detail
    assert answer.json()['error'] == 'DataError'


def test_a_msgpack_body_is_validated_as_its_json(served, run_id):
    path = OPS.format(run=run_id, op='forward_backward')
    bad_types = {'inputs': [{'input_ids': ['7', 8], 'labels': [8, 9]}]}
    out_of_vocab = {'inputs': [{'input_ids': [1, 10**9], 'labels': [-100, 2]}]}
    for body in (bad_types, out_of_vocab):
        as_json = post(served, path, json.dumps(body).encode(), 'application/json')
        as_msgpack = post(served, path, msgpack.packb(body), MSGPACK, accept=MSGPACK)
        assert as_json.status_code == as_msgpack.status_code and as_json.status_code in (400, 422)
        assert as_json.json() == as_msgpack.json()
    assert as_msgpack.status_code == 400 and '1000000000' in as_msgpack.json()['detail']
    # Binary values are not JSON's strings: a 422 naming the field.
    binary_name = post(served, path, msgpack.packb({'inputs': [{'input_ids': b'\x01', 'labels': [1]}]}), MSGPACK)
    assert binary_name.status_code == 422 and 'input_ids' in binary_name.text
