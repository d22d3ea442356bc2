"""The one exception tree of twinkle.

Every class also inherits the builtin it refines, so ``except ValueError`` keeps working for
callers that do not know twinkle. Messages name the bad value and what would be accepted.
"""

from __future__ import annotations

from collections.abc import Iterable


class TwinkleError(Exception):
    """Root of every error twinkle raises on purpose."""


class ConfigurationError(TwinkleError, ValueError):
    """A component was configured with a value it cannot use."""


class UnknownNameError(TwinkleError, KeyError):
    """A name looked up in a registry (loss, template, optimizer...) does not exist."""

    def __init__(self, kind: str, name: object, valid: Iterable[str]):
        self.kind, self.name, self.valid = kind, name, sorted(valid)
        super().__init__(f'Unknown {kind} {name!r}. Valid {kind} names are: {self.valid}')

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0])


class DataError(TwinkleError, ValueError):
    """A row, a sample or a batch does not have the shape the component needs."""


class FieldError(ConfigurationError):
    """A request field holds what this server does not serve or accept. ``field`` names it as
    the request spells it (``messages[0].content[0]``); ``code`` says why in a word, if one fits
    (OpenAI's ``param`` and ``code``)."""

    def __init__(self, message: str, field: str, code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code


class SequenceTooLongError(DataError):
    """An encoded sequence is longer than ``max_length`` under ``truncation_strategy='raise'``."""


class AssetNotFoundError(TwinkleError, FileNotFoundError):
    """A model or dataset id could not be resolved to local files."""


class HubUnavailableError(TwinkleError, ConnectionError):
    """A model hub (Hugging Face, ModelScope) could not be reached, or is turned off (offline)."""


class MissingExtraError(TwinkleError, ImportError):
    """A component needs an optional dependency that is not installed; the message names the
    extra to install (``pip install 'twinkle-train[vllm]'``)."""


class StateError(TwinkleError, RuntimeError):
    """A method was called when the component is not in a state to run it."""


class LostWorkError(StateError):
    """Requests the server answered were lost with a model worker that stopped (the server
    restarted, or a worker died): the run came back at its last kept state without them. The
    message lists them; send them again, in order, then the request that raised this (it did not
    run). ``run_id`` names the run."""

    def __init__(self, message: str, run_id: str = ''):
        super().__init__(message)
        self.run_id = run_id


class SessionExpiredError(StateError):
    """A Tinker session that sent no heartbeat for the server's ``tinker.session_timeout_s``: its
    client is taken for gone, its requests that had not started were dropped, and the server takes
    no more of its requests (a 410); a new ``ServiceClient`` opens a new session."""


class WorkerError(TwinkleError, RuntimeError):
    """A remote worker of a component (a Ray actor) died or could not be started; the message
    names the component, its rank and its device group."""


class CheckpointError(TwinkleError, OSError):
    """A checkpoint is missing, incomplete, or does not match the model it is loaded into."""


class NotFoundError(TwinkleError, LookupError):
    """A run, checkpoint, request or model that does not exist (or belongs to another tenant,
    which reads the same: nothing tells the two apart)."""


class UnauthorizedError(TwinkleError, PermissionError):
    """A request without an API key, or with one the server does not know."""


class RequestTooLargeError(DataError):
    """A request body over the server's size limit for its route."""


class RequestTimeoutError(TwinkleError, TimeoutError):
    """A request body that stopped arriving before it was whole."""


class BusyError(TwinkleError, RuntimeError):
    """A limit that frees up with time (a queue, a request rate, the adapters held); the same
    request may succeed after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float = 5.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(BusyError):
    """A tenant already has ``max_queued_per_tenant`` jobs waiting."""

    def __init__(self, tenant: str, limit: int, retry_after_s: float):
        self.tenant, self.limit = tenant, limit
        super().__init__(
            f'Tenant {tenant!r} already has {limit} queued jobs, the most max_queued_per_tenant={limit} allows; '
            f'retry in about {retry_after_s:.1f} s',
            retry_after_s,
        )


class RateLimitedError(BusyError):
    """A tenant made more requests than ``max_requests_per_minute`` allows."""

    def __init__(self, tenant: str, per_minute: int, retry_after_s: float):
        super().__init__(
            f'tenant {tenant!r} is over its limit of {per_minute} requests per minute '
            f'(max_requests_per_minute); retry in {retry_after_s:.1f} s',
            retry_after_s,
        )


class QuotaError(TwinkleError, PermissionError):
    """A tenant holds what its quota allows (checkpoint bytes, runs): nothing frees with time alone;
    the message says what to delete."""


class DailyQuotaError(BusyError):
    """A tenant used its tokens of the day (``tokens_per_day``); they renew at midnight UTC."""


class CapacityError(BusyError):
    """The server holds as many adapters as it may; one frees up when a run is released."""


class UnavailableError(TwinkleError, ConnectionError):
    """The service cannot take the request now (its store is unreachable, or the gateway is stopping);
    the same request may succeed after ``retry_after_s`` seconds, here or at another gateway."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreUnavailableError(UnavailableError):
    """The store's database does not answer (PostgreSQL down or unreachable); nothing the server
    acknowledged is lost, and the request was not acknowledged."""


def one_of(kind: str, value: object, valid: Iterable[object]) -> ConfigurationError:
    """Build the standard 'bad value, here are the good ones' error."""
    return ConfigurationError(f'Invalid {kind} {value!r}. Accepted values are: {sorted(map(str, valid))}')
