"""tinker-cookbook's ``vlm_classifier`` recipe, unmodified, trains against a twinkle server on the
tiny vision-language model: its renderer sends each picture as an ``ImageChunk`` (a JPEG and the
tokens it takes), its NLL evaluator scores the test split and its sampling evaluator samples
image prompts. Only the settings point it at the server and the model; the dataset is the
embedded shapes, written where the recipe loads ``dpdl-benchmark/caltech101`` from (a local
folder of that name wins over the hub, and nothing is fetched)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import background_server

from twinkle import assets

#: Each test here starts a server, a process or a cluster (tests/tiers.py).
pytestmark = pytest.mark.integration

pytest.importorskip('chz')  # installed beside tinker-cookbook by `make setup`, with the few others it imports


def write_shapes_as_caltech(folder: Path) -> list[str]:
    """The shapes' colour questions as an image classification dataset (image, label), the
    recipe's columns: parquet files of its train and test splits; the class names."""
    import datasets

    splits = {}
    for split in ('train', 'test'):
        rows = [row for row in assets.resolve_images(assets.dataset('shapes', split)) if row['task'] == 'colour']
        splits[split] = rows[:16] if split == 'train' else rows[:4]
    names = sorted({row['answer'] for rows in splits.values() for row in rows})
    features = datasets.Features({'image': datasets.Image(), 'label': datasets.ClassLabel(names=names)})
    folder.mkdir(parents=True)
    for split, rows in splits.items():
        columns = {
            'image': [row['messages'][0]['content'][0]['image'] for row in rows],
            'label': [names.index(row['answer']) for row in rows],
        }
        datasets.Dataset.from_dict(columns, features=features).to_parquet(str(folder / f'{split}.parquet'))
    return names


def test_tinker_cookbooks_vlm_classifier_trains_against_the_server(tmp_path: Path) -> None:
    vlm_dir = assets.tiny_model('tiny-qwen3.5-vl')
    write_shapes_as_caltech(tmp_path / 'dpdl-benchmark' / 'caltech101')
    recipe = 'tinker_cookbook.recipes.vlm_classifier.train'
    settings = [f'model_name={vlm_dir}', 'dataset=caltech101', 'batch_size=4', 'num_epochs=1', 'lora_rank=8']
    settings += ['learning_rate=1e-2', 'eval_every=2', 'save_every=0', 'n_eval=4', 'max_tokens=8']
    settings += [f'experiment_dir={tmp_path / "runs"}', 'behavior_if_log_dir_exists=delete']
    with background_server(tmp_path / 'server', vlm_dir, tenants=('cookbook',)) as (url, keys, _):
        environment = {**os.environ, 'TINKER_API_KEY': keys['cookbook'], 'HF_DATASETS_OFFLINE': '1'}
        result = subprocess.run(
            [sys.executable, '-m', recipe, *settings, f'base_url={url}'],
            env=environment,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    [run] = list((tmp_path / 'runs').iterdir())
    records = [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]
    losses = [record['train_mean_nll'] for record in records if 'train_mean_nll' in record]
    assert len(losses) == 4  # 16 pictures in batches of 4, one epoch
    assert losses[-1] < losses[0]
    evaluated = [record for record in records if any(key.startswith('test/') for key in record)]
    assert evaluated, sorted(records[-1])
