"""Tinker's export path: weights saved for download, and short-lived signed links to their files.

- ``POST /save_weights_external`` (``TrainingClient.save_weights_external``) saves the model's
  adapter in Tinker's layout (``twinkle.model.export.write_tinker_adapter``) as the checkpoint
  ``tinker://<run>/external_weights/<name>``. With ``age_encryption_recipients`` each file is
  encrypted to them with age (``pyrage``) and stored as ``<file>.age``; the plain files never stay
  on disk.
- ``GET /training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls``
  (``RestClient.get_external_weights_urls``) answers one link per file, signed with the server's
  link key and valid for ``LINK_TTL_S``.
- ``GET /external_weights_files/{id}/{file}?expires=&signature=`` serves a file to whoever holds
  its link, without an API key (tinker-cookbook's ``weights.download`` fetches the links with a
  plain GET). A link past its time, altered, or of a deleted export is refused with a 401.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyrage
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from pydantic import JsonValue

from twinkle.errors import DataError, NotFoundError, UnauthorizedError
from twinkle.model import checkpoint as ckpt
from twinkle.model.export import write_tinker_adapter
from twinkle.server.state import Service
from twinkle.server.store import TINKER_FOLDERS, Checkpoint, Run, Tenant
from twinkle.server.tinker.api import JsonObject

#: How long a download link works.
LINK_TTL_S = 3600
#: The most age recipients one export takes (the SDK's limit too).
MAX_RECIPIENTS = 10
FILES_ROUTE = '/external_weights_files'


def age_recipients(keys: list[str]) -> list[Any]:
    """The age recipients of ``keys`` (``age1...`` X25519 keys or SSH public keys)."""
    if len(keys) > MAX_RECIPIENTS:
        raise DataError(f'age_encryption_recipients takes at most {MAX_RECIPIENTS} keys; got {len(keys)}')
    recipients = []
    for number, key in enumerate(keys):
        kind = pyrage.x25519 if key.startswith('age1') else pyrage.ssh
        try:
            recipients.append(kind.Recipient.from_str(key))
        except pyrage.RecipientError:
            raise DataError(
                f'age_encryption_recipients[{number}] is not an age X25519 public key (age1...) '
                'nor an SSH public key (ssh-ed25519 ..., ssh-rsa ...)'
            ) from None
    return recipients


def export_weights(
    service: Service, who: Tenant, run: Run, name: str, expires_at: float | None, recipients: list[Any]
) -> Checkpoint:
    """Save the run's adapter, write it in Tinker's layout (encrypted to ``recipients`` when
    given) as ``external_weights/<name>`` atomically, and record it."""
    folder = service.checkpoint_dir(who, run.id) / TINKER_FOLDERS['external']
    folder.mkdir(parents=True, exist_ok=True)
    group = service.group_of(run)
    with tempfile.TemporaryDirectory(dir=folder, prefix='.saving-') as scratch:
        saved = Path(group.host.save(group.loaded(run), Path(scratch), 'adapter', save_optimizer=False))
        with ckpt.atomic_directory(folder / name) as staging:
            write_tinker_adapter(saved, staging)
            if recipients:
                for path in list(staging.iterdir()):
                    pyrage.encrypt_file(str(path), f'{path}.age', recipients)
                    path.unlink()
    size = sum(f.stat().st_size for f in (folder / name).rglob('*') if f.is_file())
    return service.store.add_checkpoint(
        who.id, run.id, name, str(folder / name), 'external', size, expires_at=expires_at
    )


def links_json(service: Service, checkpoint: Checkpoint, request: Request) -> JsonObject:
    """``{urls: {file: signed link}, expires}`` for an export's files (``ExternalWeightsUrlsResponse``)."""
    if checkpoint.kind != 'external':
        raise DataError(
            f'{checkpoint.checkpoint_id!r} is not exported weights: save them with save_weights_external, '
            'then ask for the links of tinker://<run_id>/external_weights/<name>'
        )
    root = Path(checkpoint.path)
    urls, expires = signed_links(
        service, checkpoint, request, [p.relative_to(root) for p in root.rglob('*') if p.is_file()]
    )
    return {'urls': urls, 'expires': datetime.fromtimestamp(expires, tz=timezone.utc).isoformat()}


def signed_links(
    service: Service, checkpoint: Checkpoint, request: Request, files: list[Path]
) -> tuple[dict[str, JsonValue], int]:
    """A link to each of ``files`` (paths in the checkpoint's folder) that works without a key
    for ``LINK_TTL_S``, on the host and port the request came to; and when they expire."""
    expires = int(time.time()) + LINK_TTL_S
    base = str(request.base_url).rstrip('/') + request.scope.get('root_path', '')
    urls: dict[str, JsonValue] = {}
    for file in sorted(files):
        name = file.as_posix()
        signature = _signature(service.link_key, checkpoint.id, name, expires)
        urls[name] = f'{base}/api/v1{FILES_ROUTE}/{checkpoint.id}/{name}?expires={expires}&signature={signature}'
    return urls, expires


def files_route(routes: APIRouter, service: Service) -> None:
    """The file a signed link names; no API key (the link is the credential)."""

    @routes.get(FILES_ROUTE + '/{checkpoint_id}/{name:path}', response_model=None)
    async def external_weights_file(checkpoint_id: str, name: str, expires: int, signature: str) -> FileResponse:
        expected = _signature(service.link_key, checkpoint_id, name, expires)
        if not hmac.compare_digest(expected.encode(), signature.encode()) or expires < time.time():
            raise UnauthorizedError(
                'this download link is altered or expired: ask for new links (external_weights_urls)'
            )
        checkpoint = await asyncio.to_thread(service.store.get_checkpoint_by_id, checkpoint_id)
        root = Path(checkpoint.path).resolve() if checkpoint is not None else None
        path = (root / name).resolve() if root is not None else None
        if root is None or path is None or not path.is_relative_to(root) or not path.is_file():
            raise NotFoundError('the exported weights of this link were deleted: save and ask for links again')
        return FileResponse(path, filename=path.name, media_type='application/octet-stream')


def _signature(key: bytes, checkpoint_id: str, name: str, expires: int) -> str:
    message = f'{checkpoint_id}\n{name}\n{expires}'.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()
