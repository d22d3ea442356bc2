"""``RemoteHost``: the service's model in a Ray actor, so the model workers can live on any node
of a Ray cluster while the API (FastAPI, SQLite, the scheduler) stays where it is.

The service talks to its host only through the named methods of ``Host``, so ``RemoteHost``
sends each by name to a ``ModelHost`` built in the actor. The checks the routes make before
queueing (``validate``, ``check_adapter``, ...) need only the model's shape: they are answered
here, without a round trip. The actor runs a few calls at once (the compute of the worker
thread, and chores such as releasing freed memory). Checkpoints are written by the actor,
so on several machines ``data_dir`` must be a shared file system.

Config::

    ray: {address: auto, num_cpus: 1, num_gpus: 1}   # address: null starts a local Ray
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from twinkle.errors import ConfigurationError, StateError

if TYPE_CHECKING:
    from ray.exceptions import RayTaskError
from twinkle.server.config import RaySettings, ServerConfig
from twinkle.server.execution.checks.images import ImageRows
from twinkle.server.execution.host import Forwarded, ForwardingHost
from twinkle.server.execution.hosts.model_host import Described, ModelHost

#: Calls the actor runs at once: the compute of the worker thread and the chores beside it.
ACTOR_CONCURRENCY = 4


class RemoteHost(ForwardingHost):
    """A ``ModelHost`` in a Ray actor: the checks are answered here, from the model's shape; every
    other method is sent to the actor by name."""

    def __init__(self, config: ServerConfig):
        import ray

        settings = join_ray(config)
        num_gpus = settings.num_gpus
        if num_gpus is None:
            num_gpus = 1 if (config.device or '').startswith('cuda') else 0
        # Any: a Ray actor handle, whose methods are ActorMethods (``.remote``) that ray types as the plain methods.
        actor: Any = ray.remote(ModelHost).options(
            num_cpus=settings.num_cpus, num_gpus=num_gpus, max_concurrency=ACTOR_CONCURRENCY
        )
        self.config = config
        self.device = torch.device('cuda' if (config.device or '').startswith('cuda') else 'cpu')
        self._actor = actor.remote(config)
        described: Described = self._get(self._actor.describe.remote(), 'start')
        self.model_id = described['model_id']
        self.vocab_size = described['vocab_size']
        self.context = described['context']
        self.architecture = described['architecture']
        self.image_rows = ImageRows.of(self.model_id, config.limits)
        self.pid = described['pid']
        self._targets: dict[tuple[bool, bool, bool], list[str]] = {}
        self._expert_targets: list[str] | None = None

    def forward(self, name: Forwarded, *args: object) -> object:
        return self._get(getattr(self._actor, name).remote(*args), name)

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[str]:
        key = (attn, mlp, unembed)
        if key not in self._targets:
            self._targets[key] = self._get(self._actor.lora_targets.remote(attn, mlp, unembed), 'lora_targets')
        return list(self._targets[key])

    def expert_targets(self) -> list[str]:
        if self._expert_targets is None:
            self._expert_targets = self._get(self._actor.expert_targets.remote(), 'expert_targets')
        return list(self._expert_targets)

    def restart_if_dead(self) -> str | None:
        """A Ray actor that died stays dead: its calls fail with a ``StateError`` that says so."""
        return None

    def shutdown(self) -> None:
        import ray

        ray.kill(self._actor)

    def _get(self, ref: Any, what: str) -> Any:
        """The value of a call's object ref (Any: what the actor's method returned, unpickled)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(ref)
        except RayTaskError as e:  # the host raised: raise what it raised, so a user error stays one
            raise ray_error_cause(e) from None
        except RayActorError as e:
            raise StateError(f'the model worker (Ray actor) died during {what}: {e}') from None


def join_ray(config: ServerConfig) -> RaySettings:
    """The config's ``ray`` section, this process joined to its cluster (``address: null`` starts a local Ray)."""
    import ray

    settings = config.ray
    if settings is None:
        raise ConfigurationError(
            f'{config.base_model!r} runs on Ray only with the ray section of the config (ray: {{address: auto}})'
        )
    if not ray.is_initialized():
        ray.init(address=settings.address, include_dashboard=False, log_to_driver=False)
    return settings


def ray_error_cause(error: RayTaskError) -> BaseException:
    """The exception a Ray actor's method raised, with its own message only: Ray's wrapper adds
    the remote traceback (the workers' file paths) to its text."""
    cause = error.cause
    if isinstance(cause, BaseException):
        return cause
    rebuilt: BaseException = error.as_instanceof_cause()  # type: ignore[no-untyped-call]  # ray leaves it unannotated
    return rebuilt


__all__ = ['ACTOR_CONCURRENCY', 'RemoteHost', 'join_ray', 'ray_error_cause']
