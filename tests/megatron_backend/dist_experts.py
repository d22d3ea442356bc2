"""What ``test_megatron_experts.py`` checks, run under torchrun (2 ranks, gloo) in three layouts in turn:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 tests/megatron_backend/dist_experts.py OUT_DIR

one (each rank the whole tiny Qwen3-MoE, the same rows), ep2 (each rank half the experts and half the
rows, as data parallel gives them) and tp2 (megatron's sequence parallel, the experts' linears split too).
In each, three adapters with expert LoRA are drawn from one seed and rank 0 saves to OUT_DIR/<layout>.pt:
the logits of the whole batch and every adapter's whole gradients (summed over the ranks where a data- or
sequence-parallel rank holds part of them) for the mixed pass (rows alice, bob, carol, None) and for each
adapter on every row with the loss on its rows alone, every adapter's peft state dict, and the logits of
an adapter loaded back from alice's state dict.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from twinkle import assets
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.adapter import LoraSpec
from twinkle.model.megatron import lora, lora_files

LAYOUTS = {'one': {'dp_size': 2}, 'ep2': {'dp_size': 2, 'ep_size': 2}, 'tp2': {'tp_size': 2}}
ROWS: list[str | None] = ['alice', 'bob', 'carol', None]
SEQ = 6
BOTH = ('mlp.experts.gate_up_proj', 'mlp.experts.down_proj')
#: alice: attention and both expert stacks; bob: the down stacks alone; carol: layer 1's gate_up and o_proj.
SPECS = {
    'alice': LoraSpec(r=4, alpha=8, target_modules=('q_proj', 'v_proj'), target_parameters=BOTH, init='random'),
    'bob': LoraSpec(r=2, alpha=3, target_modules=(), target_parameters=('down_proj',), init='random'),
    'carol': LoraSpec(
        r=3,
        alpha=6,
        target_modules=('o_proj',),
        target_parameters=('model.layers.1.mlp.experts.gate_up_proj',),
        init='random',
    ),
}


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids [4, SEQ], position ids, and the weights of the loss sum(logits * weights)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 4096, (len(ROWS), SEQ), generator=generator)
    weights = torch.randn(len(ROWS), SEQ, 4096, generator=generator) / (4096**0.5 * SEQ)
    return ids, torch.arange(SEQ).expand(len(ROWS), SEQ), weights


def my_rows(layout: str) -> slice:
    """The rows this rank reads: half of them under expert parallel (whose ranks are data-parallel), else all."""
    if layout != 'ep2':
        return slice(None)
    half = len(ROWS) // 2
    return slice(dist.get_rank() * half, (dist.get_rank() + 1) * half)


def run(model: Any, layout: str, names: list[str | None] | str | None, weights: torch.Tensor) -> dict[str, Any]:
    """The whole batch's logits and every adapter's whole gradients of one pass (each rank its rows)."""
    ids, positions, _ = batch()
    rows = my_rows(layout)
    model.zero_grad(set_to_none=True)
    with multi_lora.row_adapters(model, names if names is None or isinstance(names, str) else names[rows]):
        logits = model(ids[rows], positions[rows], None)
        if logits.requires_grad:  # not on the base model alone
            (logits * weights[rows]).sum().backward()
    reduce_grads(model, layout)
    logits = logits.detach()
    if layout == 'ep2':
        pieces = [torch.empty_like(logits) for _ in range(2)]
        dist.all_gather(pieces, logits.contiguous())
        logits = torch.cat(pieces)
    grads = {name: lora_files.peft_state_dict(model, name, grads=True) for name in SPECS}
    return {'logits': logits.clone(), 'grads': grads}


def reduce_grads(model: Any, layout: str) -> None:
    """What the model's layout sums after a backward: under ep2 the dense LoRA gradients over the
    data-parallel ranks (the experts' are whole already: every rank's tokens reached them); under
    sequence parallel the gradients of whole weights that saw this rank's slice of the sequence."""
    for path, param in model.named_parameters():
        if '.adapters.' not in path:
            continue
        if param.grad is None:  # this rank's rows do not use the adapter; another rank's may
            param.grad = torch.zeros_like(param)
        if layout == 'ep2' and getattr(param, 'allreduce', True):
            dist.all_reduce(param.grad)
        if layout == 'tp2' and getattr(param, 'sequence_parallel', False):
            dist.all_reduce(param.grad)


def scenario(layout: str, out: Path) -> None:
    model = build(layout)
    torch.manual_seed(0)  # from the global RNG, as peft draws: the test compares with peft's own draws
    lora.add_adapter(model, 'alice', SPECS['alice'])
    generator = torch.Generator().manual_seed(1)
    for name in ('bob', 'carol'):
        lora.add_adapter(model, name, SPECS[name], generator)
    _, _, weights = batch()
    results: dict[str, Any] = {'state': {name: lora_files.peft_state_dict(model, name) for name in SPECS}}
    results['mixed'] = run(model, layout, ROWS, weights)
    results['base'] = run(model, layout, None, weights)['logits']
    for name in SPECS:
        own = torch.tensor([row == name for row in ROWS], dtype=weights.dtype)[:, None, None]
        results[f'alone-{name}'] = run(model, layout, name, weights * own)
    lora.add_adapter(model, 'loaded', SPECS['alice'], torch.Generator().manual_seed(5))
    lora_files.load_peft_state_dict(model, 'loaded', results['state']['alice'])
    results['loaded'] = run(model, layout, 'loaded', weights)['logits']
    if dist.get_rank() == 0:
        torch.save(results, out / f'{layout}.pt')


def build(layout: str) -> Any:
    """The tiny Qwen3-MoE as this rank's megatron ``GPTModel`` in ``layout``, its weights the Hugging Face ones."""
    from transformers import AutoModelForCausalLM

    from twinkle import DeviceMesh
    from twinkle.model.megatron import compat, convert, state

    sizes = LAYOUTS[layout]
    state.initialize(DeviceMesh.from_sizes(device_type='cpu', **sizes))
    sequence_parallel = sizes.get('tp_size', 1) > 1
    if sequence_parallel:
        compat.allow_sequence_parallel_norms()
    hf = AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3-moe'))
    model = convert.build_model(hf.config, sequence_parallel=sequence_parallel)
    convert.load_hf_state_dict(model, hf.state_dict())
    return model


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group('gloo')
    out.mkdir(parents=True, exist_ok=True)
    for layout in LAYOUTS:
        scenario(layout, out)
    dist.destroy_process_group()


if __name__ == '__main__':
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    main(Path(sys.argv[1]))
