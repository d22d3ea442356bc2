"""The image recipe (``cookbook/vlm_shapes.py``, issue 32 point 8) run through its own ``run``:
SFT on the captions lowers the loss by a margin that seeds 0-2 keep and ``lr=0`` misses; the
recipe's defaults (40 SFT steps, 80 GRPO steps on 32 pictures) raise the GRPO reward.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from twinkle.assets.images import COLOURS
from twinkle.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[2]


def recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location('vlm_shapes', ROOT / 'cookbook' / 'vlm_shapes.py')
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules['vlm_shapes'] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


vlm = recipe()


def answer(completion: str, colour: str) -> dict[str, object]:
    return {'messages': [{'role': 'assistant', 'content': completion}], 'user_data': {'answer': colour}}


def test_the_colour_reward_pays_only_for_the_true_colour_alone() -> None:
    rows = [
        answer('A red square.', 'red'),
        answer('red', 'red'),
        answer('A blue square.', 'red'),
        answer('A red or blue square.', 'red'),  # hedging does not pay
        answer('A reddish square.', 'red'),  # not the word
        answer('The digit 5 in', 'red'),
    ]
    assert vlm.ColourReward()(rows) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert set(COLOURS) == {'red', 'green', 'blue', 'yellow', 'purple', 'orange'}


def test_an_unknown_phase_is_refused_naming_the_accepted_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"phase 'rl' is not one of \('sft', 'grpo', 'both'\)"):
        vlm.run(vlm.Config(phase='rl'))
    with pytest.raises(ConfigurationError, match=r"sft_task 'digits' is not one of \('colour', 'caption'\)"):
        vlm.run(vlm.Config(sft_task='digits'))


def test_sft_lowers_the_loss_and_the_grpo_loop_runs_on_image_prompts() -> None:
    config = vlm.Config(sft_task='caption', sft_steps=24, grpo_steps=1, prompts_per_step=2, group_size=4, seed=0)
    history = vlm.run(config)
    assert len(history.losses) == 24 and len(history.rewards) == 1 and len(history.accuracy) == 2
    first, last = vlm.summary(history.losses, window=5)
    # The untrained model's loss is about ln(4104) = 8.3 on each caption token; after 24 steps the
    # captions' words are learnt and only the colour and shape stay uncertain. Seed 0 gave
    # 6.47 -> 1.53 (at 30 steps seeds 0, 1, 2 gave 6.47 -> 1.50, 6.41 -> 1.58, 6.35 -> 1.33; lr=0 gave 8.58 -> 8.68).
    assert first > 5.0 and last < first - 3.0, history.losses
    # The step's reward is a mean of 0/1 scores over 2 pictures x 4 answers.
    assert all(0.0 <= r <= 1.0 and (r * 8).is_integer() for r in history.rewards), history.rewards


@pytest.mark.slow
def test_the_recipe_s_grpo_raises_the_reward() -> None:
    """The default run, seed 0: the reward's mean over the last 20 GRPO steps is at least 0.1
    above its mean over the first 10. Measured (docs/images.md, "A recipe"): seed 0 0.323 -> 0.569,
    seed 1 0.198 -> 0.480; the same draws with no update (``grpo_lr=0``, on all 164 pictures) stay
    within 0.21-0.28 in every 10 steps."""
    history = vlm.run(vlm.Config(seed=0))
    assert len(history.rewards) == 80
    first, last = sum(history.rewards[:10]) / 10, sum(history.rewards[-20:]) / 20
    assert last >= first + 0.1, (first, last, history.rewards)
