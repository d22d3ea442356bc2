"""Hugging Face -> megatron -> Hugging Face, and megatron's logits against Hugging Face's, on every layout.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=4 \
        tests/megatron_backend/convert_worker.py OUT_DIR

test_megatron_convert.py runs it once under torchrun (4 ranks, gloo) and calls ``check`` in its own process for one
rank. Each rank builds its shard of each embedded model for each layout of ``LAYOUTS`` (megatron's groups are
re-initialised between layouts), loads the whole Hugging Face tensors, exports them back, runs the same batch
through both models (forward, and backward of a next-token loss) and writes what it found to ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from twinkle import DeviceMesh, assets
from twinkle.assets.models import MOE_MODELS
from twinkle.model.megatron import convert, state

# Layout name -> mesh sizes over 4 ranks (dp takes the rest). ep folds into the data-parallel ranks.
LAYOUTS: dict[str, dict[str, int]] = {
    'tp2': {'tp_size': 2, 'dp_size': 2},
    'pp2': {'pp_size': 2, 'dp_size': 2},
    'tp2pp2': {'tp_size': 2, 'pp_size': 2},
    'ep2': {'dp_size': 4, 'ep_size': 2},
    'tp2ep2': {'tp_size': 2, 'dp_size': 2, 'ep_size': 2},
}
# Which models run on which layouts: the MoE model on every layout, the dense one where ep_size is 1.
MODELS = ('tiny-qwen3', 'tiny-qwen3-moe')
BATCH, SEQ = 2, 16


def hf_model(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets.tiny_model(name)).eval()


def batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def megatron_loss(model: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Forward and backward of next-token cross-entropy through the pipeline; the logits on the last stage.

    Each stage sends its hidden states on (under sequence parallel, this rank's slice of the sequence) and the
    gradient of its input back. Then, as megatron's ``finalize_model_grads`` does (``distributed/
    finalize_model_grads.py:452``), the gradients of the query and key norms (each rank's saw only its own
    heads) and, under sequence parallel, of every norm (each saw its slice of the sequence) are summed over
    tensor parallel."""
    from megatron.core import parallel_state as ps

    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    hidden = None
    if not ps.is_pipeline_first_stage():
        length = input_ids.shape[1] // (
            ps.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1
        )
        hidden = torch.empty(length, input_ids.shape[0], model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        hidden.requires_grad_(True)
        model.set_input_tensor(hidden)
    output = model(input_ids, position_ids, None)
    if ps.is_pipeline_last_stage():
        next_token_loss(output, input_ids).backward()
    else:
        dist.send(output.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        grad = torch.empty_like(output)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        output.backward(grad)
    if hidden is not None:
        dist.send(hidden.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    for name, param in model.named_parameters():
        summed = 'q_layernorm' in name or 'k_layernorm' in name or getattr(param, 'sequence_parallel', False)
        if summed and param.grad is not None:
            dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
    return output.detach() if ps.is_pipeline_last_stage() else None


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())


def hf_gradients(model: Any) -> dict[str, torch.Tensor]:
    """The megatron model's gradients under Hugging Face names: exported as if they were the weights."""
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.zeros_like(param) if param.grad is None else param.grad)
        gradients = convert.export_hf_state_dict(model)
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    return gradients


def max_relative_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference of any tensor, relative to that tensor's largest entry."""
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)).item() for k in want)


def check(name: str, mesh: DeviceMesh | None) -> dict[str, Any]:
    """Round trip, logits and gradients of model ``name`` under ``mesh`` (None: one process), as JSON."""
    layout = state.initialize(mesh, seed=0)
    reference = hf_model(name)
    expected = {key: tensor.clone() for key, tensor in reference.state_dict().items()}
    # megatron trains an MoE layer under tensor parallel only with sequence parallel (transformer/moe/
    # moe_layer.py:629): without it every tensor-parallel rank would dispatch the same tokens.
    sequence_parallel = layout.tp_size > 1 and name in MOE_MODELS
    model = convert.build_model(reference.config, sequence_parallel=sequence_parallel)
    convert.load_hf_state_dict(model, expected)
    exported = convert.export_hf_state_dict(model)
    input_ids = batch(reference.config.vocab_size)
    want = reference(input_ids).logits
    next_token_loss(want, input_ids).backward()
    # Every rank runs the same batch. An expert sees the tokens of all ep_size ranks of its expert-parallel
    # group, so its gradient is ep_size times one batch's (in training each rank's batch differs, and the
    # dense weights' gradients are summed over data parallel to the same total).
    want_grads = {
        key: param.grad * (layout.ep_size if '.experts.' in key else 1) for key, param in reference.named_parameters()
    }
    got = megatron_loss(model, input_ids)
    return {
        'layout': layout.__dict__,
        'local_parameters': sum(p.numel() for p in model.parameters()),
        'missing': sorted(expected.keys() - exported.keys()),
        'unknown': sorted(exported.keys() - expected.keys()),
        'different': sorted(k for k in expected.keys() & exported.keys() if not torch.equal(expected[k], exported[k])),
        'logits_max_diff': None if got is None else (got - want.detach()).abs().max().item(),
        'logits_shape': None if got is None else list(got.shape),
        'sequence_parallel': sequence_parallel,
        'grads_max_relative_diff': max_relative_diff(hf_gradients(model), want_grads),
    }


def main(out_dir: Path) -> None:
    results: dict[str, Any] = {}
    for layout, sizes in LAYOUTS.items():
        mesh = DeviceMesh.from_sizes(device_type='cpu', **sizes)
        for name in MODELS:
            if sizes.get('ep_size', 1) > 1 and name == 'tiny-qwen3':
                continue
            results[f'{layout}/{name}'] = check(name, mesh)
    (out_dir / f'rank{dist.get_rank()}.json').write_text(json.dumps(results, indent=1))


if __name__ == '__main__':
    main(Path(sys.argv[1]))
