"""The Tinker protobuf codec against the official SDK's own encoder and decoders.

Requests are built by ``tinker.proto.request_conv.forward_backward_request_to_proto`` from
``tinker.types`` objects, exactly as ``TrainingClient.forward_backward`` sends them; replies are
read back by ``tinker.proto.response_conv``, exactly as the client reads them. Expected values are
the inputs themselves, chosen to be exact in float32 (and in bfloat16 where that is tested).
"""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from twinkle.data_format import SampledSequence, SampleResponse
from twinkle.errors import DataError
from twinkle.server.execution.checks.images import IMAGE_SLOT, ImageSlot
from twinkle.server.execution.tinker import codec
from twinkle.server.execution.tinker.codec import forward_backward_output, parse_forward_backward, sample_response

# --------------------------------------------------------------------------- helpers


def _request(
    data: list[types.Datum],
    loss_fn: str = 'cross_entropy',
    loss_fn_config: dict[str, float | str] | None = None,
    seq_id: int = 3,
) -> pb.ForwardBackwardRequest:
    """The protobuf the SDK sends for ``forward_backward(data, loss_fn, loss_fn_config)``."""
    fb_input = types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config)
    request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id='s1:train:0', seq_id=seq_id)
    return forward_backward_request_to_proto(request)


def _datum(tokens: list[int], **inputs: object) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def _parse_one(datum: types.Datum) -> codec.Datum:
    call = parse_forward_backward(_request([datum]).SerializeToString())
    assert len(call.data) == 1
    return call.data[0]


def _raw_tensor(dtype: int, shape: list[int], dense: bytes) -> pb.Tensor:
    return pb.Tensor(dense=dense, dtype=dtype, shape=shape)


def _with_input(name: str, tensor: pb.Tensor) -> bytes:
    """A one-datum request whose ``loss_fn_inputs[name]`` is the hand-built ``tensor``."""
    message = _request([_datum([1, 2, 3])])
    message.data[0].loss_fn_inputs[name].CopyFrom(tensor)
    return message.SerializeToString()


def _assert_data_error(body: bytes, *fragments: str, **kwargs: object) -> None:
    with pytest.raises(DataError) as info:
        parse_forward_backward(body, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def _seq(tokens: list[int], entries: list[list[tuple[int, float]]], stop: str = 'stop') -> SampledSequence:
    return SampledSequence(stop, tokens, entries, decoded='', new_input_feature={})


# --------------------------------------------------------------------------- requests


def test_request_fields_and_tokens_across_chunks():
    # Two encoded_text chunks [5, 6] + [7] are one input [5, 6, 7].
    chunks = [types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[7])]
    datums = [
        types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={'weights': [1.0, 0.0, 1.0]}),
        _datum([2**31 - 1, 0], weights=[0.5, 0.25]),
    ]
    call = parse_forward_backward(_request(datums, loss_fn='ppo', seq_id=17).SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ('s1:train:0', 17, 'ppo', False)
    assert [d.tokens for d in call.data] == [[5, 6, 7], [2**31 - 1, 0]]
    assert call.data[1].loss_fn_inputs['weights'].tolist() == [0.5, 0.25]
    assert call.loss_fn_config == {}


def test_forward_only_flag():
    message = _request([_datum([1])])
    message.forward_only = True  # what TrainingClient.forward sets
    assert parse_forward_backward(message.SerializeToString()).forward_only is True


def test_loss_fn_config_v2_wins_and_keeps_text():
    message = _request([_datum([1])], loss_fn_config={'clip_low_threshold': 0.8, 'mode': 'token'})
    message.loss_fn_config['clip_low_threshold'] = 9.0  # a stale legacy value must lose to v2
    call = parse_forward_backward(message.SerializeToString())
    assert call.loss_fn_config == {'clip_low_threshold': 0.8, 'mode': 'token'}


def test_legacy_loss_fn_config_when_no_v2():
    # An older SDK sends only the float map.
    message = _request([_datum([1])], loss_fn_config={'beta': 0.25, 'clip_high_threshold': 1.25})
    message.ClearField('loss_fn_config_v2')
    call = parse_forward_backward(message.SerializeToString())
    assert call.loss_fn_config == {'beta': 0.25, 'clip_high_threshold': 1.25}


def test_loss_fn_inputs_from_lists_numpy_torch_and_tensor_data():
    datum = _datum(
        [1, 2, 3],
        target_tokens=[4, 5, 6],
        weights=np.array([1.0, 0.5, 0.0], dtype=np.float32),
        advantages=torch.tensor([-1.5, 2.0, 0.0]),
        logprobs=types.TensorData(data=[-0.5, -0.25, -0.125], dtype='float32'),  # no shape on the wire
        mask=types.TensorData.from_numpy(np.array([[1, 0], [0, 1], [1, 1]], dtype=np.int64)),
    )
    inputs = _parse_one(datum).loss_fn_inputs
    assert inputs['target_tokens'].dtype == torch.int64 and inputs['target_tokens'].tolist() == [4, 5, 6]
    assert inputs['weights'].dtype == torch.float32 and inputs['weights'].tolist() == [1.0, 0.5, 0.0]
    assert inputs['advantages'].tolist() == [-1.5, 2.0, 0.0]
    assert inputs['logprobs'].shape == (3,) and inputs['logprobs'].tolist() == [-0.5, -0.25, -0.125]
    assert inputs['mask'].tolist() == [[1, 0], [0, 1], [1, 1]]


def test_sparse_csr_inputs_decode_to_dense():
    # A 2-D torch target_tokens/weights with mostly zeros is sent as CSR by the SDK itself.
    targets = torch.zeros(4, 6, dtype=torch.int64)
    targets[0, 1], targets[2, 5], targets[3, 0] = 7, 9, 11
    weights = torch.zeros(4, 6)
    weights[1, 2] = 0.5
    message = _request([_datum([1, 2, 3, 4], target_tokens=targets, weights=weights)])
    wire = message.data[0].loss_fn_inputs
    assert wire['target_tokens'].WhichOneof('encoding') == 'sparse_csr'
    assert wire['weights'].WhichOneof('encoding') == 'sparse_csr'
    inputs = parse_forward_backward(message.SerializeToString()).data[0].loss_fn_inputs
    assert torch.equal(inputs['target_tokens'], targets)
    assert torch.equal(inputs['weights'], weights)


def test_int32_and_bfloat16_widen_exactly():
    # bfloat16 1.5 is 0x3FC0 and -2.0 is 0xC000: the top halves of the float32 bit patterns.
    bf16 = torch.tensor([1.5, -2.0, 0.15625], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    body = _with_input('weights', _raw_tensor(pb.DTYPE_BFLOAT16, [3], bf16))
    weights = parse_forward_backward(body).data[0].loss_fn_inputs['weights']
    assert weights.dtype == torch.float32 and weights.tolist() == [1.5, -2.0, 0.15625]
    ints = np.array([-3, 0, 2**31 - 1], dtype='<i4').tobytes()
    targets = parse_forward_backward(_with_input('t', _raw_tensor(pb.DTYPE_INT32, [3], ints))).data[0]
    assert targets.loss_fn_inputs['t'].dtype == torch.int64
    assert targets.loss_fn_inputs['t'].tolist() == [-3, 0, 2**31 - 1]


def test_decoded_tensors_are_writable():
    # np.frombuffer over the protobuf bytes is read-only; the codec must hand out its own copy.
    weights = _parse_one(_datum([1, 2], weights=[1.0, 2.0])).loss_fn_inputs['weights']
    weights.mul_(2)
    assert weights.tolist() == [2.0, 4.0]


@pytest.mark.parametrize('encoding', ['zstd', 'ZSTD', ' zstd '])
def test_zstd_body(encoding):
    # What the SDK sends when client/config says proto_compress_fwdbwd: training.py compresses
    # with ZstdCompressor().compress and sets Content-Encoding: zstd.
    plain = _request([_datum([3, 1, 4], weights=[1.0, 0.0, 1.0])]).SerializeToString()
    call = parse_forward_backward(zstandard.ZstdCompressor().compress(plain), encoding)
    assert call.data[0].tokens == [3, 1, 4]
    assert call.data[0].loss_fn_inputs['weights'].tolist() == [1.0, 0.0, 1.0]


def test_identity_encoding_is_plain():
    plain = _request([_datum([8])]).SerializeToString()
    assert parse_forward_backward(plain, 'identity').data[0].tokens == [8]


def test_dense_inputs_round_trip_property():
    @settings(max_examples=60, deadline=None)
    @given(
        array=st.one_of(
            hnp.arrays(
                np.float32,
                hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
                elements=st.floats(width=32, allow_nan=False),
            ),
            hnp.arrays(np.int64, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4)),
        )
    )
    def check(array: np.ndarray) -> None:
        decoded = _parse_one(_datum([1], x=array)).loss_fn_inputs['x']
        assert decoded.shape == array.shape
        assert torch.equal(decoded, torch.from_numpy(array))

    check()


def test_sparse_inputs_round_trip_property():
    @settings(max_examples=60, deadline=None)
    @given(
        dense=hnp.arrays(
            np.int64,
            hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=8),
            elements=st.sampled_from([0, 0, 0, 0, 5, -1, 2**40]),
        )
    )
    def check(dense: np.ndarray) -> None:
        # torch inputs named target_tokens go sparse whenever CSR is the smaller encoding.
        decoded = _parse_one(_datum([1], target_tokens=torch.from_numpy(dense))).loss_fn_inputs['target_tokens']
        assert torch.equal(decoded, torch.from_numpy(dense))

    check()


# --------------------------------------------------------------------------- request errors


def test_garbage_bytes():
    # 0xFF starts a field with wire type 7, which does not exist.
    _assert_data_error(b'\xff\xff\xff\xff', 'not a protobuf ForwardBackwardRequest')


def test_bad_zstd():
    _assert_data_error(b'not zstd at all', 'not valid zstd', content_encoding='zstd')


def test_truncated_zstd():
    body = zstandard.ZstdCompressor().compress(_request([_datum(list(range(100)))]).SerializeToString())
    _assert_data_error(body[:-4], 'ends inside its frame', content_encoding='zstd')


def test_bytes_after_zstd_frame():
    body = zstandard.ZstdCompressor().compress(_request([_datum([1])]).SerializeToString())
    _assert_data_error(body + b'xyz', '3 bytes follow the zstd frame', content_encoding='zstd')


def test_zstd_bomb_stops_at_limit():
    # 4 MiB of zeros compresses to a few hundred bytes; the limit is 1 MiB.
    bomb = zstandard.ZstdCompressor().compress(bytes(4 << 20))
    _assert_data_error(bomb, 'more than 1048576 bytes', content_encoding='zstd', max_body_bytes=1 << 20)


def test_unknown_content_encoding():
    _assert_data_error(b'', "'gzip'", 'zstd', content_encoding='gzip')


def test_a_dmel_chunk_is_refused_naming_the_datum_and_chunk():
    chunks = [types.EncodedTextChunk(tokens=[1, 2]), types.DmelChunk(dmel=b'\x00\x01')]
    datums = [_datum([1]), types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={})]
    _assert_data_error(_request(datums).SerializeToString(), 'datum 1', 'chunk 1', "'dmel'", 'encoded_text and image')


def test_an_image_chunk_takes_its_expected_tokens_as_slots_and_keeps_its_bytes():
    image = types.ImageChunk(data=b'\x89PNG-bytes', format='png', expected_tokens=3)
    chunks = [types.EncodedTextChunk(tokens=[7, 8]), image, types.EncodedTextChunk(tokens=[9])]
    datum = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={'target_tokens': [0] * 6})
    (decoded,) = parse_forward_backward(_request([datum]).SerializeToString()).data
    assert decoded.tokens == [7, 8, IMAGE_SLOT, IMAGE_SLOT, IMAGE_SLOT, 9]
    assert decoded.images == (ImageSlot(b'\x89PNG-bytes', start=2, length=3),)


@pytest.mark.parametrize(
    ('image', 'fragment'),
    [
        (types.ImageChunk(data=b'x', format='png'), 'needs expected_tokens >= 1'),
        (types.ImageChunk(data=b'x', format='png', expected_tokens=0), 'needs expected_tokens >= 1'),
    ],
)
def test_an_image_chunk_without_its_token_count_is_refused(image, fragment):
    chunks = [types.EncodedTextChunk(tokens=[1]), image]
    datum = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={})
    _assert_data_error(_request([datum]).SerializeToString(), 'datum 0 model_input chunk 1', fragment)


def test_an_image_chunk_of_another_format_or_with_override_dimensions_is_refused():
    message = _request([_datum([1])])
    chunk = message.data[0].model_input.add()
    chunk.image.data, chunk.image.format, chunk.image.expected_tokens = b'x', 'gif', 2
    _assert_data_error(message.SerializeToString(), "image format 'gif' is not accepted", "['png', 'jpeg']")
    chunk.image.format = 'png'
    chunk.image.override_dimensions.width = 8
    _assert_data_error(message.SerializeToString(), 'override_dimensions is not supported')


def test_empty_chunk():
    message = _request([_datum([1])])
    message.data[0].model_input.add()  # a Chunk with no oneof set
    _assert_data_error(message.SerializeToString(), 'datum 0 model_input chunk 1', "'empty'")


def test_token_bytes_not_int32():
    message = _request([_datum([1])])
    message.data[0].model_input[0].encoded_text.tokens = b'\x01\x00\x00'
    _assert_data_error(message.SerializeToString(), 'datum 0 model_input chunk 0 tokens', '3 bytes')


@pytest.mark.parametrize(('dtype', 'shown'), [(pb.DTYPE_UNSPECIFIED, 'DTYPE_UNSPECIFIED'), (99, '99')])
def test_bad_dtype(dtype, shown):
    body = _with_input('weights', _raw_tensor(dtype, [1], b'\x00' * 4))
    _assert_data_error(body, "datum 0 loss_fn_inputs['weights']", f'dtype {shown}', 'FLOAT32', 'BFLOAT16')


def test_shape_mismatch():
    # Three float32 values (12 bytes) under shape [4], which needs 16 bytes.
    body = _with_input('weights', _raw_tensor(pb.DTYPE_FLOAT32, [4], np.ones(3, '<f4').tobytes()))
    _assert_data_error(body, "loss_fn_inputs['weights']", '12 bytes of FLOAT32', 'shape [4] needs 16')


def test_partial_element():
    body = _with_input('target_tokens', _raw_tensor(pb.DTYPE_INT64, [], b'\x00' * 12))
    _assert_data_error(body, "loss_fn_inputs['target_tokens'] dense", '12 bytes', '8-byte')


def test_negative_dimension():
    body = _with_input('weights', _raw_tensor(pb.DTYPE_FLOAT32, [-1], b''))
    _assert_data_error(body, "loss_fn_inputs['weights']", 'negative dimension', '[-1]')


def _csr(shape: list[int], crow: list[int], col: list[int], values: list[int]) -> pb.Tensor:
    csr = pb.SparseCsr(
        values=np.asarray(values, '<i8').tobytes(),
        crow_indices=np.asarray(crow, '<i8').tobytes(),
        col_indices=np.asarray(col, '<i8').tobytes(),
    )
    return pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_INT64, shape=shape)


@pytest.mark.parametrize(
    ('tensor', 'fragment'),
    [
        (_csr([3], [0, 1], [0], [5]), 'needs a 2-D shape'),
        (_csr([2, 3], [0, 1], [0], [5]), 'crow_indices must be 3 non-decreasing'),
        (_csr([2, 3], [0, 2, 1], [0], [5]), 'crow_indices must be 3 non-decreasing'),
        (_csr([2, 3], [0, 1, 2], [0], [5]), 'crow_indices ends at 2'),
        (_csr([2, 3], [0, 1, 1], [3], [5]), 'col_indices must lie in [0, 3)'),
        (_csr([1 << 20, 1 << 20], [0], [], []), 'more than'),
    ],
)
def test_bad_sparse_csr(tensor, fragment):
    _assert_data_error(_with_input('target_tokens', tensor), "loss_fn_inputs['target_tokens']", fragment)


def test_good_hand_built_csr():
    # Row 0 holds 5 at column 2, row 1 is empty: [[0, 0, 5], [0, 0, 0]].
    body = _with_input('target_tokens', _csr([2, 3], [0, 1, 1], [2], [5]))
    decoded = parse_forward_backward(body).data[0].loss_fn_inputs['target_tokens']
    assert decoded.tolist() == [[0, 0, 5], [0, 0, 0]]


def test_empty_loss_config_value():
    message = _request([_datum([1])])
    message.loss_fn_config_v2['beta'].SetInParent()  # a LossConfigValue with neither number nor text
    _assert_data_error(message.SerializeToString(), "loss_fn_config_v2['beta']", 'number, text')


# --------------------------------------------------------------------------- forward_backward output


def test_forward_backward_output_round_trips_through_sdk():
    # Three datums of lengths 2, 0 and 3: offsets in bytes are [0, 8, 8, 20] for float32.
    logprobs = [torch.tensor([-0.5, -1.25]), torch.zeros(0), torch.tensor([-2.0, -0.125, -3.5])]
    ids = [torch.tensor([3, 4], dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.tensor([5, 6, 7])]
    outputs = [{'logprobs': lp, 'ids': i} for lp, i in zip(logprobs, ids, strict=True)]
    metrics = {'loss:sum': 6.875, 'tokens:mean': 1.5}
    body = forward_backward_output(outputs, metrics)
    reply = deserialize_forward_backward_output(body)
    assert reply.loss_fn_output_type == 'ArrayRecord'
    assert reply.metrics == metrics
    assert len(reply.loss_fn_outputs) == 3
    for got, lp, i in zip(reply.loss_fn_outputs, logprobs, ids, strict=True):
        assert got['logprobs'].dtype == 'float32' and got['logprobs'].shape == [len(lp)]
        assert got['logprobs'].tolist() == lp.tolist()
        assert got['ids'].dtype == 'int64' and got['ids'].tolist() == i.tolist()
    wire = pb.ForwardBackwardOutput.FromString(body).loss_fn_outputs[0].fields['logprobs']
    assert np.frombuffer(wire.offsets, '<i8').tolist() == [0, 8, 8, 20]


def test_output_trailing_shape_and_dtype_widening():
    # bfloat16 and float64 go as float32, bool as int64; rows of width 2 keep their trailing shape.
    outputs = [
        {'topk': torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16), 'ok': torch.tensor([True, False])},
        {'topk': torch.tensor([[0.25, 4.0], [8.0, -0.5]], dtype=torch.float64), 'ok': torch.tensor([True])},
    ]
    reply = deserialize_forward_backward_output(forward_backward_output(outputs, {'loss:sum': 0.0}))
    first, second = reply.loss_fn_outputs
    assert first['topk'].shape == [1, 2] and first['topk'].tolist() == [[1.5, -2.0]]
    assert second['topk'].shape == [2, 2] and second['topk'].tolist() == [[0.25, 4.0], [8.0, -0.5]]
    assert first['ok'].dtype == 'int64' and first['ok'].tolist() == [1, 0]


def test_output_detaches_and_lifts_scalars():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True) * 1
    reply = deserialize_forward_backward_output(
        forward_backward_output([{'logprobs': logprobs, 'loss': torch.tensor(3.0)}], {'loss:sum': 3.0})
    )
    assert reply.loss_fn_outputs[0]['logprobs'].tolist() == [-1.0, -2.0]
    assert reply.loss_fn_outputs[0]['loss'].shape == [1] and reply.loss_fn_outputs[0]['loss'].tolist() == [3.0]


def test_output_keeps_datum_count_without_fields():
    # num_datums carries the count when there is nothing per datum.
    reply = deserialize_forward_backward_output(forward_backward_output([{}, {}], {'loss:sum': 1.0}))
    assert [dict(out) for out in reply.loss_fn_outputs] == [{}, {}]
    empty = deserialize_forward_backward_output(forward_backward_output([], {'loss:sum': 0.0}))
    assert empty.loss_fn_outputs == [] and empty.metrics == {'loss:sum': 0.0}


def test_output_round_trip_property():
    @settings(max_examples=40, deadline=None)
    @given(lengths=st.lists(st.integers(0, 5), max_size=5), data=st.data())
    def check(lengths: list[int], data: st.DataObject) -> None:
        floats = st.floats(width=32, allow_nan=False)
        arrays = [data.draw(hnp.arrays(np.float32, (n,), elements=floats)) for n in lengths]
        body = forward_backward_output([{'logprobs': torch.from_numpy(a)} for a in arrays], {'loss:sum': 1.0})
        reply = deserialize_forward_backward_output(body)
        assert [out['logprobs'].to_numpy().tolist() for out in reply.loss_fn_outputs] == [a.tolist() for a in arrays]

    check()


def test_output_errors():
    with pytest.raises(DataError, match=r"datum 1 has fields \['x'\]; datum 0 has \['logprobs'\]"):
        forward_backward_output([{'logprobs': torch.zeros(1)}, {'x': torch.zeros(1)}], {'loss:sum': 0.0})
    with pytest.raises(DataError, match=r"'topk' has shapes after the first dimension \[\(2,\), \(3,\)\]"):
        forward_backward_output([{'topk': torch.zeros(1, 2)}, {'topk': torch.zeros(1, 3)}], {'loss:sum': 0.0})


@pytest.mark.parametrize('key', ['loss', 'loss:sum:sum', 'loss:avg'])
def test_metric_keys_the_client_cannot_reduce(key):
    with pytest.raises(DataError, match='name:reduction') as info:
        forward_backward_output([], {key: 1.0})
    assert repr(key) in str(info.value) and 'mean' in str(info.value)


# --------------------------------------------------------------------------- sample response


def test_sample_response_round_trips_through_sdk():
    seq_a = _seq([11, 12], [[(11, -0.5), (11, -0.5), (3, -1.5)], [(12, -2.25), (4, -0.25), (12, -2.25)]])
    seq_b = _seq([13], [[(13, -4.0), (9, -0.125)]], stop='length')  # only one of k=2 top entries known
    response = SampleResponse(
        sequences=[seq_a, seq_b],
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=[None, -1.0, -0.75],
        topk_prompt_logprobs=[None, [(2, -1.0), (7, -1.5)], [(5, -0.5), (3, -0.75)]],
    )
    body = sample_response(response, topk_sample_logprobs=2, topk_prompt_logprobs=2)
    reply = deserialize_sample_response(body)
    first, second = reply.sequences
    assert (first.stop_reason, first.tokens, first.logprobs) == ('stop', [11, 12], [-0.5, -2.25])
    assert first.topk_logprobs == [[(11, -0.5), (3, -1.5)], [(4, -0.25), (12, -2.25)]]
    assert (second.stop_reason, second.tokens, second.logprobs) == ('length', [13], [-4.0])
    assert second.topk_logprobs == [[(9, -0.125)]]  # the empty cell (0, -99999.0) is trimmed
    assert reply.prompt_logprobs == [None, -1.0, -0.75]
    assert reply.topk_prompt_logprobs == [None, [(2, -1.0), (7, -1.5)], [(5, -0.5), (3, -0.75)]]


def test_sample_response_without_extras():
    response = SampleResponse(sequences=[_seq([42, 43], [[(42, -0.5)], [(43, -1.0)]])], prompt_token_ids=[1])
    reply = deserialize_sample_response(sample_response(response))
    (seq,) = reply.sequences
    assert (seq.tokens, seq.logprobs, seq.topk_logprobs) == ([42, 43], [-0.5, -1.0], None)
    assert reply.prompt_logprobs is None and reply.topk_prompt_logprobs is None
    assert reply.prompt_cache_hit_tokens == 0  # a sampler without a prefix cache counts none


def test_sample_response_carries_the_samplers_prompt_cache_hits():
    # A prefix cache that served 2 of the prompt's 3 tokens says so; the SDK (0.23+) reads the field.
    response = SampleResponse(sequences=[], prompt_token_ids=[1, 2, 3], prompt_cache_hit_tokens=2)
    assert deserialize_sample_response(sample_response(response)).prompt_cache_hit_tokens == 2


def test_sample_response_prompt_nan_is_none_on_the_wire():
    response = SampleResponse(sequences=[], prompt_token_ids=[1, 2], prompt_logprobs=[None, -3.0])
    wire = pb.SampleResponse.FromString(sample_response(response))
    values = np.frombuffer(wire.prompt_logprobs, '<f4')
    assert math.isnan(values[0]) and values[1] == -3.0


def test_sample_response_errors():
    good = [[(1, -0.5)]]
    with pytest.raises(DataError, match=r"Sequence 0 has stop_reason 'eos'; accepted: \['stop', 'length'\]"):
        sample_response(SampleResponse([_seq([1], good, stop='eos')], prompt_token_ids=[1]))
    with pytest.raises(DataError, match='Sequence 0 has 2 tokens but 1 logprob entries'):
        sample_response(SampleResponse([_seq([1, 2], good)], prompt_token_ids=[1]))
    with pytest.raises(DataError, match='Sequence 0 has 1 tokens but 1 logprob entries'):
        sample_response(SampleResponse([_seq([1], [[]])], prompt_token_ids=[1]))
    with pytest.raises(DataError, match='sequence 0 top-k at position 0 has 2 entries, more than k=1'):
        sample_response(SampleResponse([_seq([1], [[(1, -0.5), (1, -0.5), (2, -1.0)]])], [1]), topk_sample_logprobs=1)
    with pytest.raises(DataError, match='topk_prompt_logprobs=2 was asked for'):
        sample_response(SampleResponse([_seq([1], good)], prompt_token_ids=[1]), topk_prompt_logprobs=2)


def test_docstring_examples_run():
    assert doctest.testmod(codec).failed == 0
