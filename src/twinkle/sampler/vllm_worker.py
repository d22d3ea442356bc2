"""What ``vLLMSampler`` adds to each of vLLM's workers (``engine_args['worker_extension_cls']``).

vLLM builds its workers in processes of its own and mixes this class into each; the sampler
then calls ``twinkle_reload_weights`` by name through ``LLM.collective_rpc``, with nothing but
file names and weight names as arguments (vLLM sends those without pickling code).
This module imports no vLLM: it is imported by name inside vLLM's workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open


class WeightReloader:
    """A vLLM worker mixin: reload every weight in place from safetensors files."""

    def twinkle_reload_weights(self, plan: dict[str, list[str]]) -> None:
        """Reload the model's weights, each from the file ``plan`` lists it under. vLLM's
        ``reload_weights`` processes each layer once all its weights are in (it fuses q/k/v and
        gate/up, and a CPU worker repacks its matrices), so ``plan`` names every weight."""

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for file, names in plan.items():
                with safe_open(file, 'pt') as f:
                    for name in names:
                        yield name, f.get_tensor(name)

        worker: Any = self  # the vLLM worker this class is mixed into
        worker.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)


__all__ = ['WeightReloader']
