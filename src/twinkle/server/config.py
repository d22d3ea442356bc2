"""Server configuration: a YAML or JSON file, or keyword arguments."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator, model_validator

from twinkle.errors import ConfigurationError


class Limits(BaseModel):
    """What one tenant, or any caller, may ask for. A server of several base models
    (``more_models``) applies the adapter, optimizer, pass and queue limits to each model."""

    model_config = ConfigDict(extra='forbid')

    #: Adapters (training runs) held on the base model at once, over all tenants. When it is
    #: full, an adapter is released to make room, fairly: the least recently used one of the
    #: tenants holding more than an equal share of the pool, else the least recently used of all
    #: (gradients waiting for a step are saved with it; it comes back on its next request). A
    #: 429 only when every adapter is in use by the requests running now, with a Retry-After of
    #: when they are expected to end.
    max_adapters: int = Field(32, gt=0)
    #: Adapters one tenant may hold on the model at once (its runs that are not released);
    #: a new run, or a released one used again, takes the place of the tenant's least recently
    #: used adapter (released with whatever it holds: it comes back on its next request).
    max_adapters_per_tenant: int = Field(8, gt=0)
    #: Largest LoRA rank an adapter may have (tinker-cookbook's distillation recipes train 128). An
    #: adapter's memory is its own rank's (weights, gradients and AdamW's two moments in float32); a
    #: vLLM sampler reserves this rank for each of its LoRA slots (``max_loras``) at start.
    max_lora_rank: int = Field(128, gt=0)
    #: Tokens (summed over rows) in one forward/backward or sampling request.
    max_tokens_per_request: int = Field(65_536, gt=0)
    #: Tokens one sampling request may ask to generate: num_samples x max_tokens, over its prompts (a
    #: chat of n=8 and max_tokens=2,000 asks 16,000); past it, 400 naming this limit. A chat that names
    #: no max_tokens gets an equal share of it per choice.
    max_sampled_tokens_per_request: int = Field(65_536, gt=0)
    #: Seconds of worker time one sampling request may take: the decode steps of the batch its rows are
    #: in (every sampling request in flight shares one, ``execution/sampling/slicing.py``), over all its slices; a reply
    #: still sampling then ends as at its max_tokens (finish reason 'length'). None: no bound.
    #: Held only on the torch sampler of the model's own worker, in the server's process; elsewhere
    #: (vLLM, a sampler group, worker processes, a Ray actor) a request is bounded by its tokens only.
    max_sampling_s: float | None = Field(600.0, gt=0)
    #: Optimizer states kept on the accelerator; the least recently stepped others wait in CPU
    #: memory (a GPU server) until their adapter steps again. None: no limit.
    max_optimizers_on_device: int | None = Field(None, gt=0)
    #: Optimizer states kept in memory at all; the least recently stepped others are spilled to
    #: disk (data_dir/optimizer-spill) until their adapter steps again. None: no limit.
    max_optimizers_in_memory: int | None = Field(None, gt=0)
    #: Tokens the waiting requests of several tenants may bring to one shared pass.
    max_tokens_per_pass: int = Field(16_384, gt=0)
    #: Compute requests one tenant may have queued; past it, 429 with Retry-After.
    max_queued_per_tenant: int = Field(64, gt=0)
    #: Requests (of any kind) one tenant may make per minute, in bursts of up to a tenth of it;
    #: past it, 429 with Retry-After. None: no rate limit.
    max_requests_per_minute: int | None = Field(None, gt=0)
    #: Bytes in the body of a request that carries tokens (native operations, Tinker forward_backward
    #: and sampling, OpenAI chat); past it, 413. A forward_backward of max_tokens_per_request tokens
    #: as JSON, RL inputs included, is under 5 MiB; the Tinker SDK sends at most 5 MB a request.
    max_body_bytes: int = Field(64 * 2**20, gt=0)
    #: Bytes in the body of any other request (runs, sessions, checkpoints); past it, 413.
    max_other_body_bytes: int = Field(2**20, gt=0)
    #: Images in one forward_backward, forward or sampling request (a vision-language model's);
    #: past it, 400 naming the count.
    max_images_per_request: int = Field(64, gt=0)
    #: Encoded bytes (PNG, JPEG...) of one image; past it, 400 naming the row and the image.
    max_image_bytes: int = Field(8 * 2**20, gt=0)
    #: Pixels (width x height) of one image, read from its header before it is decoded (a
    #: decompression bomb stops here); past it, 400 naming the row and the image. The default is
    #: the most Qwen's image processors keep (16,384 patches of 28 x 28) times four.
    max_image_pixels: int = Field(4 * 16_384 * 28 * 28, gt=0)
    #: Pixels (width x height, before resizing) of a request's images together, read from their headers:
    #: what decoding them costs in time (each is decoded twice, where the request is checked and on the
    #: worker, one image at a time); past it, 400 naming the total. The default: two images at
    #: max_image_pixels, or the 64 of max_images_per_request at 1.6 million pixels each.
    max_image_pixels_per_request: int = Field(2 * 4 * 16_384 * 28 * 28, gt=0)
    #: Pixels of one image after the model's image processor resizes it: its max_pixels is set to this
    #: where it is lower, so the model never sees more (None: the processor's own, ``size.longest_edge``
    #: of its preprocessor_config.json). An image that would still resize to more (long and thin: its
    #: short side is held at one merged patch) is a 400. Rows must hold the tokens of the server's resize.
    max_image_resized_pixels: int | None = Field(None, gt=0)
    #: Seconds a request body may stop arriving before the server answers 408 and hangs up.
    body_read_timeout_s: float = Field(30.0, gt=0)
    #: Seconds a connection may go without a request head (a new one, one between requests, or one
    #: that sent half a head) before the server closes it.
    idle_connection_timeout_s: float = Field(5.0, gt=0)


class TinkerSettings(BaseModel):
    """How the server speaks the Tinker API."""

    model_config = ConfigDict(extra='forbid')

    #: Datums per forward_backward request the client sends (it splits bigger batches in chunks).
    fwdbwd_max_chunk_len: int = Field(1024, gt=0)
    #: Seconds a request may wait for a lower seq_id of its model that never arrives.
    seq_gap_timeout_s: float = Field(120.0, gt=0)
    #: Seconds retrieve_future holds a request for an unfinished future (the client waits 45 s).
    retrieve_wait_s: float = Field(25.0, gt=0, le=40)
    #: LoRA alpha of adapters made through the Tinker API (its LoraConfig has only the rank).
    lora_alpha: float = Field(32.0, gt=0)
    #: Tokens to sample when a request gives no max_tokens.
    default_max_tokens: int = Field(64, gt=0)
    #: Seconds between two sweeps that delete checkpoints past their TTL, files included.
    checkpoint_expiry_interval_s: float = Field(5.0, gt=0)
    #: Seconds a session may go without a heartbeat before it expires: its requests that have not
    #: started are dropped (each fails with a SessionExpiredError) and its later ones are a 410. The
    #: SDK beats every 10 s and warns after 120 s without one that the session will be ended; 180
    #: leaves it a minute past that warning. The server's first 180 s count as heartbeats (clients
    #: of the last process beat again once it is back). None: sessions never expire.
    session_timeout_s: float | None = Field(180.0, gt=0)


class RaySettings(BaseModel):
    """Where the model worker runs when the service uses Ray (see ``twinkle.server.execution.hosts.remote_host``)."""

    model_config = ConfigDict(extra='forbid')

    #: A cluster's address ('auto', 'ray://host:10001', 'host:6379'); None starts a local Ray.
    address: str | None = None
    num_cpus: float = Field(1.0, ge=0)
    #: GPUs for the model worker; None: 1 when ``device`` is CUDA, else 0.
    num_gpus: float | None = Field(None, ge=0)


#: The dtypes the base weights may be held in ('auto': see ``ServerConfig.dtype``).
Dtype = Literal['auto', 'bfloat16', 'float32']
#: What trains a hosted model: ``TransformersModel`` or ``MegatronModel`` (``twinkle-train[megatron]``).
Backend = Literal['transformers', 'megatron']


def gpu_indices(device: str | None) -> list[int]:
    """The GPUs a model group's ``device`` lists, one per rank: 'cuda:2,3' -> [2, 3]; [] for
    'cuda' (each rank takes the GPU of its local rank), 'cuda:1', 'cpu' or None."""
    if not device or not device.startswith('cuda:') or ',' not in device:
        return []
    try:
        return [int(index) for index in device[len('cuda:') :].split(',')]
    except ValueError:
        raise ConfigurationError(f"device {device!r} must be 'cuda', 'cuda:<index>' or 'cuda:<i>,<j>,...'") from None


def check_layout(model: ServerConfig | ModelSettings) -> None:
    """A model group's ranks fit its backend's sizes: a multiple of ``tp_size * pp_size *
    fsdp_size``; FSDP is the transformers backend's, tensor and pipeline parallel megatron's;
    megatron samples only on a sampler group of its own. ``ConfigurationError`` (a ``ValueError``,
    which pydantic reports as the config's error) names the sizes and what would fit."""
    sizes = f'tp_size={model.tp_size}, pp_size={model.pp_size}, fsdp_size={model.fsdp_size}'
    if model.backend == 'megatron' and model.fsdp_size > 1:
        raise ConfigurationError(
            f'backend: megatron has no FSDP (fsdp_size={model.fsdp_size}): split the {model.ranks} ranks with '
            'tp_size and pp_size; the ranks left over are data parallel'
        )
    if model.backend == 'transformers' and (model.tp_size > 1 or model.pp_size > 1):
        raise ConfigurationError(
            f'tp_size={model.tp_size} and pp_size={model.pp_size} are for backend: megatron; the transformers '
            'backend splits its ranks with fsdp_size (FSDP2) and data parallel'
        )
    if model.backend == 'megatron' and model.speed != SpeedSettings():
        raise ConfigurationError(
            f'speed: {model.speed.model_dump(exclude_defaults=True)} switches the transformers backend; '
            'backend: megatron takes none of them'
        )
    per_replica = model.tp_size * model.pp_size * model.fsdp_size
    if model.ranks % per_replica:
        fits = ', '.join(str(per_replica * k) for k in range(1, 4))
        raise ConfigurationError(
            f'ranks={model.ranks} must be a multiple of tp_size * pp_size * fsdp_size = {per_replica} ({sizes}): '
            f'ranks {fits}, ... fit'
        )
    sampler = model.sampler
    if model.backend == 'megatron' and sampler is not None and not sampler.group:
        raise ConfigurationError(
            f'backend: megatron cannot sample beside the model (sampler: {{backend: {sampler.backend}, '
            'group: false}): give the sampler a group of its own (sampler: {ranks: 1}), which samples the saved '
            'weights'
        )


class SamplerSettings(BaseModel):
    """How a hosted model samples: ``backend``, and with ``group`` on devices of its own
    (``twinkle.server.execution.groups.sampler_group``) or beside the model on its worker."""

    model_config = ConfigDict(extra='forbid')

    #: 'torch': ``TorchSampler``; 'vllm': a vLLM engine (``twinkle[vllm]``), the runs' weights
    #: as its LoRA adapters (``twinkle.server.execution.sampling.vllm``).
    backend: Literal['torch', 'vllm'] = 'torch'
    #: True: a sampler group of its own (training and sampling at the same time; a run samples
    #: its weights as of its last sync for sampling). False: sampling runs on the model's worker,
    #: on the trainer's current weights (a vLLM engine then sits beside the model).
    group: bool = True
    #: Processes of a torch sampler group (each loads the base model once); of a vLLM one, its
    #: engine's tensor-parallel size.
    ranks: int = Field(1, ge=1)
    #: Its device ('cpu', 'cuda', 'cuda:2,3'); None: the model's.
    device: str | None = None
    #: vLLM's ``EngineArgs`` over the server's (LoRA on, ``max_lora_rank`` from the limits):
    #: ``{gpu_memory_utilization: 0.3, max_model_len: 8192}``, say.
    engine_args: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode='before')
    @classmethod
    def _backend_name(cls, value: Any) -> Any:
        """``sampler: vllm`` is ``{backend: vllm, group: false}`` (``torch``: the default sampling)."""
        if isinstance(value, str):
            return {'backend': value, 'group': False}
        return value

    @model_validator(mode='after')
    def _vllm_only(self) -> SamplerSettings:
        if self.engine_args and self.backend != 'vllm':
            raise ValueError("engine_args are for backend: 'vllm'")
        if not self.group and (self.ranks != 1 or self.device is not None):
            raise ValueError('ranks and device are for a sampler group of its own (group: true)')
        return self


class Quota(BaseModel):
    """What one tenant may use and hold, and its share of a model's worker (``Quotas``)."""

    model_config = ConfigDict(extra='forbid')

    #: Tokens trained, prompted and sampled per UTC day (``twinkle.server.metering``); a request
    #: that would pass it is a 429 until midnight UTC. Sampling's tokens count once it ends, so a
    #: day's last sampling request may pass it by its own tokens. None: no limit.
    tokens_per_day: int | None = Field(None, gt=0)
    #: Bytes of checkpoints kept; a save once they reach it is a 403 until some are deleted.
    stored_bytes: int | None = Field(None, gt=0)
    #: Training runs held (not deleted); a new run past it is a 403 until one is deleted.
    runs: int | None = Field(None, gt=0)
    #: The tenant's share of a model's worker while tenants wait for it: in each round of the
    #: queue a tenant of weight 2 runs two requests where one of weight 1 runs one (0.5: one
    #: every other round). A pass shared by several tenants serves each of them.
    weight: float = Field(1.0, gt=0, le=100)


class Quotas(BaseModel):
    """Quotas: ``default`` for every tenant, and a tenant's own entry over it, field by field::

    quotas:
      default: {tokens_per_day: 10000000, stored_bytes: 10000000000, runs: 20}
      tenants:
        research: {weight: 2, tokens_per_day: 50000000}
    """

    model_config = ConfigDict(extra='forbid')

    default: Quota = Field(default_factory=Quota)
    tenants: dict[str, Quota] = Field(default_factory=dict)

    def of(self, tenant: str) -> Quota:
        """The quota of the tenant named ``tenant``: its entry's fields over the default's."""
        own = self.tenants.get(tenant)
        if own is None:
            return self.default
        return self.default.model_copy(update={name: getattr(own, name) for name in own.model_fields_set})


class Pricing(BaseModel):
    """What the metered usage costs, in US dollars (``twinkle.server.metering``); a price left None
    is not priced, and a cost that needs it reads null."""

    model_config = ConfigDict(extra='forbid')

    #: Per million tokens trained (forward and forward_backward).
    training_per_million_tokens: float | None = Field(None, ge=0)
    #: Per million prompt tokens sampled from (once per prompt).
    sampling_prefill_per_million_tokens: float | None = Field(None, ge=0)
    #: Per million tokens sampled.
    sampling_sample_per_million_tokens: float | None = Field(None, ge=0)
    #: Per hour of a model worker's time.
    compute_per_hour: float | None = Field(None, ge=0)
    #: Per checkpoint saved.
    per_checkpoint: float | None = Field(None, ge=0)
    #: Per gigabyte (10^9 bytes) of checkpoints kept for a month (720 hours).
    storage_per_gigabyte_month: float | None = Field(None, ge=0)


class SpeedSettings(BaseModel):
    """A transformers model's speed switches, ``TransformersModel``'s of the same names
    (docs/training.md): each tenant's numbers stay those of the switches off (1e-5)."""

    model_config = ConfigDict(extra='forbid')

    #: The output layer and the loss in chunks of tokens: no ``[tokens, vocab]`` logits. None: on for
    #: a head of a real vocabulary (32,768 outputs or more; ``output_layer.fuses_by_default``).
    fused_output: bool | None = None
    #: ``forward_backward`` packs a request's rows into one row; None: where the attention
    #: kernel pays for it (flash attention), not under sdpa (``runner.packs_by_default``).
    padding_free: bool | None = None
    #: The decoder layers compiled (``torch.compile``, regional); the first pass of each kind compiles.
    compile_layers: bool = False


class ModelSettings(BaseModel):
    """Another base model the server hosts, on a model group of its own (``more_models``)."""

    model_config = ConfigDict(extra='forbid')

    base_model: str
    device: str | None = None
    ray: RaySettings | None = None
    ranks: int = Field(1, ge=1)
    fsdp_size: int = Field(1, ge=1)
    backend: Backend = 'transformers'
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    dtype: Dtype = 'auto'
    sampler: SamplerSettings | None = None
    speed: SpeedSettings = Field(default_factory=SpeedSettings)


#: How a ``store`` URL starts: PostgreSQL's schemes (libpq takes both).
POSTGRES_SCHEMES = ('postgresql://', 'postgres://')


class MetricsSettings(BaseModel):
    """Where Prometheus reads the server's metrics, and how they name tenants. ``/metrics`` on the API's
    port answers the admin key only (``admin_api_key``); ``port`` serves them without a key on a socket of
    their own, for a scraper on the same machine or network."""

    model_config = ConfigDict(extra='forbid')

    #: A port that serves the metrics alone, without a key (None: none; only ``/metrics`` with the admin key).
    port: int | None = Field(None, ge=0, lt=65536)
    #: The address of that port: this machine only by default.
    host: str = '127.0.0.1'
    #: How ``twinkle_usage_total`` names a tenant: 'id' (its store id, ``ten-...``), 'name' (the name its key
    #: was made for) or 'none' (no tenant label: the usage of all tenants summed by kind).
    tenant_label: Literal['id', 'name', 'none'] = 'id'


class ServerConfig(BaseModel):
    """Example ``server.yaml``::

        base_model: ms://Qwen/Qwen3.5-4B       # or hf://..., a local directory, or tiny-qwen3
        host: 0.0.0.0
        port: 8000
        data_dir: /var/lib/twinkle
        limits: {max_adapters: 16, max_lora_rank: 64}
        idle_release_s: 3600
        api_keys_file: keys.yaml               # tenant: key (or sha256:<hex>), re-read at start

    API keys live hashed in ``data_dir/twinkle.db``; add one with
    ``twinkle-server keys add <tenant> --config server.yaml``, or list them in ``api_keys_file``
    (its tenants follow the file: a tenant removed from it loses access at the next start).
    """

    model_config = ConfigDict(extra='forbid')

    base_model: str
    host: str = '127.0.0.1'
    port: int = Field(8000, ge=0, lt=65536)
    data_dir: str = 'twinkle-server-data'
    #: Where the store is: None keeps it in ``data_dir/twinkle.db`` (SQLite, one server process); a
    #: ``postgresql://user:password@host:port/name`` URL puts it in PostgreSQL, which several gateways
    #: share. The environment's ``TWINKLE_STORE`` sets it too (a URL holds a password: keep it out of files).
    store: str | None = None
    device: str | None = None
    limits: Limits = Field(default_factory=Limits)
    #: Run the forward_backward / forward requests of different tenants that wait at the same
    #: moment as one pass, each row through its own adapter (False: one adapter per pass).
    mixed_batches: bool = True
    #: With ``mixed_batches``: how long a request that can share a pass (or an optimizer update)
    #: waits for the other tenants whose requests the last two such passes held, when they are not
    #: all there yet (their next requests are usually a round trip behind). 0: never wait. 30 by
    #: default: 8 tenants on small-qwen3 shared passes 7.9 to a pass with it against 4.9 without,
    #: and reached x0.75 of one tenant's combined batch against x0.69
    #: (``benchmarks/mixed_tenants.py --mix-wait-ms 30 0``; docs/benchmarks.md).
    mix_wait_ms: float = Field(30.0, ge=0, le=1000)
    #: Milliseconds a sampling request (a chat, a text completion, a native or Tinker sample) holds the
    #: worker before it gives way: its next slice is its tenant's next turn, its cache kept meanwhile, so
    #: another tenant's training step waits for a slice, not for the whole reply (``sampling/slicing.py``; None:
    #: a request gives way only to sampling requests that join its batch). Slices run on the model's own
    #: worker, in this process, with the torch sampler, where the sampling requests in flight decode as one
    #: batch, and on a vLLM engine this process drives (its slices step the engine for every request in it);
    #: a sampler group on the torch sampler runs the waiting requests as one pass; worker processes
    #: (ranks > 1) or a Ray actor sample a request whole.
    sampling_slice_ms: float | None = Field(50.0, gt=0)
    #: When the model has had no request for this long, freed heap memory goes back to the
    #: operating system (glibc ``malloc_trim``), so a server's resident set follows what it holds
    #: (None: never; the next pass then faults its pages back in, about 20 ms on small-qwen3).
    release_memory_after_idle_s: float | None = Field(2.0, gt=0)
    #: Adapters idle this long are saved and released from the model, so a full pool frees
    #: itself; the next request brings one back unchanged (None: never).
    idle_release_s: float | None = Field(300.0, gt=0)
    #: Bytes of runs' kept states (weights, optimizer, counters, pending gradients) held in host
    #: memory, a RAM-backed folder (``memory_state_dir``), per hosted model: a state kept after a
    #: step or at a release skips the disk, and a run brought back reads it from memory. It outlives
    #: the server's process (a ``kill -9``: the next start moves it to disk), not the machine. Past
    #: it, the least recently kept go to disk (``data_dir``) on a thread of their own, as they all do
    #: at a graceful stop. 0: states go straight to disk.
    memory_state_bytes: int = Field(1 << 30, ge=0)
    #: The RAM-backed folder (tmpfs) of ``memory_state_bytes``, one the model's processes and the
    #: server share, as they share ``data_dir`` (on a Ray cluster of several machines: 0 bytes);
    #: each data directory keeps its states in a folder of its own there. None: ``/dev/shm``.
    memory_state_dir: str | None = None
    #: The server keeps each run's state (weights, optimizer, scheduler, counters, gradients
    #: waiting for a step) when the run is made, when it loads a checkpoint, and after every this
    #: many of its optimizer steps, committed with the step's answer: a step the client is told of
    #: is in the state its run comes back from after a model worker (or the server) dies, and a
    #: step it is not told of is not. 1, the default, loses no answered step; more loses up to this
    #: many minus one. Requests answered after the kept state (``forward_backward`` calls since the
    #: last step, those steps) are lost with the worker, and the run's next request fails with a
    #: ``LostWorkError`` that names them (send them again). A run comes back from whichever of its
    #: kept state and its training checkpoints stands at its latest step (one with the optimizer on
    #: a tie; from weights alone, ``save``'s default, the optimizer starts afresh), said in its
    #: ``restored_from`` and its history. None: only releases and the tenant's own saves keep a run's state.
    save_state_every_steps: int | None = Field(1, gt=0)
    api_keys_file: str | None = None
    #: The key of the dashboard's admin view (tenants, queues, passes, adapters, restarts; never a
    #: tenant's runs): the key itself or ``sha256:<hex>`` of it. None: no admin view.
    admin_api_key: str | None = Field(None, min_length=32)
    #: The proxies (addresses, or networks such as ``10.0.0.0/24``) whose ``X-Forwarded-Host``, ``-Proto``,
    #: ``-Prefix`` and ``-For`` the server believes (``twinkle.server.api.forwarded``): its gateways, a load
    #: balancer. The links it hands out then name the address the client used. A proxy on this machine by
    #: default; [] believes none.
    trusted_proxies: list[str] = Field(default_factory=lambda: ['127.0.0.1', '::1'])
    #: Where Prometheus reads the metrics, and how they name tenants (``MetricsSettings``).
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    tinker: TinkerSettings = Field(default_factory=TinkerSettings)
    #: Run the model in a Ray actor (on any node of a cluster); None: in the server's process.
    ray: RaySettings | None = None
    #: Worker processes that hold the model (``twinkle.server.execution.hosts.multi_rank``): 1 keeps it in the
    #: server's process (or its Ray actor); N > 1 starts N processes that join over
    #: torch.distributed (one GPU each on a CUDA device) and split every pass over them; with
    #: ``ray`` set, N Ray actors on the cluster's nodes (``twinkle.server.execution.hosts.ray_ranks``).
    ranks: int = Field(1, ge=1)
    #: Of those ranks, how many shard the base model with FSDP2; the rest replicate it (data
    #: parallel): the mesh ``DeviceMesh.from_sizes(fsdp_size=fsdp_size, dp_size=ranks // fsdp_size)``.
    fsdp_size: int = Field(1, ge=1)
    #: What trains the model: 'transformers' (``TransformersModel``: data parallel and FSDP2), or
    #: 'megatron' (``MegatronModel`` on megatron-core, ``pip install 'twinkle-train[megatron]'``,
    #: Python >= 3.12): its ``ranks`` split into ``tp_size`` (tensor parallel) x ``pp_size``
    #: (pipeline stages) x data parallel, the mesh ``DeviceMesh.from_sizes(tp_size=..., pp_size=...,
    #: dp_size=ranks // (tp_size * pp_size))``. Sampling then needs a sampler group of its own
    #: (``sampler: {ranks: 1}``, or ``{backend: vllm}`` with a device): the model's worker has no
    #: KV cache to sample with.
    backend: Backend = 'transformers'
    #: Tensor-parallel ranks of a megatron model (each holds a slice of every layer).
    tp_size: int = Field(1, ge=1)
    #: Pipeline stages of a megatron model (each holds a run of consecutive layers).
    pp_size: int = Field(1, ge=1)
    #: The base weights' dtype: 'auto' is bfloat16 on a GPU that has it and float32 elsewhere.
    #: Each tenant's LoRA weights and optimizer state are float32 whatever the base.
    dtype: Dtype = 'auto'
    #: How the model samples (``SamplerSettings``): ``{ranks: 1, device: cuda:1}`` on devices of
    #: its own (training and sampling then run at the same time, and a run samples its weights
    #: as of its last sync for sampling), ``vllm`` through a vLLM engine beside the model, or
    #: ``{backend: vllm, device: cuda:1}`` a vLLM sampler group. None: a torch sampler on the
    #: model's worker, on the trainer's current weights.
    sampler: SamplerSettings | None = None
    #: The model's speed switches (``SpeedSettings``; the transformers backend's):
    #: ``{compile_layers: true}`` compiles the decoder layers; ``{fused_output: false}`` keeps whole logits.
    speed: SpeedSettings = Field(default_factory=SpeedSettings)
    #: What each tenant may use and hold, and its share of the workers (``Quotas``).
    quotas: Quotas = Field(default_factory=Quotas)
    #: The prices of the metered usage (``GET /twinkle/v1/usage``, Tinker's billing routes).
    pricing: Pricing = Field(default_factory=Pricing)
    #: More base models, each on a model group of its own (its device or Ray actor, its worker
    #: thread, its adapters): a run names its base model, ``base_model`` above is the default.
    more_models: list[ModelSettings] = Field(default_factory=list)

    @model_validator(mode='after')
    def _distinct_models(self) -> ServerConfig:
        names = [self.base_model, *(m.base_model for m in self.more_models)]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f'each base model is hosted once; {repeated} appear more than once')
        models: list[ServerConfig | ModelSettings] = [self, *self.more_models]
        for model in models:
            try:
                check_layout(model)
            except ConfigurationError as error:  # which of several models, when there are several
                raise ValueError(f'{model.base_model}: {error}' if len(models) > 1 else str(error)) from None
            groups = [(model.device, model.ranks)]
            if model.sampler is not None and model.sampler.group:
                groups.append((model.sampler.device, model.sampler.ranks))
            for device, ranks in groups:
                listed = gpu_indices(device)
                if listed and len(listed) != ranks:
                    raise ValueError(f'device {device!r} lists {len(listed)} GPUs for {ranks} ranks: list one per rank')
        return self

    def model_groups(self) -> list[ServerConfig]:
        """One config per hosted base model, the default first: this config with that model's
        ``base_model``, ``device`` and ``ray`` (and no ``more_models``)."""
        first = ModelSettings(
            base_model=self.base_model, device=self.device, ray=self.ray, ranks=self.ranks, fsdp_size=self.fsdp_size,
            backend=self.backend, tp_size=self.tp_size, pp_size=self.pp_size, dtype=self.dtype, sampler=self.sampler,
            speed=self.speed,
        )  # fmt: skip
        return [
            self.model_copy(
                update={**{name: getattr(m, name) for name in ModelSettings.model_fields}, 'more_models': []}
            )
            for m in [first, *self.more_models]
        ]

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> ServerConfig:
        """Read a ``.yaml``/``.yml`` or ``.json`` file; ``overrides`` win over its values."""
        path = Path(path)
        if not path.is_file():
            raise ConfigurationError(f'server config {str(path)!r} does not exist')
        text = path.read_text()
        if path.suffix in ('.yaml', '.yml'):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == '.json':
            data = json.loads(text)
        else:
            raise ConfigurationError(f'server config {str(path)!r} must end in .yaml, .yml or .json')
        if isinstance(data, dict) and isinstance(data.get('api_keys_file'), str):
            data['api_keys_file'] = str(path.parent / data['api_keys_file'])  # relative to the config file
        return cls.build(**{**data, **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def build(cls, **values: Any) -> ServerConfig:
        """Validate ``values``; errors name the field and what it accepts."""
        try:
            return cls(**values)
        except ValidationError as e:
            problems = '; '.join(f'{".".join(map(str, err["loc"]))}: {err["msg"]}' for err in e.errors())
            raise ConfigurationError(f'invalid server config: {problems}') from None

    def mesh_sizes(self) -> dict[str, int]:
        """The ``DeviceMesh.from_sizes`` arguments of the model group: its ranks split into
        ``fsdp_size`` x ``pp_size`` x ``tp_size`` and data parallel over the rest.

        >>> ServerConfig(base_model='m', backend='megatron', ranks=4, tp_size=2).mesh_sizes()
        {'fsdp_size': 1, 'pp_size': 1, 'tp_size': 2, 'dp_size': 2}
        """
        check_layout(self)
        fixed = {'fsdp_size': self.fsdp_size, 'pp_size': self.pp_size, 'tp_size': self.tp_size}
        return {**fixed, 'dp_size': self.ranks // math.prod(fixed.values())}

    @property
    def db_path(self) -> Path:
        return Path(self.data_dir) / 'twinkle.db'

    @property
    def store_location(self) -> str | Path:
        """What ``Store`` opens: the PostgreSQL URL, else the SQLite file in ``data_dir``."""
        return self.store or self.db_path

    @field_validator('trusted_proxies')
    @classmethod
    def _proxy_networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(
                    f'{entry!r} is not an IP address or network; give addresses such as 10.0.0.5 or ::1, '
                    'or networks such as 10.0.0.0/24'
                ) from None
        return value

    @field_validator('store')
    @classmethod
    def _postgres_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(POSTGRES_SCHEMES):
            raise ValueError(
                f'store must be a postgresql://user:password@host:port/name URL (or left out for SQLite in '
                f'data_dir); got one starting {value[:16]!r}'
            )
        return value

    @property
    def spill_dir(self) -> Path:
        return Path(self.data_dir) / 'optimizer-spill'

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.data_dir) / 'checkpoints'

    @property
    def memory_dir(self) -> Path | None:
        """The folder of released states in host memory (``memory_state_bytes``); None: none."""
        if self.memory_state_bytes == 0:
            return None
        parent = Path('/dev/shm') if self.memory_state_dir is None else Path(self.memory_state_dir)
        if not parent.is_dir():
            return None
        home = str(Path(self.data_dir).resolve())
        return parent / f'twinkle-{hashlib.sha256(home.encode()).hexdigest()[:16]}'
