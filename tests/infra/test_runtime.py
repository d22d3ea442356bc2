"""``twinkle.initialize``: the runtime modes, their checks, and the seed's HTTP server script."""

from __future__ import annotations

import doctest
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from server_helpers import free_port, wait_until_healthy

import twinkle
from twinkle import DeviceGroup, DeviceMesh, launch
from twinkle.errors import ConfigurationError
from twinkle.infra import placement
from twinkle.infra import runtime as infra_runtime


@pytest.fixture(autouse=True)
def local_again():
    yield
    twinkle.initialize(mode='local', seed=None)


def test_local_mode_seeds_and_becomes_current():
    runtime = twinkle.initialize(mode='local', seed=3)
    first = torch.rand(3)
    twinkle.initialize(mode='local', seed=3)
    assert torch.equal(torch.rand(3), first)
    assert twinkle.get_runtime().mode == 'local' and runtime.seed == 3


@pytest.mark.parametrize(
    ('kwargs', 'match'),
    [
        ({'mode': 'cluster'}, "Invalid mode 'cluster'"),
        ({'global_device_mesh': DeviceMesh.from_sizes(dp_size=2)}, 'torchrun --nproc_per_node=2'),
        ({'port': 8000}, 'apply only to mode="http"'),
        ({'groups': [DeviceGroup('a', 1), DeviceGroup('a', 1)]}, "repeated: \\['a'\\]"),
        ({'groups': ['model']}, 'must be DeviceGroup objects'),
        (
            {'mode': 'http', 'groups': [DeviceGroup('model', 4, gpus_per_worker=2)], 'base_model': 'tiny-qwen3'},
            'one device per model worker',
        ),
        ({'mode': 'http', 'groups': [DeviceGroup('a', 1), DeviceGroup('b', 1)]}, "group named 'model'"),
    ],
)
def test_bad_runtimes_fail_before_anything_starts(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        twinkle.initialize(**kwargs)
    assert twinkle.get_runtime().mode == 'local'


@pytest.mark.integration
def test_http_mode_serves_on_the_model_group_device(tmp_path, tiny_model_dir):
    groups = [DeviceGroup('model', ranks=[0], device_type='CPU'), DeviceGroup('sampler', ranks=[1], device_type='cpu')]
    runtime = twinkle.initialize(
        mode='http', groups=groups, base_model=tiny_model_dir, port=0, data_dir=str(tmp_path), block=False
    )
    try:
        assert httpx.get(f'{runtime.server.url}/healthz').json() == {'status': 'ok'}
        assert runtime.server.app.state.service.default.host.model.device.type == 'cpu'
    finally:
        runtime.server.stop()


@pytest.mark.integration
def test_the_seed_server_script_serves_until_interrupted(tmp_path, tiny_model_dir):
    port = free_port()
    script = tmp_path / 'server.py'
    script.write_text(
        textwrap.dedent(f"""
        import twinkle
        from twinkle import DeviceGroup

        device_groups = [DeviceGroup(name='model', ranks=1, device_type='cpu')]
        twinkle.initialize(mode='http', groups=device_groups, base_model={tiny_model_dir!r}, port={port},
                           data_dir={str(tmp_path / 'data')!r})
        """)
    )
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_healthy(process, port)
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
    finally:
        process.kill()
    assert (tmp_path / 'data' / 'twinkle.db').is_file()


def test_get_device_placement_describes_the_current_runtime(monkeypatch):
    monkeypatch.setenv('WORLD_SIZE', '1')
    twinkle.initialize(mode='local', seed=None, global_device_mesh=DeviceMesh.from_sizes(dp_size=1, device_type='cpu'))
    text = twinkle.get_device_placement()
    assert 'global' in text and 'Local process' in text


@pytest.mark.integration
def test_importing_twinkle_starts_no_server_stack():
    # A client process imports twinkle: launch imports the server and Ray only inside initialize.
    code = (
        'import sys, twinkle\n'
        "print(sorted(m for m in sys.modules if m.startswith(('twinkle.server', 'ray', 'fastapi', 'uvicorn'))))"
    )
    loaded = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == '[]'


@pytest.mark.parametrize('module', [launch, infra_runtime, placement])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
