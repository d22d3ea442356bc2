"""Per-row LoRA (twinkle.model.lora.multi) against peft holding one adapter at a time.

Reference values come from an independent implementation: for each adapter, a peft model holding
only that adapter with the same A/B weights, run on that adapter's rows alone.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from torch import nn

from twinkle import assets
from twinkle.errors import ConfigurationError, DataError, StateError, UnknownNameError
from twinkle.model.lora.multi import (
    LoraSpec,
    MultiLoraLinear,
    adapter_named_parameters,
    adapter_names,
    adapter_parameters,
    add_adapter,
    inject,
    multi_lora_layers,
    peft_key,
    peft_state_dict,
    remove_adapter,
    row_adapters,
    spec_from_peft,
)

TOL = 1e-5
ATTENTION = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
# Three tenants of different ranks, alphas and targets ('b' attention only), plus 'd' that no batch uses.
SPECS = {
    'a': LoraSpec(r=4, alpha=8, target_modules='all-linear'),
    'b': LoraSpec(r=8, alpha=4, target_modules=ATTENTION),
    'c': LoraSpec(r=16, alpha=32, target_modules=('q_proj', 'up_proj', 'down_proj')),
    'd': LoraSpec(r=4, alpha=4, target_modules=('v_proj',)),
}
MIXED = ['a', 'b', None, 'c', 'a']


@pytest.fixture(scope='module')
def base_model() -> nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(assets.tiny_model('tiny-qwen3'), dtype=torch.float32)
    return model.eval()


@pytest.fixture
def multi(base_model: nn.Module) -> nn.Module:
    """The base model with SPECS injected and every B made non-zero (a fresh B = 0 adds nothing)."""
    model = copy.deepcopy(base_model)
    gen = torch.Generator().manual_seed(0)
    inject(model, SPECS, generator=gen)
    with torch.no_grad():
        for name in SPECS:
            for pname, param in adapter_named_parameters(model, name).items():
                if pname.endswith('lora_B.weight'):
                    param.normal_(0, 0.05, generator=gen)
    return model


def _ids(rows: int, seed: int, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 4000, (rows, length), generator=torch.Generator().manual_seed(seed))


def _row_losses(logits_B_T_V: torch.Tensor, ids_B_T: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy summed over each row's tokens -> [B]."""
    logp = F.cross_entropy(logits_B_T_V[:, :-1].transpose(1, 2), ids_B_T[:, 1:], reduction='none')
    return logp.sum(dim=1)


def _peft_twin(base_model: nn.Module, multi: nn.Module, name: str) -> nn.Module:
    """A peft model holding only adapter ``name``, with ``multi``'s A/B copied into lora_A/lora_B."""
    spec = SPECS[name]
    targets = spec.target_modules if spec.target_modules == 'all-linear' else list(spec.target_modules)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=targets, lora_dropout=0.0)
    twin = get_peft_model(copy.deepcopy(base_model), config)
    inner = twin.base_model.model
    peft_paths = {p for p, m in inner.named_modules() if hasattr(m, 'lora_A') and 'default' in m.lora_A}
    ours = adapter_named_parameters(multi, name)
    # The same layers are adapted ('all-linear' leaves out lm_head in both).
    assert peft_paths == {p.split('.adapters.')[0] for p in ours}
    # Our weights in peft's file format, loaded by peft itself.
    result = set_peft_model_state_dict(twin, peft_state_dict(multi, name))
    assert not [k for k in result.missing_keys if '.lora_' in k]
    return twin.eval()


def _peft_param(twin: nn.Module, pname: str, name: str) -> nn.Parameter:
    key = peft_key(pname, name).replace('.weight', '.default.weight')
    return dict(twin.named_parameters())[key]


def test_each_row_matches_peft_with_its_adapter_alone(base_model: nn.Module, multi: nn.Module) -> None:
    ids = _ids(len(MIXED), seed=1)
    with torch.no_grad(), row_adapters(multi, MIXED):
        mixed = multi(ids).logits
    diffs = []
    for i, name in enumerate(MIXED):
        with torch.no_grad():
            base = base_model(ids[i : i + 1]).logits[0]
            ref = base if name is None else _peft_twin(base_model, multi, name)(ids[i : i + 1]).logits[0]
        diffs.append((mixed[i] - ref).abs().max().item())
        if name is not None:  # the adapter really changes this row, so the check above means something
            assert (mixed[i] - base).abs().max().item() > 1e-3
    print(f'max |logits - peft| per row {MIXED}: {diffs}')
    assert max(diffs) <= TOL


def test_gradients_go_to_each_rows_own_adapter(base_model: nn.Module, multi: nn.Module) -> None:
    ids = _ids(len(MIXED), seed=2)
    with row_adapters(multi, MIXED):
        _row_losses(multi(ids).logits, ids).sum().backward()
    worst = 0.0
    for name in ('a', 'b', 'c'):
        rows = [i for i, n in enumerate(MIXED) if n == name]
        twin = _peft_twin(base_model, multi, name)
        _row_losses(twin(ids[rows]).logits, ids[rows]).sum().backward()
        for pname, param in adapter_named_parameters(multi, name).items():
            ref = _peft_param(twin, pname, name).grad
            assert param.grad is not None and ref.abs().max() > 0, pname
            worst = max(worst, (param.grad - ref).abs().max().item())
    print(f'max |grad - peft grad on own rows|: {worst:.2e}')
    assert worst <= TOL
    # 'd' had no row, and the base model is frozen: neither gets a gradient.
    assert all(p.grad is None for p in adapter_parameters(multi, 'd'))
    adapter_ids = {id(p) for name in SPECS for p in adapter_parameters(multi, name)}
    base_params = [p for p in multi.parameters() if id(p) not in adapter_ids]
    assert base_params and all(p.grad is None and not p.requires_grad for p in base_params)


def _row_loss_and_grads(
    multi: nn.Module, ids: torch.Tensor, names: list[str | None], row: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    with row_adapters(multi, names):
        loss = _row_losses(multi(ids).logits, ids)[row]
        grads = torch.autograd.grad(loss, adapter_parameters(multi, names[row]))
    return loss.detach(), grads


def test_row_results_do_not_depend_on_neighbours(multi: nn.Module) -> None:
    probe = _ids(1, seed=3)
    # The same 'b' row alone, among other tenants, and at another position beside another 'b' row.
    batches = [
        (probe, ['b'], 0),
        (torch.cat([probe, _ids(2, seed=4)]), ['b', 'a', None], 0),
        (torch.cat([_ids(3, seed=5), probe, _ids(2, seed=6)]), ['c', 'a', None, 'b', 'b', 'c'], 3),
    ]
    results = [_row_loss_and_grads(multi, ids, names, row) for ids, names, row in batches]
    loss0, grads0 = results[0]
    worst_loss = max((loss - loss0).abs().item() for loss, _ in results[1:])
    worst_grad = max(
        (g - g0).abs().max().item() for _, grads in results[1:] for g, g0 in zip(grads, grads0, strict=True)
    )
    print(f'batch invariance: max |loss diff| {worst_loss:.2e}, max |grad diff| {worst_grad:.2e}')
    assert worst_loss <= TOL and worst_grad <= TOL
    assert all(g0.abs().max() > 0 for g0 in grads0)


def test_only_the_batchs_adapters_change_on_step(multi: nn.Module) -> None:
    optimizers = {name: torch.optim.AdamW(adapter_parameters(multi, name), lr=1e-2) for name in SPECS}
    before = {k: v.clone() for k, v in multi.state_dict().items()}
    ids = _ids(2, seed=7)
    with row_adapters(multi, ['a', None]):
        _row_losses(multi(ids).logits, ids).sum().backward()
    for optimizer in optimizers.values():
        optimizer.step()
    changed = {k for k, v in multi.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {k for k in multi.state_dict() if '.adapters.a.' in k}


def test_single_layer_by_hand() -> None:
    # base = identity, A = [[1, 0]], B = [[1], [0]], alpha / r = 2 / 1: a row with the adapter
    # gets y = x + 2 * [x0, 0]; x = [[1, 2], [3, 4]] with rows ['t', None] -> [[3, 2], [3, 4]].
    linear = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(2))
    layer = MultiLoraLinear(linear)
    adapter = layer.add_adapter('t', LoraSpec(r=1, alpha=2))
    with torch.no_grad():
        adapter.lora_A.weight.copy_(torch.tensor([[1.0, 0.0]]))
        adapter.lora_B.weight.copy_(torch.tensor([[1.0], [0.0]]))
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    with row_adapters(layer, ['t', None]):
        assert torch.equal(layer(x), torch.tensor([[3.0, 2.0], [3.0, 4.0]]))
        # [B, S, in] with both rows = x: row 0's two tokens both get the delta, row 1 stays x.
        expected = torch.tensor([[[3.0, 2.0], [9.0, 4.0]], [[1.0, 2.0], [3.0, 4.0]]])
        assert torch.equal(layer(x[None].expand(2, 2, 2)), expected)
    with row_adapters(layer, [None, 't']):
        assert torch.equal(layer(x), torch.tensor([[1.0, 2.0], [9.0, 4.0]]))
    assert linear.weight.requires_grad is False


def test_new_adapter_starts_as_base_and_shares_base_weights(base_model: nn.Module) -> None:
    model = copy.deepcopy(base_model)
    q_proj = model.model.layers[0].self_attn.q_proj
    paths = add_adapter(model, 'fresh', LoraSpec(r=8, alpha=16), generator=torch.Generator().manual_seed(0))
    assert 'lm_head' not in paths and len(paths) == 14  # 7 linears in each of 2 layers, not the head
    assert model.model.layers[0].self_attn.q_proj.base_layer is q_proj  # wrapped, not copied
    ids = _ids(2, seed=8)
    with torch.no_grad(), row_adapters(model, ['fresh', 'fresh']):
        out = model(ids).logits
    with torch.no_grad():
        ref = base_model(ids).logits
    assert (out - ref).abs().max().item() <= TOL  # kaiming A, zero B: delta is 0
    assert adapter_parameters(model, 'fresh')[0].abs().max() > 0
    # The same generator seed gives the same initial A.
    again = copy.deepcopy(base_model)
    add_adapter(again, 'fresh', LoraSpec(r=8, alpha=16), generator=torch.Generator().manual_seed(0))
    assert all(
        torch.equal(p, q)
        for p, q in zip(adapter_parameters(model, 'fresh'), adapter_parameters(again, 'fresh'), strict=True)
    )


def test_remove_adapter_frees_its_parameters(base_model: nn.Module, multi: nn.Module) -> None:
    ref = weakref.ref(adapter_parameters(multi, 'a')[0])
    remove_adapter(multi, 'a')
    gc.collect()
    assert ref() is None
    assert adapter_names(multi) == ['b', 'c', 'd']
    assert not any('.adapters.a.' in k for k in multi.state_dict())
    # gate_proj was adapted by 'a' only: it is a plain Linear again; q_proj still holds 'b' and 'c'.
    assert type(multi.model.layers[0].mlp.gate_proj) is nn.Linear
    assert list(multi.model.layers[0].self_attn.q_proj.adapters) == ['b', 'c']
    with pytest.raises(UnknownNameError, match="'a'"):
        adapter_parameters(multi, 'a')
    for name in ('b', 'c', 'd'):
        remove_adapter(multi, name)
    assert not multi_lora_layers(multi)
    assert set(multi.state_dict()) == set(base_model.state_dict())


def test_bad_inputs_raise_clear_errors(multi: nn.Module) -> None:
    ids = _ids(3, seed=9)
    unknown = r"Unknown adapter 'zed'.*\['a', 'b', 'c', 'd'\]"
    with pytest.raises(UnknownNameError, match=unknown), row_adapters(multi, ['a', 'zed', None]):
        pass
    with pytest.raises(DataError, match='assigned 2 rows but the batch has 3 rows'), row_adapters(multi, ['a', None]):
        multi(ids)
    with pytest.raises(DataError, match='one adapter name'), row_adapters(multi, 42):
        pass
    with pytest.raises(StateError, match='outside row_adapters'):
        multi(ids)
    before = {k: v.shape for k, v in multi.state_dict().items()}
    for r in (0, -1, 2.5):
        with pytest.raises(ConfigurationError, match=rf'rank r={r}'):
            add_adapter(multi, 'e', LoraSpec(r=r, alpha=8))
    with pytest.raises(ConfigurationError, match=r"'nope' matches no linear layer.*'q_proj'"):
        add_adapter(multi, 'e', LoraSpec(r=4, alpha=8, target_modules=('q_proj', 'nope')))
    accepted = r"\['gaussian', 'kaiming', 'random'\]"
    with pytest.raises(ConfigurationError, match=rf"Invalid LoRA init 'orthogonal'.*{accepted}"):
        add_adapter(multi, 'e', LoraSpec(r=4, alpha=8, init='orthogonal'))
    with pytest.raises(ConfigurationError, match="'a' already exists"):
        add_adapter(multi, 'a', LoraSpec(r=4, alpha=8))
    with pytest.raises(ConfigurationError, match='Invalid adapter name'):
        add_adapter(multi, 'x.y', LoraSpec(r=4, alpha=8))
    with pytest.raises(UnknownNameError, match="'zed'"):
        remove_adapter(multi, 'zed')
    # A failed add leaves the model as it was (no half-added adapter).
    assert {k: v.shape for k, v in multi.state_dict().items()} == before


def test_one_name_applies_to_every_row(multi: nn.Module) -> None:
    ids = _ids(3, seed=10)
    with torch.no_grad(), row_adapters(multi, ['c', 'c', 'c']):
        listed = multi(ids).logits
    with torch.no_grad(), row_adapters(multi, 'c'):
        every = multi(ids).logits
        alone = multi(ids[:1]).logits  # any batch size
    # Equal up to float32 rounding, not bitwise: a CPU matmul blocks (and so sums) a problem
    # differently by its shape, so a batch of 1 and a batch of 3 may round apart; a list of
    # names and one name take different paths through MultiLoraLinear to the same arithmetic.
    torch.testing.assert_close(alone, every[:1], rtol=0, atol=TOL)
    torch.testing.assert_close(listed, every, rtol=0, atol=TOL)


@pytest.mark.parametrize('init', [True, 'gaussian', False])
def test_a_seed_gives_the_adapter_peft_gives(base_model: nn.Module, init: bool | str) -> None:
    # peft draws A and B from the global RNG layer by layer; these layers draw the same numbers
    # in the same order, so a local script and the server agree on a seeded adapter.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=['q_proj', 'down_proj'], init_lora_weights=init)
    torch.manual_seed(123)
    twin = get_peft_model(copy.deepcopy(base_model), config)
    ours = copy.deepcopy(base_model)
    torch.manual_seed(123)
    add_adapter(ours, 'x', spec_from_peft(config, ours))
    theirs = {k.replace('.default.', '.'): v for k, v in twin.named_parameters() if '.lora_' in k}
    mine = peft_state_dict(ours, 'x')
    assert set(mine) == set(theirs) and len(mine) == 8
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_unsupported_lora_options_are_refused_by_name(base_model: nn.Module) -> None:
    with pytest.raises(ConfigurationError, match=r'LoraConfig\(use_dora=True\) is not supported'):
        spec_from_peft(LoraConfig(r=4, target_modules='all-linear', use_dora=True), base_model)
    with pytest.raises(ConfigurationError, match=r"LoraConfig\(bias='all'\) is not supported"):
        spec_from_peft(LoraConfig(r=4, target_modules='all-linear', bias='all'), base_model)
    # No target_modules: peft's default for the model type (q_proj and v_proj for qwen3).
    assert spec_from_peft(LoraConfig(r=4), base_model).target_modules == ('q_proj', 'v_proj')
    assert spec_from_peft(LoraConfig(r=4, lora_alpha=8, use_rslora=True), base_model).scaling == 4.0
