"""Streaming datasets: rows read from JSONL, Parquet and Arrow files as they are needed.

Sharding over data ranks and DataLoader workers (no row twice, none missed), exact resume in
the middle of a file (with and without workers), lazy map/filter/encode, and bad lines named by
file and line, raised or skipped and counted."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from server_helpers import free_port

from twinkle import DeviceMesh, assets
from twinkle.dataloader import DataLoader
from twinkle.dataset import IterableDataset, MixedStream
from twinkle.dataset.streaming import REMOTE_BUFFER
from twinkle.errors import AssetNotFoundError, ConfigurationError, DataError, StateError
from twinkle.preprocessor import ExactDedupFilter, SelfCognitionProcessor


def write_jsonl(path: Path, rows: list[dict], extra: dict[int, str] | None = None) -> Path:
    """``rows`` one per line; ``extra[i]`` is written as line ``i + 1`` instead of a row."""
    lines, rows_left = [], iter(rows)
    for number in range(len(rows) + len(extra or {})):
        special = (extra or {}).get(number)
        lines.append(special if special is not None else json.dumps(next(rows_left)))
    path.write_text('\n'.join(lines) + '\n')
    return path


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """230 rows {'i': 0..229} over a JSONL (100 rows, a blank line), a Parquet (80, row groups of
    16) and an Arrow stream (50)."""
    jsonl = write_jsonl(tmp_path / 'a.jsonl', [{'i': i} for i in range(100)], {40: ''})
    parquet = tmp_path / 'b.parquet'
    pq.write_table(pa.table({'i': list(range(100, 180))}), parquet, row_group_size=16)
    arrow = tmp_path / 'c.arrow'
    table = pa.table({'i': list(range(180, 230))})
    with pa.ipc.new_stream(str(arrow), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=7):
            writer.write_batch(batch)
    return [jsonl, parquet, arrow]


def ids(batches) -> list[int]:
    return [row['i'] for batch in batches for row in batch]


def loader(stream: IterableDataset, monkeypatch, rank: int, ranks: int, **kwargs) -> DataLoader:
    mesh = None
    if ranks > 1:
        monkeypatch.setenv('WORLD_SIZE', str(ranks))
        monkeypatch.setenv('RANK', str(rank))
        mesh = DeviceMesh.from_sizes(dp_size=ranks, device_type='cpu')
    return DataLoader(stream, device_mesh=mesh, **kwargs)


def test_a_stream_reads_every_file_kind_in_order(files):
    assert [row['i'] for row in IterableDataset(files)] == list(range(230))
    assert [row['i'] for row in IterableDataset(files[0].parent)] == list(range(230))  # a folder, sorted


@pytest.mark.integration
def test_two_ranks_of_two_workers_read_every_row_once(files, monkeypatch):
    seen = []
    for rank in (0, 1):
        batches = list(loader(IterableDataset(files), monkeypatch, rank, 2, batch_size=8, num_workers=2))
        assert all(len(batch) <= 4 for batch in batches)  # each rank's share of the global batch
        seen += ids(batches)
    assert sorted(seen) == list(range(230))


def test_map_filter_and_encode_run_lazily_as_rows_are_read(files):
    calls = []

    def double(row):
        calls.append(row['i'])
        return {'i': row['i'], 'twice': 2 * row['i']}

    stream = IterableDataset(files).map(double).filter(lambda row: row['i'] % 3 == 0)
    assert calls == []
    first = next(iter(stream))
    assert first == {'i': 0, 'twice': 0} and calls == [0]
    rows = list(stream)
    assert [row['i'] for row in rows] == list(range(3, 230, 3))
    assert stream.counts['dropped'] == 230 - 77


def test_encode_tokenizes_each_row_when_read():
    stream = IterableDataset(assets.dataset('self-cognition'))  # the embedded JSONL file
    stream.set_template('Template', model_id=assets.tiny_model(), max_length=128)
    stream.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community')).encode()
    encoded = list(itertools.islice(stream, 6))
    assert len(encoded) == 6 and all(len(row['input_ids']) == len(row['labels']) > 0 for row in encoded)
    assert stream.counts['rows_read'] == 6  # nothing past the rows asked for was read


@pytest.mark.integration
@pytest.mark.parametrize('workers', [0, 2])
@pytest.mark.parametrize('ranks', [1, 2])
def test_a_resumed_run_gets_exactly_the_rows_an_uninterrupted_one_gets_next(files, monkeypatch, workers, ranks):
    for rank in range(ranks):
        whole = list(loader(IterableDataset(files), monkeypatch, rank, ranks, batch_size=6, num_workers=workers))
        first = loader(IterableDataset(files), monkeypatch, rank, ranks, batch_size=6, num_workers=workers)
        taken = []
        for batch in first:
            taken.append(batch)
            if len(taken) == 7:  # in the middle of the JSONL file
                break
        state = json.loads(json.dumps(first.get_state()))  # as a checkpoint keeps it
        resumed = loader(IterableDataset(files), monkeypatch, rank, ranks, batch_size=6, num_workers=workers)
        resumed.load_state(state)
        assert taken + list(resumed) == whole
        assert state['consumed_train_samples'] == sum(len(b) for b in taken) * ranks


def test_a_resume_seeks_instead_of_reading_the_rows_again(files):
    stream = IterableDataset(files)
    rows = iter(stream)
    for _ in range(150):
        next(rows)
    state = stream.state_dict()
    assert state['position']['file'] == 1 and state['position']['offset'] == 50  # row 50 of the Parquet file
    read = []
    again = IterableDataset(files).map(lambda row: read.append(row['i']) or row)
    again.load_state_dict(state)
    assert [row['i'] for row in again] == list(range(150, 230)) and read == list(range(150, 230))


def test_a_state_from_another_layout_is_refused(files, monkeypatch):
    state = loader(IterableDataset(files), monkeypatch, 0, 1, batch_size=4, num_workers=2).get_state()
    other = loader(IterableDataset(files), monkeypatch, 0, 1, batch_size=4)
    with pytest.raises(StateError, match='resume with the same data ranks and num_workers'):
        other.load_state(state)
    with pytest.raises(StateError, match='resumes from its shards'):
        other.skip_consumed_samples(4)
    with pytest.raises(TypeError, match='has no length'):
        len(other)


def test_a_malformed_line_is_named_by_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / 'big.jsonl', [{'i': i} for i in range(20)], {7: '{"i": 7,', 12: '[1, 2]'})
    with pytest.raises(DataError, match=r"big.jsonl line 8: not valid JSON .*bad_lines='skip'"):
        list(IterableDataset(path))
    stream = IterableDataset(path, bad_lines='skip')
    assert [row['i'] for row in stream] == list(range(20))
    assert stream.counts['bad_lines'] == 2
    # Shard 0 of 2 parses the even rows only: not line 8 (row 7), but line 13 (row 12).
    with pytest.raises(DataError, match=r'big\.jsonl line 13: a JSON list, not an object'):
        list(IterableDataset(path).shard(2, 0))


def test_bad_sources_and_settings_are_refused(tmp_path):
    (tmp_path / 'notes.txt').write_text('x')
    with pytest.raises(ConfigurationError, match=r"stream file type.*'\.txt'.*\['\.arrow', '\.jsonl', '\.parquet'\]"):
        IterableDataset(tmp_path / 'notes.txt')
    with pytest.raises(DataError, match=r"no such file or folder: 'missing\.jsonl'"):
        IterableDataset('missing.jsonl')
    with pytest.raises(ConfigurationError, match=r"bad_lines.*'raise', 'skip'"):
        IterableDataset(tmp_path, bad_lines='ignore')  # type: ignore[arg-type]
    path = write_jsonl(tmp_path / 'r.jsonl', [{'i': 1}])
    with pytest.raises(ConfigurationError, match='read in order'):
        DataLoader(IterableDataset(path), batch_size=2, shuffle=True)


@pytest.fixture
def two_sources(tmp_path: Path) -> tuple[Path, Path]:
    chat = write_jsonl(tmp_path / 'chat.jsonl', [{'src': 'chat', 'i': i} for i in range(3000)])
    math = write_jsonl(tmp_path / 'math.jsonl', [{'src': 'math', 'i': i} for i in range(3000)])
    return chat, math


def test_streams_mix_by_ratio_deterministically_for_a_seed(two_sources):
    def first(seed: int, n: int = 2000) -> list[tuple[str, int]]:
        mixed = MixedStream([IterableDataset(p) for p in two_sources], [0.7, 0.3], seed=seed)
        return [(row['src'], row['i']) for row in itertools.islice(mixed, n)]

    rows = first(0)
    share = sum(src == 'chat' for src, _ in rows) / len(rows)
    assert abs(share - 0.7) < 4 * (0.7 * 0.3 / len(rows)) ** 0.5  # four standard deviations: 0.041
    assert rows == first(0) and rows != first(1)
    # Each stream's own rows come in their order.
    assert [i for src, i in rows if src == 'math'] == list(range(sum(src == 'math' for src, _ in rows)))


def test_streams_concatenate_or_take_turns(two_sources):
    chat, math = two_sources
    joined = MixedStream([IterableDataset(chat), IterableDataset(math)], interleave=False)
    assert [row['src'] for row in joined] == ['chat'] * 3000 + ['math'] * 3000
    turns = MixedStream([IterableDataset(chat), IterableDataset(math)])
    assert [row['src'] for row in itertools.islice(turns, 4)] == ['chat', 'math', 'chat', 'math']
    with pytest.raises(ConfigurationError, match='probabilities must be 2 numbers >= 0 with a positive sum'):
        MixedStream([IterableDataset(chat), IterableDataset(math)], [0.5])


@pytest.mark.integration
@pytest.mark.parametrize('workers', [0, 2])
def test_a_mixture_resumes_exactly(two_sources, monkeypatch, workers):
    def mixed() -> MixedStream:
        return MixedStream([IterableDataset(p) for p in two_sources], [0.6, 0.4], seed=3)

    whole = [
        ids_of(b) for b in itertools.islice(loader(mixed(), monkeypatch, 0, 1, batch_size=16, num_workers=workers), 20)
    ]
    first = loader(mixed(), monkeypatch, 0, 1, batch_size=16, num_workers=workers)
    taken = [ids_of(b) for b in itertools.islice(first, 9)]
    resumed = loader(mixed(), monkeypatch, 0, 1, batch_size=16, num_workers=workers)
    resumed.load_state(json.loads(json.dumps(first.get_state())))
    assert taken + [ids_of(b) for b in itertools.islice(resumed, 11)] == whole


def ids_of(batch: list[dict]) -> list[tuple[str, int]]:
    return [(row['src'], row['i']) for row in batch]


@pytest.mark.integration
def test_under_torchrun_two_ranks_of_two_workers_stop_together_and_read_each_row_once(tmp_path):
    data, out = tmp_path / 'data', tmp_path / 'out'
    data.mkdir(), out.mkdir()
    write_jsonl(data / 'a.jsonl', [{'i': i} for i in range(0, 97)])
    write_jsonl(data / 'b.jsonl', [{'i': i} for i in range(97, 150)])
    command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', f'--master_port={free_port()}']
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    done = subprocess.run(
        [*command, str(Path(__file__).with_name('dist_stream.py')), str(data), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f'rank{r}.json').read_text()) for r in (0, 1)]
    assert len(ranks[0]['batches']) == len(ranks[1]['batches'])  # the same number of steps
    seen = [i for rank in ranks for batch in rank['batches'] for i in batch]
    assert len(seen) == len(set(seen))  # no row twice
    kept = [i for i in range(150) if i % 7 != 3]
    assert set(seen) <= set(kept) and len(kept) - len(seen) < 2 * 2 * 4  # at most the tails the ranks left
    assert ranks[0]['state']['streams'] == ranks[1]['state']['streams']  # every rank holds every shard's position
    assert sorted(ranks[0]['state']['streams']) == ['0.0', '0.1', '1.0', '1.1']


def test_a_parquet_file_resumes_exactly_at_any_row_with_row_groups_of_any_size(tmp_path):
    path = tmp_path / 'groups.parquet'
    pq.write_table(pa.table({'i': list(range(230))}), path, row_group_size=100)  # groups of 100, 100, 30
    for cut in (0, 1, 99, 100, 150, 199, 200, 215, 229, 230):
        stream = IterableDataset(path)
        head = [row['i'] for row in itertools.islice(iter(stream), cut)]
        resumed = IterableDataset(path)
        resumed.load_state_dict(stream.state_dict())
        assert head + [row['i'] for row in resumed] == list(range(230)), cut


def test_a_folder_streams_the_split_asked_for(tmp_path):
    write_jsonl(tmp_path / 'train.jsonl', [{'split': 'train'}] * 3)
    write_jsonl(tmp_path / 'test.jsonl', [{'split': 'test'}] * 2)
    assert {row['split'] for row in IterableDataset(tmp_path)} == {'train'}
    assert [row['split'] for row in IterableDataset(tmp_path, split='test')] == ['test', 'test']


def test_a_deduplicating_filter_reads_a_stream_whole_and_forgets_between_epochs(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / 'dups.jsonl', [{'text': f'row {i % 3}'} for i in range(6)])

    def stream() -> IterableDataset:
        return IterableDataset(path).filter(ExactDedupFilter('text'))

    single = loader(stream(), monkeypatch, 0, 1, batch_size=2)
    assert [ids_text(b) for b in single] == [['row 0', 'row 1'], ['row 2']]
    assert [ids_text(b) for b in single] == [['row 0', 'row 1'], ['row 2']]  # the second epoch, not empty
    with pytest.raises(ConfigurationError, match='ExactDedupFilter remembers the rows it kept'):
        loader(stream(), monkeypatch, 0, 1, batch_size=2, num_workers=2)
    started = stream()
    next(iter(started))
    with pytest.raises(StateError, match='a resumed stream would let earlier duplicates through'):
        stream().load_state_dict(started.state_dict())


def ids_text(batch: list[dict]) -> list[str]:
    return [row['text'] for row in batch]


@pytest.mark.integration
def test_drop_last_drops_each_shard_s_short_last_batch(files, monkeypatch):
    batches = list(loader(IterableDataset(files), monkeypatch, 0, 1, batch_size=8, drop_last=True, num_workers=2))
    assert {len(batch) for batch in batches} == {8}


@pytest.mark.integration
@pytest.mark.parametrize('workers', [0, 2])
def test_the_loader_reports_what_the_stream_counted(tmp_path, monkeypatch, workers):
    path = write_jsonl(tmp_path / 'rows.jsonl', [{'i': i} for i in range(40)], {5: 'oops', 30: '[]'})
    stream = IterableDataset(path, bad_lines='skip').filter(lambda row: row['i'] % 4)
    read = loader(stream, monkeypatch, 0, 1, batch_size=4, num_workers=workers)
    list(read)
    assert read.get_state()['counts'] == {'rows_read': 40, 'bad_lines': 2, 'dropped': 10}


def test_a_stream_reads_any_fsspec_filesystem_and_resumes_there(tmp_path):
    """The same reading through fsspec's in-memory filesystem as through a hub's or object
    storage's: JSONL by byte offset, Parquet by row group, an Arrow file without a memory map."""
    import fsspec

    memory = fsspec.filesystem('memory')
    root = f'/stream-{tmp_path.name}'
    memory.pipe(f'{root}/a.jsonl', ''.join(json.dumps({'i': i}) + '\n' for i in range(30)).encode())
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({'i': list(range(30, 60))}), sink, row_group_size=8)
    memory.pipe(f'{root}/b.parquet', sink.getvalue().to_pybytes())
    sink = pa.BufferOutputStream()
    table = pa.table({'i': list(range(60, 75))})
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=4)
    memory.pipe(f'{root}/c.arrow', sink.getvalue().to_pybytes())
    url = f'memory://{root}'
    assert [row['i'] for row in IterableDataset(url)] == list(range(75))
    for cut in (10, 45, 66):
        stream = IterableDataset(url)
        head = [row['i'] for row in itertools.islice(iter(stream), cut)]
        resumed = IterableDataset(url)
        resumed.load_state_dict(stream.state_dict())
        assert head + [row['i'] for row in resumed] == list(range(75)), cut
    memory.rm(root, recursive=True)


def test_a_hub_dataset_that_is_not_cached_is_not_found_offline(monkeypatch):
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    with pytest.raises(AssetNotFoundError, match='no-such-org/no-such-set'):
        IterableDataset('hf://no-such-org/no-such-set')


class ModelScopeFiles(http.server.BaseHTTPRequestHandler):
    """The two routes of ModelScope's API that a streamed dataset reads, over a local folder:
    the paged file tree (``/api/v1/datasets/{org}/{name}/repo/tree``) and a file's bytes
    (``/api/v1/datasets/{org}/{name}/repo?FilePath=``), honouring ``Range`` as the hub does.
    ``served`` records the byte ranges sent."""

    root: Path
    repo = 'org/set'
    served: ClassVar[list[tuple[str, int, int]]] = []

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def do_HEAD(self) -> None:
        self.do_GET(head=True)

    def do_GET(self, head: bool = False) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        prefix = f'/api/v1/datasets/{self.repo}/repo'
        if url.path == prefix + '/tree':
            files = sorted(p for p in self.root.rglob('*') if p.is_file())
            size, page = int(query['PageSize']), int(query['PageNumber'])
            listed = [
                {'Path': p.relative_to(self.root).as_posix(), 'Size': p.stat().st_size, 'Type': 'blob'}
                for p in files[(page - 1) * size : page * size]
            ]
            self.answer(200, json.dumps({'Code': 200, 'Data': {'Files': listed}, 'Success': True}).encode())
        elif url.path == prefix and (self.root / query.get('FilePath', '-')).is_file():
            data = (self.root / query['FilePath']).read_bytes()
            ranged = re.fullmatch(r'bytes=(\d+)-(\d*)', self.headers.get('Range', ''))
            if not ranged:
                self.answer(200, data, head=head)
                return
            start, end = int(ranged[1]), min(int(ranged[2] or len(data) - 1), len(data) - 1)
            self.served.append((query['FilePath'], start, end + 1))
            self.answer(206, data[start : end + 1], {'Content-Range': f'bytes {start}-{end}/{len(data)}'}, head)
        else:
            self.answer(404, b'{"Code": 404, "Message": "not found"}')

    def answer(self, status: int, body: bytes, headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for name, value in {'Content-Length': str(len(body)), 'Accept-Ranges': 'bytes', **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


@pytest.fixture
def modelscope_hub(tmp_path, monkeypatch):
    """A loopback server answering as ModelScope does for ``org/set``, whose files are a JSONL (6 MB)
    of 3,000 rows and a Parquet of 40; nothing in the local cache, the hub online."""
    root = tmp_path / 'repo'
    (root / 'data').mkdir(parents=True)
    write_jsonl(root / 'data' / 'train.jsonl', [{'i': i, 'pad': 'x' * 2000} for i in range(3000)])
    pq.write_table(pa.table({'i': list(range(3000, 3040))}), root / 'data' / 'train_2.parquet', row_group_size=8)
    (root / 'README.md').write_text('# org/set\n')
    handler = type('Handler', (ModelScopeFiles,), {'root': root, 'served': []})
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv('MODELSCOPE_ENDPOINT', f'http://127.0.0.1:{server.server_address[1]}')
    monkeypatch.setenv('MODELSCOPE_CACHE', str(tmp_path / 'empty-cache'))
    monkeypatch.delenv('MODELSCOPE_OFFLINE', raising=False)
    monkeypatch.delenv('TWINKLE_OFFLINE', raising=False)
    yield handler
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.mark.integration
def test_a_modelscope_dataset_streams_without_a_download_and_resumes_mid_file(modelscope_hub):
    """``ms://`` reads the hub's files in ranged blocks, as ModelScope's streaming mode reads
    them: the first rows cost one block, not the file, and a resume seeks into the middle."""
    size = (modelscope_hub.root / 'data' / 'train.jsonl').stat().st_size
    stream = IterableDataset('ms://org/set')
    head = [row['i'] for row in itertools.islice(iter(stream), 5)]
    assert head == list(range(5))
    assert modelscope_hub.served == [('data/train.jsonl', 0, REMOTE_BUFFER)] and size > REMOTE_BUFFER
    state = stream.state_dict()

    modelscope_hub.served.clear()
    resumed = IterableDataset('ms://org/set')
    resumed.load_state_dict(state)
    rest = [row['i'] for row in resumed]
    assert head + rest == list(range(3040))
    first_read = min(start for name, start, _ in modelscope_hub.served if name == 'data/train.jsonl')
    assert first_read == state['position']['offset'] > 0


@pytest.mark.integration
def test_an_unknown_modelscope_dataset_is_not_found(modelscope_hub):
    with pytest.raises(AssetNotFoundError, match='org/missing'):
        IterableDataset('ms://org/missing')
