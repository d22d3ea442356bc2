"""A server started from a script (``twinkle.initialize(mode='http', block=False)``) that the
script never stops is stopped at interpreter exit like a graceful stop: the process exits 0,
its run's adapter state is saved for a restart, and no thread of it is left to be killed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import twinkle
    from peft import LoraConfig
    from twinkle_client import TwinkleClient
    from twinkle_client.model import MultiLoraTransformersModel
    from twinkle.server.store import Store

    model_dir, data_dir = sys.argv[1], sys.argv[2]
    runtime = twinkle.initialize(mode='http', block=False, base_model=model_dir, port=0, data_dir=data_dir)
    store = Store(runtime.server.app.state.service.config.db_path)
    key = store.tenants.add('alice')[1]
    store.close()
    model = MultiLoraTransformersModel(client=TwinkleClient(runtime.server.url, key))
    print(model.add_adapter_to_model('default', LoraConfig(r=4, target_modules='all-linear')), flush=True)
    print(sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()), flush=True)
    # no runtime.server.stop(): the interpreter's exit must stop it
    """
)


def test_a_server_the_script_never_stops_is_stopped_gracefully_at_exit(tiny_model_dir, tmp_path: Path):
    data_dir = tmp_path / 'data'
    done = subprocess.run(
        [sys.executable, '-c', SCRIPT, tiny_model_dir, str(data_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run_id, threads = done.stdout.split('\n')[:2]
    assert 'twinkle-scheduler' in threads  # the worker ran while the script did ...
    # ... and the graceful stop saved the run's adapter, so a restart brings it back
    saved = list((data_dir / 'checkpoints').glob(f'*/{run_id}/state@*'))  # on disk, out of host memory
    assert len(saved) == 1 and (saved[0] / 'adapter_model.safetensors').is_file(), sorted(data_dir.rglob('*'))
