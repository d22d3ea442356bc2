"""API keys: how they are made, how they are stored, and where a request carries one.

A key is shown to its tenant once, when it is made; the server keeps only its hash.

>>> key = new_api_key()
>>> key.startswith('tk-') and len(hash_key(key)) == 64
True
>>> key_from_headers({'authorization': 'Bearer tk-abc'})
'tk-abc'
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping

KEY_PREFIX = 'tk-'


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
