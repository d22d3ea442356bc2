"""Full-parameter training on ``MegatronModel`` saved with its optimizer and resumed from the
checkpoint: the next step's loss is the one the run would have had without stopping."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip('megatron.core')

sys.path.insert(0, str(Path(__file__).parent))

from dist_model import batch

from twinkle import assets
from twinkle.model.megatron import MegatronModel


def train_step(model: MegatronModel) -> float:
    out = model.forward_backward(inputs=batch())
    model.clip_grad_and_step(max_grad_norm=math.inf)
    return float(out.loss)  # type: ignore[arg-type]


def test_full_parameter_training_resumes_from_its_checkpoint_exactly(tmp_path):
    model = MegatronModel(model_id=assets.tiny_model('tiny-qwen3'))
    model.set_optimizer('AdamW', lr=1e-3)
    first = train_step(model)
    checkpoint = model.save('step-1', str(tmp_path), save_optimizer=True)
    assert (Path(checkpoint) / 'model.safetensors').is_file()
    second = train_step(model)  # the run going on, AdamW's moments from step 1 included
    assert second < first

    resumed = MegatronModel(model_id=checkpoint)
    resumed.set_optimizer('AdamW', lr=1e-3)
    counters = resumed.resume_from_checkpoint(checkpoint)
    assert counters['optim_step'] == 1
    assert abs(train_step(resumed) - second) <= 1e-5 * second
