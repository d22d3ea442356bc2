"""``MegatronModel`` at TP=2, PP=2, TP2xPP2 and DP=2 against one process, and against ``TransformersModel``.

``dist_model.py`` takes one SGD step (``lr=1``, no clipping) from the same adapter, and from the
same full weights, at each layout in real ``torch.distributed.run`` processes (gloo); each weight's
change is then its gradient, compared by its Hugging Face name. Tolerances: 1e-5 between
megatron layouts (the same arithmetic, summed in other orders over the slices), 1e-4 against
``TransformersModel`` (another attention and MLP implementation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip('megatron.core')

from safetensors.torch import load_file

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from dist_model import transformers_main  # noqa: E402
from server_helpers import free_port  # noqa: E402

LAYOUTS = {'tp1': 1, 'tp2': 2, 'pp2': 2, 'tp2pp2': 4, 'dp2': 2}
#: The mixture of experts, in one process and with its experts split over 2 ranks (expert parallel).
MOE_LAYOUTS = {'moe-tp1': ('tp1', 1), 'moe-ep2': ('ep2', 2), 'moe-tp2': ('tp2', 2)}
DENSE, MOE = 'tiny-qwen3', 'tiny-qwen3-moe'
SAME = 1e-5
HF = 1e-4


def torchrun(out: Path, layout: str, ranks: int, init: Path, model: str) -> None:
    command = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={ranks}']
    command += [f'--master_port={free_port()}', str(HERE / 'dist_model.py'), str(out), layout, str(init), model]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    done = subprocess.run(command, env=env, capture_output=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()[-4000:]


@pytest.fixture(scope='module')
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each layout's output folder, and 'hf': TransformersModel's; all from one adapter 'init'."""
    from peft import LoraConfig

    from twinkle import assets
    from twinkle.model import TransformersModel

    root = tmp_path_factory.mktemp('megatron-layouts')
    folders: dict[str, Path] = {}
    experts = {'target_parameters': ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']}  # peft's way to the stacks
    for model, targets, extra in ((DENSE, 'all-linear', {}), (MOE, ['q_proj', 'k_proj', 'v_proj', 'o_proj'], experts)):
        torch.manual_seed(0)
        seeded = TransformersModel(model_id=assets.tiny_model(model))
        # Random A and B (init_lora_weights=False): every LoRA weight gets a gradient at the first step.
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **extra)
        seeded.add_adapter_to_model('a', config)
        init = Path(seeded.save(f'init-{model}', str(root)))
        hf = 'hf' if model == DENSE else 'moe-hf'
        folders[hf] = root / hf
        folders[hf].mkdir()
        transformers_main(folders[hf], str(init), model)
        layouts = {name: (name, ranks) for name, ranks in LAYOUTS.items()} if model == DENSE else MOE_LAYOUTS
        for name, (layout, ranks) in layouts.items():
            folders[name] = root / name
            folders[name].mkdir()
            torchrun(folders[name], layout, ranks, init, model)
    return folders


def results(folder: Path) -> dict:
    return json.loads((folder / 'results.json').read_text())


def assert_close(got: float, want: float, tol: float) -> None:
    assert abs(got - want) <= tol * max(1.0, abs(want)), (got, want)


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
    for name, value in want.items():
        scale = max(1.0, value.abs().max().item())
        assert (got[name] - value).abs().max().item() <= tol * scale, name


@pytest.mark.parametrize('layout', ['tp2', 'pp2', 'tp2pp2', 'dp2'])
@pytest.mark.parametrize('training', ['lora', 'full'])
def test_layouts_give_the_one_process_losses_and_gradients(runs, layout, training):
    one, other = results(runs['tp1'])[training], results(runs[layout])[training]
    for key in ('loss', 'grad_norm', 'loss_after'):
        assert_close(other[key], one[key], SAME)
    grads = load_file(str(runs[layout] / f'{training}-grads.safetensors'))
    assert_grads_close(grads, load_file(str(runs['tp1'] / f'{training}-grads.safetensors')), SAME)


@pytest.mark.parametrize(
    ('layout', 'training'),
    # moe-ep2: 8 experts per layer, 4 on each rank; the 2 ranks also split the rows. moe-tp2: every
    # expert split over 2 ranks, with megatron's sequence parallel (attention LoRA under it too).
    [('moe-ep2', 'lora'), ('moe-ep2', 'full'), ('moe-tp2', 'lora'), ('moe-tp2', 'full')],
)
def test_a_mixture_of_experts_split_gives_the_one_process_losses_and_gradients(runs, layout, training):
    one, other = results(runs['moe-tp1'])[training], results(runs[layout])[training]
    for key in ('loss', 'grad_norm', 'loss_after'):
        assert_close(other[key], one[key], SAME)
    grads = load_file(str(runs[layout] / f'{training}-grads.safetensors'))
    assert_grads_close(grads, load_file(str(runs['moe-tp1'] / f'{training}-grads.safetensors')), SAME)


@pytest.mark.parametrize('training', ['lora', 'full'])
@pytest.mark.parametrize(('hf', 'one'), [('hf', 'tp1'), ('moe-hf', 'moe-tp1')])
def test_megatron_gives_transformers_losses_and_gradients(runs, training, hf, one):
    # The mixture of experts without the router's load-balancing loss (router_aux_loss_coef=0) on both.
    want, got = results(runs[hf])[training], results(runs[one])[training]
    for key in ('loss', 'grad_norm', 'loss_after'):
        assert_close(got[key], want[key], HF)
    grads = load_file(str(runs[one] / f'{training}-grads.safetensors'))
    assert_grads_close(grads, load_file(str(runs[hf] / f'{training}-grads.safetensors')), HF)


@pytest.mark.parametrize('layout', ['tp2', 'pp2', 'tp2pp2'])
def test_an_adapter_saved_from_megatron_loads_in_plain_peft_with_the_same_logits(runs, layout):
    from dist_model import PROBE
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinkle import assets

    base = AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3'), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(runs[layout] / 'lora-ckpt')).eval()
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([PROBE])).logits
    megatron_logits = load_file(str(runs[layout] / 'lora-probe.safetensors'))['logits']
    assert (megatron_logits - logits).abs().max().item() <= SAME * max(1.0, logits.abs().max().item())


def test_three_adapters_in_one_mixed_pass_equal_each_alone_at_tp2(runs):
    # At TP=2: adapters a, b, c (rows 0-1, 2, 3) through one forward_backward_mixed against three
    # forward_backward calls of their own; losses and every LoRA gradient (peft keys) compared.
    mixed = results(runs['tp2'])['mixed']
    assert mixed['loss'] > 0
    assert mixed['loss_gap'] <= SAME
    assert mixed['grad_gap'] <= SAME


def test_two_stages_refuse_an_adapter_missing_from_a_stage_and_tied_embeddings_trained_whole(runs):
    refused = results(runs['pp2'])['refused']
    assert (
        "adapter 'late': its target_modules leave pipeline stage(s) [0] of 2 without a LoRA layer"
        in (refused['empty_stage'])
    )
    assert refused['adapters_after'] == ''  # removed on every rank, nothing half-added
    assert 'tied input and output embeddings under pp_size=2' in refused['tied']


def test_expert_parallel_runs_a_mixed_pass_whose_ranks_hold_different_rows(runs):
    # ep2: adapter a's rows differ in length between the ranks, b has rows on rank 0 alone; the
    # ranks' forwards still meet in the experts' dispatch, and a's loss is its own pass's.
    mixed = results(runs['moe-ep2'])['mixed']
    assert mixed['loss'] > 0 and mixed['b'] > 0
    assert mixed['loss_gap'] <= SAME * mixed['loss']
