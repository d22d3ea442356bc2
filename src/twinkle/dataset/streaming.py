"""Datasets streamed from files: rows read when they are needed, never all held in memory.

``IterableDataset`` reads JSONL, Parquet and Arrow files (a file, a folder of them, a list, or a
hub dataset, read from its cache or streamed from the hub) row by row. ``map``, ``filter`` and ``encode`` are recorded
and run on each row as it is read. A stream split into shards (``shard(n, i)``, which the
``DataLoader`` does for data-parallel ranks and its worker processes) gives raw row ``k`` to
shard ``k % n``: together the shards read every row once. Its position (file, byte offset or
row in the file, rows read) moves on as rows are handed out; ``state_dict()`` saved after a
row and ``load_state_dict`` in a new process resume at the row after it, mid-file included,
by seeking, not by reading again.

A JSONL line that is not a JSON object is named by file and line number. With
``bad_lines='raise'`` (the default) it stops the stream; with ``'skip'`` it is left out and
counted (``counts['bad_lines']``).
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import posixpath
import random
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from twinkle.dataset.base import FilterSpec, PreprocessorSpec, as_predicate, as_row_fn
from twinkle.errors import AssetNotFoundError, ConfigurationError, DataError, StateError, one_of
from twinkle.hub import is_offline, parse_hub_id, resolve_dataset
from twinkle.template import TEMPLATES, Template

#: File extensions a stream reads, by kind.
STREAM_KINDS = {'.jsonl': 'jsonl', '.parquet': 'parquet', '.arrow': 'arrow'}
BadLines = Literal['raise', 'skip']
#: Rows a Parquet or Arrow file hands over at once.
READ_BATCH = 1024
#: Bytes one read of a remote file asks for.
REMOTE_BUFFER = 2**20


@dataclass
class StreamPosition:
    """Where a stream goes on: file ``file`` at ``offset`` (a byte offset into JSONL, a row
    index into Parquet/Arrow), ``line`` lines of that file behind it (JSONL), ``row`` raw rows
    of all files read so far (what decides a row's shard)."""

    file: int = 0
    offset: int = 0
    line: int = 0
    row: int = 0


class IterableDataset:
    """Rows streamed from files, transformed lazily.

    Example::

        stream = IterableDataset('data/train.jsonl', bad_lines='skip')
        stream.set_template('Template', model_id=assets.tiny_model(), max_length=512)
        stream.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community')).encode()
        for batch in DataLoader(stream, batch_size=8, num_workers=2):
            ...
    """

    def __init__(
        self,
        source: str | Path | Sequence[str | Path],
        *,
        split: str = 'train',
        bad_lines: BadLines = 'raise',
        revision: str | None = None,
    ):
        """``split``: in a folder (or a hub dataset), the files whose path names it, as
        ``Dataset`` picks them (every file when none does)."""
        if bad_lines not in ('raise', 'skip'):
            raise one_of('bad_lines', bad_lines, ['raise', 'skip'])
        self.files = stream_files(source, revision, split)
        self.bad_lines = bad_lines
        self.template: Template | None = None
        self._steps: list[tuple[str, Callable[[dict[str, Any]], Any]]] = []
        self.num_shards, self.shard_index = 1, 0
        self.position = StreamPosition()
        #: Raw rows read (this shard's), bad lines skipped, rows dropped by a map or filter.
        self.counts = {'rows_read': 0, 'bad_lines': 0, 'dropped': 0}

    # ---- lazy transforms ----------------------------------------------------------------------
    def map(self, preprocessor: PreprocessorSpec, init_args: Mapping[str, Any] | None = None) -> IterableDataset:
        """Apply a preprocessor (as ``Dataset.map`` takes it) to each row when it is read; a
        ``None`` result drops the row."""
        self._steps.append(('map', as_row_fn(preprocessor, init_args)))
        return self

    def filter(self, predicate: FilterSpec, init_args: Mapping[str, Any] | None = None) -> IterableDataset:
        """Keep the rows for which ``predicate(row)`` is true (as ``Dataset.filter`` takes it)."""
        self._steps.append(('filter', as_predicate(predicate, init_args)))
        return self

    def set_template(self, template: str | type[Template] | Template, **kwargs: Any) -> IterableDataset:
        self.template = TEMPLATES.build(template, Template, **kwargs)
        return self

    def encode(self, add_generation_prompt: bool = False) -> IterableDataset:
        """Tokenize each row with the template when it is read; the row keeps its other fields."""
        if self.template is None:
            raise StateError('IterableDataset.encode() needs a template: call set_template(...) first')
        encode = partial(self.template.encode, add_generation_prompt=add_generation_prompt)
        self._steps.append(('encode', encode))
        return self

    def shard(self, num_shards: int, index: int) -> IterableDataset:
        """This stream's shard ``index`` of ``num_shards`` (of the shard it is, when already one),
        from the beginning."""
        remembering = [type(step).__name__ for _, step in self._steps if getattr(step, 'remembers', False)]
        if remembering and num_shards * self.num_shards > 1:
            raise ConfigurationError(
                f'{remembering[0]} remembers the rows it kept, and each shard of a stream (a data rank, a worker) '
                'would keep its own: deduplicate the files first (Dataset.filter), or read the stream whole '
                '(one rank, num_workers=0)'
            )
        if (
            not isinstance(num_shards, int)
            or num_shards < 1
            or not isinstance(index, int)
            or not 0 <= index < num_shards
        ):
            raise ConfigurationError(
                f'shard takes num_shards >= 1 and 0 <= index < num_shards; got {num_shards}, {index}'
            )
        view = copy.copy(self)
        view.num_shards = self.num_shards * num_shards
        view.shard_index = self.shard_index + self.num_shards * index
        view.position, view.counts = StreamPosition(), dict.fromkeys(self.counts, 0)
        return view

    # ---- reading ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This shard's rows from the current position on; the position follows each row handed out."""
        for raw, after in self._raw_rows():
            self.counts['rows_read'] += 1
            row = self._apply(raw)
            self.position = after
            if row is not None:
                yield row
        self.position = StreamPosition(file=len(self.files), row=self.position.row)

    def restart(self) -> None:
        """Back to the first row (a new epoch), the counts from zero."""
        self.position = StreamPosition()
        self.counts = dict.fromkeys(self.counts, 0)
        for _, step in self._steps:
            reset = getattr(step, 'reset', None)
            if getattr(step, 'remembers', False) and callable(reset):
                reset()  # a new pass: a deduplicating filter forgets the last one's rows

    def state_dict(self) -> dict[str, Any]:
        return {
            'position': asdict(self.position),
            'counts': dict(self.counts),
            'shard': [self.num_shards, self.shard_index],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume where ``state`` (from ``state_dict`` of the same shard) left off."""
        if list(state.get('shard', ())) != [self.num_shards, self.shard_index]:
            raise StateError(
                f'this state belongs to shard {state.get("shard")} (num_shards, index); this stream is '
                f'{[self.num_shards, self.shard_index]}'
            )
        position = StreamPosition(**state['position'])
        remembering = [type(step).__name__ for _, step in self._steps if getattr(step, 'remembers', False)]
        if remembering and position != StreamPosition():
            raise StateError(
                f'{remembering[0]} remembers the rows it kept, which a stream state does not hold: a resumed '
                'stream would let earlier duplicates through; deduplicate the files first (Dataset.filter)'
            )
        self.position = position
        self.counts = dict(state['counts'])

    def _apply(self, row: dict[str, Any]) -> dict[str, Any] | None:
        for kind, step in self._steps:
            if kind == 'filter':
                if not step(row):
                    self.counts['dropped'] += 1
                    return None
                continue
            result = step(row)
            if result is None:
                self.counts['dropped'] += 1
                return None
            if not isinstance(result, Mapping):
                raise DataError(f'a preprocessor returned {type(result).__name__}; expected a dict or None')
            row = {**row, **result} if kind == 'encode' else dict(result)
        return row

    def _raw_rows(self) -> Iterator[tuple[dict[str, Any], StreamPosition]]:
        """(row, the position after it) for this shard's rows from ``self.position`` on."""
        position = self.position
        for index in range(position.file, len(self.files)):
            path = self.files[index]
            reader = _jsonl_rows if path.kind == 'jsonl' else _table_rows
            # Every shard counts every raw row, its own or not: the count decides the next file's shards.
            rows = yield from reader(self, path, position)
            position = StreamPosition(file=index + 1, row=rows)

    def mine(self, row_number: int) -> bool:
        return row_number % self.num_shards == self.shard_index

    def bad_line(self, path: StreamFile, line: int, why: str) -> None:
        message = f'{path.name} line {line}: {why}'
        if self.bad_lines == 'raise':
            raise DataError(f"{message} (IterableDataset(bad_lines='skip') leaves such lines out and counts them)")
        self.counts['bad_lines'] += 1

    def __repr__(self) -> str:
        steps = [kind for kind, _ in self._steps]
        return f'IterableDataset({len(self.files)} files, steps={steps}, shard {self.shard_index} of {self.num_shards})'


def _jsonl_rows(
    stream: IterableDataset, path: StreamFile, start: StreamPosition
) -> Generator[tuple[dict[str, Any], StreamPosition], None, int]:
    """A JSONL file's rows of this shard from byte ``start.offset`` (blank lines are not rows);
    returns the raw rows read by the end of the file, from the stream's start."""
    offset, line, row_number = start.offset, start.line, start.row
    with path.open() as handle:
        handle.seek(offset)
        for raw in handle:
            offset += len(raw)
            line += 1
            if not raw.strip():
                continue
            row_number += 1
            if not stream.mine(row_number - 1):
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                stream.bad_line(path, line, f'not valid JSON ({error.msg if hasattr(error, "msg") else error})')
                continue
            if not isinstance(row, dict):
                stream.bad_line(path, line, f'a JSON {type(row).__name__}, not an object (a row)')
                continue
            yield row, StreamPosition(start.file, offset, line, row_number)
    return row_number


def _table_rows(
    stream: IterableDataset, path: StreamFile, start: StreamPosition
) -> Generator[tuple[dict[str, Any], StreamPosition], None, int]:
    """A Parquet or Arrow file's rows of this shard from row ``start.offset``; returns the raw
    rows read by the end of the file, from the stream's start."""
    index, row_number = start.offset, start.row
    for batch in _record_batches(path, start.offset):
        for row in batch.to_pylist():
            index += 1
            row_number += 1
            if stream.mine(row_number - 1):
                yield row, StreamPosition(start.file, index, 0, row_number)
    return row_number


def _record_batches(path: StreamFile, skip: int) -> Iterator[pa.RecordBatch]:
    """The record batches of a Parquet or Arrow (IPC file or stream) file past its first ``skip`` rows."""
    if path.kind == 'parquet':
        parquet = pq.ParquetFile(path.open())
        # Whole row groups before the position are not read: start at the group holding row `skip`.
        ends = list(itertools.accumulate(parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)))
        first = next((g for g, end in enumerate(ends) if end > skip), len(ends))
        groups, seen = list(range(first, len(ends))), ends[first - 1] if first else 0
        batches: Iterator[pa.RecordBatch] = parquet.iter_batches(batch_size=READ_BATCH, row_groups=groups)
    else:
        source = pa.memory_map(path.path) if path.local else pa.PythonFile(path.open(), mode='r')
        try:
            reader: Any = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            batches = iter(pa.ipc.open_stream(source))
        seen = 0
    for batch in batches:
        if seen + batch.num_rows <= skip:
            seen += batch.num_rows
            continue
        yield batch.slice(max(0, skip - seen))
        seen += batch.num_rows


@dataclass(frozen=True)
class StreamFile:
    """One file a stream reads, on an fsspec filesystem (the local disk, a hub, object storage)."""

    fs: Any  # fsspec.AbstractFileSystem
    path: str

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def kind(self) -> str:
        return STREAM_KINDS[posixpath.splitext(self.path)[1].lower()]

    @property
    def local(self) -> bool:
        return 'file' in _protocols(self.fs)

    def open(self) -> Any:
        """The file for reading; a remote one behind a read buffer, so that a line costs a
        buffered read, not a request (fsspec's own buffer reads a whole block per line)."""
        handle = self.fs.open(self.path, 'rb')
        return handle if self.local else io.BufferedReader(handle, buffer_size=REMOTE_BUFFER)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def stream_files(
    source: str | Path | Sequence[str | Path], revision: str | None = None, split: str = 'train'
) -> list[StreamFile]:
    """The files a stream reads, in order: a file, the data files of a folder (sorted; those
    whose path names ``split`` when some do), or a list of those; each a local path or an
    fsspec URL (``s3://``, ``memory://``, ...). A hub id reads its snapshot's files when they
    are in the local cache. Otherwise it streams from its hub without a download: ``hf://org/name``
    through ``huggingface_hub.HfFileSystem``, ``ms://org/name`` through ``ModelScopeFileSystem``
    (the per-file URLs ModelScope's own streaming mode reads, in ranged blocks)."""
    sources = [source] if isinstance(source, (str, Path)) else list(source)
    if not sources:
        raise ConfigurationError('IterableDataset needs at least one file or folder')
    files: list[StreamFile] = []
    for item in sources:
        fs, root = _filesystem(str(item), revision)
        if fs.isdir(root):
            found = sorted(p for p in fs.find(root) if posixpath.splitext(p)[1].lower() in STREAM_KINDS)
            if not found:
                raise DataError(f'no {sorted(STREAM_KINDS)} files under the folder {posixpath.basename(root)!r}')
            picked = [p for p in found if split in posixpath.relpath(p, root)] or found
            files += [StreamFile(fs, p) for p in picked]
        elif fs.isfile(root):
            suffix = posixpath.splitext(root)[1].lower()
            if suffix not in STREAM_KINDS:
                raise one_of('stream file type', suffix or posixpath.basename(root), sorted(STREAM_KINDS))
            files.append(StreamFile(fs, root))
        else:
            raise DataError(f'no such file or folder: {str(item)!r}')
    return files


def _filesystem(text: str, revision: str | None) -> tuple[Any, str]:
    """(the fsspec filesystem, the path on it) of a local path, an fsspec URL or a hub id."""
    import fsspec

    if text.startswith(('ms://', 'hf://')):
        hub_id = parse_hub_id(text)
        hub: Literal['ms', 'hf'] = 'hf' if hub_id.hub == 'hf' else 'ms'
        if is_offline(hub) or _cached(text, revision):
            text = resolve_dataset(text, revision=revision)
        elif hub == 'hf':
            from huggingface_hub import HfFileSystem

            return HfFileSystem(), f'datasets/{hub_id.name}' + (f'@{revision}' if revision else '')
        else:
            from twinkle.dataset.modelscope_fs import ModelScopeFileSystem

            return ModelScopeFileSystem(hub_id.name, revision), hub_id.name
    if '://' not in text:
        return fsspec.filesystem('file'), str(Path(text).expanduser().absolute())
    fs, path = fsspec.core.url_to_fs(text)
    return fs, path


def _cached(hub_id: str, revision: str | None) -> bool:
    try:
        resolve_dataset(hub_id, revision=revision, offline=True)
    except AssetNotFoundError:
        return False
    return True


class MixedStream:
    """Several streams as one: interleaved, each row drawn from stream ``k`` with probability
    ``probabilities[k]`` (a seeded draw: the same seed gives the same mixture), or concatenated
    (``probabilities=None, interleave=False``). Interleaving stops when a drawn stream runs out,
    as ``datasets.interleave_datasets`` does by default; without probabilities the streams take
    turns. It shards, saves and resumes as a stream does; its state holds each stream's and the
    number of draws made.

    >>> mixed = MixedStream([chat, math], probabilities=[0.7, 0.3], seed=0)  # doctest: +SKIP
    """

    def __init__(
        self,
        streams: list[IterableDataset],
        probabilities: list[float] | None = None,
        *,
        seed: int = 0,
        interleave: bool = True,
    ):
        if len(streams) < 2 or not all(isinstance(s, IterableDataset) for s in streams):
            raise ConfigurationError('MixedStream mixes two or more IterableDatasets')
        if probabilities is not None:
            if not interleave:
                raise ConfigurationError('probabilities interleave the streams; concatenation takes none')
            if (
                len(probabilities) != len(streams)
                or any(not p >= 0 for p in probabilities)
                or not sum(probabilities) > 0
            ):
                raise ConfigurationError(
                    f'probabilities must be {len(streams)} numbers >= 0 with a positive sum; got {probabilities!r}'
                )
        self.streams, self.probabilities, self.seed, self.interleave = streams, probabilities, seed, interleave
        self.shard_index = 0
        self.draws = 0

    def shard(self, num_shards: int, index: int) -> MixedStream:
        """Shard ``index`` of ``num_shards`` of every stream, mixed with a seed of its own."""
        view = MixedStream(
            [s.shard(num_shards, index) for s in self.streams],
            self.probabilities,
            seed=self.seed,
            interleave=self.interleave,
        )
        view.shard_index = index
        return view

    def _choices(self) -> Iterator[int]:
        """Which stream each row comes from, past the draws already made."""
        generator = random.Random(f'{self.seed}:{self.shard_index}')
        weights = self.probabilities
        draw = 0
        while True:
            if weights is None:
                choice = draw % len(self.streams)
            else:
                choice = generator.choices(range(len(self.streams)), weights=weights)[0]
            draw += 1
            if draw > self.draws:
                yield choice

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.interleave:
            for stream in self.streams:
                yield from stream
            return
        iterators = [iter(stream) for stream in self.streams]
        for choice in self._choices():
            row = next(iterators[choice], None)
            if row is None:
                return
            self.draws += 1
            yield row

    def restart(self) -> None:
        self.draws = 0
        for stream in self.streams:
            stream.restart()

    def state_dict(self) -> dict[str, Any]:
        return {'draws': self.draws, 'streams': [stream.state_dict() for stream in self.streams]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if len(state.get('streams', ())) != len(self.streams):
            raise StateError(
                f'this state mixes {len(state.get("streams", ()))} streams; this mixture has {len(self.streams)}'
            )
        self.draws = int(state['draws'])
        for stream, saved in zip(self.streams, state['streams'], strict=True):
            stream.load_state_dict(saved)

    @property
    def counts(self) -> dict[str, int]:
        """The streams' counts, summed."""
        return {key: sum(s.counts[key] for s in self.streams) for key in self.streams[0].counts}


class PackedStream:
    """A stream's encoded rows packed (first-fit-decreasing, ``twinkle.dataset.packing``) into
    sequences of up to ``max_length`` tokens, ``buffer_size`` rows at a time: the streaming form
    of ``PackingDataset``. Its state is the source's position at the start of the current buffer
    and how many of that buffer's sequences were handed out; a resume reads that buffer again
    (at most ``buffer_size`` rows), packs it the same way and goes on after them."""

    def __init__(self, source: IterableDataset | MixedStream, max_length: int, buffer_size: int = 1000):
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ConfigurationError(f'buffer_size must be a positive integer; got {buffer_size!r}')
        self.source, self.max_length, self.buffer_size = source, max_length, buffer_size
        self.buffer_start: dict[str, Any] = source.state_dict()
        self.handed = 0

    def shard(self, num_shards: int, index: int) -> PackedStream:
        return PackedStream(self.source.shard(num_shards, index), self.max_length, self.buffer_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from twinkle.dataset.packing import pack

        self.source.load_state_dict(self.buffer_start)
        rows = iter(self.source)
        while True:
            buffer = list(itertools.islice(rows, self.buffer_size))
            if not buffer:
                return
            packed = pack(buffer, self.max_length)  # type: ignore[arg-type]
            for sequence in packed[self.handed :]:
                self.handed += 1
                yield dict(sequence)
            self.buffer_start, self.handed = self.source.state_dict(), 0

    def restart(self) -> None:
        self.source.restart()
        self.buffer_start, self.handed = self.source.state_dict(), 0

    def state_dict(self) -> dict[str, Any]:
        return {'buffer_start': self.buffer_start, 'handed': self.handed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.buffer_start, self.handed = dict(state['buffer_start']), int(state['handed'])

    @property
    def counts(self) -> dict[str, int]:
        return self.source.counts


#: What a DataLoader reads as a stream.
Stream = IterableDataset | MixedStream | PackedStream
