"""Tinker's export path: weights saved for download, and short-lived signed links to their files.

- ``POST /save_weights_external`` (``TrainingClient.save_weights_external``) saves the model's
  adapter in Tinker's layout (``twinkle.model.checkpoint.export.write_tinker_adapter``) as the checkpoint
  ``tinker://<run>/external_weights/<name>``. With ``age_encryption_recipients`` each file is
  encrypted to them with age (``pyrage``) and stored as ``<file>.age``; the plain files never stay
  on disk.
- ``GET /training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls``
  (``RestClient.get_external_weights_urls``) answers one link per file, signed with the server's
  link key and valid for ``LINK_TTL_S``.
- the links are ``twinkle.server.api.links``': a file to whoever holds its link, without an API key
  (tinker-cookbook's ``weights.download`` fetches them with a plain GET); altered or expired, a
  401; of a deleted export, a 404.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyrage
from fastapi import Request

from twinkle.errors import DataError
from twinkle.model.checkpoint import files as ckpt
from twinkle.model.checkpoint.export import write_tinker_adapter
from twinkle.server.api.links import signed_links, weight_files
from twinkle.server.api.tinker.base import JsonObject
from twinkle.server.execution.groups.run_files import EXPORT_SCRATCH
from twinkle.server.service import Service
from twinkle.server.store import Checkpoint, Run

#: The most age recipients one export takes (the SDK's limit too).
MAX_RECIPIENTS = 10


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
    service: Service,
    run: Run,
    name: str,
    expires_at: float | None,
    recipients: list[Any],
    answer: Callable[[Checkpoint], JsonObject],
) -> JsonObject:
    """Save the run's adapter, write it in Tinker's layout (encrypted to ``recipients`` when
    given) as ``external_weights/<name>``, and record it: its row and the request's answer are
    one commit, as for any checkpoint (``ModelGroup.record_checkpoint``)."""
    group = service.group_of(run)

    def write(folder: Path) -> None:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=EXPORT_SCRATCH) as scratch:
            saved = group.save(run, Path(scratch), 'adapter', save_optimizer=False)
            with ckpt.atomic_directory(folder) as staging:
                write_tinker_adapter(saved, staging)
                if recipients:
                    for path in list(staging.iterdir()):
                        pyrage.encrypt_file(str(path), f'{path}.age', recipients)
                        path.unlink()

    return group.record_checkpoint(run, 'external', name, write, answer, expires_at=expires_at)


def links_json(service: Service, checkpoint: Checkpoint, request: Request) -> JsonObject:
    """``{urls: {file: signed link}, expires}`` for an export's files (``ExternalWeightsUrlsResponse``)."""
    if checkpoint.kind != 'external':
        raise DataError(
            f'{checkpoint.checkpoint_id!r} is not exported weights: save them with save_weights_external, '
            'then ask for the links of tinker://<run_id>/external_weights/<name>'
        )
    urls, expires = signed_links(service, checkpoint, request, weight_files(checkpoint))
    return {'urls': urls, 'expires': datetime.fromtimestamp(expires, tz=timezone.utc).isoformat()}
