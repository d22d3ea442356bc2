"""The tests' Tinker SDK clients (sdk_clients.py): a session's heartbeat is found while its
client is open and is gone once ``ServiceClients`` closed it, which is what conftest.py's
``no_sdk_session_outlives_its_module`` checks at the end of every module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sdk_clients import ServiceClients, open_sdk_sessions
from server_helpers import background_server

from twinkle_client import init_tinker_compat_client

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, str]]:
    with background_server(tmp_path_factory.mktemp('sdk-clients'), tiny_model_dir, ('alice',)) as (url, keys, _):
        yield url, keys['alice']


def test_each_session_beats_until_its_client_is_closed(server):
    url, key = server
    before = set(open_sdk_sessions())
    with ServiceClients() as clients:
        made = clients(url, key)
        kept = clients.keep(init_tinker_compat_client(url, key))
        unused = clients(url, key)  # no request: no session, no heartbeat, and closing it is a no-op
        assert set(open_sdk_sessions()) == before  # a session starts with the client's first use
        sessions = {made.holder.get_session_id(), kept.holder.get_session_id()}
        assert len(sessions) == 2 and set(open_sdk_sessions()) - before == sessions
        made.close('success').result()  # closed by hand too: the factory's second close is a no-op
        assert set(open_sdk_sessions()) - before == {kept.holder.get_session_id()}
    assert set(open_sdk_sessions()) == before
    for client in (made, kept, unused):
        with pytest.raises(RuntimeError, match='ServiceClient is closed'):
            client.create_lora_training_client(base_model='tiny-qwen3', rank=4)


def test_the_fixture_closes_its_clients_when_the_test_ends(server, sdk_clients):
    url, key = server
    session_id = sdk_clients(url, key).holder.get_session_id()
    assert session_id in open_sdk_sessions()  # and the module's guard fails this test if it beats on after
