"""torchvision's Python code beside the CPU torch, for vLLM's CPU build (``make setup-vllm`` runs it).

vLLM's Qwen3-VL code, which its Qwen3.5 code imports, imports transformers' image processors, and
those need torchvision's transforms. PyPI's torchvision wheels are built for CUDA torch: beside the
CPU torch their compiled ops (``_C.so``, ``image.so``) do not load (``libc10_cuda.so`` is missing),
and ``import torchvision`` then fails on its two fake registrations that are not guarded by
``_has_ops()`` ('operator torchvision::nms does not exist', pytorch/vision#9085).

Run with the environment's interpreter, this script removes the compiled ops that cannot load and
installs an import hook (a ``.pth`` file and this module) that declares those two operators'
schemas, and nothing else, before torchvision is first imported. torchvision then imports with all
its Python code: the transforms the image processors use run on torch's own kernels, and the
detection ops (``nms``, ``roi_align``...) raise torchvision's own 'Couldn't load custom C++ ops'.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

#: The operators ``torchvision._meta_registrations`` registers fake kernels for unconditionally.
UNGUARDED = ('nms', 'qnms')
SCHEMA = '(Tensor dets, Tensor scores, float iou_threshold) -> Tensor'
#: torchvision's compiled parts, built for CUDA torch.
COMPILED = ('_C.so', 'image.so')
_LIBRARIES: list[Any] = []  # the torch.library.Library holding the schemas must outlive the import


class DeclareUnguardedOps(importlib.abc.MetaPathFinder):
    """Declares ``UNGUARDED``'s schemas the first time torchvision is looked for, then steps aside."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != 'torchvision':
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        origin = None if spec is None or spec.origin is None else Path(spec.origin).parent
        if origin is not None and not (origin / '_C.so').exists():  # a torchvision with its ops defines them
            import torch

            library = torch.library.Library('torchvision', 'FRAGMENT')  # type: ignore[no-untyped-call]
            for op in UNGUARDED:
                library.define(op + SCHEMA)  # type: ignore[no-untyped-call]  # torch leaves it untyped
            _LIBRARIES.append(library)
        return spec


def install_hook() -> None:
    """What the ``.pth`` file runs at each start of the environment's interpreter: cheap, torch is
    imported only when torchvision is."""
    if not any(isinstance(finder, DeclareUnguardedOps) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeclareUnguardedOps())


def install() -> None:
    """Remove torchvision's compiled parts from this interpreter's environment and install the hook."""
    site = Path(sysconfig.get_paths()['purelib'])
    package = site / 'torchvision'
    if not package.is_dir():
        raise SystemExit(f'torchvision is not installed in {site}')
    for name in COMPILED:
        (package / name).unlink(missing_ok=True)
    shutil.copyfile(__file__, site / 'twinkle_torchvision_cpu.py')
    hook = 'import twinkle_torchvision_cpu; twinkle_torchvision_cpu.install_hook()\n'
    (site / 'twinkle_torchvision_cpu.pth').write_text(hook)
    print(f'torchvision in {site}: compiled ops removed, the import hook installed')


if __name__ == '__main__':
    install()
