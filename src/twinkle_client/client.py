"""``TwinkleClient``: HTTP to a twinkle server, futures awaited, errors raised with the
server's message."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar, cast

import httpx
import msgpack
from pydantic import BaseModel, JsonValue, ValidationError

from twinkle import errors
from twinkle.errors import DataError, TwinkleError
from twinkle.wire import (
    IDEMPOTENCY_HEADER,
    MAX_QUEUE_WAIT_S,
    MSGPACK,
    MSGPACK_TYPES,
    QUEUE_HEADER,
    CheckpointInfo,
    CheckpointList,
    FileLinks,
    FutureAccepted,
    FutureInfo,
    RunHistory,
    RunInfo,
    RunList,
    RunRestore,
    RunStep,
    UsageReport,
    parse_twinkle_path,
)

PREFIX = '/twinkle/v1'
#: Most seconds one request waits for a compute request to settle (the server's longest wait is
#: 60 s); half the client's ``timeout`` when that is shorter.
WAIT_S = 30.0
#: Longest ``Retry-After`` a 429 is retried after; a longer one (a daily quota spent) raises at once.
MAX_RETRY_AFTER_S = 60.0
#: Seconds before the first try again of a request whose connection failed, doubling up to the second
#: (a gateway that died: a load balancer in front sends the next try to another).
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.1, 2.0
#: Answers of a proxy whose gateway is gone (bad gateway, its timeout): tried again, as a broken connection is.
PROXY_FAILURES = (502, 504)
#: Errors of a connection that never carried the request: any request may be sent again after them.
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout)
Wire = TypeVar('Wire', bound=BaseModel)
_default: TwinkleClient | None = None


class RemoteError(TwinkleError, RuntimeError):
    """The server refused or failed a request. ``status`` is the HTTP status (or 200 for a
    request that failed while running), ``category`` 'user' (fix the request) or 'server'.

    Raised as a subclass that is also the ``twinkle.errors`` class the server named, so that
    ``except StateError`` (or ``DataError``...) catches a server's error as it catches the
    local model's (``remote_error``)."""

    def __init__(self, message: str, status: int, category: str = 'user'):
        Exception.__init__(self, message)  # not super(): a twinkle.errors class after it may take other arguments
        self.status, self.category = status, category

    def __str__(self) -> str:
        return str(self.args[0])


def remote_error(message: str, status: int, category: str = 'user', kind: str | None = None) -> RemoteError:
    """A ``RemoteError`` that is also ``twinkle.errors.<kind>`` when the server named one of its classes."""
    cls = getattr(errors, kind, None) if kind else None
    if not isinstance(cls, type) or not issubclass(cls, TwinkleError) or cls is TwinkleError:
        return RemoteError(message, status, category)
    return _remote_class(cls)(message, status, category)


_REMOTE_CLASSES: dict[str, type[RemoteError]] = {}


def _remote_class(cls: type[TwinkleError]) -> type[RemoteError]:
    """``Remote<Class>``: a ``RemoteError`` and a ``cls``, made once per class."""
    if cls.__name__ not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[cls.__name__] = type(f'Remote{cls.__name__}', (RemoteError, cls), {'__module__': __name__})
    return _REMOTE_CLASSES[cls.__name__]


#: A training run as the server describes it (``twinkle.wire.RunInfo``).
TrainingRun = RunInfo
#: A saved checkpoint as the server describes it (``twinkle.wire.CheckpointInfo``).
Checkpoint = CheckpointInfo


class TwinkleClient:
    """One server, one API key. ``timeout`` bounds a single HTTP call; ``result`` waits for a
    compute request as long as it runs. With ``queue_s`` a compute request that finds its
    tenant's queue full waits that many seconds on the server for room, in turn, rather than being
    refused with a 429 and retried. With ``binary`` (the default) request bodies go as MessagePack and
    compute answers come back in it (``twinkle.wire.MSGPACK``): token ids and logprobs cost about a
    third of their JSON to write and read, in half the bytes; ``binary=False`` speaks JSON only."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 120.0,
        max_retries: int = 20,
        queue_s: float = 0.0,
        binary: bool = True,
    ):
        if not isinstance(max_retries, int) or max_retries < 1:
            raise TwinkleError(f'max_retries must be a positive integer (tries per request); got {max_retries!r}')
        if not 0 <= queue_s <= MAX_QUEUE_WAIT_S:
            raise TwinkleError(f'queue_s must be between 0 and {MAX_QUEUE_WAIT_S:.0f} seconds; got {queue_s!r}')
        self.base_url = base_url.rstrip('/')
        headers = {'Authorization': f'Bearer {api_key}'}
        if queue_s:  # a compute request waits this long for room in a full queue rather than a 429
            headers[QUEUE_HEADER] = str(queue_s)
        if binary:
            headers['Accept'] = f'{MSGPACK}, application/json;q=0.5'
        self.binary = binary
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.max_retries = max_retries
        self.wait_s = min(WAIT_S, timeout / 2)

    # ---- plumbing -------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        *,
        json: JsonValue = None,
        params: Mapping[str, str | int | float] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> JsonValue:
        """JSON values in and out (sent and read as MessagePack when ``binary``), tried up to ``max_retries``
        times (``_exchange``); errors raise ``RemoteError`` with the server's message."""
        response = self._exchange(method, path, json, params, dict(headers or {}))
        if response.status_code >= 400:
            raise remote_error(_detail(response), response.status_code, kind=_error_class(response))
        return _answer(response)

    def _exchange(
        self,
        method: str,
        path: str,
        json: JsonValue,
        params: Mapping[str, str | int | float] | None,
        headers: dict[str, str],
    ) -> httpx.Response:
        """The server's answer to one request, sent again while it may be: after a 429 (busy) or a 503 (the
        store unreachable, the gateway stopping), its ``Retry-After`` (up to ``MAX_RETRY_AFTER_S``) later.
        A request that runs once however often it is sent (a GET, or a compute request with its
        ``Idempotency-Key``) is sent again too when its connection breaks or a proxy answers 502 or 504
        (its gateway died), any request when it could not connect: each after a back-off, the last try's
        answer or error as it comes."""
        content = None
        if json is not None and self.binary:
            json, content = None, _msgpack(json)
            headers['Content-Type'] = MSGPACK
        resendable = method == 'GET' or IDEMPOTENCY_HEADER in headers
        for attempt in range(self.max_retries - 1):
            try:
                response = self.http.request(method, path, params=params, headers=headers, json=json, content=content)
            except httpx.TransportError as error:
                if not (resendable or isinstance(error, UNSENT)):
                    raise
                time.sleep(min(FIRST_BACKOFF_S * 2**attempt, MAX_BACKOFF_S))
                continue
            pause = _retry_after(response, resendable)
            if pause is None:
                return response
            time.sleep(pause)
        return self.http.request(method, path, params=params, headers=headers, json=json, content=content)

    def submit(self, path: str, body: BaseModel | dict[str, JsonValue]) -> str:
        """Queue a compute request (a ``twinkle.wire`` model, or its JSON); its future id."""
        return self._post_compute(path, body, wait=0.0).future_id

    def _post_compute(self, path: str, body: BaseModel | dict[str, JsonValue], wait: float) -> FutureAccepted:
        """POST a compute request, named by an ``Idempotency-Key`` of its own that each try of it carries:
        sent again (its gateway died while it waited), it runs once. With ``wait`` > 0 the server answers
        once the request settles or ``wait`` seconds pass, with the future in the answer."""
        content = body.model_dump(mode='json') if isinstance(body, BaseModel) else body
        params = {'wait': wait} if wait > 0 else None
        key = {IDEMPOTENCY_HEADER: str(uuid.uuid4())}
        return FutureAccepted.model_validate(self.request('POST', path, json=content, params=params, headers=key))

    def result(self, future_id: str) -> JsonValue:
        """Wait for a compute request; its result, or ``RemoteError`` if it failed."""
        while True:
            record = FutureInfo.model_validate(
                self.request('GET', f'{PREFIX}/futures/{future_id}', params={'wait': self.wait_s})
            )
            if (settled := _settled(record)) is not None:
                return settled.result

    def call(self, path: str, body: BaseModel | dict[str, JsonValue]) -> JsonValue:
        """A compute request and its result: one round trip when it settles within ``wait_s``
        (the request waits for it), polls of its future after that."""
        accepted = self._post_compute(path, body, wait=self.wait_s)
        if accepted.future is not None and (settled := _settled(accepted.future)) is not None:
            return settled.result
        return self.result(accepted.future_id)

    def close(self) -> None:
        self.http.close()

    # ---- management -----------------------------------------------------------------------------
    def health_check(self) -> bool:
        try:
            answer: JsonValue = self.http.get('/healthz').json()
        except (httpx.HTTPError, ValueError):  # unreachable, or not JSON: not a healthy twinkle server
            return False
        return isinstance(answer, dict) and answer.get('status') == 'ok'

    def list_training_runs(self, limit: int = 100, offset: int = 0) -> list[TrainingRun]:
        data = self.request('GET', f'{PREFIX}/runs', params={'limit': limit, 'offset': offset})
        return RunList.model_validate(data).runs

    def get_training_run(self, run_id: str) -> TrainingRun:
        return RunInfo.model_validate(self.request('GET', f'{PREFIX}/runs/{run_id}'))

    def delete_training_run(self, run_id: str) -> None:
        """Delete a run: its adapter and the state the server kept for it; its checkpoints stay
        (``delete_checkpoint`` each). It then no longer counts against the tenant's runs quota."""
        self.request('DELETE', f'{PREFIX}/runs/{run_id}')

    def run_history(self, run_id: str, after: int = 0) -> list[RunStep]:
        """The run's figures at each optimizer step after step ``after`` (loss, lr, grad_norm,
        tokens_per_s), oldest first: every step, in pages of the server's size."""
        steps: list[RunStep] = []
        while True:
            page = RunHistory.model_validate(
                self.request('GET', f'{PREFIX}/runs/{run_id}/history', params={'after': after})
            ).steps
            if not page:
                return steps
            steps += page
            after = page[-1].step

    def usage(self, since: float = 0.0, until: float | None = None) -> UsageReport:
        """What this key's tenant used in the UTC hours that start in ``[since, until)`` (unix
        seconds; ``until`` None: up to now), per run and in total, with the checkpoints it keeps
        and the costs by the server's prices; with the admin key, every tenant's."""
        params: dict[str, float] = {'since': since} if until is None else {'since': since, 'until': until}
        return UsageReport.model_validate(self.request('GET', f'{PREFIX}/usage', params=params))

    def run_restores(self, run_id: str) -> list[RunRestore]:
        """The times the server brought the run back with less than it had, oldest first: a model
        worker died and it continued from its last saved state (``restored_from.step``, with the
        ``lost_steps`` after it forgotten in its history), or it had only a checkpoint of weights
        alone (``fresh_optimizer``). ``get_training_run(...).restored_from`` is the last one."""
        answer = self.request('GET', f'{PREFIX}/runs/{run_id}/history', params={'limit': 1})
        return RunHistory.model_validate(answer).restores

    def download_checkpoint(self, path: str, out_dir: str | Path) -> Path:
        """The weight files of ``twinkle://<run>/checkpoints/<name>`` (not its optimizer state)
        into ``out_dir``, a new or empty folder, which appears whole or not at all."""
        run_id, name = parse_twinkle_path(path)
        links = FileLinks.model_validate(self.request('POST', f'{PREFIX}/runs/{run_id}/checkpoints/{name}/links'))
        out = Path(out_dir)
        if out.exists() and any(out.iterdir()):
            raise DataError(f'the folder {str(out_dir)!r} is not empty; give a new or empty folder')
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f'.{out.name}-', dir=out.parent))
        try:
            for file, url in links.urls.items():
                target = (staging / file).resolve()
                if not target.is_relative_to(staging.resolve()):
                    raise DataError(f'the server named a file outside the checkpoint: {file!r}')
                target.parent.mkdir(parents=True, exist_ok=True)
                with httpx.stream('GET', url, timeout=self.http.timeout) as answer:  # the link needs no key
                    if answer.status_code >= 400:
                        answer.read()
                        raise remote_error(_detail(answer), answer.status_code, kind=_error_class(answer))
                    with target.open('wb') as handle:
                        for chunk in answer.iter_bytes():
                            handle.write(chunk)
            if out.exists():
                out.rmdir()
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return out

    def list_checkpoints(self, run_id: str) -> list[Checkpoint]:
        return CheckpointList.model_validate(self.request('GET', f'{PREFIX}/runs/{run_id}/checkpoints')).checkpoints

    def delete_checkpoint(self, run_id_or_path: str, name: str | None = None) -> None:
        """Delete by ``twinkle://run/checkpoints/name`` or by run id and name."""
        if name is None:
            run_id_or_path, name = parse_twinkle_path(run_id_or_path)
        self.request('DELETE', f'{PREFIX}/runs/{run_id_or_path}/checkpoints/{name}')


def _settled(record: FutureInfo) -> FutureInfo | None:
    """``record`` if it is done, None while it runs; a failed one raises ``RemoteError``."""
    if record.status == 'done':
        return record
    if record.status == 'failed':
        message = record.error or 'the request failed'
        named = re.match(r'(\w+): ', message)  # the server writes 'ClassName: message'
        raise remote_error(message, 200, record.category or 'server', named[1] if named else None)
    return None


def init_twinkle_client(
    base_url: str, api_key: str, *, timeout: float = 120.0, max_retries: int = 20, queue_s: float = 0.0
) -> TwinkleClient:
    """A client for ``base_url``, also made the default for components built without ``client=``."""
    global _default
    _default = TwinkleClient(base_url, api_key, timeout=timeout, max_retries=max_retries, queue_s=queue_s)
    return _default


def default_client() -> TwinkleClient:
    if _default is None:
        raise TwinkleError('no twinkle client: call init_twinkle_client(base_url, api_key) or pass client=')
    return _default


def build(model: type[Wire], fields: Mapping[str, object]) -> Wire:
    """A ``twinkle.wire`` request from Python values (tuples as lists, as JSON has them), or a
    ``DataError`` saying which field is wrong, before anything is sent."""
    try:
        return model.model_validate(json.loads(json.dumps(fields)))
    except (TypeError, ValueError) as e:  # a value JSON cannot carry (a tensor, a set), or a bad field
        raise DataError(f'{model.__name__}: {_problems(e)}') from None


def _problems(error: Exception) -> str:
    if not isinstance(error, ValidationError):
        return str(error)
    return '; '.join(f'{".".join(map(str, p["loc"])) or "body"}: {p["msg"]}' for p in error.errors())


def _msgpack(value: JsonValue) -> bytes:
    return cast(bytes, msgpack.packb(value, use_bin_type=True))


def _retry_after(response: httpx.Response, resendable: bool) -> float | None:
    """Seconds to wait before sending the request of ``response`` again; None: the answer stands."""
    if response.status_code in PROXY_FAILURES and resendable:
        return 1.0
    if response.status_code not in (429, 503):
        return None
    try:
        pause = float(response.headers.get('Retry-After', '1'))
    except ValueError:  # an HTTP date: not ours
        pause = 1.0
    return pause if pause <= MAX_RETRY_AFTER_S else None


def _answer(response: httpx.Response) -> JsonValue:
    """The server's answer, JSON or MessagePack by its content type: the caller validates it with a wire model."""
    if response.headers.get('content-type', '').split(';')[0].strip() in MSGPACK_TYPES:
        return cast(JsonValue, msgpack.unpackb(response.content, raw=False))
    body: JsonValue = response.json()
    return body


def _error_class(response: httpx.Response) -> str | None:
    """The ``twinkle.errors`` class a 4xx names (its ``error`` field)."""
    try:
        kind = response.json().get('error')
    except (ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def _detail(response: httpx.Response) -> str:
    """The server's message: its ``detail``, a 422's problems as ``field.path: message``."""
    try:
        detail = response.json().get('detail', response.text)
    except ValueError:
        detail = response.text
    if isinstance(detail, list):  # a 422: where and what, one problem each
        detail = '; '.join(_located(problem) for problem in detail)
    return f'HTTP {response.status_code}: {detail}'


def _located(problem: object) -> str:
    if not isinstance(problem, dict):
        return str(problem)
    where = '.'.join(str(part) for part in problem.get('loc', []) if part != 'body') or 'body'
    return f'{where}: {problem.get("msg", problem)}'
