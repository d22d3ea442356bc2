"""The official ``tinker`` SDK's ``RestClient``, unmodified, against a real server on loopback:
training runs of both APIs, checkpoints (listing, deleting, publishing, TTLs), weights info and
sessions, each also as another tenant, who must find nothing.

Every test has tenants of its own (``carol-<test>``), so counts and orders are exact.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import tinker
from peft import LoraConfig
from tinker import types

from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig
from twinkle.server.store import Store
from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

#: Seconds between two sweeps for expired checkpoints: short, so that a TTL test takes seconds.
SWEEP_S = 0.2


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, Store, BackgroundServer]]:
    config = ServerConfig.build(
        base_model=tiny_model_dir,
        port=0,
        data_dir=str(tmp_path_factory.mktemp('tinker-rest')),
        device='cpu',
        tinker={'checkpoint_expiry_interval_s': SWEEP_S, 'retrieve_wait_s': 5.0},
    )
    background = BackgroundServer(config)
    with background as url:
        yield url, background.app.state.service.store, background


@dataclass
class Account:
    name: str
    key: str
    sdk: tinker.ServiceClient
    url: str

    @property
    def rest(self) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.url, api_key=self.key)


@pytest.fixture
def tenant(server, sdk_clients) -> Callable[..., Account]:
    """``tenant('alice')``: a new tenant of this test, with an SDK ServiceClient for its key
    (closed when the test ends)."""
    url, store, _ = server

    def make(name: str, **kwargs) -> Account:
        tenant, key = store.tenants.add(f'{name}-{next(_numbers)}')
        return Account(tenant.name, key, sdk_clients(url, key, **kwargs), url)

    return make


_numbers = itertools.count()


def training_client(service: tinker.ServiceClient, model: str, **kwargs) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=model, rank=kwargs.pop('rank', 4), **kwargs).result()


def native_run(url: str, key: str, lora: LoraConfig) -> tuple[MultiLoraTransformersModel, str]:
    """A run of twinkle's own API: the model and its run id."""
    model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
    return model, model.add_adapter_to_model('native', lora)


def on_disk(server, run_id: str, checkpoint_id: str) -> Path:
    """Where the server keeps a checkpoint's files (the API never tells)."""
    folder, name = checkpoint_id.split('/')
    kind = {'weights': 'training', 'sampler_weights': 'sampler'}[folder]
    store = server[1]
    run = store.runs.by_id(run_id)
    return Path(store.checkpoints.get(run.tenant_id, run_id, name, kind).path)


def wait_for(condition: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def near_now(moment: datetime, slack_s: float = 60.0) -> bool:
    return abs(moment - datetime.now(timezone.utc)) < timedelta(seconds=slack_s)


def datum(tokens: list[int]) -> types.Datum:
    """An SFT datum: position i predicts ``tokens[i + 1]``."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={'target_tokens': tokens[1:], 'weights': [1.0] * (len(tokens) - 1)},
    )


def test_runs_of_both_apis_are_listed_newest_first_with_their_details(server, tenant, tiny_model_dir):
    alice = tenant('alice')
    rest = alice.rest
    trained = training_client(alice.sdk, tiny_model_dir, rank=4, user_metadata={'purpose': 'rest'})
    trained.save_state('first').result()
    trained.save_weights_for_sampler('first-sampler').result()
    trained.save_state('second').result()
    _, native_id = native_run(server[0], alice.key, LoraConfig(r=8, target_modules=['q_proj', 'v_proj']))

    page = rest.list_training_runs().result()
    assert [r.training_run_id for r in page.training_runs] == [native_id, trained.model_id]
    assert (page.cursor.offset, page.cursor.limit, page.cursor.total_count) == (0, 20, 2)
    run = rest.get_training_run(trained.model_id).result()
    assert run == page.training_runs[1]
    assert (run.base_model, run.model_owner, run.is_lora, run.lora_rank, run.corrupted) == (
        tiny_model_dir,
        alice.name,
        True,
        4,
        False,
    )
    assert near_now(run.last_request_time) and run.user_metadata == {'purpose': 'rest'}
    assert run.last_checkpoint.tinker_path == f'tinker://{trained.model_id}/weights/second'
    assert run.last_sampler_checkpoint.checkpoint_id == 'sampler_weights/first-sampler'
    plain = rest.get_training_run(native_id).result()
    assert (plain.model_owner, plain.lora_rank, plain.last_checkpoint, plain.user_metadata) == (
        alice.name,
        8,
        None,
        None,
    )
    second = rest.list_training_runs(limit=1, offset=1).result()
    assert [r.training_run_id for r in second.training_runs] == [trained.model_id]
    assert (second.cursor.offset, second.cursor.limit, second.cursor.total_count) == (1, 1, 2)
    path = f'tinker://{trained.model_id}/weights/first'
    assert rest.get_training_run_by_tinker_path(path).result().training_run_id == trained.model_id
    with pytest.warns(FutureWarning, match='create_rest_client'):  # the SDK's older way to a RestClient
        legacy = alice.sdk.create_rest_client()
    assert legacy.get_training_run(trained.model_id).result() == run


def test_runs_are_listed_by_project(server, tenant, sdk_clients, tiny_model_dir):
    alice = tenant('alice', project_id='proj-a')
    other = sdk_clients(server[0], alice.key, project_id='proj-b')
    in_a, in_b = training_client(alice.sdk, tiny_model_dir), training_client(other, tiny_model_dir)
    by_project = {p: alice.rest.list_training_runs(project_id=p).result() for p in ('proj-a', 'proj-b', 'c')}
    assert [r.training_run_id for r in by_project['proj-a'].training_runs] == [in_a.model_id]
    assert [r.training_run_id for r in by_project['proj-b'].training_runs] == [in_b.model_id]
    assert by_project['c'].training_runs == [] and by_project['c'].cursor.total_count == 0


def test_checkpoints_are_listed_per_run_and_per_user_with_pagination(server, tenant, tiny_model_dir):
    alice = tenant('alice')
    rest = alice.rest
    client, later = training_client(alice.sdk, tiny_model_dir), training_client(alice.sdk, tiny_model_dir)
    before = datetime.now(timezone.utc)
    client.save_state('a').result()
    client.save_weights_for_sampler('b').result()
    later.save_state('c').result()

    listed = rest.list_checkpoints(client.model_id).result().checkpoints
    kinds = [(c.checkpoint_id, c.checkpoint_type) for c in listed]
    assert kinds == [('weights/a', 'training'), ('sampler_weights/b', 'sampler')]
    for checkpoint in listed:
        assert checkpoint.tinker_path == f'tinker://{client.model_id}/{checkpoint.checkpoint_id}'
        files = on_disk(server, client.model_id, checkpoint.checkpoint_id)
        assert checkpoint.size_bytes == sum(f.stat().st_size for f in files.rglob('*') if f.is_file()) > 0
        assert not checkpoint.public and checkpoint.expires_at is None
        assert before - timedelta(seconds=1) <= checkpoint.time <= datetime.now(timezone.utc)
    # Per user: every run's checkpoints, newest first, a page at a time.
    first = rest.list_user_checkpoints(limit=2).result()
    assert [c.tinker_path for c in first.checkpoints] == [
        f'tinker://{later.model_id}/weights/c',
        f'tinker://{client.model_id}/sampler_weights/b',
    ]
    assert (first.cursor.offset, first.cursor.limit, first.cursor.total_count) == (0, 2, 3)
    last = rest.list_user_checkpoints(limit=2, offset=2).result()
    assert [c.tinker_path for c in last.checkpoints] == [f'tinker://{client.model_id}/weights/a']
    assert (last.cursor.offset, last.cursor.total_count) == (2, 3)
    assert [c.checkpoint_id for c in rest.list_checkpoints(later.model_id).result().checkpoints] == ['weights/c']


def test_deleting_a_checkpoint_removes_its_files_and_unloads_its_sampler(server, tenant, tiny_model_dir):
    alice = tenant('alice')
    rest, host = alice.rest, server[2].app.state.service.default.host
    client = training_client(alice.sdk, tiny_model_dir)
    sampler_path = client.save_weights_for_sampler('gone').result().path
    state_path = client.save_state('publish').result().path  # a name that is also a route's last segment
    kept = client.save_state('kept').result().path
    files = [
        on_disk(server, client.model_id, f'{folder}/{name}')
        for folder, name in [('sampler_weights', 'gone'), ('weights', 'publish')]
    ]
    prompt, greedy = types.ModelInput.from_ints([11, 42, 7]), types.SamplingParams(max_tokens=2, temperature=0.0)
    alice.sdk.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, greedy).result()
    assert str(files[0]) in host._sampler_adapters  # sampling loaded the saved weights

    rest.delete_checkpoint(client.model_id, 'sampler_weights/gone').result()
    rest.delete_checkpoint_from_tinker_path(state_path).result()
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [kept]
    assert not any(f.exists() for f in files)
    assert wait_for(lambda: str(files[0]) not in host._sampler_adapters)
    with pytest.raises(tinker.NotFoundError):
        alice.sdk.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, greedy).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint(client.model_id, 'sampler_weights/gone').result()
    for malformed in ('checkpoints/kept', 'weights/.hidden', 'exported/x', 'kept'):
        with pytest.raises(tinker.BadRequestError, match='expected weights/<name>, sampler_weights/<name> or'):
            rest.delete_checkpoint(client.model_id, malformed).result()
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [kept]
    assert on_disk(server, client.model_id, 'weights/kept').exists()


def test_saving_sampler_weights_again_under_a_name_samples_the_new_weights(tenant, tiny_model_dir):
    alice = tenant('alice')
    client = training_client(alice.sdk, tiny_model_dir, seed=1)
    tokens = [11, 42, 7, 99, 5]

    def scored() -> float:
        """The summed logprob of ``tokens`` under the weights saved as 'latest' just now."""
        path = client.save_weights_for_sampler('latest').result().path
        sampler = alice.sdk.create_sampling_client(model_path=path).result()
        return sum(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])

    before = scored()
    for _ in range(3):  # training on the very tokens makes them likelier
        client.forward_backward([datum(tokens)], 'cross_entropy').result()
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert scored() > before + 0.1  # the same tinker path, newer weights: not the first ones still loaded


def test_a_published_checkpoint_is_loaded_by_others_but_stays_its_owners(tenant, tiny_model_dir):
    alice, bob = tenant('alice'), tenant('bob')
    owner, other = alice.rest, bob.rest
    client = training_client(alice.sdk, tiny_model_dir, seed=2)
    path = client.save_state('shared').result().path
    with pytest.raises(tinker.NotFoundError):
        bob.sdk.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(path).result()

    owner.publish_checkpoint_from_tinker_path(path).result()
    assert [c.public for c in owner.list_checkpoints(client.model_id).result().checkpoints] == [True]
    copy = bob.sdk.create_training_client_from_state(path).result()
    example = [datum([3, 14, 15, 92, 65])]
    mine, theirs = (c.forward(example, 'cross_entropy').result() for c in (client, copy))
    assert theirs.loss_fn_outputs[0]['logprobs'].tolist() == mine.loss_fn_outputs[0]['logprobs'].tolist()
    assert other.get_weights_info_by_tinker_path(path).result().lora_rank == 4
    # Loading is all another tenant may do with it.
    assert other.list_user_checkpoints().result().checkpoints == []
    for call in (
        lambda: other.list_checkpoints(client.model_id),
        lambda: other.get_training_run(client.model_id),
        lambda: other.publish_checkpoint_from_tinker_path(path),
        lambda: other.unpublish_checkpoint_from_tinker_path(path),
        lambda: other.set_checkpoint_ttl_from_tinker_path(path, 1),
        lambda: other.delete_checkpoint_from_tinker_path(path),
    ):
        with pytest.raises(tinker.NotFoundError):
            call().result()
    listed = owner.list_checkpoints(client.model_id).result().checkpoints
    assert [(c.tinker_path, c.public, c.expires_at) for c in listed] == [(path, True, None)]

    owner.unpublish_checkpoint_from_tinker_path(path).result()
    assert [c.public for c in owner.list_checkpoints(client.model_id).result().checkpoints] == [False]
    with pytest.raises(tinker.NotFoundError):
        bob.sdk.create_training_client_from_state(path).result()


def test_a_ttl_deletes_the_checkpoint_and_its_files_once_it_expires(server, tenant, tiny_model_dir):
    alice = tenant('alice')
    rest = alice.rest
    client = training_client(alice.sdk, tiny_model_dir)
    short = client.save_weights_for_sampler('short').result().path
    kept = client.save_state('kept').result().path
    files = on_disk(server, client.model_id, 'sampler_weights/short')
    rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
    expiry = {c.tinker_path: c.expires_at for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert expiry[kept] - datetime.now(timezone.utc) == pytest.approx(timedelta(hours=1), abs=timedelta(seconds=30))
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()  # cleared: kept until deleted
    with pytest.raises(tinker.UnprocessableEntityError):
        rest.set_checkpoint_ttl_from_tinker_path(kept, 0).result()

    set_at = time.monotonic()
    rest.set_checkpoint_ttl_from_tinker_path(short, 1).result()
    listed = rest.list_checkpoints(client.model_id).result().checkpoints
    assert [(c.tinker_path, c.expires_at is None) for c in listed] == [(short, False), (kept, True)]
    assert files.exists()
    assert wait_for(lambda: not files.exists(), timeout_s=15.0)  # the sweep's doing: nobody listed meanwhile
    assert time.monotonic() - set_at >= 1.0
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [kept]
    assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == [kept]
    time.sleep(3 * SWEEP_S)
    assert on_disk(server, client.model_id, 'weights/kept').exists()


def test_weights_info_tells_the_lora_config_of_tinker_and_native_runs(server, tenant, tiny_model_dir):
    alice = tenant('alice')
    rest = alice.rest
    client = training_client(alice.sdk, tiny_model_dir, rank=4, train_unembed=False)
    info = rest.get_weights_info_by_tinker_path(client.save_state('info').result().path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (tiny_model_dir, True, 4)
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, False)
    sampler = client.save_weights_for_sampler('info').result().path
    assert rest.get_weights_info_by_tinker_path(sampler).result() == info
    # Native runs: what their peft target_modules tell.
    cases = [
        (LoraConfig(r=8, target_modules=['q_proj', 'v_proj']), (8, True, False, False)),
        (LoraConfig(r=6, target_modules=['down_proj', 'lm_head']), (6, False, True, True)),
        (LoraConfig(r=2, target_modules='all-linear'), (2, True, True, False)),
    ]
    for lora, expected in cases:
        model, run_id = native_run(server[0], alice.key, lora)
        model.save('native-info')
        info = rest.get_weights_info_by_tinker_path(f'tinker://{run_id}/weights/native-info').result()
        assert (info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == expected, lora
    # a path no checkpoint can have is not found, and the answer says what a path looks like
    with pytest.raises(tinker.NotFoundError, match='tinker://<run_id>/weights/<name>'):
        rest.get_weights_info_by_tinker_path('tinker://run-x/weights/..').result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(f'tinker://{client.model_id}/weights/never-saved').result()


def test_a_session_lists_its_runs_and_samplers(server, tenant, sdk_clients, tiny_model_dir):
    alice = tenant('alice', user_metadata={'team': 'rest'})
    second = sdk_clients(server[0], alice.key)
    rest = alice.rest
    session_id = alice.sdk.holder.get_session_id()
    client = training_client(alice.sdk, tiny_model_dir)
    by_name = alice.sdk.create_sampling_client(base_model=tiny_model_dir).result()
    unnamed = client.save_weights_and_get_sampling_client().result()
    session = rest.get_session(session_id).result()
    second_id = second.holder.get_session_id()
    empty = rest.get_session(second_id).result()
    pages = [
        rest.list_sessions(limit=limit, offset=offset).result().sessions for limit, offset in [(1, 0), (10, 0), (10, 1)]
    ]
    assert session.training_run_ids == [client.model_id]
    assert session.sampler_ids == [by_name._sampling_session_id, unnamed._sampling_session_id]
    assert session.user_metadata == {'team': 'rest'}
    assert pages == [[second_id], [second_id, session_id], [session_id]]  # newest first
    assert (empty.training_run_ids, empty.sampler_ids) == ([], [])
    with pytest.raises(tinker.NotFoundError):
        rest.get_session('sess-nope').result()


def test_another_tenants_runs_checkpoints_and_sessions_do_not_exist(server, tenant, tiny_model_dir):
    url = server[0]
    alice, bob = tenant('alice'), tenant('bob')
    client = training_client(alice.sdk, tiny_model_dir)
    client.save_state('private').result()
    alice.rest.publish_checkpoint_from_tinker_path(client.save_weights_for_sampler('public').result().path).result()
    _, native_id = native_run(url, alice.key, LoraConfig(r=4, target_modules=['q_proj']))
    session_id, bob_session = alice.sdk.holder.get_session_id(), bob.sdk.holder.get_session_id()
    rest = bob.rest
    calls = {
        'get run': lambda run: rest.get_training_run(run),
        'list checkpoints': lambda run: rest.list_checkpoints(run),
        'delete': lambda run: rest.delete_checkpoint(run, 'weights/private'),
        'publish': lambda run: rest.publish_checkpoint_from_tinker_path(f'tinker://{run}/weights/private'),
        'unpublish': lambda run: rest.unpublish_checkpoint_from_tinker_path(f'tinker://{run}/sampler_weights/public'),
        'ttl': lambda run: rest.set_checkpoint_ttl_from_tinker_path(f'tinker://{run}/weights/private', 5),
        'weights info': lambda run: rest.get_weights_info_by_tinker_path(f'tinker://{run}/weights/private'),
        'session': lambda run: rest.get_session(session_id if run == client.model_id else 'sess-missing'),
    }
    for name, call in calls.items():
        for run_id in (client.model_id, native_id, 'sess-missing:train:0'):  # alice's two, and nobody's
            with pytest.raises(tinker.NotFoundError) as error:
                call(run_id).result()
            assert error.value.status_code == 404, (name, run_id)
    assert rest.list_training_runs().result().training_runs == []
    assert rest.list_user_checkpoints().result().checkpoints == []
    assert rest.list_sessions().result().sessions == [bob_session]
    # The owner still has all of it, unchanged.
    listed = alice.rest.list_checkpoints(client.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.public, c.expires_at) for c in listed] == [
        ('weights/private', False, None),
        ('sampler_weights/public', True, None),
    ]
    answer = httpx.get(f'{url}/api/v1/training_runs/{client.model_id}', headers={'X-API-Key': bob.key})
    assert answer.status_code == 404 and client.model_id in answer.json()['detail']


def test_what_the_server_has_no_notion_of_is_refused_at_once(server, tenant, tiny_model_dir):
    alice = tenant('alice')
    rest = alice.rest
    session_id = alice.sdk.holder.get_session_id()
    path = training_client(alice.sdk, tiny_model_dir).save_state('x').result().path
    started = time.monotonic()
    for call, message in [
        (lambda: rest.copy_weights(path, 'proj-1'), 'no projects'),
        (lambda: rest.assign_session_project(session_id, 'proj-1'), 'no projects'),
        (lambda: rest.search_sessions(types.SessionSearchRequest()), 'list_sessions'),
    ]:
        with pytest.raises(tinker.BadRequestError, match=message):
            call().result()
    with pytest.raises(tinker.NotFoundError, match='external_weights/x'):
        rest.get_external_weights_urls(path.replace('/weights/', '/external_weights/')).result()
    assert time.monotonic() - started < 20  # answered, not retried for minutes
    headers = {'X-API-Key': alice.key}
    for route, params in [('checkpoints', {'limit': -1}), ('sessions', {'access_scope': 'everyone'})]:
        assert httpx.get(f'{server[0]}/api/v1/{route}', params=params, headers=headers).status_code == 422
