"""``RemoteHost``: the service's model in a Ray actor, so the model workers can live on any node
of a Ray cluster while the API (FastAPI, SQLite, the scheduler) stays where it is.

The service talks to its host only through ``ModelHost`` methods, so ``RemoteHost`` forwards
each call to a ``ModelHost`` built in the actor; operations written against the host
(``host.call(fn, ...)``, a Tinker step say) are sent by reference and run next to the model.
The actor runs a few calls at once: the server's one worker thread sends the compute, while
the cheap checks the routes make before queueing (``validate``, ``check_adapter``, ...) are
answered beside it instead of waiting for a step to end. Checkpoints are written by the actor,
so on several machines ``data_dir`` must be a shared file system.

Config::

    ray: {address: auto, num_cpus: 1, num_gpus: 1}   # address: null starts a local Ray
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twinkle.errors import ConfigurationError, StateError
from twinkle.server.config import ServerConfig
from twinkle.server.execution.model_host import ModelHost
from twinkle.server.execution.multi_rank import MultiRankHost

#: Calls the actor runs at once: the compute of the worker thread and the routes' checks.
ACTOR_CONCURRENCY = 4


class _HostActor(ModelHost):
    """``ModelHost`` with what a proxy needs to learn once: its fixed attributes."""

    def describe(self) -> dict[str, Any]:
        import os

        return {
            'model_id': self.model_id,
            'vocab_size': self.vocab_size,
            'context': self.context,
            'architecture': self.architecture,
            'pid': os.getpid(),
        }


class RemoteHost:
    """A ``ModelHost`` in a Ray actor, with the same methods."""

    def __init__(self, config: ServerConfig):
        import ray

        settings = config.ray
        if settings is None:
            raise ConfigurationError('a RemoteHost needs the ray section of the config (ray: {address: auto})')
        if not ray.is_initialized():
            ray.init(address=settings.address, include_dashboard=False, log_to_driver=False)
        num_gpus = settings.num_gpus
        if num_gpus is None:
            num_gpus = 1 if (config.device or '').startswith('cuda') else 0
        # Any: the handle's methods are Ray ActorMethods (``.remote``), which ray types as the plain methods.
        actor: Any = ray.remote(_HostActor).options(
            num_cpus=settings.num_cpus, num_gpus=num_gpus, max_concurrency=ACTOR_CONCURRENCY
        )
        self.config = config
        self._actor = actor.remote(config)
        described = self._get(self._actor.describe.remote(), 'start')
        self.model_id: str = described['model_id']
        self.vocab_size: int = described['vocab_size']
        self.context: int | None = described['context']
        self.architecture: str | None = described['architecture']
        self.pid: int = described['pid']

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith('_'):
            raise AttributeError(name)
        method = getattr(self._actor, name)
        return lambda *args, **kwargs: self._get(method.remote(*args, **kwargs), name)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._get(self._actor.call.remote(fn, *args), getattr(fn, '__name__', 'call'))

    def shutdown(self) -> None:
        import ray

        ray.kill(self._actor)

    def _get(self, ref: Any, what: str) -> Any:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(ref)
        except RayTaskError as e:  # the host raised: raise what it raised, so a user error stays one
            raise e.as_instanceof_cause() from None
        except RayActorError as e:
            raise StateError(f'the model worker (Ray actor) died during {what}: {e}') from None


#: Where a hosted model runs: this process, a Ray actor, or worker processes of this machine.
Host = ModelHost | RemoteHost | MultiRankHost


def build_host(config: ServerConfig) -> Host:
    """The model host a config asks for: in this process, in a Ray actor (``ray:`` set), on
    worker processes of this machine (``ranks`` > 1), or on Ray actors of a cluster (both)."""
    if config.ranks > 1 and config.ray is not None:
        from twinkle.server.execution.ray_ranks import RayRanks

        return MultiRankHost(config, RayRanks)
    if config.ranks > 1:
        return MultiRankHost(config)
    return RemoteHost(config) if config.ray is not None else ModelHost(config)
