"""Point the official ``tinker`` SDK at a twinkle server, unpatched.

A twinkle server speaks the Tinker wire protocol that the SDK speaks, and it hands out API keys
that start with ``tml-`` as the SDK requires, so the SDK needs no patch: ``ServiceClient(base_url=
url, api_key=key)`` trains against it as it is. What :func:`init_tinker_client` adds is a check
that the installed SDK is a version this server was tested with, and environment defaults so
that ``ServiceClient()`` with no arguments reaches the twinkle server::

    from twinkle import init_tinker_client

    init_tinker_client('http://127.0.0.1:8000', 'tml-...')  # or set TWINKLE_SERVER_URL / TWINKLE_API_KEY
    from tinker import ServiceClient

    training_client = ServiceClient().create_lora_training_client(base_model='Qwen/Qwen3.5-4B', rank=16)

The SDK reads ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` when a ``ServiceClient`` is built, not
when ``tinker`` is imported, so the call may come before or after the import. Nothing here
imports ``tinker`` (which imports torch).
"""

from __future__ import annotations

import importlib.metadata
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from twinkle.errors import ConfigurationError

#: The ``tinker`` SDK releases whose wire protocol the server implements and was tested with.
SUPPORTED_TINKER = '>=0.38,<0.39'
#: Key prefixes the SDK accepts (an API key, or a JWT); others it refuses before sending a request.
TINKER_KEY_PREFIXES = ('tml-', 'eyJ')
#: Where the SDK reads its defaults, and where twinkle's own settings are read from.
TINKER_BASE_URL, TINKER_API_KEY = 'TINKER_BASE_URL', 'TINKER_API_KEY'
TWINKLE_SERVER_URL, TWINKLE_API_KEY = 'TWINKLE_SERVER_URL', 'TWINKLE_API_KEY'


def installed_tinker_version() -> str:
    """The version of the installed ``tinker`` distribution (read from its metadata, no import)."""
    try:
        return importlib.metadata.version('tinker')
    except importlib.metadata.PackageNotFoundError:
        raise ConfigurationError(
            f"the tinker SDK is not installed; install a supported release: pip install 'tinker{SUPPORTED_TINKER}'"
        ) from None


def check_tinker_version(version: str | None = None) -> str:
    """``version`` (default: the installed one) if it is in :data:`SUPPORTED_TINKER`; a
    ``ConfigurationError`` naming it and the supported range otherwise.

    >>> check_tinker_version('0.38.2')
    '0.38.2'
    >>> check_tinker_version('0.40.0')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    twinkle.errors.ConfigurationError: tinker 0.40.0 is installed, but twinkle supports tinker>=0.38,<0.39 ...
    """
    version = installed_tinker_version() if version is None else version
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise ConfigurationError(f'tinker version {version!r} is not a version number') from None
    if not SpecifierSet(SUPPORTED_TINKER, prereleases=True).contains(parsed):
        raise ConfigurationError(
            f'tinker {version} is installed, but twinkle supports tinker{SUPPORTED_TINKER} (the wire protocol '
            f"changes between releases): pip install 'tinker{SUPPORTED_TINKER}'"
        )
    return version


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> None:
    """Check the installed ``tinker`` SDK and set its environment defaults for a twinkle server.

    ``base_url`` and ``api_key``, when given, become ``TINKER_BASE_URL`` and ``TINKER_API_KEY``
    (replacing any set before: the call says where to go). When not given, ``TWINKLE_SERVER_URL``
    and ``TWINKLE_API_KEY`` fill ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` if those are unset.
    Arguments passed to ``ServiceClient(...)`` still win over all of these.

    Without a base URL from any of these, ``ServiceClient()`` goes to the SDK's default, the
    Tinker production API: pass ``base_url=`` to it or here.
    """
    check_tinker_version()
    url = _resolve('base_url', base_url, TINKER_BASE_URL, TWINKLE_SERVER_URL)
    key = _resolve('api_key', api_key, TINKER_API_KEY, TWINKLE_API_KEY)
    if key and not key.startswith(TINKER_KEY_PREFIXES):
        raise ConfigurationError(
            f'the API key {key[:4]!r}... would be refused by the tinker SDK, which accepts keys that start with '
            f'{list(TINKER_KEY_PREFIXES)}; twinkle-server keys start with tml- (twinkle-server keys add <tenant>)'
        )
    for name, value in ((TINKER_BASE_URL, url), (TINKER_API_KEY, key)):
        if value:
            os.environ[name] = value


def _resolve(argument: str, value: str | None, name: str, fallback: str) -> str | None:
    """What variable ``name`` should hold: the ``argument``'s ``value`` if given, else what it
    holds, else what ``fallback`` holds."""
    if value is not None:
        if not isinstance(value, str) or not value.strip():
            raise ConfigurationError(
                f'init_tinker_client: {argument} must be a non-empty string or None; got {value!r}'
            )
        return value
    return os.environ.get(name) or os.environ.get(fallback) or None


__all__ = ['SUPPORTED_TINKER', 'check_tinker_version', 'init_tinker_client', 'installed_tinker_version']
