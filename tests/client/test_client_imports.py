"""The thin client imports without the training stack: a user who only talks HTTP to a twinkle
server installs and imports ``twinkle_client`` (its model, sampler, checkpoint engine and Tinker
entry) without torch, peft or transformers being loaded; and ``import twinkle`` resolves its
public names on first use."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from peft import LoraConfig

import twinkle
from twinkle.errors import ConfigurationError
from twinkle_client.model import _lora_fields

#: What the client must not load at import: the training stack, and the tinker SDK (it imports torch).
HEAVY = ('torch', 'peft', 'transformers', 'tinker')

#: The client's modules, and the twinkle modules they import, each imported alone in a fresh process.
CLIENT_MODULES = (
    'twinkle',
    'twinkle.errors',
    'twinkle.wire',
    'twinkle.data_format',
    'twinkle.tinker_sdk',
    'twinkle_client',
    'twinkle_client.client',
    'twinkle_client.model',
    'twinkle_client.sampler',
    'twinkle_client.checkpoint_engine',
    'twinkle_client.tinker_compat',
)


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (nothing imported yet); its stdout, or a failure with its stderr."""
    done = subprocess.run(
        [sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.integration
@pytest.mark.parametrize('module', CLIENT_MODULES)
def test_the_client_imports_without_torch_peft_or_transformers(module):
    code = f"""
        import importlib, json, sys
        importlib.import_module({module!r})
        print(json.dumps(sorted(name for name in {HEAVY!r} if name in sys.modules)))
    """
    assert json.loads(run_python(code)) == [], f'importing {module} loaded the training stack'


@pytest.mark.integration
def test_a_merged_export_without_torch_names_what_to_install():
    # torch made unimportable (None in sys.modules): the client still imports and builds a model;
    # export and upload_to_hub fail before any request, with the packages to install.
    code = """
        import sys
        sys.modules['torch'] = None
        from twinkle.errors import MissingExtraError
        from twinkle_client import TwinkleClient
        from twinkle_client.model import MultiLoraTransformersModel

        model = MultiLoraTransformersModel(client=TwinkleClient('http://127.0.0.1:9', 'tk-unused'))
        for call in (lambda: model.export('twinkle://run/checkpoints/c', 'out', merge=True),
                     lambda: model.upload_to_hub('twinkle://run/checkpoints/c', 'hf://org/name', merge=True)):
            try:
                call()
            except MissingExtraError as error:
                print(type(error).__name__, isinstance(error, ImportError), error)
    """
    lines = run_python(code).splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        assert line.startswith('MissingExtraError True '), line
        assert "'torch'" in line and 'pip install torch peft transformers' in line, line


# ---- LoRA configs, duck-typed -----------------------------------------------------------------------
# LoraConfig(r=4, lora_alpha=8, target_modules=['v_proj', 'q_proj']) holds peft's defaults for the
# rest: lora_dropout 0.0, bias 'none', use_rslora False, init_lora_weights True, target_parameters
# None (not sent); peft keeps target_modules as a set, sent sorted.
EXPECTED_LORA = {
    'bias': 'none',
    'init_lora_weights': True,
    'lora_alpha': 8,
    'lora_dropout': 0.0,
    'r': 4,
    'target_modules': ['q_proj', 'v_proj'],
    'use_rslora': False,
}


def test_a_peft_lora_config_is_read_by_its_fields():
    assert _lora_fields(LoraConfig(r=4, lora_alpha=8, target_modules=['v_proj', 'q_proj'])) == EXPECTED_LORA


def test_a_dict_or_any_object_with_the_fields_reads_the_same():
    assert _lora_fields(dict(EXPECTED_LORA)) == EXPECTED_LORA
    assert _lora_fields({'r': 8, 'target_modules': {'v_proj', 'q_proj'}}) == {
        'r': 8,
        'target_modules': ['q_proj', 'v_proj'],
    }
    assert _lora_fields(SimpleNamespace(r=2, lora_alpha=None, bias='all')) == {'r': 2, 'bias': 'all'}


def test_a_dict_with_an_unknown_field_is_refused_by_name():
    with pytest.raises(ConfigurationError, match=r"'rank'.*\['bias', 'init_lora_weights', .*'use_rslora'\]"):
        _lora_fields({'rank': 8})


def test_a_config_without_lora_fields_is_refused():
    with pytest.raises(ConfigurationError, match=r'LoRA config .* got 8'):
        _lora_fields(8)


# ---- twinkle's public names, resolved on first use -----------------------------------------------------
@pytest.mark.integration
def test_import_twinkle_loads_no_runtime_until_a_name_is_read():
    code = """
        import json, sys
        import twinkle
        before = 'twinkle.infra' in sys.modules
        mesh = twinkle.DeviceMesh
        from twinkle.infra.mesh import DeviceMesh
        print(json.dumps([before, 'twinkle.infra' in sys.modules, mesh is DeviceMesh]))
    """
    assert json.loads(run_python(code)) == [False, True, True]


def test_every_public_name_is_the_object_its_module_defines():
    from twinkle.infra import DeviceGroup, DeviceMesh, get_device_placement, get_runtime
    from twinkle.launch import initialize
    from twinkle.tinker_sdk import init_tinker_client
    from twinkle.utils.logger import get_logger

    expected = {
        'DeviceGroup': DeviceGroup,
        'DeviceMesh': DeviceMesh,
        'get_device_placement': get_device_placement,
        'get_runtime': get_runtime,
        'initialize': initialize,
        'init_tinker_client': init_tinker_client,
        'get_logger': get_logger,
    }
    assert sorted(twinkle.__all__) == sorted([*expected, '__version__'])
    assert twinkle.__version__ == '0.1.0'
    for name, value in expected.items():
        assert getattr(twinkle, name) is value, name
    assert set(twinkle.__all__) <= set(dir(twinkle))


def test_an_unknown_name_is_an_attribute_error_and_sub_packages_still_import():
    with pytest.raises(AttributeError, match=r"module 'twinkle' has no attribute 'DeviceMeshh'"):
        _ = twinkle.DeviceMeshh
    from twinkle import assets  # a sub-package, imported through the same from-import

    assert assets.__name__ == 'twinkle.assets'
