"""API keys: how they are made, how they are stored, and where a request carries one.

A key is shown to its tenant once, when it is made; the server keeps only its hash.

>>> key = new_api_key()
>>> key.startswith('tml-') and len(hash_key(key)) == 64
True
>>> key_from_headers({'authorization': 'Bearer tk-abc'})
'tk-abc'
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

from twinkle.errors import ConfigurationError

#: The Tinker SDK accepts only keys that start with ``tml-``; one key serves both APIs.
KEY_PREFIX = 'tml-'
#: A key's hash as the API keys file may give it instead of the key itself.
_HASHED = re.compile(r'sha256:([0-9a-f]{64})')
#: Keys a caller brings must be as unguessable as ours, since they are only hashed with SHA-256.
MIN_KEY_LENGTH = 32
#: Where a request's ASGI scope keeps the tenant its key names (None: no tenant has it) once looked
#: up, so that ``HttpLimits`` and the routes' ``key_holder`` look it up once between them.
TENANT_KEY = 'twinkle.tenant'


def new_api_key() -> str:
    """A fresh key: 256 random bits, URL-safe, with a prefix that makes it easy to spot in a leak scan."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The hex SHA-256 of ``key``, which is all the store keeps.

    A fast hash is the right tool here, unlike for passwords: keys are random 256-bit tokens, so there is
    no dictionary to try and a slow hash (bcrypt, scrypt) would only add latency to every request. It also
    makes the hash usable as an indexed lookup column.
    """
    return hashlib.sha256(key.encode('utf-8')).hexdigest()


def key_from_headers(headers: Mapping[str, str]) -> str | None:
    """The key in ``Authorization: Bearer <key>`` or else ``X-Api-Key: <key>``; None when neither holds one.

    Header names and the ``Bearer`` scheme are matched case-insensitively (Starlette lowercases names,
    a plain dict may not).
    """
    lowered = {name.lower(): value for name, value in headers.items()}
    scheme, _, credentials = lowered.get('authorization', '').strip().partition(' ')
    if scheme.lower() == 'bearer' and credentials.strip():
        return credentials.strip()
    api_key = lowered.get('x-api-key', '').strip()
    return api_key or None


def read_keys_file(path: str | Path) -> dict[str, str]:
    """The API keys file: a YAML or JSON mapping of tenant name to key, each key given either
    as is (at least 32 characters) or as ``sha256:<hex digest>`` so the file need not hold
    secrets. Returns tenant name -> key hash.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), 'keys.yaml')
    >>> _ = open(path, 'w').write('alice: sha256:' + '0' * 64)
    >>> read_keys_file(path)['alice'] == '0' * 64
    True
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigurationError(f'API keys file {str(path)!r} does not exist')
    if path.suffix == '.json':
        entries = json.loads(path.read_text())
    else:
        import yaml

        entries = yaml.safe_load(path.read_text()) or {}
    if not isinstance(entries, dict):
        raise ConfigurationError(f'API keys file {str(path)!r} must map tenant names to keys')
    return {str(name): _key_hash(path, str(name), key) for name, key in entries.items()}


def _key_hash(path: Path, name: str, key: object) -> str:
    if isinstance(key, str) and (hashed := _HASHED.fullmatch(key)):
        return hashed.group(1)
    if not isinstance(key, str) or len(key) < MIN_KEY_LENGTH or key != key.strip():
        raise ConfigurationError(
            f'API keys file {str(path)!r}: the key of tenant {name!r} must be a string of at least '
            f'{MIN_KEY_LENGTH} characters without surrounding whitespace, or sha256:<64 hex digits>'
        )
    return hash_key(key)
