"""A model group whose ranks are Ray actors on two nodes (``ranks: 2`` with ``ray:``): a local
Ray cluster of two nodes on loopback (``ray.cluster_utils.Cluster``, one CPU each, so the two
ranks must land on different nodes), FSDP2 over gloo across them, and three tenants that get the
numbers of a one-rank host in this process (1e-5, as ``tests/server/test_server_ranks.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_server_ranks import TOL, flat, train

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

ray = pytest.importorskip('ray')

from ray.cluster_utils import Cluster  # noqa: E402

from twinkle import assets  # noqa: E402
from twinkle.infra.ray.cluster import LOCAL_SYSTEM_CONFIG  # noqa: E402
from twinkle.server.config import ServerConfig  # noqa: E402
from twinkle.server.execution.hosts.model_host import ModelHost  # noqa: E402
from twinkle.server.execution.placement import build_host  # noqa: E402


@pytest.fixture(scope='module')
def two_nodes() -> Iterator[str]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={'num_cpus': 1, 'include_dashboard': False, '_system_config': LOCAL_SYSTEM_CONFIG},
    )
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_group_on_two_nodes_trains_with_the_numbers_of_one_rank(two_nodes):
    model = assets.tiny_model('tiny-qwen3')
    config = ServerConfig(base_model=model, device='cpu', ranks=2, fsdp_size=2, ray={'address': two_nodes})
    host = build_host(config)
    try:
        nodes = host._workers.nodes  # where Ray placed rank 0 and rank 1
        assert len(set(nodes)) == 2 and set(nodes) == {node['NodeID'] for node in ray.nodes() if node['Alive']}
        on_two_nodes = train(host)
    finally:
        host.shutdown()
    on_one_rank = train(ModelHost(ServerConfig(base_model=model, device='cpu')))
    assert torch.allclose(flat(on_two_nodes), flat(on_one_rank), rtol=TOL, atol=TOL)
