"""Advantages, rewards and CompletionRewardMetric on examples worked out by hand."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch

import twinkle.advantage.base
import twinkle.advantage.grpo
import twinkle.advantage.rloo
import twinkle.metric.completion
import twinkle.reward.format
import twinkle.reward.gsm8k
from twinkle.advantage import ADVANTAGES, GRPOAdvantage, RLOOAdvantage
from twinkle.errors import ConfigurationError, DataError
from twinkle.metric import METRICS, CompletionRewardMetric
from twinkle.reward import REWARDS, FormatReward, GSM8KAccuracyReward, GSM8KFormatReward

# Two prompts, G = 4 samples each, in contiguous groups: prompt 0 solved half the time, prompt 1
# always (a constant group, which carries no signal).
REWARDS_8 = [0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_grpo_group_scale_divides_by_each_group_std():
    # Group 0: mean 0.5, deviations +-0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3), so
    # A = +-0.5 / sqrt(1/3) = +-sqrt(3)/2. Group 1: all equal, so 0 (not 0/0 = NaN).
    advantages = GRPOAdvantage()(REWARDS_8, num_generations=4)
    half_root3 = math.sqrt(3) / 2
    assert advantages.dtype == torch.float32 and advantages.shape == (8,)
    assert advantages.tolist() == pytest.approx([-half_root3, half_root3, -half_root3, half_root3, 0, 0, 0, 0])


def test_grpo_batch_scale_divides_by_the_batch_std():
    # Batch mean 0.75: deviations -0.75 (twice) and 0.25 (six times), squares sum to
    # 2 * 0.5625 + 6 * 0.0625 = 1.5, unbiased std sqrt(1.5 / 7). Group 0 keeps its own mean
    # (deviations +-0.5), so A = +-0.5 / sqrt(1.5 / 7); group 1 stays 0.
    advantages = GRPOAdvantage()(REWARDS_8, num_generations=4, scale='batch')
    a = 0.5 / math.sqrt(1.5 / 7)
    assert advantages.tolist() == pytest.approx([-a, a, -a, a, 0, 0, 0, 0])


def test_grpo_none_scale_only_subtracts_the_group_mean():
    advantages = GRPOAdvantage()(REWARDS_8, num_generations=4, scale='none')
    assert advantages.tolist() == [-0.5, 0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]


def test_grpo_takes_lists_numpy_and_tensors_alike():
    expected = GRPOAdvantage()(REWARDS_8, num_generations=4)
    assert torch.equal(GRPOAdvantage()(np.array(REWARDS_8), num_generations=4), expected)
    assert torch.equal(GRPOAdvantage()(torch.tensor(REWARDS_8), num_generations=4), expected)
    assert torch.equal(GRPOAdvantage()(torch.tensor(REWARDS_8, dtype=torch.float64), num_generations=4), expected)


def test_grpo_with_one_generation_uses_the_batch_as_one_group():
    # [1, 2, 6]: mean 3, deviations (-2, -1, 3), squares sum to 14, unbiased std sqrt(7).
    advantages = GRPOAdvantage()([1.0, 2.0, 6.0])
    assert advantages.tolist() == pytest.approx([-2 / math.sqrt(7), -1 / math.sqrt(7), 3 / math.sqrt(7)])
    assert GRPOAdvantage()([5.0]).tolist() == [0.0]


def test_a_constant_group_is_exactly_zero_even_when_its_mean_is_not_exact():
    # 0.7 is not a binary fraction: float32 (and float64) means of seven 0.7s differ from 0.7 by
    # an ulp, and the naive (r - mean) / (std + 1e-8) turns that into about 0.8 in float32.
    for rewards in ([0.7] * 7, torch.full((7,), 0.7)):
        for scale in ('group', 'batch', 'none'):
            assert GRPOAdvantage()(rewards, num_generations=7, scale=scale).tolist() == [0.0] * 7
            assert RLOOAdvantage()(rewards, num_generations=7, scale=scale).tolist() == [0.0] * 7


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5, so A = (-3, -1.5, 4.5),
    # which is G/(G-1) = 3/2 times the GRPO deviations (-2, -1, 3).
    rloo = RLOOAdvantage()
    assert rloo([1.0, 2.0, 6.0], num_generations=3, scale='none').tolist() == [-3.0, -1.5, 4.5]
    # 'group' divides by the group's unbiased std, sqrt(14 / 2) = sqrt(7).
    grouped = rloo([1.0, 2.0, 6.0], num_generations=3)
    assert grouped.tolist() == pytest.approx([-3 / math.sqrt(7), -1.5 / math.sqrt(7), 4.5 / math.sqrt(7)])
    # Group 0 of REWARDS_8: a 0 has baseline (1+0+1)/3 = 2/3, a 1 has (0+0+1)/3 = 1/3.
    two_thirds = 2 / 3
    assert rloo(REWARDS_8, num_generations=4, scale='none').tolist() == pytest.approx(
        [-two_thirds, two_thirds, -two_thirds, two_thirds, 0, 0, 0, 0]
    )
    # 'batch': the batch std of REWARDS_8 is sqrt(1.5 / 7), as in the GRPO test.
    a = two_thirds / math.sqrt(1.5 / 7)
    assert rloo(REWARDS_8, num_generations=4, scale='batch').tolist() == pytest.approx([-a, a, -a, a, 0, 0, 0, 0])


@pytest.mark.parametrize(
    ('call', 'error', 'match'),
    [
        (lambda: GRPOAdvantage()([1.0, 2.0], num_generations=0), ConfigurationError, r'positive integer; got 0'),
        (lambda: GRPOAdvantage()([1.0, 2.0], num_generations=2.0), ConfigurationError, r'positive integer; got 2\.0'),
        (lambda: GRPOAdvantage()([1.0, 2.0], num_generations=True), ConfigurationError, r'got True'),
        (
            lambda: RLOOAdvantage()([1.0, 2.0], num_generations=1),
            ConfigurationError,
            r'RLOOAdvantage needs .*>= 2; got 1',
        ),
        (
            lambda: GRPOAdvantage()([1.0, 2.0], scale='std'),
            ConfigurationError,
            r"scale 'std'.*\['batch', 'group', 'none'\]",
        ),
        (lambda: GRPOAdvantage()([0.0] * 6, num_generations=4), DataError, r'6 rewards, not a multiple of .*=4'),
        (lambda: GRPOAdvantage()([0.0, 1.0, math.nan, 1.0], num_generations=2), DataError, r'index 2 is nan'),
        (lambda: RLOOAdvantage()(np.array([0.0, -np.inf]), num_generations=2), DataError, r'index 1 is -inf'),
        (lambda: GRPOAdvantage()([]), DataError, r'rewards is empty'),
        (lambda: GRPOAdvantage()(torch.zeros(2, 2)), DataError, r'1-D.*\(2, 2\)'),
        (lambda: GRPOAdvantage()(['a', 'b']), DataError, r'must be numbers'),
    ],
)
def test_advantages_refuse_bad_input_and_name_it(call, error, match):
    with pytest.raises(error, match=match):
        call()
    assert issubclass(error, ValueError)


def test_advantages_are_registered_by_name():
    assert ADVANTAGES.names() == ['GRPOAdvantage', 'RLOOAdvantage']
    assert ADVANTAGES.get('RLOOAdvantage') is RLOOAdvantage


def row(completion: str | None, truth: object = '1234', user_data: object = None) -> dict:
    messages = [{'role': 'system', 'content': 'Solve.'}, {'role': 'user', 'content': 'What is 1000 + 234?'}]
    if completion is not None:
        messages.append({'role': 'assistant', 'content': completion})
    return {'messages': messages, 'user_data': {'ground_truth': truth} if user_data is None else user_data}


def test_gsm8k_accuracy_compares_the_last_answer_as_a_number():
    rows = [
        row('1000 + 234 = 1234\n#### 1,234'),  # thousands comma
        row('#### 1234.0'),  # same number, other spelling
        row('#### 3.0', truth='3'),
        row('#### -5', truth=-5),  # a ground truth given as an int
        row('#### 1234 apples.'),  # the number right after the mark counts
        row('The answer is 1234.'),  # right number, no '####': strict, 0
        row('#### 1243'),  # wrong number
        row('#### 1234\nWait, no.\n#### 99'),  # the LAST '####' counts
        row('#### 99\nWait.\n#### 1234'),
        row('#### 1234\nActually I am not sure.\n####'),  # the last mark has no number
    ]
    assert GSM8KAccuracyReward()(rows) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_gsm8k_accuracy_reads_sampled_rows_and_pair_lists():
    # A sampler's new_input_feature: token fields plus the messages and user_data of the prompt.
    feature = {'input_ids': [1, 2, 3], 'labels': [2, 3, -100], **row('#### 1234')}
    pairs = row('#### 1234', user_data=[['ground_truth', '1234'], ['id', 7]])
    # Two assistant turns: only the last one is the completion.
    multi = row('#### 1234')
    multi['messages'] += [{'role': 'user', 'content': 'Sure?'}, {'role': 'assistant', 'content': '#### 5'}]
    assert GSM8KAccuracyReward()([feature, pairs, multi]) == [1.0, 1.0, 0.0]


def test_rewards_name_the_row_that_cannot_be_scored():
    with pytest.raises(DataError, match=r"row 1 has no assistant message .*fields: \['messages', 'user_data'\]"):
        GSM8KAccuracyReward()([row('#### 1234'), row(None)])
    with pytest.raises(DataError, match=r"row 0 has no assistant message .*fields: \['input_ids'\]"):
        FormatReward()([{'input_ids': [1]}])
    with pytest.raises(DataError, match=r"row 0: user_data\['ground_truth'\] must be a number; got None"):
        GSM8KAccuracyReward()([row('#### 1', user_data={})])
    with pytest.raises(DataError, match=r"ground_truth'\] must be a number; got 'twelve'"):
        GSM8KAccuracyReward()([row('#### 12', truth='twelve')])
    with pytest.raises(DataError, match=r'row 0: user_data must be a dict or a list of \[key, value\] pairs'):
        GSM8KAccuracyReward()([row('#### 12', user_data='12')])


def test_gsm8k_format_wants_a_line_of_hash_marks_and_a_number():
    completions = [
        'Add them.\n#### 1,234',
        '#### 42.',  # a full stop after the number
        '  ####   -3.5  ',
        'The answer is #### 42',  # not on its own line
        '#### forty-two',
        'The answer is 42.',
        '#### 42 apples',  # more than the number on the line
    ]
    rewards = GSM8KFormatReward()([row(text) for text in completions])
    assert rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_format_reward_matches_the_whole_completion():
    completions = [
        '<think>2 + 2\nis 4</think>\n<answer>4</answer>',  # '.' spans lines
        '<think>x</think><answer>4</answer>\n',  # surrounding whitespace is stripped
        '<answer>4</answer>',  # no reasoning
        '<think>x</think><answer>4</answer> and more',  # text after the answer
        'Sure. <think>x</think><answer>4</answer>',  # text before
    ]
    assert FormatReward()([row(text) for text in completions]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    digits = FormatReward(pattern=r'\d+')
    assert digits([row('42'), row('x42')]) == [1.0, 0.0]


def test_format_reward_refuses_a_bad_pattern():
    with pytest.raises(ConfigurationError, match=r"FormatReward pattern '\(ab' is not a valid regular expression"):
        FormatReward(pattern='(ab')


def test_rewards_are_registered_by_name():
    assert REWARDS.names() == [
        'FormatReward', 'GSM8KAccuracyReward', 'GSM8KFormatReward', 'LetterWordsReward', 'OverlongPunishment',
    ]  # fmt: skip
    assert isinstance(REWARDS.build('GSM8KFormatReward', base=GSM8KFormatReward), GSM8KFormatReward)


def test_completion_reward_metric_over_two_steps():
    metric = CompletionRewardMetric()
    metric.accumulate(
        rewards={'accuracy': [1.0, 0.0], 'format': [1.0, 1.0]},
        completion_lengths=[10, 20],
        generate_time=2.0,
        weight_sync_time=0.5,
    )
    metric.accumulate(
        inputs={},
        outputs={},
        loss=None,
        rewards={'accuracy': [1.0, 1.0], 'format': [0.0, 0.0]},
        completion_lengths=[30],
    )
    metric.accumulate(generate_time=4.0)
    # accuracy [1, 0, 1, 1]: mean 0.75, deviations (0.25, -0.75, 0.25, 0.25), squares sum to 0.75,
    # sample std sqrt(0.75 / 3) = 0.5. format [1, 1, 0, 0]: mean 0.5, squares sum to 1, sqrt(1/3).
    # Lengths: 60 tokens over 3 completions (not the mean of the step means, 22.5). Times: the mean
    # over the calls that gave one.
    assert metric.calculate() == pytest.approx(
        {
            'accuracy_reward': 0.75,
            'accuracy_reward_std': 0.5,
            'format_reward': 0.5,
            'format_reward_std': math.sqrt(1 / 3),
            'completion_length': 20.0,
            'generate_time_s': 3.0,
            'weight_sync_time_s': 0.5,
        }
    )
    metric.reset()
    assert metric.calculate() == {}
    metric.accumulate(rewards=[0.25])  # a plain list is the 'total' reward; one value has std 0
    assert metric.calculate() == {'total_reward': 0.25, 'total_reward_std': 0.0}


def test_completion_reward_metric_refuses_non_finite_rewards():
    metric = CompletionRewardMetric()
    with pytest.raises(DataError, match=r"reward 'total' at index 1 is nan"):
        metric.accumulate(rewards=[1.0, math.nan])
    with pytest.raises(DataError, match=r"reward 'accuracy' must be a list of numbers"):
        metric.accumulate(rewards={'accuracy': ['yes']})
    assert METRICS.get('CompletionRewardMetric') is CompletionRewardMetric


@pytest.mark.parametrize(
    'module',
    [
        twinkle.advantage.base,
        twinkle.advantage.grpo,
        twinkle.advantage.rloo,
        twinkle.reward.gsm8k,
        twinkle.reward.format,
        twinkle.metric.completion,
    ],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0
