"""Download links that work without an API key, for a short while: the link is the credential.

``signed_links`` signs a link per file of a checkpoint with the server's link key (made at start,
so a restart voids the links) for ``LINK_TTL_S``; ``files_route`` serves the file a link names.
An altered or expired link is a 401; a link to a deleted checkpoint, a 404. Tinker's exported
weights (``tinker/external.py``), the dashboard's downloads and the native client's
``download_checkpoint`` all hand out these links.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import JsonValue

from twinkle.errors import NotFoundError, UnauthorizedError
from twinkle.model.checkpoint.export import TRAINING_FILES
from twinkle.server.service import Service
from twinkle.server.store import Checkpoint

#: How long a download link works.
LINK_TTL_S = 3600
#: The route of the files, under the Tinker API's ``/api/v1`` (where Tinker's clients expect them).
FILES_ROUTE = '/external_weights_files'


def weight_files(checkpoint: Checkpoint) -> list[Path]:
    """The checkpoint's files but its training state (optimizer, scheduler, RNG, trainer state)."""
    root = Path(checkpoint.path)
    return [p.relative_to(root) for p in root.rglob('*') if p.is_file() and p.name not in TRAINING_FILES]


def signed_links(
    service: Service, checkpoint: Checkpoint, request: Request, files: list[Path]
) -> tuple[dict[str, JsonValue], int]:
    """A link to each of ``files`` (paths in the checkpoint's folder) that works without a key
    for ``LINK_TTL_S``, on the host and port the request came to; and when they expire."""
    expires = int(time.time()) + LINK_TTL_S
    base = str(request.base_url).rstrip('/')  # the root path (behind a proxy) included
    urls: dict[str, JsonValue] = {}
    for file in sorted(files):
        name = file.as_posix()
        signature = _signature(service.link_key, checkpoint.id, name, expires)
        urls[name] = f'{base}/api/v1{FILES_ROUTE}/{checkpoint.id}/{name}?expires={expires}&signature={signature}'
    return urls, expires


def files_route(routes: APIRouter, service: Service) -> None:
    """The route of the file a signed link names, on ``routes`` (the Tinker API's router, under
    ``/api/v1``); it takes no API key."""

    @routes.get(FILES_ROUTE + '/{checkpoint_id}/{name:path}', response_model=None)
    async def external_weights_file(checkpoint_id: str, name: str, expires: int, signature: str) -> FileResponse:
        expected = _signature(service.link_key, checkpoint_id, name, expires)
        if not hmac.compare_digest(expected.encode(), signature.encode()) or expires < time.time():
            raise UnauthorizedError(
                'this download link is altered or expired: ask for new links (external_weights_urls, or '
                'POST /twinkle/v1/runs/{run_id}/checkpoints/{name}/links)'
            )
        checkpoint = await asyncio.to_thread(service.store.checkpoints.by_id, checkpoint_id)
        root = Path(checkpoint.path).resolve() if checkpoint is not None else None
        path = (root / name).resolve() if root is not None else None
        if root is None or path is None or not path.is_relative_to(root) or not path.is_file():
            raise NotFoundError('the checkpoint of this link was deleted: save it again and ask for new links')
        return FileResponse(path, filename=path.name, media_type='application/octet-stream')


def signed_link(service: Service, request: Request, route: str, name: str) -> str:
    """A link to ``route/name`` (under ``/api/v1``) that works without a key for ``LINK_TTL_S``;
    its route checks it with ``check_signature``."""
    expires = int(time.time()) + LINK_TTL_S
    base = str(request.base_url).rstrip('/')
    signature = _signature(service.link_key, route, name, expires)
    return f'{base}/api/v1{route}/{name}?expires={expires}&signature={signature}'


def check_signature(service: Service, route: str, name: str, expires: int, signature: str, remedy: str) -> None:
    """A 401 that says what to do (``remedy``) unless ``signed_link`` made this link and it has not expired."""
    expected = _signature(service.link_key, route, name, expires)
    if not hmac.compare_digest(expected.encode(), signature.encode()) or expires < time.time():
        raise UnauthorizedError(f'this link is altered or expired: {remedy}')


def _signature(key: bytes, checkpoint_id: str, name: str, expires: int) -> str:
    """The signature of a link to a checkpoint's file, or (``checkpoint_id`` a route) to another thing."""
    message = f'{checkpoint_id}\n{name}\n{expires}'.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()
