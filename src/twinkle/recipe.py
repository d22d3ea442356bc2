"""What a recipe that runs in several modes takes from the mode: the one place that knows it.

A recipe names its mode in a ``ModeSettings`` and gets back what its loop trains and samples
with; the loop is then the same plain loop in every mode:

- ``'local'``: this process. Under ``torchrun`` each process is one rank of the model's mesh
  (``mesh(WORLD_SIZE, device_type)``) and has a sampler of its own;
- ``'ray'``: the model on a device group ``'model'`` of ``model_ranks`` workers, the sampler on a
  group ``'sampler'`` of ``sampler_ranks`` (their actors are the components' ranks). Without
  ``RAY_ADDRESS`` and on CPUs a private local Ray starts with one logical CPU per rank, however
  many cores the machine has; Ray is shut down when the recipe's ``with`` block ends;
- ``'server'``: the native client (``twinkle_client``) against the server at ``url`` with
  ``api_key``; without a ``url``, a server on the recipe's model starts in this process (one
  tenant, a sampler group of its own with ``sampler_group``) and stops with the block.

``start_parts`` gives the model, the sampler and the weight sync (``RecipeParts``);
``start_runtime`` only starts the runtime and gives the model's mesh, for a recipe that builds
its own model (an SFT recipe, a Megatron one) and needs no sampler. ``add_config_arguments``
turns a recipe's config dataclass into its command line.

>>> settings = ModeSettings(mode='local', seed=0)
>>> with start_runtime(settings) as mesh:  # one process: no mesh
...     print(mesh)
None
>>> data_parallel(2, 'cpu').sizes['dp'], data_parallel(1, 'cpu')
(2, None)
>>> ModeSettings(mode='torchrun')
Traceback (most recent call last):
...
twinkle.errors.ConfigurationError: Invalid mode 'torchrun'. Accepted values are: ['local', 'ray', 'server']

A GRPO recipe in every mode (``cookbook/grpo_async.py`` and ``cookbook/agent_guess_number.py``
are such loops)::

    with start_parts(ModeSettings(mode='ray'), model_dir) as parts:
        parts.model.add_adapter_to_model('default', lora)
        for step in range(steps):
            parts.sync_weights()                       # the sampler now samples the trainer's weights
            responses = parts.sampler.sample(prompts, params)
            parts.model.forward_backward(inputs=..., advantages=...)
            parts.model.clip_grad_and_step()
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias, cast

from twinkle.errors import ConfigurationError, one_of
from twinkle.infra.mesh import DeviceGroup, DeviceMesh

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from twinkle.infra.ray.handle import RemoteHandle
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.sampler import TorchSampler as ClientSampler

    #: The model in each mode: in this process, its Ray actors' handle, or the client's run on a server.
    Model: TypeAlias = TransformersModel | RemoteHandle | MultiLoraTransformersModel
    Sampler: TypeAlias = TorchSampler | RemoteHandle | ClientSampler

RecipeMode = Literal['local', 'ray', 'server']
RECIPE_MODES: tuple[RecipeMode, ...] = ('local', 'ray', 'server')
#: The model's mesh over ``ranks`` ranks of ``device_type`` (None: no mesh, one process's layout).
MeshOf: TypeAlias = Callable[[int, str], 'DeviceMesh | None']
#: A staged copy of the trainer's weights: its version, and the call that loads it into the sampler
#: later (None: nothing to load), as ``AsyncRollouts.publish(version, apply)`` takes them.
Staged: TypeAlias = tuple[int, 'Callable[[], object] | None']


@dataclass
class ModeSettings:
    """Where a recipe's model and sampler run."""

    # 'local' (one process, or one rank of torchrun), 'ray' or 'server'.
    mode: RecipeMode = 'local'
    # Seeds Python, NumPy and torch when the runtime starts (twinkle.initialize); 'server' leaves them.
    seed: int = 0
    # 'ray': workers of the 'model' group and of the 'sampler' group (0: no sampler group).
    model_ranks: int = 1
    sampler_ranks: int = 1
    # The components' device ('cpu', 'cuda'); None: CUDA where there is one, else the CPU.
    device: str | None = None
    # > 0: torch threads in this process and, in 'ray' mode, in each actor (0: torch's default).
    threads: int = 0
    # 'server': a running server to train on, with this tenant's key; '' starts one here.
    url: str = ''
    api_key: str = ''
    # 'server': the server samples in a sampler group of its own, which sees the run's weights only
    # once they are synced; without one it samples the trainer's current weights (a sync is a no-op).
    sampler_group: bool = False

    def __post_init__(self) -> None:
        if self.mode not in RECIPE_MODES:
            raise one_of('mode', self.mode, RECIPE_MODES)
        if self.model_ranks < 1 or self.sampler_ranks < 0:
            raise ConfigurationError(
                f'model_ranks must be at least 1 and sampler_ranks at least 0; '
                f'got {self.model_ranks} and {self.sampler_ranks}'
            )

    @classmethod
    def of(cls, config: object, **overrides: object) -> ModeSettings:
        """The settings that ``config`` (a recipe's config) names in fields of the same names, then ``overrides``.

        >>> @dataclass
        ... class Config:
        ...     mode: str = 'ray'
        ...     steps: int = 3
        >>> settings = ModeSettings.of(Config(), seed=1)
        >>> settings.mode, settings.seed, settings.threads
        ('ray', 1, 0)
        """
        names = [field.name for field in dataclasses.fields(cls)]
        values = {name: getattr(config, name) for name in names if hasattr(config, name)}
        return cls(**{**values, **overrides})

    @property
    def device_type(self) -> str:
        """The device type of the Ray groups and of the mesh."""
        if self.device is not None:
            return self.device.split(':')[0]
        import torch

        return 'cuda' if torch.cuda.is_available() else 'cpu'


@dataclass(frozen=True)
class Synced:
    """One weight sync: the version of the weights the sampler samples after it, and its seconds."""

    version: int
    seconds: float


@dataclass
class RecipeParts:
    """What a recipe's loop trains and samples with, the same calls in every mode."""

    mode: RecipeMode
    model: Model
    sampler: Sampler
    # Load the trainer's current weights into the sampler now.
    sync_weights: Callable[[], Synced]
    # A copy of the trainer's weights as of now, to load later (between two generations of an async loop).
    stage_weights: Callable[[], Staged]


def data_parallel(ranks: int, device_type: str) -> DeviceMesh | None:
    """The default mesh: plain data parallel over the ranks, none for one rank."""
    return DeviceMesh.from_sizes(dp_size=ranks, device_type=device_type) if ranks > 1 else None


@contextmanager
def start_runtime(settings: ModeSettings, mesh: MeshOf = data_parallel) -> Iterator[DeviceMesh | None]:
    """Start twinkle's runtime for ``settings.mode`` ('local' or 'ray') and give the model's mesh:
    ``mesh(ranks, device_type)`` over torchrun's processes or the 'model' group's workers, None in
    one process. Build the model with ``device_mesh=`` it and ``remote_group='model'`` (the sampler
    with ``remote_group='sampler'``); both are ignored where they do not apply."""
    from twinkle.launch import initialize

    if settings.mode == 'server':
        raise ConfigurationError("start_runtime starts 'local' or 'ray'; a server's model comes from start_parts")
    _set_threads(None, settings.threads)
    device = settings.device_type
    if settings.mode == 'local':
        from twinkle.infra import distributed

        world = distributed.world_size()
        layout = mesh(world, device) if world > 1 else None
        initialize(mode='local', global_device_mesh=layout, seed=settings.seed)
        yield layout
        return
    if device == 'cpu' and not os.environ.get('RAY_ADDRESS'):
        from twinkle.infra.ray.cluster import start_local

        start_local(settings.model_ranks + settings.sampler_ranks)  # its workers at this process's priority
    groups = [DeviceGroup('model', settings.model_ranks, device)]
    if settings.sampler_ranks:
        groups.append(DeviceGroup('sampler', settings.sampler_ranks, device))
    try:
        initialize(mode='ray', groups=groups, seed=settings.seed)
        yield mesh(settings.model_ranks, device)
    finally:
        _stop_ray()


@contextmanager
def start_parts(settings: ModeSettings, model_dir: str) -> Iterator[RecipeParts]:
    """The model and the sampler of ``model_dir`` (a local folder; a server started here serves
    it) in ``settings.mode``, and their weight sync. The model has no adapter, optimizer or loss
    yet: the recipe sets them, with the same calls in every mode."""
    _set_threads(None, settings.threads)  # before anything loads (a server started here computes in this process)
    if settings.mode == 'server':
        with _server_parts(settings, model_dir) as parts:
            yield parts
        return
    if settings.mode == 'ray' and not settings.sampler_ranks:
        raise ConfigurationError("start_parts on Ray needs a 'sampler' group: sampler_ranks must be at least 1")
    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    with start_runtime(settings) as mesh:
        model = TransformersModel(model_dir, device_mesh=mesh, device=settings.device, remote_group='model')
        sampler = TorchSampler(model_dir, device=settings.device, remote_group='sampler')
        if settings.mode == 'ray' and settings.threads:
            for component in (model, sampler):
                cast('RemoteHandle', component).remote_execute(_set_threads, settings.threads, dispatch='all')
        manager = CheckpointEngineManager(model, sampler)

        # merge_and_sync=False: the sampler keeps the adapter as an adapter; each sync moves its tensors only.
        def sync_weights() -> Synced:
            result = manager.sync_weights(merge_and_sync=False)
            return Synced(result.weight_version, result.seconds)

        def stage_weights() -> Staged:
            staged = manager.stage_weights(merge_and_sync=False)
            return staged.version, lambda: manager.apply_staged(staged)

        yield RecipeParts(settings.mode, model, sampler, sync_weights, stage_weights)


@contextmanager
def _server_parts(settings: ModeSettings, model_dir: str) -> Iterator[RecipeParts]:
    """The client's model and sampler of one run on the server at ``settings.url``; without one,
    on a server of ``model_dir`` started here for the block."""
    if not settings.url:
        with _local_server(settings, model_dir) as served, _server_parts(served, model_dir) as parts:
            yield parts
        return
    from twinkle_client import TwinkleClient
    from twinkle_client.checkpoint_engine import CheckpointEngineManager
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle_client.sampler import TorchSampler as ClientSampler

    client = TwinkleClient(settings.url, settings.api_key)
    model = MultiLoraTransformersModel(client=client)
    sampler = ClientSampler(model=model)
    manager = CheckpointEngineManager(model, sampler)
    # A loop syncs (or stages) before its first step and after each step that changed the weights, so
    # counting the calls counts the run's optimizer steps: what the server stamps on each sequence.
    versions = iter(range(1 << 62))

    def sync_weights() -> Synced:
        if not settings.sampler_group:  # the server samples the trainer's current weights
            return Synced(next(versions), 0.0)
        result = manager.sync_weights()
        return Synced(result.weight_version, result.seconds)

    def stage_weights() -> Staged:
        # The server keeps the weights; the sampler group's copy is saved when the rollout applies it.
        return next(versions), manager.sync_weights if settings.sampler_group else None

    try:
        yield RecipeParts('server', model, sampler, sync_weights, stage_weights)
    finally:
        client.close()


@contextmanager
def _local_server(settings: ModeSettings, model_dir: str) -> Iterator[ModeSettings]:
    """A server of ``model_dir`` on a thread of this process, its store in a temporary folder, one
    tenant: ``settings`` with its URL and the tenant's key."""
    from twinkle.server.cli import BackgroundServer
    from twinkle.server.config import ServerConfig
    from twinkle.server.store import Store

    sampler = {'sampler': {'ranks': 1, 'device': settings.device_type}} if settings.sampler_group else {}
    with tempfile.TemporaryDirectory() as data_dir:
        server_config = ServerConfig.build(base_model=model_dir, port=0, data_dir=data_dir, **sampler)
        with Store(server_config.db_path) as store:
            key = store.tenants.add('recipe')[1]
        with BackgroundServer(server_config) as url:
            yield dataclasses.replace(settings, url=url, api_key=key)


def _set_threads(component: object, threads: int) -> None:
    """torch's threads in this process (``component``: the actor's, when run by ``remote_execute``)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def _stop_ray() -> None:
    """Give back the groups' devices and leave Ray (a local Ray started here ends with it)."""
    import ray

    from twinkle.infra.runtime import release_runtime

    try:
        release_runtime()
    finally:
        ray.shutdown()


def add_config_arguments(
    parser: argparse.ArgumentParser,
    defaults: DataclassInstance,
    *,
    choices: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """A ``--flag`` per field of the dataclass ``defaults``, parsed with the type of its value,
    which is the default; a boolean field also gets ``--no-flag``; ``choices`` limits a field to
    the values it names. ``Config(**vars(parser.parse_args()))`` is then the run's config.

    >>> @dataclass
    ... class Config:
    ...     steps: int = 3
    ...     sync: bool = False
    ...     mode: str = 'local'
    >>> parser = argparse.ArgumentParser()
    >>> add_config_arguments(parser, Config(), choices={'mode': RECIPE_MODES})
    >>> Config(**vars(parser.parse_args(['--steps', '5', '--sync', '--mode', 'ray'])))
    Config(steps=5, sync=True, mode='ray')
    """
    for field in dataclasses.fields(defaults):
        default = getattr(defaults, field.name)
        flag = f'--{field.name.replace("_", "-")}'
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            limit = (choices or {}).get(field.name)
            parser.add_argument(flag, type=type(default), default=default, choices=limit)


__all__ = [
    'RECIPE_MODES',
    'MeshOf',
    'ModeSettings',
    'RecipeMode',
    'RecipeParts',
    'Staged',
    'Synced',
    'add_config_arguments',
    'data_parallel',
    'start_parts',
    'start_runtime',
]
