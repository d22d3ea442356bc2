"""Where built assets live, and how each is built exactly once.

Layout under :func:`twinkle_home`::

    assets/
      tokenizers/twinkle-bpe-4096-v1/      tokenizer.json, tokenizer_config.json
      models/tiny-qwen3-v1.1/               config.json, model.safetensors, tokenizer files...
      datasets/gsm8k-v1/                    train.jsonl, test.jsonl
      locks/                                one FileLock per asset

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


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Return ``final``, first calling ``build(tmp)`` and renaming ``tmp`` to it if it is missing.

    ``build`` fills an empty temporary folder. It runs at most once per ``final`` across threads
    and processes sharing the cache; if it raises, nothing is left behind.
    """
    if final.is_dir():
        return final
    lock_dir = final.parent.parent.parent / 'locks'  # assets/locks, shared by every kind
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f'{final.parent.name}-{final.name}.lock')):
        if final.is_dir():  # another process finished it while we waited for the lock
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f'.{final.name}.tmp-', dir=final.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is plain files
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
