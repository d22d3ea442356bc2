"""Tinker's export path against a real server on loopback: the unmodified SDK's
``save_weights_external`` and ``get_external_weights_urls``, links fetched with a plain GET, and
tinker-cookbook's ``weights.download`` / ``build_hf_model`` / ``build_lora_adapter``, whose
models give the server's own logprobs."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from twinkle.server.cli import BackgroundServer
from twinkle.server.config import ServerConfig

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

TOKENS = [(7 * j) % 400 + 10 for j in range(12)]


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir) -> Iterator[tuple[str, dict[str, str]]]:
    config = ServerConfig.build(
        base_model=tiny_model_dir,
        port=0,
        data_dir=str(tmp_path_factory.mktemp('export')),
        device='cpu',
        tinker={'seq_gap_timeout_s': 1200},  # longer than the test may take: a missing seq_id would hang it
    )
    background = BackgroundServer(config)
    with background as url:
        store = background.app.state.service.store
        yield url, {name: store.tenants.add(name)[1] for name in ('alice', 'bob')}


@pytest.fixture(scope='module')
def trained(server, module_sdk_clients, tiny_model_dir) -> tuple[tinker.TrainingClient, torch.Tensor]:
    """Alice's model after three SFT steps, and the server's logprobs of TOKENS under it."""
    url, keys = server
    sdk = module_sdk_clients(url, keys['alice'])
    client = sdk.create_lora_training_client(base_model=tiny_model_dir, rank=8).result()
    data = [datum(TOKENS)]
    for _ in range(3):
        client.forward_backward(data, 'cross_entropy').result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    logprobs = client.forward(data, 'cross_entropy').result().loss_fn_outputs[0]['logprobs'].to_torch()
    return client, logprobs


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={'target_tokens': tokens[1:], 'weights': [1.0] * (len(tokens) - 1)},
    )


def logprobs_of(model: torch.nn.Module) -> torch.Tensor:
    """The model's log-probabilities of each next token of TOKENS (what the server's forward gives)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits.float()
    return logits.log_softmax(-1)[0].gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0]


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as answer:  # no API key: the link is the credential
        return answer.read()


def test_exported_weights_come_back_through_signed_links_with_the_server_s_logprobs(
    server, trained, tiny_model_dir, tmp_path
):
    url, keys = server
    client, served = trained
    path = client.save_weights_external('final').result().path
    assert path == f'tinker://{client.model_id}/external_weights/final'
    rest = tinker.RestClient(base_url=url, api_key=keys['alice'])
    links = rest.get_external_weights_urls(path).result()
    assert sorted(links.urls) == ['adapter_config.json', 'adapter_model.safetensors']
    assert timedelta(minutes=50) < links.expires - datetime.now(timezone.utc) < timedelta(minutes=70)
    for name, link in links.urls.items():
        (tmp_path / 'adapter').mkdir(exist_ok=True)
        (tmp_path / 'adapter' / name).write_bytes(fetch(link))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    exported = logprobs_of(PeftModel.from_pretrained(base, str(tmp_path / 'adapter')))
    torch.testing.assert_close(exported, served, atol=1e-4, rtol=1e-4)
    listed = {c.checkpoint_id: c.checkpoint_type for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert listed['external_weights/final'] == 'external'

    # An altered or foreign link is refused; another tenant gets no links; a deleted export's links stop.
    link = links.urls['adapter_model.safetensors']
    for altered in (link[:-1] + ('0' if link[-1] != '0' else '1'), link.replace('expires=', 'expires=1')):
        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch(altered)
        assert refused.value.code == 401 and b'ask for new links' in refused.value.read()
    bob = tinker.RestClient(base_url=url, api_key=keys['bob'])
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(path).result()
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(urllib.error.HTTPError) as gone:
        fetch(link)
    assert gone.value.code == 404


def test_tinker_cookbook_downloads_and_builds_models_with_the_server_s_logprobs(
    server, trained, tiny_model_dir, tmp_path, monkeypatch
):
    """weights.download of a training checkpoint: a new model loads it, exports it encrypted to
    a fresh age key, downloads, decrypts and deletes the export; then both builders."""
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter, download

    url, keys = server
    client, served = trained
    checkpoint = client.save_state('for-download').result().path
    monkeypatch.setenv('TINKER_API_KEY', keys['alice'])
    adapter = download(tinker_path=checkpoint, output_dir=str(tmp_path / 'download'), base_url=url)
    assert sorted(p.name for p in Path(adapter).iterdir()) == ['adapter_config.json', 'adapter_model.safetensors']
    build_hf_model(base_model=tiny_model_dir, adapter_path=adapter, output_path=str(tmp_path / 'hf'), dtype='float32')
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / 'hf')
    torch.testing.assert_close(logprobs_of(merged), served, atol=1e-4, rtol=1e-4)
    build_lora_adapter(base_model=tiny_model_dir, adapter_path=adapter, output_path=str(tmp_path / 'peft'))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft = logprobs_of(PeftModel.from_pretrained(base, str(tmp_path / 'peft')))
    torch.testing.assert_close(peft, served, atol=1e-4, rtol=1e-4)
    # download() deleted its encrypted export; the checkpoint it read stays.
    rest = tinker.RestClient(base_url=url, api_key=keys['alice'])
    listed = [c.checkpoint_id for c in rest.list_checkpoints(client.model_id).result().checkpoints]
    assert 'weights/for-download' in listed and not any(c.startswith('external_weights/') for c in listed)


def test_encrypted_exports_and_bad_recipients(server, trained):
    import pyrage

    url, keys = server
    client, _ = trained
    identity = pyrage.x25519.Identity.generate()
    path = client.save_weights_external('sealed', age_encryption_recipients=[str(identity.to_public())]).result().path
    rest = tinker.RestClient(base_url=url, api_key=keys['alice'])
    links = rest.get_external_weights_urls(path).result().urls
    assert sorted(links) == ['adapter_config.json.age', 'adapter_model.safetensors.age']
    config = pyrage.decrypt(fetch(links['adapter_config.json.age']), [identity])
    assert b'"lora_alpha"' in config
    # The SDK asks for external_weights/ paths only; asked directly, a training checkpoint's links are a 400.
    client.save_state('plain').result()
    route = f'{url}/api/v1/training_runs/{client.model_id}/checkpoints/weights/plain/external_weights_urls'
    answer = httpx.get(route, headers={'X-API-Key': keys['alice']})
    assert answer.status_code == 400 and 'is not exported weights' in answer.json()['detail']
    # A refused request still takes its seq_id: the model's next request runs at once, instead
    # of waiting for the missing number until the gap timeout (set long here) and failing.
    with pytest.raises(tinker.BadRequestError, match=r'age_encryption_recipients\[0\] is not an age'):
        client.save_weights_external('bad', age_encryption_recipients=['age1notakey']).result()
    assert client.save_weights_external('after-refusal').result().path.endswith('/external_weights/after-refusal')
