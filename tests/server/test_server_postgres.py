"""The server on a PostgreSQL store (issue 34, point 1): the same service as on SQLite, its rows in a real
PostgreSQL server's database; the database unreachable at start is a clear error after retries with back-off,
and the database going away in the middle answers 503s with ``Retry-After`` until it is back, losing nothing
acknowledged."""

from __future__ import annotations

import time

import httpx
import pg_helpers
import psycopg
import pytest
from peft import LoraConfig
from server_helpers import background_server

from twinkle.errors import StoreUnavailableError
from twinkle.server.store import Store
from twinkle_client import RemoteError, TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

ROWS = [{'input_ids': [5, 6, 7, 8, 9, 10], 'labels': [-100, 6, 7, 8, 9, 10]}]


@pytest.mark.integration
def test_a_server_on_postgres_trains_saves_and_meters(tmp_path, tiny_model_dir, postgres_url):
    with background_server(tmp_path, tiny_model_dir, tenants=('alice',), store=postgres_url) as (url, keys, _):
        model = MultiLoraTransformersModel(client=TwinkleClient(url, keys['alice']))
        run_id = model.add_adapter_to_model('pg', LoraConfig(r=4, target_modules='all-linear'))
        model.set_optimizer('AdamW', lr=1e-3)
        losses = []
        for _ in range(2):
            losses.append(model.forward_backward(inputs=ROWS).loss)
            model.clip_grad_and_step()
        path = model.save('pg-ckpt')
        assert losses[1] < losses[0] and path == f'twinkle://{run_id}/checkpoints/pg-ckpt'
        usage = model.client.usage().tenants[0].total
        assert usage.tokens_trained == 2 * len(ROWS[0]['input_ids']) and usage.checkpoints_saved == 1
    assert not (tmp_path / 'twinkle.db').exists()  # the rows are in PostgreSQL, not a SQLite file
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute('SELECT status FROM runs WHERE id = %s', (run_id,)).fetchone() == ('released',)  # at stop
        assert conn.execute("SELECT COUNT(*) FROM checkpoints WHERE name = 'pg-ckpt'").fetchone() == (1,)


def test_an_unreachable_database_at_start_is_a_clear_error_after_retries():
    url = f'postgresql://twinkle:hunter2@127.0.0.1:{pg_helpers.free_port()}/nothing'
    began = time.monotonic()
    with pytest.raises(StoreUnavailableError) as error:
        Store(url, connect_timeout_s=1.5)
    waited = time.monotonic() - began
    message = str(error.value)
    assert message.startswith('cannot reach the PostgreSQL store at postgresql://twinkle:***@127.0.0.1:')
    assert 'hunter2' not in message and 'tried for 2 s' in message
    assert waited >= 1.5, waited  # retried with back-off for its whole timeout, not refused at the first try


@pytest.mark.integration
def test_the_database_gone_in_the_middle_is_a_503_until_it_is_back(tmp_path, tiny_model_dir):
    with (
        pg_helpers.postgres_server() as own,
        pg_helpers.fresh_database(own) as store_url,
        background_server(tmp_path, tiny_model_dir, tenants=('alice',), store=store_url) as (url, keys, _),
    ):
        client = TwinkleClient(url, keys['alice'], max_retries=1)
        model = MultiLoraTransformersModel(client=client)
        run_id = model.add_adapter_to_model('pg', LoraConfig(r=4, target_modules='all-linear'))
        saved = model.save('before')

        own.pause()  # PostgreSQL stops: the server's connection breaks
        try:
            headers = {'Authorization': f'Bearer {keys["alice"]}'}
            answer = httpx.get(f'{url}/twinkle/v1/runs/{run_id}', headers=headers, timeout=60)
            assert answer.status_code == 503, answer.text
            assert answer.json()['error'] == 'StoreUnavailableError'
            assert 'the PostgreSQL store stopped answering' in answer.json()['detail']
            assert int(answer.headers['Retry-After']) >= 1
            with pytest.raises(RemoteError) as refused:
                model.forward_backward(inputs=ROWS)
            assert refused.value.status == 503
            assert httpx.get(f'{url}/healthz', timeout=30).status_code == 200  # the server itself stays up
        finally:
            own.resume()
        model.client = TwinkleClient(url, keys['alice'])  # retries a 503 after its Retry-After, as a 429
        assert model.forward_backward(inputs=ROWS).loss > 0  # reconnected within its back-off
        kept = [c.twinkle_path for c in model.client.list_checkpoints(run_id)]
        assert kept == [saved]  # nothing acknowledged was lost


def test_the_store_setting_takes_a_postgres_url_only():
    from twinkle.errors import ConfigurationError
    from twinkle.server.config import ServerConfig

    url = 'postgresql://twinkle:pw@db:5432/twinkle'
    assert ServerConfig.build(base_model='m', store=url).store_location == url
    assert str(ServerConfig.build(base_model='m', data_dir='/d').store_location) == '/d/twinkle.db'
    with pytest.raises(ConfigurationError, match=r"store must be a postgresql://.* got one starting 'mysql://db/x'"):
        ServerConfig.build(base_model='m', store='mysql://db/x')
