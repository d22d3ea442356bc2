"""Moving the trainer's current weights into a sampler."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from peft import PeftModel, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer

from twinkle.errors import ConfigurationError
from twinkle.model.group import FULL
from twinkle.model.transformers import TransformersModel
from twinkle.sampler.torch_sampler import TorchSampler
from twinkle.utils.logger import get_logger
from twinkle.utils.weights import canonical_name

logger = get_logger()


@dataclass
class SyncResult:
    """What one ``sync_weights`` moved."""

    weight_version: int
    tensors: int
    bytes: int
    seconds: float
    mode: str  # 'merged', 'adapter' or 'full'


class CheckpointEngineManager:
    """Keeps a sampler's weights equal to a trainer's.

    ``sync_weights(merge_and_sync=True)`` merges the LoRA adapter into the weights it wraps
    (``W + scale * B @ A``, computed aside: the trainer's model stays unmerged) and copies the
    merged matrices into the sampler's base model, which then samples without an adapter. With
    ``merge_and_sync=False`` the sampler keeps the adapter as an adapter: the first sync creates
    it there with the trainer's LoRA config, later syncs move only the adapter tensors (for a
    rank-``r`` LoRA a small fraction of the model). The first sync of either kind also copies
    every base weight, so a sampler built from other weights ends up equal to the trainer.
    A model without adapters always moves all its weights.

    After each sync the sampler's ``weight_version`` is the number of syncs so far; every
    sequence it samples records it.
    """

    def __init__(self, model: TransformersModel, sampler: TorchSampler):
        if not isinstance(model, TransformersModel):
            raise ConfigurationError(f'model must be a TransformersModel; got {type(model).__name__}')
        if not isinstance(sampler, TorchSampler):
            raise ConfigurationError(f'sampler must be a TorchSampler; got {type(sampler).__name__}')
        self.model = model
        self.sampler = sampler
        self.version = sampler.weight_version
        self._last_mode: str | None = None

    def sync_weights(self, merge_and_sync: bool = True, *, adapter_name: str | None = None) -> SyncResult:
        started = time.perf_counter()
        group = self.model._group(adapter_name)
        mode = 'full' if group.name == FULL else 'merged' if merge_and_sync else 'adapter'
        # Base weights move on the first sync, and when the mode changes (a merged sync leaves
        # merged matrices in the sampler's base model that an adapter sync must not build on).
        moved = self._send_base(everything=mode == 'full' or mode != self._last_mode)
        if mode == 'merged':
            moved += self._send_merged(group.name)
            self.sampler.default_adapter = None
        elif mode == 'adapter':
            moved += self._send_adapter(group.name, group.config)
            self.sampler.default_adapter = group.name
        self._last_mode = mode
        self.version += 1
        self.sampler.weight_version = self.version
        self.sampler.reset_prefix_cache()
        return SyncResult(
            weight_version=self.version,
            tensors=len(moved),
            bytes=sum(t.numel() * t.element_size() for t in moved),
            seconds=time.perf_counter() - started,
            mode=mode,
        )

    def _send_base(self, everything: bool) -> list[torch.Tensor]:
        """Every base (non-adapter) weight, when ``everything``; else nothing, since frozen base
        weights have not changed since the last sync."""
        if not everything:
            return []
        weights = {
            canonical_name(name): p.detach()
            for name, p in self.model.model.named_parameters()
            if '.lora_' not in name and 'modules_to_save' not in name
        }
        self.sampler.load_weights(weights)
        return list(weights.values())

    def _send_merged(self, adapter_name: str) -> list[torch.Tensor]:
        weights = {}
        with torch.no_grad():
            for name, module in self.model.model.named_modules():
                if isinstance(module, LoraLayer) and adapter_name in module.lora_A:
                    base = module.get_base_layer().weight
                    delta = module.get_delta_weight(adapter_name)
                    weights[canonical_name(f'{name}.weight')] = base + delta.to(base.dtype)
        self.sampler.load_weights(weights)
        return list(weights.values())

    def _send_adapter(self, adapter_name: str, config: object) -> list[torch.Tensor]:
        model = self.model.model
        if not isinstance(model, PeftModel):
            raise ConfigurationError('merge_and_sync=False needs an adapter on the model')
        adapter = get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
        state = {k: v.detach() for k, v in adapter.items()}
        self.sampler.load_adapter_weights(adapter_name, state, config=config)
        return list(state.values())
