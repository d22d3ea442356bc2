"""twinkle.infra.mesh: device groups, the rank grid, data ranks, and the placement text.

The grid is ``fsdp, pp, dp, cp, tp`` row-major (tp fastest), so a rank is
``(((fsdp * pp_size + pp) * dp_size + dp) * cp_size + cp) * tp_size + tp``; every expected grid
and data rank below is worked out from that formula by hand, in the comment above it.
"""

from __future__ import annotations

import doctest
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from twinkle.errors import ConfigurationError, StateError
from twinkle.infra import DeviceGroup, DeviceMesh, get_device_placement
from twinkle.infra import mesh as mesh_module


def test_module_examples_run() -> None:
    result = doctest.testmod(mesh_module)
    assert result.attempted >= 5
    assert result.failed == 0


# ---------------------------------------------------------------- DeviceGroup


def test_group_int_ranks_mean_the_first_n() -> None:
    group = DeviceGroup(name='default', ranks=8, device_type='cuda')
    assert group.ranks == [0, 1, 2, 3, 4, 5, 6, 7]
    assert group.world_size == 8


def test_group_list_ranks_are_kept_as_given() -> None:
    group = DeviceGroup(name='sampler', ranks=[4, 5, 6, 7], device_type='GPU')
    assert group.ranks == [4, 5, 6, 7]
    assert group.world_size == 4


@pytest.mark.parametrize(
    ('spelling', 'normalised'),
    [('cuda', 'cuda'), ('GPU', 'cuda'), ('gpu', 'cuda'), ('cpu', 'cpu'), ('CPU', 'cpu'), ('npu', 'npu')],
)
def test_group_device_type_is_normalised_and_the_spelling_kept(spelling: str, normalised: str) -> None:
    group = DeviceGroup('g', 2, device_type=spelling)
    assert group.device_type == normalised
    assert group.requested_device_type == spelling


def test_group_world_size_counts_workers_not_devices() -> None:
    # 4 devices, 2 per worker (e.g. a tensor-parallel sampler): 2 worker processes.
    group = DeviceGroup('sampler', ranks=4, gpus_per_worker=2)
    assert (group.num_devices, group.world_size) == (4, 2)


def test_groups_with_the_same_ranks_are_equal_whatever_the_spelling() -> None:
    assert DeviceGroup('m', 2, 'GPU') == DeviceGroup('m', [0, 1], 'cuda')
    assert DeviceGroup('m', 2) != DeviceGroup('m', [1, 2])


@pytest.mark.parametrize(
    ('kwargs', 'in_message'),
    [
        ({'name': '', 'ranks': 2}, "''"),
        ({'name': 'g', 'ranks': 0}, 'ranks=0'),
        ({'name': 'g', 'ranks': -3}, 'ranks=-3'),
        ({'name': 'g', 'ranks': []}, '[]'),
        ({'name': 'g', 'ranks': [0, -1]}, '[-1]'),
        ({'name': 'g', 'ranks': [0, 'a']}, "['a']"),
        ({'name': 'g', 'ranks': [0, 1, 1, 2, 2]}, '[1, 2]'),
        ({'name': 'g', 'ranks': '0,1'}, "'0,1'"),
        ({'name': 'g', 'ranks': True}, 'True'),
        ({'name': 'g', 'ranks': 2, 'gpus_per_worker': 0}, 'gpus_per_worker'),
        ({'name': 'g', 'ranks': 4, 'gpus_per_worker': 3}, 'gpus_per_worker=3'),
        ({'name': 'g', 'ranks': 2, 'device_type': 'tpu'}, "'tpu'"),
    ],
)
def test_group_rejects_bad_values_naming_them(kwargs: dict, in_message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        DeviceGroup(**kwargs)
    assert in_message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_device_type_lists_the_accepted_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"'tpu'.*\['cpu', 'cuda', 'gpu', 'npu'\]"):
        DeviceGroup('g', 1, device_type='tpu')


# ---------------------------------------------------------------- DeviceMesh: the seeds' examples


def test_fsdp4_dp2() -> None:
    mesh = DeviceMesh.from_sizes(fsdp_size=4, dp_size=2)
    # rank = fsdp * 2 + dp: rows are fsdp, columns dp.
    assert mesh.mesh.reshape(4, 2).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.world_size == 8
    # All 8 ranks read different data (fsdp and dp both split the batch).
    assert mesh.dp_world_size == 8
    # data rank = fsdp * dp_size + dp = the global rank here.
    assert [mesh.data_rank(r) for r in range(8)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert mesh.coords(5) == {'fsdp': 2, 'pp': 0, 'dp': 1, 'cp': 0, 'tp': 0}
    # Rank 5's fsdp group: dp=1 fixed, fsdp 0..3 -> 1, 3, 5, 7; its dp group: fsdp=2 fixed -> 4, 5.
    assert mesh.ranks_along('fsdp', 5) == [1, 3, 5, 7]
    assert mesh.ranks_along('dp', 5) == [4, 5]
    assert mesh.ranks_along('tp', 5) == [5]


def test_tp2_pp4() -> None:
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=4)
    # rank = pp * 2 + tp.
    assert mesh.mesh.reshape(4, 2).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.world_size == 8
    # No data dimension: every rank reads the single shard 0.
    assert mesh.dp_world_size == 1
    assert [mesh.data_rank(r) for r in range(8)] == [0] * 8
    # 5 = 2 * 2 + 1: stage 2, tp rank 1.
    assert mesh.coords(5) == {'fsdp': 0, 'pp': 2, 'dp': 0, 'cp': 0, 'tp': 1}
    assert mesh.ranks_along('tp', 5) == [4, 5]
    assert mesh.ranks_along('pp', 5) == [1, 3, 5, 7]


def test_tp2_pp2_dp2() -> None:
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    # rank = pp * 4 + dp * 2 + tp.
    assert mesh.mesh.reshape(2, 2, 2).tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert mesh.dp_world_size == 2
    # data rank = dp = (rank // 2) % 2; pp and tp peers read the same batch.
    assert [mesh.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # 6 = 1 * 4 + 1 * 2 + 0.
    assert mesh.coords(6) == {'fsdp': 0, 'pp': 1, 'dp': 1, 'cp': 0, 'tp': 0}
    assert mesh.ranks_along('dp', 6) == [4, 6]
    assert mesh.ranks_along('pp', 6) == [2, 6]
    assert mesh.ranks_along('tp', 6) == [6, 7]


def test_all_five_dimensions() -> None:
    mesh = DeviceMesh.from_sizes(fsdp_size=2, pp_size=2, dp_size=2, cp_size=2, tp_size=2)
    # 27 = 16 + 8 + 2 + 1: fsdp 1, pp 1, dp 0, cp 1, tp 1; data rank = 1 * 2 + 0 = 2.
    assert mesh.coords(27) == {'fsdp': 1, 'pp': 1, 'dp': 0, 'cp': 1, 'tp': 1}
    assert mesh.data_rank(27) == 2
    assert mesh.dp_world_size == 4
    # cp group: cp 0..1 with the rest fixed -> 25, 27.
    assert mesh.ranks_along('cp', 27) == [25, 27]
    assert mesh.ranks_along('fsdp', 27) == [11, 27]


def test_world_size_given_and_matching() -> None:
    mesh = DeviceMesh.from_sizes(world_size=4, dp_size=4)
    assert mesh.world_size == 4
    assert mesh.sizes == {'fsdp': 1, 'pp': 1, 'dp': 4, 'cp': 1, 'tp': 1, 'ep': 1, 'ulysses': 1}


def test_world_size_mismatch_names_every_size_and_the_product() -> None:
    with pytest.raises(ConfigurationError) as info:
        DeviceMesh.from_sizes(world_size=4, dp_size=3)
    message = str(info.value)
    assert 'world_size=4' in message
    for part in ('fsdp_size=1', 'pp_size=1', 'dp_size=3', 'cp_size=1', 'tp_size=1', '= 3'):
        assert part in message
    assert isinstance(info.value, ValueError)


def test_none_sizes_mean_one() -> None:
    mesh = DeviceMesh.from_sizes(dp_size=None, fsdp_size=None, tp_size=2, pp_size=None, ep_size=None)
    assert mesh == DeviceMesh.from_sizes(tp_size=2)
    assert mesh.world_size == 2


@pytest.mark.parametrize('bad', [0, -2, 1.5, True, '2'])
def test_bad_size_is_named(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=rf'tp_size must be a positive integer, got {bad!r}'):
        DeviceMesh.from_sizes(tp_size=bad)


# ---------------------------------------------------------------- DeviceMesh: folded dims


def test_ulysses_shares_a_shard_between_consecutive_data_ranks() -> None:
    mesh = DeviceMesh.from_sizes(dp_size=4, tp_size=2, ulysses_size=2)
    assert mesh.world_size == 8  # ulysses adds no ranks
    # rank = dp * 2 + tp; data rank = dp // 2.
    assert [mesh.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert mesh.dp_world_size == 2
    # Rank 3 (dp 1, tp 1) splits its sequences with the other tp-1 rank of shard 0: dp 0 -> rank 1.
    assert mesh.ranks_along('ulysses', 3) == [1, 3]
    assert mesh.ranks_along('ulysses', 6) == [4, 6]


def test_ulysses_must_divide_the_data_ranks() -> None:
    with pytest.raises(ConfigurationError, match=r'ulysses_size=3 .* = 4'):
        DeviceMesh.from_sizes(fsdp_size=2, dp_size=2, ulysses_size=3)


def test_ep_is_folded_and_must_divide_a_pipeline_stage() -> None:
    mesh = DeviceMesh.from_sizes(pp_size=2, dp_size=2, ep_size=2)
    assert mesh.world_size == 4
    assert mesh.sizes['ep'] == 2
    # A stage has 4 / 2 = 2 ranks: 4 experts-groups cannot fit.
    with pytest.raises(ConfigurationError, match=r'ep_size=4 .* = 2'):
        DeviceMesh.from_sizes(pp_size=2, dp_size=2, ep_size=4)


# ---------------------------------------------------------------- DeviceMesh: methods


@pytest.mark.parametrize('rank', [8, -1, 2.0, None])
def test_rank_outside_the_mesh_is_named(rank: object) -> None:
    mesh = DeviceMesh.from_sizes(dp_size=8)
    with pytest.raises(ConfigurationError, match=r'accepted ranks are 0 \.\. 7'):
        mesh.coords(rank)
    with pytest.raises(ConfigurationError, match=rf'rank {rank!r} '):
        mesh.data_rank(rank)


def test_unknown_dimension_lists_the_accepted_ones() -> None:
    mesh = DeviceMesh.from_sizes(dp_size=2)
    with pytest.raises(ConfigurationError, match=r"'ep'.*\['cp', 'dp', 'fsdp', 'pp', 'tp', 'ulysses'\]"):
        mesh.ranks_along('ep', 0)


def test_repr_shows_the_sizes_above_one() -> None:
    assert repr(DeviceMesh.from_sizes(fsdp_size=4, dp_size=2)) == (
        "DeviceMesh(world_size=8, fsdp=4, dp=2, device_type='cuda')"
    )
    assert repr(DeviceMesh.from_sizes(device_type='CPU')) == "DeviceMesh(world_size=1, device_type='cpu')"


def test_equality_is_by_sizes_and_device_type() -> None:
    mesh = DeviceMesh.from_sizes(fsdp_size=4, dp_size=2)
    assert mesh == DeviceMesh.from_sizes(world_size=8, dp_size=2, fsdp_size=4, device_type='GPU')
    assert mesh == DeviceMesh(fsdp_size=4, dp_size=2)
    assert mesh != DeviceMesh.from_sizes(fsdp_size=2, dp_size=4)
    assert mesh != DeviceMesh.from_sizes(fsdp_size=4, dp_size=2, device_type='cpu')
    assert mesh != DeviceMesh.from_sizes(fsdp_size=4, dp_size=2, ulysses_size=2)
    assert len({mesh, DeviceMesh(fsdp_size=4, dp_size=2)}) == 1


def test_mesh_grid_is_read_only_and_the_mesh_immutable() -> None:
    mesh = DeviceMesh.from_sizes(dp_size=2)
    with pytest.raises(ValueError, match='read-only'):
        mesh.mesh[0, 0, 0, 0, 0] = 5
    with pytest.raises(AttributeError):
        mesh.dp_size = 4


# ---------------------------------------------------------------- get_device_placement


def _rows(text: str, after: str) -> list[list[str]]:
    """The whitespace-split rows of the table under the line starting with ``after`` (header included)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after)) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith('  '):
            break
        rows.append(line.split())
    return rows


def test_placement_lists_each_group_with_its_ranks() -> None:
    groups = [DeviceGroup('model', ranks=4), DeviceGroup('sampler', ranks=[4, 5, 6, 7], device_type='GPU')]
    text = get_device_placement(groups=groups)
    rows = _rows(text, 'Device groups')
    assert rows[0] == ['name', 'device', 'ranks', 'workers', 'gpus/worker']
    assert rows[1] == ['model', 'cuda', '0,', '1,', '2,', '3', '4', '1']
    assert rows[2] == ['sampler', 'cuda', '(GPU)', '4,', '5,', '6,', '7', '4', '1']


def test_placement_shows_every_rank_of_a_mesh() -> None:
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2)
    text = get_device_placement(groups=[DeviceGroup('model', 8)], meshes={'model': mesh})
    assert "Device mesh 'model': DeviceMesh(world_size=8, pp=2, dp=2, tp=2, device_type='cuda'), 2 data shards" in text
    rows = _rows(text, 'Device mesh')
    assert rows[0] == ['rank', 'pp', 'dp', 'tp', 'data_rank']
    # rank = pp * 4 + dp * 2 + tp; data rank = dp.
    expected = [[r, r // 4, (r // 2) % 2, r % 2, (r // 2) % 2] for r in range(8)]
    assert [[int(cell) for cell in row] for row in rows[1:]] == expected


def test_placement_of_a_one_rank_mesh_has_only_rank_and_data_rank() -> None:
    text = get_device_placement(meshes={'solo': DeviceMesh.from_sizes()})
    assert 'Device groups' not in text
    assert _rows(text, 'Device mesh') == [['rank', 'data_rank'], ['0', '0']]


def test_placement_without_arguments_describes_the_local_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('WORLD_SIZE', '4')
    monkeypatch.setenv('RANK', '2')
    monkeypatch.delenv('LOCAL_RANK', raising=False)
    rows = _rows(get_device_placement(), 'Local process')
    assert rows[0] == ['world_size', 'rank', 'local_rank', 'device']
    assert rows[1][:3] == ['4', '2', '2']
    if torch.cuda.is_available():
        assert rows[1][3].startswith('cuda:')
    else:
        assert rows[1][3] == 'cpu'


def test_placement_defaults_to_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ('WORLD_SIZE', 'RANK', 'LOCAL_RANK'):
        monkeypatch.delenv(name, raising=False)
    assert _rows(get_device_placement(), 'Local process')[1][:3] == ['1', '0', '0']


def test_placement_rejects_bad_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('WORLD_SIZE', 'eight')
    with pytest.raises(ConfigurationError, match="WORLD_SIZE='eight'"):
        get_device_placement()
    with pytest.raises(ConfigurationError, match='must map a name to a DeviceMesh'):
        get_device_placement(meshes=[DeviceMesh.from_sizes()])
    with pytest.raises(ConfigurationError, match='must hold DeviceGroup objects, got str'):
        get_device_placement(groups=['model'])


# ---------------------------------------------------------------- to_torch


@pytest.fixture
def gloo_world_of_one(tmp_path) -> Iterator[None]:
    """A real single-process gloo process group (world size 1), torn down afterwards."""
    if dist.is_initialized():
        pytest.skip('a process group is already initialised in this test process')
    dist.init_process_group('gloo', init_method=f'file://{tmp_path / "store"}', rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_to_torch_needs_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip('a process group is already initialised in this test process')
    with pytest.raises(StateError, match='init_process_group'):
        DeviceMesh.from_sizes(device_type='cpu').to_torch()


@pytest.mark.integration
def test_to_torch_in_a_gloo_world_of_one(gloo_world_of_one: None) -> None:
    torch_mesh = DeviceMesh.from_sizes(device_type='cpu').to_torch()
    assert torch_mesh.device_type == 'cpu'
    assert torch_mesh.mesh_dim_names == ('dp',)
    assert torch_mesh.mesh.tolist() == [0]
    assert list(torch_mesh.get_coordinate()) == [0]
    # The device type can be overridden (a 'GPU' mesh described on a CPU-only host).
    assert DeviceMesh.from_sizes(device_type='GPU').to_torch(device_type='cpu').device_type == 'cpu'


@pytest.mark.integration
def test_to_torch_refuses_a_mesh_larger_than_the_world(gloo_world_of_one: None) -> None:
    with pytest.raises(ConfigurationError, match='world size 2 but the process group has 1 ranks'):
        DeviceMesh.from_sizes(dp_size=2, device_type='cpu').to_torch()


@pytest.fixture
def fake_world_of_eight_as_rank_5() -> Iterator[None]:
    """torch's in-process fake backend: rank 5 of 8 without other processes (no collectives run)."""
    fake_pg = pytest.importorskip('torch.testing._internal.distributed.fake_pg')
    if dist.is_initialized():
        pytest.skip('a process group is already initialised in this test process')
    dist.init_process_group('fake', store=fake_pg.FakeStore(), rank=5, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_to_torch_keeps_the_grid_and_drops_size_one_dims(fake_world_of_eight_as_rank_5: None) -> None:
    mesh = DeviceMesh.from_sizes(tp_size=2, pp_size=2, dp_size=2, device_type='cpu')
    torch_mesh = mesh.to_torch()
    assert torch_mesh.mesh_dim_names == ('pp', 'dp', 'tp')
    assert torch_mesh.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    # torch's view of rank 5 agrees with ours: pp 1, dp 0, tp 1 and the same process groups.
    assert list(torch_mesh.get_coordinate()) == [1, 0, 1]
    for dim in ('pp', 'dp', 'tp'):
        assert torch_mesh[dim].mesh.tolist() == mesh.ranks_along(dim, 5)
