"""A user's torchrun job, trimmed for ``test_exit_clean.py``: FSDP2 LoRA over 2 ranks (gloo), two
optimizer steps and a save, then the script simply ends.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 tests/infra/exit_job.py OUT_DIR

Before twinkle starts anything it registers an exit hook; exit hooks run last in, first out, so
this one runs after twinkle's own and writes the names of the threads still alive in this
process to ``OUT_DIR/threads-RANK.json`` (Linux: ``/proc/self/task``; elsewhere nothing).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path


def record_threads(out_dir: Path) -> None:
    tasks = Path('/proc/self/task')
    if tasks.is_dir():
        names = sorted((task / 'comm').read_text().strip() for task in tasks.iterdir())
        (out_dir / f'threads-{os.environ.get("RANK", "0")}.json').write_text(json.dumps(names))


def main(out_dir: Path) -> None:
    from dist_train import GLOBAL_BATCH, build, rows

    import twinkle
    from twinkle import DeviceMesh
    from twinkle.dataloader import DataLoader

    world = int(os.environ['WORLD_SIZE'])
    twinkle.initialize(mode='local', seed=0, global_device_mesh=DeviceMesh.from_sizes(dp_size=world, device_type='cpu'))
    mesh = DeviceMesh.from_sizes(fsdp_size=world, device_type='cpu')
    model = build('lora', mesh)
    for _, batch in zip(range(2), DataLoader(rows(), batch_size=GLOBAL_BATCH, device_mesh=mesh), strict=False):
        model.forward_backward(inputs=batch, adapter_name='bob')
        model.clip_grad_and_step(adapter_name='bob')
    model.save('last', output_dir=str(out_dir), adapter_name='bob')


if __name__ == '__main__':
    atexit.register(record_threads, Path(sys.argv[1]))  # first registered: runs after twinkle's hook
    main(Path(sys.argv[1]))
