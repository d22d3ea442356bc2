"""Resolve model and dataset ids to local files.

An id is one of:

- ``ms://org/name``: a ModelScope repo;
- ``hf://org/name`` (or ``hf://name``): a Hugging Face repo;
- a local file or directory path (absolute, relative, or starting with ``~``);
- a bare ``org/name`` that is not an existing local path: a ModelScope repo, as in the
  reference release.

Hub ids go through each hub's own ``snapshot_download``, which returns the cached snapshot when
it is there and downloads it otherwise. Downloads are off (local cache only) when
``TWINKLE_OFFLINE`` is set, or the hub's own variable: ``HF_HUB_OFFLINE`` /
``TRANSFORMERS_OFFLINE`` for Hugging Face, ``MODELSCOPE_OFFLINE`` for ModelScope (a twinkle
convention: modelscope 1.40 itself reads no offline variable). The cache folders are read from
the environment at each call (``HF_HUB_CACHE`` / ``HF_HOME``, ``MODELSCOPE_CACHE``), not frozen
at import time as the libraries do.

>>> parse_hub_id('hf://Qwen/Qwen3-0.6B')
HubId(hub='hf', name='Qwen/Qwen3-0.6B')
>>> str(parse_hub_id('ms://Qwen/Qwen3-0.6B'))
'ms://Qwen/Qwen3-0.6B'
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from twinkle.errors import AssetNotFoundError, ConfigurationError

HubName = Literal['ms', 'hf', 'local']
RepoType = Literal['model', 'dataset']

# The schemes an id may start with, and the hub each one names.
SCHEMES: dict[str, HubName] = {'ms': 'ms', 'hf': 'hf'}
ACCEPTED_FORMS = (
    'ms://org/name (ModelScope)',
    'hf://org/name or hf://name (Hugging Face)',
    'org/name (ModelScope, unless it is an existing local path)',
    'a local file or directory path',
)
HUB_LABELS = {'ms': 'ModelScope', 'hf': 'Hugging Face'}
# Environment variables that turn downloads off, per hub; TWINKLE_OFFLINE applies to both.
OFFLINE_ENV = {
    'hf': ('TWINKLE_OFFLINE', 'HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'),
    'ms': ('TWINKLE_OFFLINE', 'MODELSCOPE_OFFLINE'),
}
_TRUE_VALUES = {'1', 'ON', 'YES', 'TRUE'}  # as huggingface_hub reads its own flags
_SCHEME_RE = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$', re.DOTALL)
_SEGMENT_RE = re.compile(r'^[A-Za-z0-9_][A-Za-z0-9_.-]*$')


@dataclass(frozen=True)
class HubId:
    """A parsed id: which hub, and the repo id (``org/name``) or the absolute local path."""

    hub: HubName
    # 'org/name' for 'ms' and 'hf'; an absolute, user-expanded path for 'local'.
    name: str

    def __str__(self) -> str:
        return self.name if self.hub == 'local' else f'{self.hub}://{self.name}'


def parse_hub_id(raw: str) -> HubId:
    """Parse ``ms://``, ``hf://``, a local path, or a bare ``org/name`` (ModelScope).

    A bare id is looked up on disk first: an existing path wins over the hub.

    >>> parse_hub_id('hf://gpt2')
    HubId(hub='hf', name='gpt2')
    >>> parse_hub_id('xx://a/b')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    twinkle.errors.ConfigurationError: Invalid id 'xx://a/b': unknown scheme 'xx://'. ...
    """
    if not isinstance(raw, str) or not raw.strip():
        raise _invalid(raw, 'it is empty')
    match = _SCHEME_RE.match(raw)
    if match:
        scheme, repo_id = match.groups()
        if scheme not in SCHEMES:
            raise _invalid(raw, f'unknown scheme {scheme + "://"!r}')
        hub = SCHEMES[scheme]
        _check_repo_id(raw, hub, repo_id)
        return HubId(hub, repo_id)
    path = Path(raw).expanduser()
    if not path.exists() and _is_repo_id(raw, max_segments=2, min_segments=2):
        return HubId('ms', raw)
    return HubId('local', str(path.absolute()))


def resolve_model(model_id: str, *, revision: str | None = None, offline: bool | None = None) -> str:
    """Return a local directory holding the model named by ``model_id``.

    ``revision`` is a branch, tag or commit on the hub (hub ids only). ``offline`` forces the
    local-cache-only lookup on (True) or off (False); None reads the offline variables.
    """
    return _resolve(model_id, 'model', revision, offline)


def resolve_dataset(dataset_id: str, *, revision: str | None = None, offline: bool | None = None) -> str:
    """Return a local directory or file holding the dataset named by ``dataset_id``.

    Arguments as for :func:`resolve_model`; a local dataset may be a single file.
    """
    return _resolve(dataset_id, 'dataset', revision, offline)


def is_offline(hub: Literal['ms', 'hf']) -> bool:
    """Whether downloads from ``hub`` are turned off by the environment."""
    return any(os.environ.get(name, '').strip().upper() in _TRUE_VALUES for name in OFFLINE_ENV[hub])


def hub_cache_dir(hub: Literal['ms', 'hf']) -> Path:
    """The cache root each library uses, read from the environment now.

    Hugging Face: ``HF_HUB_CACHE`` > ``HUGGINGFACE_HUB_CACHE`` > ``$HF_HOME/hub`` >
    ``$XDG_CACHE_HOME/huggingface/hub`` > ``~/.cache/huggingface/hub``.
    ModelScope (1.38+): ``MODELSCOPE_CACHE`` > ``MS_CACHE_HOME`` > ``~/.cache/modelscope``.
    """
    env = os.environ
    if hub == 'hf':
        home = env.get('HF_HOME') or os.path.join(env.get('XDG_CACHE_HOME') or '~/.cache', 'huggingface')
        raw = env.get('HF_HUB_CACHE') or env.get('HUGGINGFACE_HUB_CACHE') or os.path.join(home, 'hub')
    else:
        raw = env.get('MODELSCOPE_CACHE') or env.get('MS_CACHE_HOME') or '~/.cache/modelscope'
    return Path(os.path.expandvars(raw)).expanduser().absolute()


# ---------------------------------------------------------------------------------------------
# Parsing helpers


def _invalid(raw: object, reason: str) -> ConfigurationError:
    return ConfigurationError(f'Invalid id {raw!r}: {reason}. Accepted forms are: {", ".join(ACCEPTED_FORMS)}')


def _is_repo_id(text: str, *, min_segments: int, max_segments: int) -> bool:
    segments = text.split('/')
    return min_segments <= len(segments) <= max_segments and all(
        _SEGMENT_RE.match(s) and s not in ('.', '..') for s in segments
    )


def _check_repo_id(raw: str, hub: HubName, repo_id: str) -> None:
    # ModelScope repos always have an owner; Hugging Face still serves a few bare names (gpt2).
    min_segments = 2 if hub == 'ms' else 1
    if not _is_repo_id(repo_id, min_segments=min_segments, max_segments=2):
        shape = 'org/name' if hub == 'ms' else 'org/name or name'
        raise _invalid(raw, f'a {HUB_LABELS[hub]} repo id must look like {shape}, got {repo_id!r}')


# ---------------------------------------------------------------------------------------------
# Resolution


def _resolve(raw: str, repo_type: RepoType, revision: str | None, offline: bool | None) -> str:
    hub_id = parse_hub_id(raw)
    if hub_id.hub == 'local':
        return _resolve_local(raw, hub_id, repo_type, revision)
    if offline is None:
        offline = is_offline(hub_id.hub)
    return _FETCHERS[hub_id.hub](raw, hub_id.name, repo_type, revision, offline)


def _resolve_local(raw: str, hub_id: HubId, repo_type: RepoType, revision: str | None) -> str:
    path = Path(hub_id.name)
    if revision is not None:
        raise ConfigurationError(
            f'revision={revision!r} was given for the local path {raw!r}; a revision applies to '
            'hub ids (ms://org/name, hf://org/name) only'
        )
    if not path.exists():
        raise AssetNotFoundError(
            f'Local {repo_type} path {raw!r} does not exist (looked at {path}). Pass an existing file '
            'or directory, or a hub id: ms://org/name for ModelScope, hf://org/name for Hugging Face.'
        )
    if repo_type == 'model' and not path.is_dir():
        raise ConfigurationError(
            f'Local model path {raw!r} is a file ({path}); a model is a directory holding config.json and the weights'
        )
    return str(path.resolve())


def _fetch_hf(raw: str, repo_id: str, repo_type: RepoType, revision: str | None, offline: bool) -> str:
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    cache = hub_cache_dir('hf')
    try:
        return huggingface_hub.snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, cache_dir=cache, local_files_only=offline
        )
    except HFValidationError as e:
        raise _invalid(raw, str(e)) from e
    except (LocalEntryNotFoundError, HfHubHTTPError) as e:
        looked_in = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        raise _not_found(raw, 'hf', repo_id, repo_type, revision, offline, looked_in, e) from e


def _fetch_ms(raw: str, repo_id: str, repo_type: RepoType, revision: str | None, offline: bool) -> str:
    import requests

    invalid, failures = _modelscope_errors()
    cache = hub_cache_dir('ms')
    try:
        return _ms_snapshot(repo_id, repo_type, revision, cache, offline)
    except invalid as e:
        raise _invalid(raw, str(e)) from e
    except failures as e:
        # huggingface_hub falls back to its cache when the hub cannot be reached; modelscope does
        # not, so do it here.
        if not offline and isinstance(e, (ConnectionError, requests.ConnectionError)):
            with contextlib.suppress(*failures):
                return _ms_snapshot(repo_id, repo_type, revision, cache, True)
        looked_in = getattr(e, 'cache_dir', None) or cache / f'{repo_type}s' / repo_id.replace('/', '--')
        raise _not_found(raw, 'ms', repo_id, repo_type, revision, offline, Path(looked_in), e) from e


def _ms_snapshot(repo_id: str, repo_type: RepoType, revision: str | None, cache: Path, offline: bool) -> str:
    # import_module, because the package attribute modelscope.hub.snapshot_download is the function.
    module = importlib.import_module('modelscope.hub.snapshot_download')
    folder: str = module.snapshot_download(
        repo_id=repo_id,
        repo_type=repo_type,
        revision=revision,
        cache_dir=str(cache),
        local_files_only=offline,
    )
    return folder


def _modelscope_errors() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """(bad-argument errors, lookup/download errors) of the installed modelscope."""
    import requests

    try:  # modelscope >= 1.38 delegates to the modelscope_hub package
        from modelscope_hub.errors import HubError, InvalidParameter
    except ImportError:  # older releases raise builtins
        return (), (ValueError, OSError, requests.RequestException)
    return (InvalidParameter,), (HubError, requests.RequestException)


def _not_found(
    raw: str,
    hub: Literal['ms', 'hf'],
    repo_id: str,
    repo_type: RepoType,
    revision: str | None,
    offline: bool,
    looked_in: Path,
    error: Exception,
) -> AssetNotFoundError:
    label = HUB_LABELS[hub]
    at = f' at revision {revision!r}' if revision else ''
    if offline:
        set_vars = [n for n in OFFLINE_ENV[hub] if os.environ.get(n, '').strip().upper() in _TRUE_VALUES]
        mode = f'downloads are off ({", ".join(set_vars) or "offline=True"}), so only the local cache was read'
        allow = f', or allow downloads (unset {", ".join(set_vars)})' if set_vars else ''
    else:
        mode = 'the download failed and no cached copy was found'
        allow = ''
    cli = 'hf download' if hub == 'hf' else 'modelscope download'
    cache_env = 'HF_HUB_CACHE' if hub == 'hf' else 'MODELSCOPE_CACHE'
    return AssetNotFoundError(
        f'Could not resolve {repo_type} {raw!r} ({label} repo {repo_id!r}{at}): {mode}. '
        f'Looked in {looked_in}. {label} said: {type(error).__name__}: {str(error).rstrip(".")}. '
        f'To fix: download it first (`{cli} {repo_id} --repo-type {repo_type}`), point {cache_env} '
        f'at the cache that holds it, or pass a local path instead{allow}.'
    )


_Fetcher = Callable[[str, str, RepoType, str | None, bool], str]
_FETCHERS: dict[str, _Fetcher] = {'hf': _fetch_hf, 'ms': _fetch_ms}
