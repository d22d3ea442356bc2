"""``TwinkleClient``: HTTP to a twinkle server, futures awaited, errors raised with the
server's message."""

from __future__ import annotations

import time
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict

from twinkle.errors import TwinkleError

PREFIX = '/twinkle/v1'
_default: TwinkleClient | None = None


class RemoteError(TwinkleError, RuntimeError):
    """The server refused or failed a request. ``status`` is the HTTP status (or 200 for a
    request that failed while running), ``category`` 'user' (fix the request) or 'server'."""

    def __init__(self, message: str, status: int, category: str = 'user'):
        super().__init__(message)
        self.status, self.category = status, category


class TrainingRun(BaseModel):
    model_config = ConfigDict(extra='ignore')

    training_run_id: str
    base_model: str
    adapter_name: str
    status: str
    created_at: float
    last_request_at: float


class Checkpoint(BaseModel):
    model_config = ConfigDict(extra='ignore')

    name: str
    run_id: str
    twinkle_path: str
    kind: str
    size_bytes: int
    created_at: float


class TwinkleClient:
    """One server, one API key. ``timeout`` bounds a single HTTP call; ``result`` waits for a
    compute request as long as it runs."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 120.0, max_retries: int = 20):
        if not isinstance(max_retries, int) or max_retries < 1:
            raise TwinkleError(f'max_retries must be a positive integer (tries per request); got {max_retries!r}')
        self.base_url = base_url.rstrip('/')
        self.http = httpx.Client(
            base_url=self.base_url, headers={'Authorization': f'Bearer {api_key}'}, timeout=timeout
        )
        self.max_retries = max_retries

    # ---- plumbing -------------------------------------------------------------------------------
    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """JSON in, JSON out; a 429 is retried after its ``Retry-After``; other errors raise
        ``RemoteError`` with the server's message."""
        for _ in range(self.max_retries):
            response = self.http.request(method, path, **kwargs)
            if response.status_code != 429:
                break
            time.sleep(float(response.headers.get('Retry-After', '1')))
        if response.status_code >= 400:
            raise RemoteError(_detail(response), response.status_code)
        return response.json()

    def submit(self, path: str, body: dict[str, Any]) -> str:
        return self.request('POST', path, json=body)['future_id']

    def result(self, future_id: str) -> Any:
        """Wait for a compute request; its result, or ``RemoteError`` if it failed."""
        while True:
            record = self.request('GET', f'{PREFIX}/futures/{future_id}', params={'wait': 30})
            if record['status'] == 'done':
                return record['result']
            if record['status'] == 'failed':
                raise RemoteError(record['error'], 200, record.get('category') or 'server')

    def call(self, path: str, body: dict[str, Any]) -> Any:
        return self.result(self.submit(path, body))

    def close(self) -> None:
        self.http.close()

    # ---- management -----------------------------------------------------------------------------
    def health_check(self) -> bool:
        try:
            return self.http.get('/healthz').json().get('status') == 'ok'
        except httpx.HTTPError:
            return False

    def list_training_runs(self, limit: int = 100, offset: int = 0) -> list[TrainingRun]:
        data = self.request('GET', f'{PREFIX}/runs', params={'limit': limit, 'offset': offset})
        return [TrainingRun(**run) for run in data['runs']]

    def get_training_run(self, run_id: str) -> TrainingRun:
        return TrainingRun(**self.request('GET', f'{PREFIX}/runs/{run_id}'))

    def list_checkpoints(self, run_id: str) -> list[Checkpoint]:
        data = self.request('GET', f'{PREFIX}/runs/{run_id}/checkpoints')
        return [Checkpoint(**checkpoint) for checkpoint in data['checkpoints']]

    def delete_checkpoint(self, run_id_or_path: str, name: str | None = None) -> None:
        """Delete by ``twinkle://run/checkpoints/name`` or by run id and name."""
        if name is None:
            from twinkle.server.store import parse_twinkle_path

            run_id_or_path, name = parse_twinkle_path(run_id_or_path)
        self.request('DELETE', f'{PREFIX}/runs/{run_id_or_path}/checkpoints/{name}')


def init_twinkle_client(base_url: str, api_key: str, **kwargs: Any) -> TwinkleClient:
    """A client for ``base_url``, also made the default for components built without ``client=``."""
    global _default
    _default = TwinkleClient(base_url, api_key, **kwargs)
    return _default


def default_client() -> TwinkleClient:
    if _default is None:
        raise TwinkleError('no twinkle client: call init_twinkle_client(base_url, api_key) or pass client=')
    return _default


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get('detail', response.text)
    except ValueError:
        detail = response.text
    return f'HTTP {response.status_code}: {detail}'
