"""Every docstring example under ``src/``, run: a module whose docstrings hold ``>>>`` examples is a test
here, and each of its examples must give what it says (``doctest``, with ``ELLIPSIS``)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / 'src'
#: Modules importable only where an optional extra is installed: their examples run in that extra's suite.
OPTIONAL = {'vllm', 'megatron'}
#: Modules whose examples start a process (the sandbox runs code in one): outside the quick tier.
STARTS_PROCESSES = {'twinkle.agent.sandbox'}


def modules_with_examples() -> list[str]:
    found = []
    for path in sorted(SRC.rglob('*.py')):
        if '>>> ' in path.read_text(encoding='utf-8'):
            parts = path.relative_to(SRC).with_suffix('').parts
            found.append('.'.join(parts[:-1] if parts[-1] == '__init__' else parts))
    return found


MODULES = modules_with_examples()


def test_the_examples_are_found() -> None:
    assert len(MODULES) >= 60, MODULES  # 65 modules when this was written; a finder that finds none is broken
    assert 'twinkle.wire' in MODULES or any(m.startswith('twinkle.wire.') for m in MODULES)


@pytest.mark.parametrize(
    'name', [pytest.param(m, marks=pytest.mark.integration) if m in STARTS_PROCESSES else m for m in MODULES]
)
def test_examples(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and error.name.split('.')[0] in OPTIONAL:
            pytest.skip(f'{name} needs {error.name}, an optional extra')
        raise
    tests = [t for t in doctest.DocTestFinder().find(module, name) if t.examples]
    assert tests, f'{name} holds ">>> " but no example doctest finds (a module-level string, or a non-docstring)'
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in tests:
        runner.run(test, out=report.append)
    assert runner.failures == 0, ''.join(report)
