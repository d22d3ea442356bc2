"""``Host``: what the service asks of a hosted model, wherever it runs.

Three hosts implement it: ``ModelHost`` (the model in the server's process), ``RemoteHost`` (a
``ModelHost`` in a Ray actor) and ``MultiRankHost`` (a ``ModelHost`` on each of several worker
processes or Ray actors). The service calls only the named methods below; the two that forward
(``ForwardingHost``) send a method's name from :data:`FORWARDED` and its arguments, and the far
side calls that method of its ``ModelHost``. No function object crosses to the model.

A sampler group of its own (``SamplerGroup``) has a smaller face, :class:`SamplingHost`: the
checks, sampling saved weights, and its life (restart, shutdown).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, cast

import torch
from tinker import types as tinker_types
from typing_extensions import TypedDict

from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import TwinkleError
from twinkle.model.checkpoint.checkpointer import Restored
from twinkle.server.config import ServerConfig
from twinkle.server.execution.checks.images import Images, RowImages
from twinkle.server.execution.checks.requests import Json, JsonObject, Outcome, RequestChecks, SavedWeights
from twinkle.server.execution.tinker.codec import ForwardBackwardCall

if TYPE_CHECKING:
    from twinkle.server.execution.sampling.chat import ChatReply, ChatRequest

#: A request of a shared pass: its adapter and its arguments.
AdapterRequest = tuple[str, JsonObject]


class Footprint(TypedDict):
    """What one rank of a host holds of the base model, and its process's resident memory."""

    rank: int
    #: Elements of the base decoder layers' weights this rank holds (FSDP2: its shard), and of all of them.
    decoder_elements_held: int
    decoder_elements: int
    #: Bytes of all base weights this rank holds, and of all of them.
    base_bytes_held: int
    base_bytes: int
    resident_mib: float


class SamplingHost(Protocol):
    """What a sampler answers: the checks of a ``sample`` request, sampling saved weights, its life."""

    config: ServerConfig
    model_id: str
    vocab_size: int
    context: int | None

    def sample_request(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None, decode: bool = True
    ) -> tuple[list[JsonObject], SamplingParams]: ...

    def check_sampling_params(self, params: SamplingParams) -> None: ...

    def check_images(self, rows: Sequence[RowImages]) -> None:
        """A request's images, before it is queued (``RequestChecks.check_images``)."""
        ...

    def sample_ids(
        self, prompt: list[int], params: SamplingParams, weights: SavedWeights | None, images: Images = ()
    ) -> SampleResponse:
        """Sample a prompt of token ids (with its image chunks, ``images``) from the base model
        (``weights`` None) or saved weights."""
        ...

    def sample_weights(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None, weights: SavedWeights | None = None
    ) -> list[JsonObject]:
        """Sample the base model (``weights`` None) or saved weights; one ``SampleResponse`` per prompt, as a dict."""
        ...

    def forget_sampler_weights(self, directory: Path) -> None:
        """Unload the adapter of ``directory``'s weights, if loaded (its checkpoint was deleted)."""
        ...

    def restart_if_dead(self) -> str | None:
        """Start the workers again if one died; then what happened (every adapter is gone), else None."""
        ...

    def shutdown(self) -> None: ...


class Host(SamplingHost, Protocol):
    """A base model with many tenants' adapters, and the operations a tenant may run on them."""

    architecture: str | None
    device: torch.device

    # ---- checks, answered where the routes run -----------------------------------------------------
    def check_adapter(self, lora: Mapping[str, Json]) -> None: ...

    def validate(self, operation: str, kwargs: JsonObject) -> None: ...

    def lora_targets(self, attn: bool, mlp: bool, unembed: bool) -> list[str]: ...

    def expert_targets(self) -> list[str]: ...

    # ---- adapters ------------------------------------------------------------------------------------
    def add_adapter(
        self, adapter: str, lora: Mapping[str, Json], gradient_accumulation_steps: int = 1, seed: int | None = None
    ) -> None: ...

    def remove_adapter(self, adapter: str) -> None: ...

    def save(self, adapter: str, directory: Path, name: str, save_optimizer: bool) -> str: ...

    def load(self, adapter: str, path: Path, load_optimizer: bool, shown_as: str | None = None) -> None: ...

    def restore_state(self, adapter: str, path: Path, shown_as: str | None = None) -> Restored:
        """Bring the adapter back to a saved state: weights and, where kept, optimizer, counters and
        accumulation window (``TransformersModel.restore_state``)."""
        ...

    # ---- operations ----------------------------------------------------------------------------------
    def run(self, adapter: str, operation: str, kwargs: JsonObject) -> Json: ...

    def run_mixed(self, operation: str, requests: list[AdapterRequest]) -> list[Outcome]: ...

    def run_steps(self, requests: list[AdapterRequest]) -> list[Outcome]: ...

    def tinker_forward_backward(self, requests: list[tuple[str, ForwardBackwardCall]]) -> list[bytes | TwinkleError]:
        """Tinker ``forward_backward`` (or ``forward``) calls of several models as one pass."""
        ...

    def tinker_optim_step(self, requests: list[tuple[str, tinker_types.AdamParams]]) -> list[Outcome]:
        """Tinker ``optim_step`` calls of several models as one optimizer update."""
        ...

    def sample_chat(self, request: ChatRequest) -> ChatReply:
        """An OpenAI-style completion: encode (chat messages) or take (token ids) the prompt, sample, split."""
        ...

    def take_step_logs(self) -> dict[str, list[dict[str, float]]]:
        """Each adapter's optimizer steps since the last call (the runs' step history)."""
        ...

    # ---- the process -----------------------------------------------------------------------------------
    def release_free_memory(self) -> bool: ...

    def footprint(self) -> list[Footprint]:
        """Per rank: the base weights it holds and its resident memory."""
        ...

    def ping(self) -> None:
        """Nothing, on every rank: what a call costs to reach the model."""
        ...


#: The methods a ``ForwardingHost`` sends to the ``ModelHost`` on the far side, by name.
Forwarded = Literal[
    'add_adapter', 'remove_adapter', 'save', 'load', 'restore_state', 'run', 'run_mixed',
    'run_steps', 'tinker_forward_backward', 'tinker_optim_step', 'sample_chat', 'sample_ids', 'sample_weights',
    'sample_many', 'forget_sampler_weights', 'take_step_logs', 'release_free_memory', 'footprint', 'ping',
]  # fmt: skip
FORWARDED: frozenset[str] = frozenset(Forwarded.__args__)  # type: ignore[attr-defined]  # Literal's members


class ForwardingHost(RequestChecks):
    """A ``Host`` whose model is elsewhere (a Ray actor, worker processes): the checks are answered
    here, from the model's shape; every other method is sent by name (:meth:`forward`)."""

    model_id: str
    architecture: str | None

    def forward(self, name: Forwarded, *args: object) -> object:
        """``name(*args)`` on the far side's ``ModelHost``; its result, or its error raised here."""
        raise NotImplementedError

    def add_adapter(
        self, adapter: str, lora: Mapping[str, Json], gradient_accumulation_steps: int = 1, seed: int | None = None
    ) -> None:
        self.forward('add_adapter', adapter, dict(lora), gradient_accumulation_steps, seed)

    def remove_adapter(self, adapter: str) -> None:
        self.forward('remove_adapter', adapter)

    def save(self, adapter: str, directory: Path, name: str, save_optimizer: bool) -> str:
        return str(self.forward('save', adapter, directory, name, save_optimizer))

    def load(self, adapter: str, path: Path, load_optimizer: bool, shown_as: str | None = None) -> None:
        self.forward('load', adapter, path, load_optimizer, shown_as)

    def restore_state(self, adapter: str, path: Path, shown_as: str | None = None) -> Restored:
        return cast(Restored, self.forward('restore_state', adapter, path, shown_as))

    def run(self, adapter: str, operation: str, kwargs: JsonObject) -> Json:
        return self.forward('run', adapter, operation, kwargs)

    def run_mixed(self, operation: str, requests: list[AdapterRequest]) -> list[Outcome]:
        return cast('list[Outcome]', self.forward('run_mixed', operation, requests))

    def run_steps(self, requests: list[AdapterRequest]) -> list[Outcome]:
        return cast('list[Outcome]', self.forward('run_steps', requests))

    def tinker_forward_backward(self, requests: list[tuple[str, ForwardBackwardCall]]) -> list[bytes | TwinkleError]:
        return cast('list[bytes | TwinkleError]', self.forward('tinker_forward_backward', requests))

    def tinker_optim_step(self, requests: list[tuple[str, tinker_types.AdamParams]]) -> list[Outcome]:
        return cast('list[Outcome]', self.forward('tinker_optim_step', requests))

    def sample_chat(self, request: ChatRequest) -> ChatReply:
        return cast('ChatReply', self.forward('sample_chat', request))

    def sample_weights(
        self, inputs: list[JsonObject], sampling_params: JsonObject | None, weights: SavedWeights | None = None
    ) -> list[JsonObject]:
        return cast('list[JsonObject]', self.forward('sample_weights', inputs, sampling_params, weights))

    def sample_many(self, calls: list[tuple[str, tuple[object, ...]]]) -> list[object]:
        """``ModelHost.sample_many``: a pass of sampling calls, decoded as one batch where the model is."""
        return cast('list[object]', self.forward('sample_many', calls))

    def sample_ids(
        self, prompt: list[int], params: SamplingParams, weights: SavedWeights | None, images: Images = ()
    ) -> SampleResponse:
        return cast('SampleResponse', self.forward('sample_ids', prompt, params, weights, images))

    def forget_sampler_weights(self, directory: Path) -> None:
        self.forward('forget_sampler_weights', directory)

    def take_step_logs(self) -> dict[str, list[dict[str, float]]]:
        return cast('dict[str, list[dict[str, float]]]', self.forward('take_step_logs'))

    def release_free_memory(self) -> bool:
        return bool(self.forward('release_free_memory'))

    def footprint(self) -> list[Footprint]:
        return cast('list[Footprint]', self.forward('footprint'))

    def ping(self) -> None:
        self.forward('ping')


__all__ = [
    'FORWARDED', 'AdapterRequest', 'Footprint', 'Forwarded', 'ForwardingHost', 'Host', 'Json', 'JsonObject', 'Outcome',
    'SamplingHost',
]  # fmt: skip
