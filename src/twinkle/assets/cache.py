"""Where built assets live, and how each is built exactly once.

Layout under :func:`twinkle_home`::

    assets/
      tokenizers/twinkle-bpe-4096-v2/      tokenizer.json, tokenizer_config.json
      models/tiny-qwen3-v1.2/               config.json, model.safetensors, tokenizer files...
      datasets/gsm8k-v2/                    train.jsonl, test.jsonl
      locks/                                one FileLock per asset, e.g. models-tiny-qwen3-v1.2.lock

An asset is built into a temporary folder next to its final place and renamed into place in
one step, under a per-asset file lock. A folder that exists under its final name is therefore
always complete, and two processes asking at once build it once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

ENV_HOME = 'TWINKLE_HOME'


def twinkle_home() -> Path:
    """The root of twinkle's cache: ``$TWINKLE_HOME``, else ``$XDG_CACHE_HOME/twinkle``.

    ``XDG_CACHE_HOME`` defaults to ``~/.cache``. The folder is not created here.
    """
    if home := os.environ.get(ENV_HOME):
        return Path(home).expanduser()
    cache = os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache'
    return Path(cache).expanduser() / 'twinkle'


def asset_dir(kind: str, name: str) -> Path:
    """The final folder of asset ``name`` of ``kind`` ('models', 'datasets', 'tokenizers')."""
    return twinkle_home() / 'assets' / kind / name


def build_asset(kind: str, name: str, build: Callable[[Path], None]) -> Path:
    """``asset_dir(kind, name)``, built by ``build`` on first use (see ``build_once``)."""
    lock = twinkle_home() / 'assets' / 'locks' / f'{kind}-{name}.lock'
    return build_once(asset_dir(kind, name), build, lock)


def build_once(final: Path, build: Callable[[Path], None], lock: Path) -> Path:
    """Return ``final``, first calling ``build(tmp)`` and renaming ``tmp`` to it if it is missing.

    ``build`` fills an empty temporary folder made next to ``final``. Under the file lock
    ``lock`` it runs at most once per ``final`` across threads and processes; if it raises,
    nothing is left behind.
    """
    if final.is_dir():
        return final
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if final.is_dir():  # another process finished it while we waited for the lock
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f'.{final.name}.tmp-', dir=final.parent))
        try:
            build(tmp)
            _make_readable(tmp)
            os.rename(tmp, final)  # atomic: readers see no folder or a complete one
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _make_readable(folder: Path) -> None:
    """Give the built tree ordinary modes; ``mkdtemp`` (and some writers) make it owner-only."""
    folder.chmod(0o755)
    for path in folder.rglob('*'):
        path.chmod(0o755 if path.is_dir() else 0o644)
