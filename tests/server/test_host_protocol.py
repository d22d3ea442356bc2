"""The hosts speak one typed protocol: every wire operation has a handler in ``ModelHost``'s
table, and every method a forwarding host sends by name is a ``ModelHost`` method that takes the
same arguments (so a ``RemoteHost`` or ``MultiRankHost`` call reaches what it names)."""

from __future__ import annotations

import inspect

import pytest

from twinkle import assets
from twinkle.errors import ConfigurationError
from twinkle.server.config import ServerConfig
from twinkle.server.execution.host import FORWARDED, ForwardingHost
from twinkle.server.execution.hosts.model_host import ModelHost
from twinkle.wire import OPERATIONS


def _parameters(function: object) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]  # type: ignore[arg-type]


@pytest.mark.parametrize('name', sorted(FORWARDED))
def test_a_forwarded_method_is_the_model_hosts_with_the_same_arguments(name):
    assert callable(getattr(ModelHost, name, None)), f'ModelHost has no {name}'
    assert _parameters(getattr(ForwardingHost, name)) == _parameters(getattr(ModelHost, name))


@pytest.fixture(scope='module')
def host() -> ModelHost:
    return ModelHost(ServerConfig(base_model=assets.tiny_model('tiny-qwen3'), device='cpu'))


def test_every_wire_operation_has_a_handler_and_nothing_else_does(host):
    assert sorted(host.operations) == sorted(OPERATIONS)


def test_an_unknown_operation_names_the_accepted_ones(host):
    host.add_adapter('a', {'r': 2, 'target_modules': ['q_proj']})
    with pytest.raises(ConfigurationError, match=r"unknown operation 'call'; accepted: \['add_metric'"):
        host.run('a', 'call', {})


def test_ping_and_footprint_answer_in_process(host):
    # What the benchmarks and the rank tests read of a group, from the in-process host: all of the weights.
    host.ping()
    (rank,) = host.footprint()
    assert rank['rank'] == 0 and rank['decoder_elements_held'] == rank['decoder_elements'] > 0
    assert rank['base_bytes_held'] == rank['base_bytes'] and rank['resident_mib'] > 0
