"""The embedded agent tasks: the calculator and its GSM8K environment, the read-pages document
task, and one rollout of read-pages episodes through the real engine, template and tools with a
scripted policy in place of a model. Expected values are worked by hand in the comments."""

from __future__ import annotations

import asyncio
import doctest
import json
import re
import time

import pytest

from twinkle.agent import Action, Generation, RolloutEngine, ToolBox, ToolCall, ToolEnv
from twinkle.agent.tasks import calculator as calculator_module
from twinkle.agent.tasks import read_pages as read_pages_module
from twinkle.agent.tasks.calculator import CalculatorEnv, calculator, calculator_envs, gsm8k_problems
from twinkle.agent.tasks.read_pages import Document, ReadPagesEnv, make_document, read_pages_envs
from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.errors import ConfigurationError, DataError
from twinkle.reward.gsm8k import GSM8KAccuracyReward
from twinkle.template import Template

SIX_TIMES_SEVEN = {'question': 'What is 6 times 7?', 'answer': '6 times 7 is 6*7 = <<6*7=42>>42.\n#### 42'}


def turn(text: str = '', *calls: ToolCall) -> Action:
    return Action(text=text, tool_calls=list(calls), tokens=[], truncated=False)


def test_doctests() -> None:
    for module in (calculator_module, read_pages_module):
        result = doctest.testmod(module)
        assert result.attempted >= 1 and result.failed == 0, module.__name__


# ---- the calculator ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ('expression', 'value'),
    [
        ('3 * (4 + 5)', '27'),  # 4 + 5 = 9, 3 * 9 = 27
        ('48 / 2', '24'),  # exact: a whole quotient has no '.0'
        ('0.1 + 0.2', '0.3'),  # exact decimals, not 0.30000000000000004
        ('1 / 3', '0.333333333333333'),  # 15 significant digits
        ('7 // 2', '3'),
        ('-7 // 2', '-4'),  # floor, as Python: -3.5 rounds down to -4
        ('7 % 3', '1'),
        ('2 ** 10', '1024'),
        ('2 ** -2', '0.25'),  # 1 / 4
        ('4 ** 0.5', '2'),  # a root, through float: 2.0 shows as 2
        ('-(2 + 3) * 4', '-20'),
        (' 12.5 * 4 ', '50'),  # 50.0 exact, surrounding spaces ignored
        ('10 ** 99', '1' + '0' * 99),  # 100 digits: the largest size allowed
        ('-' * 499 + '1', '-1'),  # 499 signs, an odd number: deep, but within the length bound and no crash
    ],
)
def test_calculator_evaluates_arithmetic_exactly(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ('expression', 'says'),
    [
        ('x + 1', "'x' is a name"),
        ('abs(-3)', "'abs(-3)' calls a function"),
        ('__import__("os").system("true")', 'calls a function'),
        ('1,000 + 1', 'thousands commas'),
        ('2 ^ 3', "'^' is not arithmetic here; use + - * / // % **"),
        ('1 / (2 - 2)', '1 / 0 divides by zero'),
        ('(-8) ** 0.5', '(-8) ** 0.5 is not a real number'),
        ('True + 1', 'True is not a number'),
        ('"6" * 7', "'6' is not a number"),
        ('3 +', "'3 +' is not an arithmetic expression"),
        ('1 < 2', "'1 < 2' is not arithmetic"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic_and_says_why(expression: str, says: str) -> None:
    with pytest.raises(DataError) as raised:
        calculator(expression)
    assert says in str(raised.value)


@pytest.mark.parametrize(
    ('expression', 'says'),
    [
        ('9 ** 9 ** 9', '9 ** 387420489 has more than 100 digits'),  # 9 ** 9 = 387420489 first
        ('2 ** 10 ** 10', 'has more than 100 digits'),
        ('(10 ** 99) * (10 ** 99)', 'more than 100 digits'),  # 199 digits, refused after one product
        ('2.5 ** 100000', 'has more than 100 digits'),
        ('10.0 ** 400', 'has more than 100 digits'),
        ('1e999', 'too large'),  # a float literal past the float range
        ('9' * 10_000, 'the expression has 10000 characters; the calculator reads at most 500'),
    ],
)
def test_calculator_refuses_huge_numbers_at_once(expression: str, says: str) -> None:
    started = time.perf_counter()
    with pytest.raises(DataError) as raised:
        calculator(expression)
    assert says in str(raised.value)
    assert time.perf_counter() - started < 1.0  # refused before the work; 9 ** 9 ** 9 alone would run for hours


def test_the_calculator_redoes_the_embedded_problems_annotations() -> None:
    # Every '<<a op b=c>>' of the embedded GSM8K problems was computed by the asset's generator;
    # the calculator must give the same c (and no '.0' on whole quotients).
    checked = 0
    for problem in gsm8k_problems('train')[:100]:
        for expression, value in re.findall(r'<<([^=]+)=([^>]+)>>', problem['answer']):
            assert calculator(expression) == value, expression
            checked += 1
    assert checked >= 200  # every template does at least two calculations


def test_a_bad_calculator_call_is_an_answer_the_model_reads() -> None:
    calls = [
        ToolCall('calculator', {'expression': 'x * 2'}),
        ToolCall('calculator', {'formula': '1 + 1'}),  # not its argument's name
        ToolCall('calculator', {'expression': '6 * 7'}),
    ]
    refused, misnamed, fine = asyncio.run(ToolBox([calculator]).run(calls))
    assert refused.failed and refused.content.startswith('Error: calculator raised DataError: ')
    assert "'x' is a name" in refused.content
    assert misnamed.failed and misnamed.content.startswith('Error: bad arguments for calculator: ')
    assert (fine.failed, fine.content) == (False, '42')


# ---- CalculatorEnv ------------------------------------------------------------------------------


def test_calculator_env_opens_with_the_prompt_and_the_question() -> None:
    env = CalculatorEnv(SIX_TIMES_SEVEN, problem_id='hand/1')
    system, user = env.reset()
    assert system['role'] == 'system' and 'calculator' in system['content'] and '#### <number>' in system['content']
    assert user == {'role': 'user', 'content': 'What is 6 times 7?'}
    assert [schema['function']['name'] for schema in env.tools.schemas] == ['calculator']
    assert env.user_data == {'task': 'calculator', 'problem_id': 'hand/1', 'ground_truth': '42'}


def test_calculator_env_answers_a_tool_call_with_the_result() -> None:
    env = CalculatorEnv(SIX_TIMES_SEVEN)
    result = asyncio.run(env.step(turn('Let me multiply.', ToolCall('calculator', {'expression': '6 * 7'}))))
    assert result.messages == [{'role': 'tool', 'content': '42'}]
    assert (result.done, result.reward) == (False, 0.0)


@pytest.mark.parametrize(
    ('answer', 'reward'),
    [
        ('6 * 7 = 42\n#### 42', 1.0),
        ('#### 42.0', 1.0),  # the same number
        ('#### 41', 0.0),
        ('#### 40\nNo, 6 * 7 is 42.\n#### 42', 1.0),  # the last #### counts
        ('#### 42\nor maybe\n#### 43', 0.0),
        ('The answer is 42.', 0.0),  # no ####: the format the prompt asks for is part of the task
        ('', 0.0),
    ],
)
def test_calculator_env_grades_the_final_answer_like_the_gsm8k_reward(answer: str, reward: float) -> None:
    env = CalculatorEnv(SIX_TIMES_SEVEN)
    result = asyncio.run(env.step(turn(answer)))
    assert (result.done, result.reward, result.messages) == (True, reward, [])
    row = {'messages': [{'role': 'assistant', 'content': answer}], 'user_data': env.user_data}
    assert GSM8KAccuracyReward()([row]) == [reward]  # one extraction, the reward's


def test_calculator_env_refuses_a_problem_without_a_final_answer() -> None:
    with pytest.raises(DataError, match="problem 'bad' needs a question and an answer ending in"):
        CalculatorEnv({'question': 'What is 6 times 7?', 'answer': '42'}, problem_id='bad')


def test_calculator_envs_give_each_group_one_embedded_problem() -> None:
    groups = calculator_envs('test', num_tasks=3, group_size=2, seed=7)
    assert [len(group) for group in groups] == [2, 2, 2]
    ids = [[env.user_data['problem_id'] for env in group] for group in groups]
    assert all(a == b for a, b in ids) and len({a for a, _ in ids}) == 3
    assert ids == [[env.user_data['problem_id'] for env in group] for group in calculator_envs('test', 3, 2, seed=7)]
    for (env, _), (problem_id, _) in zip(groups, ids, strict=True):
        index = int(problem_id.rsplit('/', 1)[1])
        problem = gsm8k_problems('test')[index]
        assert isinstance(env, CalculatorEnv)
        assert env.reset()[1]['content'] == problem['question']
        assert env.user_data['ground_truth'] == problem['answer'].rsplit('#### ', 1)[1]


def test_calculator_envs_name_the_valid_splits_and_sizes() -> None:
    with pytest.raises(
        ConfigurationError, match=r"Invalid split of the embedded gsm8k problems 'dev'.*'test', 'train'"
    ):
        calculator_envs('dev', num_tasks=1, group_size=1)
    with pytest.raises(ConfigurationError, match=r"num_tasks must be 1 to 200 \(the 'test' problems\); got 201"):
        calculator_envs('test', num_tasks=201, group_size=1)


# ---- ReadPagesEnv -------------------------------------------------------------------------------


def read(env: ToolEnv, *pages: int) -> list[str]:
    """The tool's answer to each page, read one page a turn through the environment."""
    answers = []
    for page in pages:
        result = asyncio.run(env.step(turn('', ToolCall('read_page', {'page': page}))))
        assert not result.done and len(result.messages) == 1 and result.messages[0]['role'] == 'tool'
        answers.append(result.messages[0]['content'])
    return answers


def test_a_document_counts_its_word() -> None:
    # 'a' occurs twice on page 1 and once on page 2; 'ab' is another word.
    assert Document(pages=('a b a', 'ab a c'), word='a').count == 3


def test_documents_are_the_same_for_the_same_seed() -> None:
    first, again, other = make_document('doc/1'), make_document('doc/1'), make_document('doc/2')
    assert first == again and first != other
    assert 4 <= len(first.pages) <= 8
    assert all(len(page.split()) == 40 for page in first.pages)
    assert first.word in ' '.join(first.pages).split() or first.count == 0
    assert len(make_document('doc/1', pages=3, words_per_page=10).pages) == 3
    groups, again_groups = read_pages_envs(2, 2, seed=3), read_pages_envs(2, 2, seed=3)
    documents = [[env.document for env in group if isinstance(env, ReadPagesEnv)] for group in groups]
    assert [[env.document for env in group if isinstance(env, ReadPagesEnv)] for group in again_groups] == documents
    assert documents[0][0] == documents[0][1] != documents[1][0]  # a group shares its document


def test_reading_every_page_through_the_tool_gives_the_count() -> None:
    env = ReadPagesEnv(make_document('read_pages/test/0', pages=5), document_id='read_pages/test/0')
    system, user = env.reset()
    word = env.document.word
    assert 'read_page' in system['content']
    assert user['content'] == f'The document has 5 pages. How many times does the word "{word}" occur in the document?'
    pages = read(env, 1, 2, 3, 4, 5)
    count = 0
    for page in pages:  # count by hand, word by word
        for token in page.split():
            count += token == word
    assert count == env.user_data['ground_truth'] == env.document.count
    assert count > 0  # 200 words drawn from 12: the asked word occurs (this seed: checked once, fixed by the seed)
    assert pages == list(env.document.pages) and len(set(pages)) == 5
    assert env.user_data == {
        'task': 'read_pages',
        'document_id': 'read_pages/test/0',
        'word': word,
        'pages': 5,
        'ground_truth': count,
    }


def test_a_page_out_of_range_is_an_error_naming_the_range() -> None:
    env = ReadPagesEnv(Document(pages=('a b', 'b c', 'c a'), word='a'))
    for page in (0, 4, -1):
        result = asyncio.run(env.step(turn('', ToolCall('read_page', {'page': page}))))
        assert result.tool_results[0].failed
        assert result.messages[0]['content'] == (
            f'Error: read_page raised DataError: there is no page {page}; the pages are 1 to 3'
        )
    result = asyncio.run(env.step(turn('', ToolCall('read_page', {'page': 'two'}))))
    assert result.messages[0]['content'].startswith('Error: bad arguments for read_page: page:')


def test_one_page_a_turn() -> None:
    env = ReadPagesEnv(Document(pages=('a b', 'b c'), word='a'))
    result = asyncio.run(env.step(turn('', ToolCall('read_page', {'page': 1}), ToolCall('read_page', {'page': 2}))))
    assert [m['content'] for m in result.messages] == ['a b', 'Error: at most 1 tool calls a turn']


@pytest.mark.parametrize(
    ('answer', 'reward'),
    [
        ('3', 1.0),
        ('The word occurs 3 times.', 1.0),
        ('Pages 1 and 2 hold it 3 times.', 1.0),  # the last number is the count
        ('3.0', 1.0),
        ('It occurs 3 times on 2 pages.', 0.0),  # ... so this reports 2
        ('4', 0.0),
        ('three', 0.0),
        ('', 0.0),
    ],
)
def test_read_pages_grades_the_last_number(answer: str, reward: float) -> None:
    # 'a' occurs 2 + 0 + 1 = 3 times.
    env = ReadPagesEnv(Document(pages=('a b a', 'b c', 'c a'), word='a'))
    result = asyncio.run(env.step(turn(answer)))
    assert (result.done, result.reward) == (True, reward)


# ---- a rollout of read-pages episodes, with a scripted policy ----------------------------------


class ScriptedReader:
    """A policy with no model: it reads the pages in order, one ``read_page`` call a turn, then
    counts the word in the ``<tool_response>`` blocks of its prompt. The count comes out right
    only if every page reached the prompt's tokens through a real tool call."""

    def __init__(self, template: Template):
        self.template = template
        self.replies: list[list[int]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        return [self._reply(ids) for ids in prompts]

    def _reply(self, ids: list[int]) -> Generation:
        text = self.template.decode(ids)
        pages = int(_search(r'The document has (\d+) pages', text))
        word = _search(r'the word "(\w+)"', text)
        read = re.findall(r'<tool_response>\n(.*?)\n</tool_response>', text, re.DOTALL)
        if len(read) < pages:
            reply = read_call(len(read) + 1)
        else:
            reply = f'The word occurs {sum(page.split().count(word) for page in read)} times.'
        tokens = self.encode(reply)
        self.replies.append(tokens)
        return Generation(tokens=tokens, logprobs=[-0.5] * len(tokens), stop_reason='stop')

    def encode(self, reply: str) -> list[int]:
        ids: list[int] = self.template.tokenizer.encode(reply, add_special_tokens=False)
        return [*ids, self.template.end_of_turn_id()]


def read_call(page: int) -> str:
    return '<tool_call>\n' + json.dumps({'name': 'read_page', 'arguments': {'page': page}}) + '\n</tool_call>'


def _search(pattern: str, text: str) -> str:
    match = re.search(pattern, text)
    assert match is not None, pattern
    return match.group(1)


def test_a_rollout_reads_every_page_through_tool_calls_and_is_graded(tiny_model_dir: str) -> None:
    template = Template(tiny_model_dir)
    policy = ScriptedReader(template)
    groups = read_pages_envs(num_tasks=2, group_size=2, seed=11, pages=5)
    documents = [env.document for group in groups for env in group if isinstance(env, ReadPagesEnv)]
    engine = RolloutEngine(policy, template, SamplingParams(max_tokens=96), max_turns=8)
    episodes = engine.rollout(groups)

    assert [(e.group, e.index) for e in episodes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for episode, document in zip(episodes, documents, strict=True):
        assert (episode.end, episode.error, len(episode.turns), episode.final_reward) == ('done', None, 6, 1.0)
        # system, user, then 5 times (the call, the page), then the answer
        assert [m['role'] for m in episode.messages] == ['system', 'user', *['assistant', 'tool'] * 5, 'assistant']
        assert [m['content'] for m in episode.messages if m['role'] == 'tool'] == list(document.pages)
        assert episode.messages[-1]['content'] == f'The word occurs {document.count} times.'
        assert [t.tool_calls[0].arguments for t in episode.turns[:5]] == [{'page': p} for p in range(1, 6)]
        # The model's tokens: five calls and the answer, each with its end-of-turn token, scripted
        # independently here; the feature trains those and nothing else.
        expected = [policy.encode(read_call(p)) for p in range(1, 6)] + [policy.encode(episode.messages[-1]['content'])]
        assert [t.action_tokens for t in episode.turns] == expected
        feature = episode.to_feature()
        trained = [label for label in feature['labels'] if label != IGNORE_INDEX]
        assert trained == [token for tokens in expected for token in tokens]
        assert episode.num_model_tokens == len(trained) == sum(map(len, expected))
        assert episode.old_logps == [-0.5] * len(trained)
        assert feature['user_data']['ground_truth'] == document.count and feature['user_data']['reward'] == 1.0
    assert len(policy.replies) == 4 * 6
    assert (engine.stats.tool_calls, engine.stats.tool_errors, dict(engine.stats.ends)) == (20, 0, {'done': 4})
