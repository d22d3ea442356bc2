"""Two torchrun ranks (gloo) read one stream with 2 DataLoader workers each; ``test_streaming.py`` checks them.

    python -m torch.distributed.run --nproc_per_node=2 tests/dataset/dist_stream.py DATA_DIR OUT_DIR

Each rank writes the rows of every batch it got (``rank<r>.json``): with a filter that leaves
the shards uneven, every rank must stop at the same step, and together the ranks read every
row of the batches they trained on once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import twinkle
from twinkle import DeviceMesh
from twinkle.dataloader import DataLoader
from twinkle.dataset import IterableDataset
from twinkle.infra import distributed


def main(data: Path, out: Path) -> None:
    mesh = DeviceMesh.from_sizes(dp_size=2, device_type='cpu')
    twinkle.initialize(mode='local', seed=0, global_device_mesh=mesh)
    stream = IterableDataset(sorted(data.glob('*.jsonl'))).filter(lambda row: row['i'] % 7 != 3)
    loader = DataLoader(stream, batch_size=8, num_workers=2, device_mesh=mesh)
    batches = [[row['i'] for row in batch] for batch in loader]
    state = loader.get_state()
    (out / f'rank{distributed.rank()}.json').write_text(json.dumps({'batches': batches, 'state': state}))


if __name__ == '__main__':
    main(Path(sys.argv[1]), Path(sys.argv[2]))
