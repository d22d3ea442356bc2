"""What ``test_megatron_lora.py`` checks, run under torchrun (2 ranks, gloo) in three layouts in turn:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 tests/megatron_backend/dist_lora.py OUT_DIR

tp1 (each rank the whole model), tp2 and pp2. In each, the tiny Qwen3's weights go into a megatron
GPTModel, three adapters are added from one seed, and rank 0 saves to OUT_DIR/<layout>.pt: the
logits and LoRA gradients of the mixed pass (rows through alice, alice, bob, carol), the same of each
adapter alone on its rows, every adapter's peft state dict, and the logits of an adapter loaded
back from alice's state dict.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from twinkle import assets
from twinkle.errors import ConfigurationError
from twinkle.model.lora import multi as multi_lora
from twinkle.model.lora.adapter import LoraSpec
from twinkle.model.megatron import lora, lora_files

LAYOUTS = {'tp1': (1, 1), 'tp2': (2, 1), 'pp2': (1, 2)}
ROWS = ['alice', 'alice', 'bob', 'carol']
SEQ = 6
#: Each adapter's spec: different ranks, scalings and targets (bob only some attention projections, carol only layer 1).
SPECS = {
    'alice': LoraSpec(r=4, alpha=8, target_modules='all-linear', init='random'),
    'bob': LoraSpec(r=2, alpha=3, target_modules=('q_proj', 'v_proj', 'o_proj'), init='random'),
    'carol': LoraSpec(r=3, alpha=6, target_modules=r'model\.layers\.1\..*_proj', init='random'),
}


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids [4, SEQ], position ids, and the weights of the loss sum(logits * weights), a
    mean over tokens of a per-token loss of the size cross-entropy has."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 4096, (len(ROWS), SEQ), generator=generator)
    weights = torch.randn(len(ROWS), SEQ, 4096, generator=generator) / (4096**0.5 * SEQ)
    return ids, torch.arange(SEQ).expand(len(ROWS), SEQ), weights


class Pipeline:
    """Stage-to-stage hand-offs of a two-stage pipeline (ranks 0 and 1), forward and backward."""

    def __init__(self, model: Any, pp_size: int) -> None:
        self.model, self.pp_size, self.rank = model, pp_size, dist.get_rank()
        self.received: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The whole logits [b, s, V] on every rank; only the last stage's carry the graph."""
        if self.pp_size == 1:
            logits: torch.Tensor = self.model(ids, positions, None)
            return logits
        shape = (ids.shape[1], ids.shape[0], self.model.config.hidden_size)
        if self.rank == 0:
            self.sent = self.model(ids, positions, None)
            dist.send(self.sent.detach().contiguous(), 1)
            logits = torch.empty(ids.shape[0], ids.shape[1], self.model.vocab_size)
        else:
            received = torch.empty(shape)
            dist.recv(received, 0)
            self.received = received.requires_grad_()
            self.model.set_input_tensor(self.received)
            logits = self.model(ids, positions, None)
        whole = logits.detach().clone()
        dist.broadcast(whole, 1)
        return logits if self.rank == 1 else whole

    def backward(self, logits: torch.Tensor, weights: torch.Tensor) -> None:
        if self.pp_size == 1 or self.rank == 1:
            (logits * weights[: logits.shape[0]]).sum().backward()
        if self.pp_size == 1:
            return
        if self.rank == 1:
            assert self.received is not None and self.received.grad is not None
            dist.send(self.received.grad.contiguous(), 0)
        else:
            assert self.sent is not None
            grad = torch.empty_like(self.sent)
            dist.recv(grad, 1)
            if self.sent.requires_grad:  # not when no adapter of the pass has a layer on this stage
                self.sent.backward(grad)


def run(model: Any, pipeline: Pipeline, names: list[str] | str, ids: torch.Tensor, weights: torch.Tensor) -> dict:
    """Logits and every adapter's gradients (peft keys, whole) of one pass over ``ids``."""
    model.zero_grad(set_to_none=True)
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], ids.shape[1])
    with multi_lora.row_adapters(model, names):
        logits = pipeline.forward(ids, positions)
        pipeline.backward(logits, weights)
    grads = {name: lora_files.peft_state_dict(model, name, grads=True) for name in SPECS}
    return {'logits': logits.detach().clone(), 'grads': grads, 'grad_norm': grad_norm(model)}


def grad_norm(model: Any) -> float:
    """The LoRA gradients' global norm as megatron's clip_grad_norm counts it: each parameter
    once (its ``tensor_model_parallel`` marks), summed over the model-parallel group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    squares = torch.zeros(())
    for path, param in model.named_parameters():
        if '.adapters.' in path and param.grad is not None and param_is_not_tensor_parallel_duplicate(param):
            squares += param.grad.pow(2).sum()
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    return squares.sqrt().item()


def scenario(layout: str, out: Path) -> None:
    tp, pp = LAYOUTS[layout]
    model = build(tp, pp)
    torch.manual_seed(0)  # from the global RNG, as peft draws: test_lora compares with peft's own draws
    lora.add_adapter(model, 'alice', SPECS['alice'])
    generator = torch.Generator().manual_seed(1)
    for name in ('bob', 'carol'):
        lora.add_adapter(model, name, SPECS[name], generator)
    ids, _, weights = batch()
    pipeline = Pipeline(model, pp)
    results: dict[str, Any] = {'state': {name: lora_files.peft_state_dict(model, name) for name in SPECS}}
    results['mixed'] = run(model, pipeline, ROWS, ids, weights)
    for name in SPECS:
        rows = [i for i, row in enumerate(ROWS) if row == name]
        results[f'alone-{name}'] = run(model, pipeline, name, ids[rows], weights[rows])
    results['refused'] = refused(model)
    results['dropout'] = dropout_replicas(model, pipeline, ids, weights)
    lora.add_adapter(model, 'loaded', SPECS['alice'], torch.Generator().manual_seed(5))
    lora_files.load_peft_state_dict(model, 'loaded', results['state']['alice'])
    results['loaded'] = run(model, pipeline, 'loaded', ids[:2], weights[:2])['logits']
    if dist.get_rank() == 0:
        torch.save(results, out / f'{layout}.pt')


def dropout_replicas(model: Any, pipeline: Pipeline, ids: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
    """A train-mode pass through an adapter with dropout, each rank drawing from its own RNG: how
    far apart the two ranks' gradients of the parameters megatron marks as replicated are (tp2: 0,
    they are one tensor-parallel group; tp1: two separate replicas, their draws differ), and how
    far the dropped pass is from the undropped one (more than 0: dropout dropped)."""
    lora.add_adapter(model, 'dropped', LoraSpec(r=2, alpha=4, dropout=0.5, init='random'), torch.Generator())
    torch.manual_seed(100 + dist.get_rank())
    model.train()
    dropped = run(model, pipeline, 'dropped', ids, weights)
    spread = 0.0
    for path, param in model.named_parameters() if pipeline.pp_size == 1 else []:
        if '.adapters.dropped.' in path and not param.tensor_model_parallel:
            copies = [torch.empty_like(param.grad) for _ in range(dist.get_world_size())]
            dist.all_gather(copies, param.grad)
            spread = max(spread, (copies[1] - copies[0]).abs().max().item())
    model.eval()
    plain = run(model, pipeline, 'dropped', ids, weights)
    model.train()
    multi_lora.remove_adapter(model, 'dropped')
    return {'spread': spread, 'effect': (dropped['logits'] - plain['logits']).abs().max().item()}


def refused(model: Any) -> dict[str, str]:
    """The messages of adapters refused for their targets (each leaves the model as it was)."""
    before = multi_lora.adapter_names(model), sum(1 for _ in model.modules())
    messages = {}
    for case, targets in (('megatron-name', ('linear_qkv',)), ('pattern', r'model\.layers\.9\..*'), ('empty', ())):
        try:
            lora.add_adapter(model, 'bad', LoraSpec(r=2, alpha=2, target_modules=targets))
        except ConfigurationError as error:
            messages[case] = str(error)
    assert (multi_lora.adapter_names(model), sum(1 for _ in model.modules())) == before
    return messages


def build(tp: int, pp: int) -> Any:
    """The tiny Qwen3 as this rank's megatron ``GPTModel`` at tensor parallel ``tp``, pipeline ``pp``
    (data parallel over the rest), its weights the Hugging Face ones."""
    from transformers import AutoModelForCausalLM

    from twinkle import DeviceMesh
    from twinkle.model.megatron import convert, state

    state.initialize(DeviceMesh(device_type='cpu', tp_size=tp, pp_size=pp, dp_size=2 // (tp * pp)))
    hf = AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3'))
    model = convert.build_model(hf.config)
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
