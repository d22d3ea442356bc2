"""The official ``tinker`` SDK against a twinkle server: its version check, its environment
defaults, and twinkle's rows as its ``Datum`` s. Client-side: nothing here imports the server, and
``tinker`` (which imports torch) is imported only inside :func:`input_feature_to_datum`.

**Pointing the SDK at a twinkle server, unpatched.** A twinkle server speaks the Tinker wire
protocol that the SDK speaks, and it hands out API keys that start with ``tml-`` as the SDK
requires, so the SDK needs no patch: ``ServiceClient(base_url=url, api_key=key)`` trains against
it as it is. What :func:`init_tinker_client` adds is a check that the installed SDK is a version
this server was tested with, and environment defaults so that ``ServiceClient()`` with no
arguments reaches the twinkle server::

    from twinkle import init_tinker_client

    init_tinker_client('http://127.0.0.1:8000', 'tml-...')  # or set TWINKLE_SERVER_URL / TWINKLE_API_KEY
    from tinker import ServiceClient

    training_client = ServiceClient().create_lora_training_client(base_model='Qwen/Qwen3.5-4B', rank=16)

The SDK reads ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` when a ``ServiceClient`` is built, not
when ``tinker`` is imported, so the call may come before or after the import.

**Rows to Datums: where the shift lives.** A twinkle row (``InputFeature``, from
``Template.encode``) holds ``input_ids`` and ``labels`` already shifted: position ``i`` is
trained to predict ``labels[i]`` (that is ``input_ids[i + 1]``), or nothing where ``labels[i]``
is ``IGNORE_INDEX`` (-100); the loss (``CrossEntropyLoss``) scores ``logits[i]`` against
``labels[i]`` with no further shift. A Tinker ``Datum`` has the same layout: position ``i`` of
``model_input`` predicts ``loss_fn_inputs['target_tokens'][i]``, scaled by ``weights[i]``. So
the tokens go across as they are, the labels become the targets (-100 replaced by token 0, which
weight 0 leaves untrained), and the weights are 1 where a label is trained and 0 elsewhere.

The ``cross_entropy`` loss of the datum, ``-(logprobs * weights).sum()``, is then the token sum
of twinkle's ``CrossEntropyLoss`` on the row: its mean times the trained-token count.

Example (hand-made: the row ``a b c d`` trains ``c`` and ``d``, predicted at positions 1 and 2)::

    >>> datum = input_feature_to_datum({'input_ids': [5, 6, 7, 8], 'labels': [-100, 7, 8, -100]})
    >>> datum.model_input.to_ints()
    [5, 6, 7, 8]
    >>> datum.loss_fn_inputs['target_tokens'].tolist(), datum.loss_fn_inputs['weights'].tolist()
    ([0, 7, 8, 0], [0.0, 1.0, 1.0, 0.0])
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError, DataError

if TYPE_CHECKING:
    import tinker

#: The ``tinker`` SDK releases whose wire protocol the server implements and was tested with.
SUPPORTED_TINKER = '>=0.38,<0.39'
#: Key prefixes the SDK accepts (an API key, or a JWT); others it refuses before sending a request.
TINKER_KEY_PREFIXES = ('tml-', 'eyJ')
#: Where the SDK reads its defaults, and where twinkle's own settings are read from.
TINKER_BASE_URL, TINKER_API_KEY = 'TINKER_BASE_URL', 'TINKER_API_KEY'
TWINKLE_SERVER_URL, TWINKLE_API_KEY = 'TWINKLE_SERVER_URL', 'TWINKLE_API_KEY'
#: The target token put where a label is ignored: any id in the vocabulary does, its weight is 0.
MASKED_TARGET = 0


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


# ---- rows to Datums -------------------------------------------------------------------------------
def input_feature_to_datum(feature: Mapping[str, object]) -> tinker.types.Datum:
    """The Tinker ``Datum`` of one encoded twinkle row (``input_ids`` and pre-shifted ``labels``,
    lists, 1-D numpy arrays or 1-D tensors); see the module docstring for the layout.

    ``tinker`` is imported here, not with this module: it imports torch, and the client (which
    imports this module for :func:`check_tinker_version`) needs no torch until it builds a datum.
    """
    from tinker import types

    missing = [name for name in ('input_ids', 'labels') if name not in feature]
    if missing:
        raise DataError(
            f'a row to convert needs input_ids and labels (encode it with a Template first); '
            f'it lacks {missing} and has {sorted(feature)}'
        )
    tokens = _int_list('input_ids', feature['input_ids'])
    labels = _int_list('labels', feature['labels'])
    if not tokens:
        raise DataError('input_ids is empty: a datum needs at least one token')
    if len(labels) != len(tokens):
        raise DataError(f'labels has {len(labels)} values for {len(tokens)} input_ids; they must be equally long')
    bad = next((label for label in labels if label < 0 and label != IGNORE_INDEX), None)
    if bad is not None:
        raise DataError(f'labels hold {bad}; a label is a token id (>= 0) or {IGNORE_INDEX} (not trained)')
    targets = [MASKED_TARGET if label == IGNORE_INDEX else label for label in labels]
    weights = [0.0 if label == IGNORE_INDEX else 1.0 for label in labels]
    n = len(tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            'target_tokens': types.TensorData(data=targets, dtype='int64', shape=[n]),
            'weights': types.TensorData(data=weights, dtype='float32', shape=[n]),
        },
    )


def _int_list(name: str, values: object) -> list[int]:
    """``values`` (a list, or an array or tensor with ``tolist``) as a flat list of ints."""
    tolist = getattr(values, 'tolist', None)
    listed = tolist() if callable(tolist) else values
    if not isinstance(listed, (list, tuple)):
        raise DataError(f'{name} must be a list of token ids; got {type(values).__name__}')
    if any(isinstance(v, (list, tuple)) for v in listed):
        raise DataError(f'{name} must be one flat sequence (one row); got nested lists: convert each row apart')
    ints = [v for v in listed if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) != len(listed):
        kinds = sorted({type(v).__name__ for v in listed if not isinstance(v, int) or isinstance(v, bool)})
        raise DataError(f'{name} must hold integer token ids; got values of type {kinds}')
    return ints


__all__ = [
    'MASKED_TARGET',
    'SUPPORTED_TINKER',
    'check_tinker_version',
    'init_tinker_client',
    'input_feature_to_datum',
    'installed_tinker_version',
]
