"""The web dashboard in a real browser: headless Chromium (Debian's, driven by Playwright) signs
in with a tenant's key, watches a run's curves grow while it trains, downloads, publishes and
deletes a checkpoint, and never sees another tenant's run, on the page or in any answer it gets;
the admin key sees tenants, models and passes. Screenshots are saved and checked."""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from peft import LoraConfig
from PIL import Image, ImageChops
from safetensors.torch import load_file
from server_helpers import background_server

from twinkle_client import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Debian's chromium is not installed: `make test` installs it with apt-get as root"
    ),
]
ADMIN_KEY = 'admin-' + 'k' * 40
ROWS = [{'input_ids': [5 + i, 17, 42, 99, 3 + i, 8], 'labels': [5 + i, 17, 42, 99, 3 + i, 8]} for i in range(2)]
TIMEOUT_MS = 60_000


@pytest.fixture(scope='module')
def server(tmp_path_factory, tiny_model_dir):
    data_dir = tmp_path_factory.mktemp('dashboard')
    with background_server(data_dir, tiny_model_dir, admin_api_key=ADMIN_KEY) as (url, keys, running):
        yield url, keys, running.app.state.service.store


@pytest.fixture(scope='module')
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=['--no-sandbox'])
        yield browser
        browser.close()


def trained_run(url: str, key: str, name: str, steps: int) -> tuple[MultiLoraTransformersModel, str]:
    model = MultiLoraTransformersModel(client=TwinkleClient(url, key))
    run_id = model.add_adapter_to_model(name, LoraConfig(r=4, target_modules='all-linear'), seed=3)
    model.set_optimizer('AdamW', lr=1e-2)
    train(model, steps)
    return model, run_id


def train(model: MultiLoraTransformersModel, steps: int, pause_s: float = 0.0, reward: bool = False) -> None:
    for step in range(steps):
        if reward:  # a figure of the trainer's own: the page draws it once it appears
            model.log_step_figures({'reward': 0.1 * step})
        model.forward_backward(inputs=ROWS)
        model.clip_grad_and_step()
        time.sleep(pause_s)


def sign_in(browser, url: str, key: str, seen: list[str]):
    """A new page signed in with ``key``; ``seen`` collects the URL and body of every answer it gets."""
    page = browser.new_page(viewport={'width': 1280, 'height': 900})

    def record(response) -> None:
        try:
            seen.append(f'{response.url}\n{response.text()}')
        except Exception:  # a redirect or a download has no text body
            seen.append(response.url)

    page.on('response', record)
    page.goto(f'{url}/dashboard')
    page.fill('#key', key)
    page.click('#sign-in-form button[type=submit]')
    return page


def points(page) -> int:
    return int(page.get_attribute('#chart-loss', 'data-points'))


def png(data: bytes) -> Image.Image:
    assert data[:8] == b'\x89PNG\r\n\x1a\n'
    return Image.open(io.BytesIO(data)).convert('RGB')


def test_a_tenant_watches_its_curves_grow_and_manages_its_checkpoints(server, browser, tmp_path):
    url, keys, store = server
    _, bobs_run = trained_run(url, keys['bob'], 'bobs-private-adapter', steps=2)
    alice, run_id = trained_run(url, keys['alice'], 'alice-sft', steps=1)
    seen: list[str] = []
    page = sign_in(browser, url, keys['alice'], seen)
    page.wait_for_selector(f'#runs li[data-run="{run_id}"].selected', timeout=TIMEOUT_MS)
    assert page.is_hidden('#sign-in') and page.is_hidden('#admin-view') and page.is_visible('#tenant-view')
    page.wait_for_function("document.querySelector('#chart-loss')?.dataset.points === '1'", timeout=TIMEOUT_MS)

    # The run trains while the page watches, in two bursts (3 steps, then 4): the chart shows 4
    # points after the first and 8 after the second, whatever the load (no race with the poll).
    shots = []
    for steps, shown, name in ((3, 4, 'curves-early.png'), (4, 8, 'curves-late.png')):
        trainer = threading.Thread(target=train, args=(alice, steps, 0.4, True))
        trainer.start()
        condition = f"document.querySelector('#chart-loss').dataset.points === '{shown}'"
        page.wait_for_function(condition, timeout=TIMEOUT_MS)
        trainer.join()
        assert points(page) == shown
        shots.append(page.locator('#chart-loss').screenshot())
        (tmp_path / name).write_bytes(page.screenshot(full_page=True))
    early, late = shots
    assert ImageChops.difference(png(early), png(late)).getbbox() is not None  # the drawn curve changed
    assert len(png(late).getcolors(maxcolors=1 << 16) or ()) > 10  # a chart, not a blank box
    page.wait_for_function("document.querySelector('#chart-reward')?.dataset.points === '8'", timeout=TIMEOUT_MS)
    assert page.locator('#charts canvas').count() == 5  # loss, lr, grad norm, tokens/s, and the logged reward
    history = TwinkleClient(url, keys['alice']).run_history(run_id)
    assert page.text_content('#run-status') == f'8 steps recorded, last step {history[-1].step}'
    # The usage table: the run's 8 steps of ROWS' tokens, as the tenant sent them, and its total.
    trained = 8 * sum(len(row['input_ids']) for row in ROWS)
    usage_cell = f'document.querySelector(\'#usage tr[data-key="{run_id}"] td:nth-child(2)\')?.textContent'
    page.wait_for_function(f"{usage_cell} === '{trained}'", timeout=TIMEOUT_MS)
    assert page.locator('#usage tr[data-key="total"]').count() == 1

    # A checkpoint: listed, downloaded through its signed link, published, then deleted.
    alice.save('ckpt-a')
    row = '#checkpoints tr[data-checkpoint="training/ckpt-a"]'
    page.wait_for_selector(row, timeout=TIMEOUT_MS)
    page.click(f'{row} button:text("Download")')
    with page.expect_download() as download:
        page.click('#links a:text-is("adapter_model.safetensors")')
    saved = tmp_path / 'downloaded.safetensors'
    download.value.save_as(saved)
    checkpoint = store.checkpoints.get(store.tenants.for_key(keys['alice']).id, run_id, 'ckpt-a')
    assert saved.read_bytes() == (Path(checkpoint.path) / 'adapter_model.safetensors').read_bytes()
    assert any('lora_A' in name for name in load_file(str(saved)))
    assert 'optimizer.pt' not in page.text_content('#links')
    page.click(f'{row} button:text("Publish")')
    page.wait_for_selector(f'{row} button:text("Unpublish")', timeout=TIMEOUT_MS)
    assert store.checkpoints.get(checkpoint.tenant_id, run_id, 'ckpt-a').public
    (tmp_path / 'checkpoints.png').write_bytes(page.screenshot(full_page=True))
    if os.environ.get('TWINKLE_DASHBOARD_PNG'):  # the README's picture: TWINKLE_DASHBOARD_PNG=docs/dashboard.png
        page.screenshot(path=os.environ['TWINKLE_DASHBOARD_PNG'], full_page=True)
    page.click(f'{row} button:text("Delete")')
    page.wait_for_selector(row, state='detached', timeout=TIMEOUT_MS)
    assert store.checkpoints.get(checkpoint.tenant_id, run_id, 'ckpt-a') is None
    assert not Path(checkpoint.path).exists()

    # Bob's run never reached alice's page, nor any answer it got.
    assert bobs_run not in page.content()
    assert seen and not [answer for answer in seen if bobs_run in answer or 'bobs-private-adapter' in answer]
    page.close()


def test_a_tenant_reaches_nothing_of_another_through_the_dashboard_routes(server):
    url, keys, _ = server
    bob, bobs_run = trained_run(url, keys['bob'], 'bob-kept', steps=1)
    bob.save('bobs-ckpt')
    alice = {'X-API-Key': keys['alice']}
    base = f'{url}/dashboard/api/runs/{bobs_run}/checkpoints/training/bobs-ckpt'
    for method, route in [('POST', f'{base}/links'), ('PUT', f'{base}/public'), ('DELETE', base)]:
        answer = httpx.request(method, route, headers=alice)
        assert answer.status_code == 404, (route, answer.text)
        assert bobs_run in answer.json()['detail'] and 'bobs-ckpt' in answer.json()['detail']
    assert httpx.get(f'{url}/dashboard/api/admin', headers=alice).status_code == 401
    assert httpx.get(f'{url}/dashboard/api/session', headers={'X-API-Key': 'tml-' + 'x' * 40}).status_code == 401
    # The admin key is not a tenant's: it reads no runs.
    assert httpx.get(f'{url}/twinkle/v1/runs', headers={'X-API-Key': ADMIN_KEY}).status_code == 401


def test_the_admin_key_sees_tenants_models_and_passes(server, browser, tmp_path):
    url, keys, _ = server
    trained_run(url, keys['alice'], 'alice-for-admin', steps=1)
    page = sign_in(browser, url, ADMIN_KEY, [])
    page.wait_for_selector('#tenants tbody tr', timeout=TIMEOUT_MS)
    tenants = {row.split('\t')[0]: row.split('\t')[1:] for row in page.inner_text('#tenants tbody').splitlines()}
    assert set(tenants) == {'alice', 'bob'}
    assert int(tenants['alice'][0]) >= 1  # runs
    model = page.inner_text('#models tbody').split('\t')
    assert int(model[2]) >= 2  # adapters in memory: alice's and bob's
    page.wait_for_selector('#passes tbody tr', timeout=TIMEOUT_MS)
    assert 'forward_backward' in page.inner_text('#passes tbody')
    page.wait_for_selector('#tenant-usage tbody tr[data-key="bob"]', timeout=TIMEOUT_MS)
    usage = {row.split('\t')[0]: row.split('\t')[1:] for row in page.inner_text('#tenant-usage tbody').splitlines()}
    assert set(usage) == {'alice', 'bob'} and int(usage['alice'][0]) > 0 and int(usage['bob'][0]) > 0
    assert page.text_content('#who') == 'admin'
    assert page.is_hidden('#sign-in') and page.is_hidden('#tenant-view')
    (tmp_path / 'admin.png').write_bytes(page.screenshot(full_page=True))
    assert png((tmp_path / 'admin.png').read_bytes()).size[0] == 1280
    page.close()
