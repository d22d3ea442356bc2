"""The protobuf bodies of the Tinker protocol, server side: the inverse of the SDK's
``tinker.proto.request_conv`` (we parse what it builds) and ``tinker.proto.response_conv``
(we build what it parses).

Request, ``ForwardBackwardRequest`` -> :class:`ForwardBackwardCall`:

- the body may be zstd-compressed (``Content-Encoding: zstd``); it must hold exactly one frame;
- ``loss_fn_config_v2`` (a number or a text per key) wins over the legacy float-only
  ``loss_fn_config``, which the SDK fills as well for the numbers;
- a datum's tokens are its ``model_input`` chunks concatenated: ``encoded_text`` chunks
  (little-endian int32 ids), and ``image`` chunks (a PNG or JPEG file with its
  ``expected_tokens``), each held as that many ``IMAGE_SLOT`` tokens and an :class:`ImageSlot`
  that the host fills with the model's image pad id and the image's pixels
  (``twinkle.server.execution.checks.images``); ``dmel`` chunks are rejected;
- each ``loss_fn_inputs`` tensor is dense bytes or sparse CSR (values in the tensor's dtype,
  ``crow_indices`` and ``col_indices`` int64), with a dtype and a shape. Both decode to a dense
  torch tensor. As the SDK's own decoder does, INT32 widens to int64 and BFLOAT16 to float32, so
  a loss sees only float32 and int64. An empty shape means 1-D (the SDK sends no shape for a
  ``TensorData`` built from a list). CSR carries no pad value on the wire, so unlisted cells
  are 0, even if the client built the tensor with ``from_torch_sparse(t, pad_value=-100)``;
- a datum's provenance (``model_input_spans`` and ``loss_fn_input_spans``, both or neither) is a
  list of :class:`Span` each, checked to tile its field: the spans' lengths add up to the number
  of input tokens, or of ``target_tokens``. Whether the sequences they name hold those tokens is
  the server's to check against what it recorded (``api.tinker.provenance``).

Replies:

- :func:`forward_backward_output`: one ``ArrayRecord`` whose ``BatchedTensor`` per field holds
  the datums' arrays concatenated, int64 byte offsets (n + 1), the dtype and the shape after the
  first dimension (equal for every datum);
- :func:`sample_response`: int32 tokens, float32 sampled-token logprobs (always), top-k as dense
  ``length x k`` matrices with ``(0, -99999.0)`` in empty cells, prompt logprobs as float32 with
  NaN for the first position.

Every malformed request raises :class:`twinkle.errors.DataError` naming the datum and the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from twinkle.data_format import SampledSequence, SampleResponse, TokenLogprob
from twinkle.errors import DataError
from twinkle.server.execution.checks.images import IMAGE_SLOT, ImageSlot, RowImages

#: Largest decompressed ``forward_backward`` body; a zstd bomb stops here.
MAX_BODY_BYTES = 1 << 28
#: Most cells a sparse CSR tensor may densify to (its shape is not bounded by the body size).
MAX_SPARSE_ELEMENTS = 1 << 27
#: Compressed bytes fed to zstd per step; zstd expands at most ~32,768x, so the check on the
#: output size after each step overshoots ``max_body_bytes`` by at most ~32 MiB.
_ZSTD_STEP = 1024

#: Wire dtype -> (name in messages, little-endian numpy dtype of its bytes).
_WIRE_DTYPES: dict[int, tuple[str, np.dtype]] = {
    pb.DTYPE_FLOAT32: ('FLOAT32', np.dtype('<f4')),
    pb.DTYPE_INT64: ('INT64', np.dtype('<i8')),
    pb.DTYPE_INT32: ('INT32', np.dtype('<i4')),
    pb.DTYPE_BFLOAT16: ('BFLOAT16', np.dtype('<u2')),
}
_STOP_REASONS = {'stop': pb.STOP_REASON_STOP, 'length': pb.STOP_REASON_LENGTH}
_METRIC_REDUCTIONS = ('sum', 'mean', 'min', 'max', 'slack', 'hash2', 'unique')


@dataclass(frozen=True)
class Span:
    """One provenance claim of a datum: its next ``length`` positions are positions
    ``[offset, offset + length)`` of the prompt (``kind='prompt'``) or of the sampled tokens
    (``kind='sampled'``) of the sampled sequence ``sequence_id``."""

    kind: str
    sequence_id: str
    offset: int
    length: int


#: The image formats an image chunk may name (the Tinker SDK's ``ImageChunk.format``).
IMAGE_FORMATS = ('png', 'jpeg')


@dataclass(frozen=True)
class Datum:
    """One training example: the input token ids and the loss inputs, dense float32 or int64;
    with provenance, the spans that tile ``tokens`` and ``target_tokens``."""

    tokens: list[int]
    loss_fn_inputs: dict[str, torch.Tensor]
    model_input_spans: list[Span] | None = None
    loss_fn_input_spans: list[Span] | None = None
    #: Its image chunks, in order (their positions in ``tokens`` hold ``IMAGE_SLOT``).
    images: tuple[ImageSlot, ...] = ()


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded ``ForwardBackwardRequest``; ``forward_only`` is the SDK's ``forward()``."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def parse_forward_backward(
    body: bytes,
    content_encoding: str | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_sparse_elements: int = MAX_SPARSE_ELEMENTS,
) -> ForwardBackwardCall:
    """Decode the body of ``POST /api/v1/forward_backward``.

    ``content_encoding`` is the request's ``Content-Encoding`` header: ``None`` or ``identity``
    for a plain body, ``zstd`` for a compressed one. Raises :class:`DataError` for anything that
    does not decode; checks nothing beyond decoding (token ids, loss names and input shapes are
    the trainer's business).
    """
    message = _parse_request(_decompress(body, content_encoding, max_body_bytes))
    return ForwardBackwardCall(
        model_id=message.model_id,
        seq_id=message.seq_id,
        loss_fn=message.loss_fn,
        loss_fn_config=_loss_fn_config(message),
        forward_only=message.forward_only,
        data=[_datum(i, datum, max_sparse_elements) for i, datum in enumerate(message.data)],
    )


def _decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    encoding = (content_encoding or 'identity').strip().lower()
    if encoding == 'identity':
        return body
    if encoding != 'zstd':
        raise DataError(f'Unsupported Content-Encoding {content_encoding!r}; accepted: none, identity, zstd')
    try:
        return _zstd_decompress(body, max_bytes)
    except zstandard.ZstdError as exc:
        raise DataError(f'The body is not valid zstd: {exc}') from exc


def _zstd_decompress(body: bytes, max_bytes: int) -> bytes:
    """One zstd frame, fed in small steps so that a bomb is caught near ``max_bytes``."""
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    parts: list[bytes] = []
    size, end = 0, 0
    while end < len(body) and not decompressor.eof:
        parts.append(decompressor.decompress(body[end : end + _ZSTD_STEP]))
        end = min(end + _ZSTD_STEP, len(body))
        size += len(parts[-1])
        if size > max_bytes:
            raise DataError(f'The zstd body decompresses to more than {max_bytes} bytes, the limit')
    if not decompressor.eof:
        raise DataError(f'The zstd body ends inside its frame ({len(body)} bytes; truncated?)')
    trailing = len(decompressor.unused_data) + len(body) - end
    if trailing:
        raise DataError(f'{trailing} bytes follow the zstd frame; send exactly one frame')
    return b''.join(parts)


def _parse_request(data: bytes) -> pb.ForwardBackwardRequest:
    try:
        return pb.ForwardBackwardRequest.FromString(data)
    except DecodeError as exc:
        raise DataError(f'The body is not a protobuf ForwardBackwardRequest ({len(data)} bytes): {exc}') from exc


def _loss_fn_config(message: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """``loss_fn_config_v2`` when the client sent it, else the legacy float map."""
    if not message.loss_fn_config_v2:
        return {key: float(value) for key, value in message.loss_fn_config.items()}
    config: dict[str, float | str] = {}
    for key, value in message.loss_fn_config_v2.items():
        kind = value.WhichOneof('value')
        if kind is None:
            raise DataError(f'loss_fn_config_v2[{key!r}] holds no value; accepted: number, text')
        config[key] = float(value.number) if kind == 'number' else value.text
    return config


def _datum(index: int, datum: pb.Datum, max_sparse_elements: int) -> Datum:
    inputs = {
        name: _tensor(tensor, f'datum {index} loss_fn_inputs[{name!r}]', max_sparse_elements)
        for name, tensor in datum.loss_fn_inputs.items()
    }
    tokens, images = _tokens(index, datum.model_input)
    if not datum.model_input_spans and not datum.loss_fn_input_spans:
        return Datum(tokens=tokens, loss_fn_inputs=inputs, images=images)
    if not datum.model_input_spans or not datum.loss_fn_input_spans:
        raise DataError(
            f'datum {index} has only one of model_input_spans and loss_fn_input_spans; send both or neither'
        )
    targets = inputs.get('target_tokens')
    target_count = targets.numel() if targets is not None else 0
    return Datum(
        tokens=tokens,
        loss_fn_inputs=inputs,
        model_input_spans=_spans(index, 'model_input_spans', datum.model_input_spans, len(tokens)),
        loss_fn_input_spans=_spans(index, 'loss_fn_input_spans', datum.loss_fn_input_spans, target_count),
        images=images,
    )


def _spans(index: int, field: str, spans: Sequence[pb.ProvenanceSpan], positions: int) -> list[Span]:
    """The spans of one field, checked to be well formed and to tile its ``positions``."""
    decoded: list[Span] = []
    for number, span in enumerate(spans):
        kind = span.WhichOneof('span')
        where = f'datum {index} {field}[{number}]'
        if kind is None:
            raise DataError(f'{where} holds neither prompt_tokens nor sampled_tokens')
        arm = span.prompt_tokens if kind == 'prompt_tokens' else span.sampled_tokens
        if not arm.sequence_id:
            raise DataError(f'{where} names no sequence_id')
        if arm.offset < 0 or arm.length < 0:
            raise DataError(f'{where} has offset {arm.offset} and length {arm.length}; both must be >= 0')
        decoded.append(Span(kind.removesuffix('_tokens'), arm.sequence_id, arm.offset, arm.length))
    covered = sum(span.length for span in decoded)
    if covered != positions:
        raise DataError(f'datum {index} {field} cover {covered} positions but the field has {positions}')
    return decoded


def _tokens(index: int, chunks: Sequence[pb.Chunk]) -> tuple[list[int], tuple[ImageSlot, ...]]:
    """The chunks' token ids concatenated, an image chunk's as ``IMAGE_SLOT`` s, and the images."""
    tokens: list[int] = []
    images: list[ImageSlot] = []
    for position, chunk in enumerate(chunks):
        kind = chunk.WhichOneof('chunk')
        where = f'datum {index} model_input chunk {position}'
        if kind == 'image':
            expected = chunk.image.expected_tokens if chunk.image.HasField('expected_tokens') else None
            override = chunk.image.HasField('override_dimensions')
            slot = image_slot(where, chunk.image.data, chunk.image.format, expected, len(tokens), override)
            images.append(slot)
            tokens += [IMAGE_SLOT] * slot.length
        elif kind == 'encoded_text':
            tokens += _frombuffer(chunk.encoded_text.tokens, np.dtype('<i4'), f'{where} tokens').tolist()
        else:
            raise DataError(f'{where} is {kind or "empty"!r}; accepted: encoded_text and image chunks')
    return tokens, tuple(images)


def datum_images(call: ForwardBackwardCall) -> list[RowImages]:
    """The call's datums' tokens and image chunks, as the checks of a request's images take them."""
    return [RowImages.of_slots(f'datum {index}', datum.tokens, datum.images) for index, datum in enumerate(call.data)]


def image_slot(
    where: str, data: bytes, image_format: str, expected: int | None, start: int, override: bool
) -> ImageSlot:
    """An image chunk at token ``start``, checked: a known format, its ``expected_tokens`` given
    (the tokens it takes; the host checks them against the image), no ``override_dimensions``."""
    if image_format not in IMAGE_FORMATS:
        raise DataError(f'{where}: image format {image_format!r} is not accepted; accepted: {list(IMAGE_FORMATS)}')
    if expected is None or expected < 1:
        raise DataError(
            f'{where}: an image chunk needs expected_tokens >= 1 (the tokens the image takes, as the '
            f"model's image processor counts them); got {expected}"
        )
    if override:
        raise DataError(f'{where}: override_dimensions is not supported; resize the image before sending it')
    return ImageSlot(bytes(data), start, expected)


def _frombuffer(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise DataError(f'{where}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte {dtype.name}')
    return np.frombuffer(raw, dtype=dtype)


def _tensor(tensor: pb.Tensor, where: str, max_sparse_elements: int) -> torch.Tensor:
    """A dense torch tensor (float32 or int64) from a dense or sparse CSR wire tensor."""
    if tensor.dtype not in _WIRE_DTYPES:
        accepted = [name for name, _ in _WIRE_DTYPES.values()]
        got = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else tensor.dtype
        raise DataError(f'{where} has dtype {got}; accepted: {accepted}')
    name, dtype = _WIRE_DTYPES[tensor.dtype]
    shape = list(tensor.shape)
    if any(size < 0 for size in shape):
        raise DataError(f'{where} has a negative dimension in shape {shape}')
    if tensor.WhichOneof('encoding') == 'sparse_csr':
        array = _dense_from_csr(tensor.sparse_csr, dtype, shape, where, max_sparse_elements)
    else:
        array = _dense(tensor.dense, dtype, name, shape, where)
    return torch.from_numpy(_widen(array, tensor.dtype))


def _dense(raw: bytes, dtype: np.dtype, name: str, shape: list[int], where: str) -> np.ndarray:
    flat = _frombuffer(raw, dtype, f'{where} dense')
    if not shape:
        return flat
    if flat.size != math.prod(shape):
        raise DataError(
            f'{where} has {len(raw)} bytes of {name}, but shape {shape} needs {math.prod(shape) * dtype.itemsize}'
        )
    return flat.reshape(shape)


def _dense_from_csr(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], where: str, max_elements: int) -> np.ndarray:
    """Densify CSR as ``torch.sparse_csr_tensor(...).to_dense()`` would: unlisted cells are 0."""
    if len(shape) != 2:
        raise DataError(f'{where} is sparse CSR with shape {shape}; CSR needs a 2-D shape')
    if math.prod(shape) > max_elements:
        raise DataError(f'{where} is sparse CSR of shape {shape}, more than {max_elements} cells dense')
    values = _frombuffer(csr.values, dtype, f'{where} sparse_csr.values')
    crow = _frombuffer(csr.crow_indices, np.dtype('<i8'), f'{where} sparse_csr.crow_indices')
    col = _frombuffer(csr.col_indices, np.dtype('<i8'), f'{where} sparse_csr.col_indices')
    _check_csr(crow, col, values.size, shape, where)
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = values
    return dense


def _check_csr(crow: np.ndarray, col: np.ndarray, nnz: int, shape: list[int], where: str) -> None:
    rows, cols = shape
    if crow.size != rows + 1 or crow[0] != 0 or np.any(np.diff(crow) < 0):
        raise DataError(
            f'{where} sparse_csr.crow_indices must be {rows + 1} non-decreasing offsets from 0 '
            f'for shape {shape}; got {crow.tolist()[:8]} ({crow.size} entries)'
        )
    if not crow[-1] == col.size == nnz:
        raise DataError(
            f'{where} sparse_csr lists {nnz} values and {col.size} column indices, '
            f'but crow_indices ends at {crow[-1]}; the three must agree'
        )
    if col.size and (col.min() < 0 or col.max() >= cols):
        raise DataError(f'{where} sparse_csr.col_indices must lie in [0, {cols}); got {col.min()}..{col.max()}')


def _widen(array: np.ndarray, wire_dtype: int) -> np.ndarray:
    """A native, writable float32 or int64 copy (bfloat16 is the top half of a float32)."""
    if wire_dtype == pb.DTYPE_BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.int64 if array.dtype.kind == 'i' else np.float32)


def forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: Mapping[str, float]) -> bytes:
    """The ``ForwardBackwardOutput`` result of a forward or forward_backward.

    ``outputs`` holds one dict per datum, all with the same keys (e.g. ``logprobs``, float32 of
    the datum's length); a 0-d tensor goes as shape ``(1,)``. Floating tensors go as float32,
    the rest as int64. ``metrics`` keys must be ``name:reduction`` (one colon), as the client
    requires.

    >>> from tinker.proto.response_conv import deserialize_forward_backward_output
    >>> body = forward_backward_output([{'logprobs': torch.tensor([-1.0, -2.0])}], {'loss:sum': 3.0})
    >>> reply = deserialize_forward_backward_output(body)
    >>> reply.loss_fn_outputs[0]['logprobs'].tolist(), reply.metrics
    ([-1.0, -2.0], {'loss:sum': 3.0})
    """
    record = pb.ArrayRecord(type_tag='ArrayRecord', num_datums=len(outputs))
    for name in _field_names(outputs):
        record.fields[name].CopyFrom(_batched_tensor(name, [output[name] for output in outputs]))
    message = pb.ForwardBackwardOutput(
        loss_fn_output_type='ArrayRecord', loss_fn_outputs=[record], metrics=_metrics(metrics)
    )
    return message.SerializeToString()


def _field_names(outputs: list[dict[str, torch.Tensor]]) -> list[str]:
    names = sorted(outputs[0]) if outputs else []
    for index, output in enumerate(outputs):
        if sorted(output) != names:
            raise DataError(f'Output of datum {index} has fields {sorted(output)}; datum 0 has {names}')
    return names


def _batched_tensor(name: str, tensors: list[torch.Tensor]) -> pb.BatchedTensor:
    """The datums' arrays concatenated, with int64 byte offsets to slice them apart again."""
    arrays = [tensor.detach().cpu().reshape(tensor.shape or (1,)) for tensor in tensors]
    floating = any(array.is_floating_point() for array in arrays)
    dtype, wire = (np.dtype('<f4'), pb.DTYPE_FLOAT32) if floating else (np.dtype('<i8'), pb.DTYPE_INT64)
    trailing = {tuple(array.shape[1:]) for array in arrays}
    if len(trailing) > 1:
        raise DataError(f'Output field {name!r} has shapes after the first dimension {sorted(trailing)}; need one')
    chunks = [array.to(torch.float32 if floating else torch.int64).numpy().astype(dtype).tobytes() for array in arrays]
    offsets = np.cumsum([0, *map(len, chunks)]).astype('<i8')
    return pb.BatchedTensor(
        data=b''.join(chunks),
        offsets=offsets.tobytes(),
        dtype=wire,
        trailing_shape=next(iter(trailing), ()),
    )


def _metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    for key in metrics:
        # The client does ``name, reduction = key.split(':')``: exactly one colon, or it raises.
        if key.count(':') != 1 or key.partition(':')[2] not in _METRIC_REDUCTIONS:
            raise DataError(
                f'Metric {key!r} must be keyed name:reduction with one colon; reductions: {_METRIC_REDUCTIONS}'
            )
    return {key: float(value) for key, value in metrics.items()}


def sample_response(response: SampleResponse, *, topk_sample_logprobs: int = 0, topk_prompt_logprobs: int = 0) -> bytes:
    """The ``SampleResponse`` result of an ``asample`` from twinkle's own response.

    ``topk_sample_logprobs`` and ``topk_prompt_logprobs`` are the ``k`` the request asked for
    (0: none). Prompt logprobs go when ``response.prompt_logprobs`` is set.

    >>> from tinker.proto.response_conv import deserialize_sample_response
    >>> seq = SampledSequence('stop', [7], [[(7, -0.5)]], decoded='', new_input_feature={})
    >>> reply = deserialize_sample_response(sample_response(SampleResponse([seq], prompt_token_ids=[1])))
    >>> reply.sequences[0].tokens, reply.sequences[0].logprobs, reply.sequences[0].stop_reason
    ([7], [-0.5], 'stop')
    """
    message = pb.SampleResponse(
        sequences=[_sampled_sequence(i, seq, topk_sample_logprobs) for i, seq in enumerate(response.sequences)],
        prompt_cache_hit_tokens=response.prompt_cache_hit_tokens,  # what the sampler counted (0: no prefix cache)
    )
    if response.prompt_logprobs is not None:
        values = [math.nan if value is None else value for value in response.prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, dtype='<f4').tobytes()
    if topk_prompt_logprobs:
        if response.topk_prompt_logprobs is None:
            raise DataError(f'topk_prompt_logprobs={topk_prompt_logprobs} was asked for, but the response has none')
        rows = response.topk_prompt_logprobs
        message.topk_prompt_logprobs.CopyFrom(_topk(rows, topk_prompt_logprobs, 'prompt'))
    return message.SerializeToString()


def _sampled_sequence(index: int, seq: SampledSequence, k: int) -> pb.SampledSequence:
    """Tokens, the sampled tokens' logprobs (``entry[0]``) and the top-k (``entry[1:]``)."""
    if seq.stop_reason not in _STOP_REASONS:
        raise DataError(f'Sequence {index} has stop_reason {seq.stop_reason!r}; accepted: {list(_STOP_REASONS)}')
    if len(seq.logprobs) != len(seq.tokens) or not all(seq.logprobs):
        raise DataError(
            f'Sequence {index} has {len(seq.tokens)} tokens but {len(seq.logprobs)} logprob entries '
            '(each needs the sampled token first)'
        )
    message = pb.SampledSequence(
        stop_reason=_STOP_REASONS[seq.stop_reason],
        tokens=np.asarray(seq.tokens, dtype='<i4').tobytes(),
        logprobs=np.asarray([entry[0][1] for entry in seq.logprobs], dtype='<f4').tobytes(),
    )
    if k:
        message.topk_sampled_logprobs.CopyFrom(_topk([entry[1:] for entry in seq.logprobs], k, f'sequence {index}'))
    return message


def _topk(rows: Sequence[Sequence[TokenLogprob] | None], k: int, where: str) -> pb.TopkLogprobs:
    """Dense ``len(rows) x k`` matrices; a ``None`` row or a short row's tail is ``(0, -99999.0)``."""
    if k < 0:
        raise DataError(f'{where}: top-k count must be >= 0; got {k}')
    token_ids = np.zeros((len(rows), k), dtype='<i4')
    logprobs = np.full((len(rows), k), MASK_LOGPROB, dtype='<f4')
    for position, row in enumerate(rows):
        if row is None:
            continue
        if len(row) > k:
            raise DataError(f'{where} top-k at position {position} has {len(row)} entries, more than k={k}')
        for rank, (token, logprob) in enumerate(row):
            token_ids[position, rank], logprobs[position, rank] = token, logprob
    return pb.TopkLogprobs(token_ids=token_ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(rows))
