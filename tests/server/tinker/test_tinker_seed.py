"""The seed documents' Tinker client scripts, run against a real twinkle server on loopback with
the unpatched ``tinker`` SDK; and the two helpers they import: ``input_feature_to_datum`` and
``init_tinker_client``."""

from __future__ import annotations

import doctest
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from hypothesis import given
from hypothesis import strategies as st
from server_helpers import background_server
from tinker import types

import twinkle.server.common
import twinkle.tinker_sdk as tinker_sdk
from twinkle import init_tinker_client
from twinkle.data_format import IGNORE_INDEX
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, DataError
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.server.common import input_feature_to_datum
from twinkle.server.tinker.common import input_feature_to_datum as seed_000_import
from twinkle.tinker_sdk import check_tinker_version
from twinkle_client import init_tinker_compat_client

ROOT = Path(__file__).resolve().parents[3]
ENV_NAMES = ('TINKER_BASE_URL', 'TINKER_API_KEY', 'TWINKLE_SERVER_URL', 'TWINKLE_API_KEY')
KEY = 'tml-' + 'k' * 40


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    with background_server(tmp_path_factory.mktemp('tinker-seed'), tiny_model_dir, tenants=('alice',)) as running:
        url, keys, _ = running
        yield url, keys['alice']


def encode(model_dir: str, path: str, rows: int, template: str = 'Template') -> Dataset:
    dataset = Dataset(dataset_meta=DatasetMeta(path, data_slice=range(rows)))
    dataset.set_template(template, model_id=model_dir, max_length=256)
    dataset.map(SelfCognitionProcessor('twinkle Model', 'twinkle Team'), load_from_cache_file=False)
    dataset.encode(batched=True, load_from_cache_file=False)
    return dataset


@pytest.fixture(scope='module')
def rows(tiny_model_dir, self_cognition_path) -> list[dict]:
    return list(encode(tiny_model_dir, self_cognition_path, 8).dataset)


@pytest.fixture
def clean_env(monkeypatch):
    """None of the four variables set, each restored after the test (set first so that
    monkeypatch records it even when it was absent)."""
    for name in ENV_NAMES:
        monkeypatch.setenv(name, 'placeholder')
        monkeypatch.delenv(name)
    return monkeypatch


# ---- input_feature_to_datum -----------------------------------------------------------------------
def test_a_hand_made_row_becomes_the_datum_with_the_same_positions():
    # Tokens a b c d with c and d trained: twinkle's labels put c at position 1 and d at 2 (each
    # position predicts the next token), and so does the datum; the ignored ends get target 0, weight 0.
    datum = input_feature_to_datum({'input_ids': [5, 6, 7, 8], 'labels': [-100, 7, 8, -100]})
    assert datum.model_input.to_ints() == [5, 6, 7, 8]
    assert datum.loss_fn_inputs['target_tokens'].tolist() == [0, 7, 8, 0]
    assert datum.loss_fn_inputs['weights'].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert datum.loss_fn_inputs['target_tokens'].dtype == 'int64'
    assert datum.loss_fn_inputs['weights'].dtype == 'float32'
    assert seed_000_import is input_feature_to_datum  # the import path of seed 000


@given(st.lists(st.tuples(st.integers(0, 151_000), st.one_of(st.just(IGNORE_INDEX), st.integers(0, 151_000)))))
def test_every_row_keeps_its_tokens_and_trains_exactly_its_labels(pairs):
    if not pairs:
        with pytest.raises(DataError, match='at least one token'):
            input_feature_to_datum({'input_ids': [], 'labels': []})
        return
    ids, labels = map(list, zip(*pairs, strict=True))
    datum = input_feature_to_datum({'input_ids': ids, 'labels': labels})
    targets = datum.loss_fn_inputs['target_tokens'].tolist()
    weights = datum.loss_fn_inputs['weights'].tolist()
    assert datum.model_input.to_ints() == ids
    assert weights == [float(label != IGNORE_INDEX) for label in labels]
    assert [t for t, w in zip(targets, weights, strict=True) if w] == [x for x in labels if x != IGNORE_INDEX]
    assert all(t == 0 for t, w in zip(targets, weights, strict=True) if not w)


def test_encoded_rows_train_the_next_token_at_each_labelled_position(rows):
    # The template's labels are pre-shifted (labels[i] == input_ids[i + 1] where trained), so the
    # datum's target at a weighted position is the token that follows it in model_input.
    for row in rows:
        datum = input_feature_to_datum(row)
        tokens, targets = datum.model_input.to_ints(), datum.loss_fn_inputs['target_tokens'].tolist()
        weighted = [i for i, w in enumerate(datum.loss_fn_inputs['weights'].tolist()) if w]
        assert weighted and weighted[-1] < len(tokens) - 1
        assert [targets[i] for i in weighted] == [tokens[i + 1] for i in weighted]


@pytest.mark.parametrize(
    ('feature', 'message'),
    [
        ({'input_ids': [1, 2]}, r"lacks \['labels'\]"),
        ({'input_ids': [1, 2], 'labels': [2]}, 'labels has 1 values for 2 input_ids'),
        ({'input_ids': [[1, 2]], 'labels': [[2, -100]]}, 'one flat sequence'),
        ({'input_ids': [1, 2], 'labels': [2, -1]}, r'labels hold -1; a label is a token id \(>= 0\) or -100'),
        ({'input_ids': [1.0, 2.0], 'labels': [2, -100]}, r"integer token ids; got values of type \['float'\]"),
    ],
)
def test_a_row_that_is_not_one_encoded_sequence_is_refused(feature, message):
    with pytest.raises(DataError, match=message):
        input_feature_to_datum(feature)


@pytest.mark.integration
def test_the_tinker_loss_sum_is_twinkles_token_mean_times_the_token_count(server, rows, tiny_model_dir):
    # A fresh adapter's LoRA B is zero, so its first forward is the base model's: the same
    # numbers twinkle's own TransformersModel computes on the same rows.
    local = TransformersModel(model_id=tiny_model_dir, device='cpu')
    local.set_loss('CrossEntropyLoss')
    output = local.forward_only(inputs=rows)
    mean = local.calculate_loss()
    url, key = server
    with tinker.ServiceClient(base_url=url, api_key=key) as service_client:
        training_client = service_client.create_lora_training_client(base_model=tiny_model_dir, rank=8).result()
        result = training_client.forward_backward([input_feature_to_datum(r) for r in rows], 'cross_entropy').result()
    assert output.num_tokens == sum(label != IGNORE_INDEX for row in rows for label in row['labels'])
    assert result.metrics['loss:sum'] == pytest.approx(mean * output.num_tokens, rel=1e-5)
    for i, row in enumerate(rows):  # and token by token: Tinker's logprobs are twinkle's logps
        remote = result.loss_fn_outputs[i]['logprobs'].tolist()
        trained = [j for j, label in enumerate(row['labels']) if label != IGNORE_INDEX]
        assert [remote[j] for j in trained] == pytest.approx(output.logps[i, trained].tolist(), abs=1e-4)


# ---- the seed scripts -----------------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.filterwarnings('ignore:Using the future as the TrainingClient:FutureWarning')  # as the seed does
def test_seed_000_script_trains_and_saves(server, tiny_model_dir, self_cognition_path):
    """Seed 000's Tinker script with the model id, dataset path, URL and key replaced."""
    url, key = server
    base_model = tiny_model_dir
    dataset = encode(base_model, self_cognition_path, 64)
    dataloader = DataLoader(dataset=dataset, batch_size=8)
    service_client = init_tinker_compat_client(url, key)
    assert isinstance(service_client, tinker.ServiceClient)
    with service_client:
        training_client = service_client.create_lora_training_client(base_model=base_model, rank=16)
        losses, paths = [], []
        for epoch in range(3):
            for _step, batch in enumerate(dataloader):
                input_datum = [input_feature_to_datum(input_feature) for input_feature in batch]
                fwdbwd_future = training_client.forward_backward(input_datum, 'cross_entropy')
                optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
                fwdbwd_result = fwdbwd_future.result()
                optim_future.result()
                tokens = sum(sum(d.loss_fn_inputs['weights'].tolist()) for d in input_datum)
                losses.append(fwdbwd_result.metrics['loss:sum'] / tokens)
            paths.append(training_client.save_state(f'twinkle-lora-{epoch}').result().path)
    assert all(math.isfinite(loss) for loss in losses)
    # 8 steps an epoch at the seed's learning rate: on the random tiny model the per-token loss
    # (8.9 untrained) averages about 8.6 over the first epoch and 7.5 over the third; ask for half that.
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < first - 0.5, losses
    run_id = paths[0].removeprefix('tinker://').split('/')[0]
    assert paths == [f'tinker://{run_id}/weights/twinkle-lora-{epoch}' for epoch in range(3)]


@pytest.mark.integration
def test_seed_002_script_runs_offline_and_its_loss_falls(tmp_path, tiny_model_dir):
    """cookbook/tinker_sft.py is seed 002's section 3.2 script; with no URL it starts its own server."""
    command = [sys.executable, str(ROOT / 'cookbook' / 'tinker_sft.py'), '--samples', '32', '--lr', '1e-3']
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES and k != 'MODELSCOPE_TOKEN'}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r'epoch \d step \d loss ([\d.]+)', done.stdout)]
    assert len(losses) == 12, done.stdout[-2000:]  # 3 epochs of 4 batches of 8
    # At lr 1e-3 the per-token loss averages about 8.2 over the first epoch and 4.8 over the third.
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 2.0, losses
    saved = re.findall(r'Saved checkpoint to (tinker://\S+)', done.stdout)
    assert [path.rsplit('/', 1)[1] for path in saved] == ['twinkle-lora-0', 'twinkle-lora-1', 'twinkle-lora-2']


# ---- init_tinker_client ---------------------------------------------------------------------------
@pytest.mark.integration
def test_init_tinker_client_points_an_argumentless_service_client_at_the_server(server, clean_env, tiny_model_dir):
    url, key = server
    init_tinker_client(url, key)
    assert (os.environ['TINKER_BASE_URL'], os.environ['TINKER_API_KEY']) == (url, key)
    with tinker.ServiceClient() as service_client:
        training_client = service_client.create_lora_training_client(base_model=tiny_model_dir, rank=8).result()
        info = training_client.get_info()
    assert (info.model_data.model_name, info.lora_rank) == (tiny_model_dir, 8)


def test_twinkle_variables_fill_the_sdks_only_when_it_has_none(clean_env):
    clean_env.setenv('TWINKLE_SERVER_URL', 'http://twinkle:8000')
    clean_env.setenv('TWINKLE_API_KEY', KEY)
    init_tinker_client()
    assert (os.environ['TINKER_BASE_URL'], os.environ['TINKER_API_KEY']) == ('http://twinkle:8000', KEY)
    clean_env.setenv('TINKER_BASE_URL', 'http://already-set')
    init_tinker_client()
    assert os.environ['TINKER_BASE_URL'] == 'http://already-set'
    init_tinker_client(base_url='http://argument')  # an argument says where to go: it replaces
    assert os.environ['TINKER_BASE_URL'] == 'http://argument'


def test_init_tinker_client_leaves_an_unset_environment_unset(clean_env):
    init_tinker_client()
    assert not any(name in os.environ for name in ENV_NAMES)


def test_keys_the_sdk_would_refuse_are_refused_here_first(clean_env):
    with pytest.raises(ConfigurationError, match=r"'abcd'\.\.\. would be refused .* \['tml-', 'eyJ'\]"):
        init_tinker_client('http://127.0.0.1:8000', 'abcdefgh')
    assert 'TINKER_BASE_URL' not in os.environ  # nothing set when refused
    with pytest.raises(ConfigurationError, match='base_url must be a non-empty string'):
        init_tinker_client('', KEY)


@pytest.mark.parametrize('version', ['0.38.0', '0.38.7', '0.38.1rc1'])
def test_tinker_releases_of_the_supported_series_pass(version):
    assert check_tinker_version(version) == version


@pytest.mark.parametrize('version', ['0.37.9', '0.39.0', '1.0.0'])
def test_other_tinker_releases_are_refused_with_the_supported_range(version):
    with pytest.raises(ConfigurationError, match=rf'tinker {re.escape(version)} is installed, .* tinker>=0\.38,<0\.39'):
        check_tinker_version(version)


def test_the_installed_tinker_is_checked_by_both_entry_points(monkeypatch, clean_env):
    assert check_tinker_version() == tinker.__version__
    monkeypatch.setattr(tinker_sdk, 'installed_tinker_version', lambda: '0.39.2')
    with pytest.raises(ConfigurationError, match=r'tinker 0\.39\.2 is installed'):
        init_tinker_client('http://127.0.0.1:8000', KEY)
    with pytest.raises(ConfigurationError, match=r'tinker 0\.39\.2 is installed'):
        init_tinker_compat_client('http://127.0.0.1:8000', KEY)
    assert 'TINKER_BASE_URL' not in os.environ


def test_a_missing_tinker_sdk_says_how_to_install_it(monkeypatch):
    def not_installed(name: str) -> str:
        raise tinker_sdk.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(tinker_sdk.importlib.metadata, 'version', not_installed)
    with pytest.raises(ConfigurationError, match=r"not installed; .*pip install 'tinker>=0\.38,<0\.39'"):
        check_tinker_version()


def test_doctests():
    for module in (twinkle.server.common, tinker_sdk):
        assert doctest.testmod(module, raise_on_error=False).failed == 0, module.__name__
