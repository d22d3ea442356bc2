"""Multi-turn rollouts: what batching episodes buys, what a turn's prefill costs as the episode
grows, and how closely the trainer agrees with the sampler over a long episode.

* ``batching``: ``--episodes`` episodes of ``--turns`` turns each (``--max-tokens`` new tokens a
  turn, the end of turn ignored so every system samples the same tokens; the environment adds a
  short user turn after each), run by one ``RolloutEngine`` at once, against the same episodes
  run one after the other (an engine per episode: the baseline of a loop without a batcher).
  ``speed_ratio`` = tokens/s at once / tokens/s one at a time. Same sampler, same process.
* ``prefill``: one episode of ``--prefill-turns`` turns of ``--prefill-tokens`` tokens, played
  turn by turn; at each turn ``k`` the time of a call that only reads the episode so far
  (``max_tokens=1``): the cost of the prefix. ``TorchSampler`` recomputes the whole prefix each
  turn; vLLM's prefix caching (``--vllm``, in the vLLM environment) computes only what the last
  turn added.
  ``growth`` = time at the last turn / time at turn 1 (flat: about 1).
* ``agreement``: ``--kl-episodes`` episodes of 10 turns sampled in float32; the trainer's
  teacher-forced log-probabilities of the model's tokens against the sampler's, with
  tinker-cookbook's ``kl_sample_train_v1`` (mean of sampler minus trainer log-probability) and
  ``kl_sample_train_v2`` (half the mean squared difference), and the largest difference.

Usage::

    .venv/bin/python benchmarks/agent_rollout.py                  # writes benchmarks/results/agent_rollout.json
    .venv-vllm/bin/python benchmarks/agent_rollout.py --vllm --output benchmarks/results/agent_rollout_vllm.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from twinkle import assets
from twinkle.agent import Action, Env, RolloutEngine, StepResult
from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler
from twinkle.template import Template


class Talk(Env):
    """A conversation of ``turns`` turns: each answered by a short user message."""

    def __init__(self, turns: int, topic: int = 0):
        self.turns, self.topic, self.seen = turns, topic, 0

    def reset(self) -> list[dict[str, str]]:
        return [{'role': 'user', 'content': f'Tell me about topic number {self.topic}, one part at a time.'}]

    def step(self, action: Action) -> StepResult:
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(done=True)
        return StepResult(messages=[{'role': 'user', 'content': f'Go on with part {self.seen + 1}.'}])


def batching(sampler: Any, template: Template, args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def at_once() -> int:
        engine = RolloutEngine(sampler, template, params, max_turns=args.turns)
        episodes = engine.rollout([Talk(args.turns, i) for i in range(args.episodes)])
        return sum(e.num_model_tokens for e in episodes)

    def one_by_one() -> int:
        tokens = 0
        for i in range(args.episodes):
            engine = RolloutEngine(sampler, template, params, max_turns=args.turns)
            tokens += sum(e.num_model_tokens for e in engine.rollout([Talk(args.turns, i)]))
        return tokens

    rates: dict[str, list[float]] = {'at_once': [], 'one_by_one': []}
    for round_ in range(args.repeats + 1):  # the first round warms up
        for name, run in (('at_once', at_once), ('one_by_one', one_by_one)):
            started = time.perf_counter()
            tokens = run()
            if round_:
                rates[name].append(tokens / (time.perf_counter() - started))
    at_once_rate, one_rate = statistics.median(rates['at_once']), statistics.median(rates['one_by_one'])
    return {
        'episodes': args.episodes,
        'turns': args.turns,
        'max_tokens': args.max_tokens,
        'tokens_per_s_at_once': round(at_once_rate, 1),
        'tokens_per_s_one_by_one': round(one_rate, 1),
        'speed_ratio': round(at_once_rate / one_rate, 2),
    }


def prefill(sampler: Any, template: Template, args: argparse.Namespace) -> dict[str, Any]:
    """Turn by turn, the time of a call that reads the episode so far and writes one token."""
    env = Talk(args.prefill_turns)
    tokens = template.encode({'messages': env.reset()}, add_generation_prompt=True)['input_ids']
    probe, turn = SamplingParams(max_tokens=1), SamplingParams(max_tokens=args.prefill_tokens, ignore_eos=True)
    seconds = []
    for _turn in range(args.prefill_turns):
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            sampler.sample([{'input_ids': tokens}], probe)
            times.append(time.perf_counter() - started)
        seconds.append(statistics.median(times))
        [response] = sampler.sample([{'input_ids': tokens}], turn)
        tokens += [*response.sequences[0].tokens, template.end_of_turn_id()]
        result = env.step(Action(text='', tool_calls=[], tokens=[], truncated=True))
        tokens += template.continuation(result.messages or [{'role': 'user', 'content': 'end'}])
    return {
        'turns': args.prefill_turns,
        'prefix_tokens_last_turn': len(tokens),
        'seconds_per_turn': [round(s, 5) for s in seconds],
        'growth': round(seconds[-1] / seconds[0], 2),
    }


def agreement(sampler: Any, template: Template, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = RolloutEngine(sampler, template, SamplingParams(max_tokens=args.max_tokens), max_turns=10)
    episodes = engine.rollout([Talk(10, i) for i in range(args.kl_episodes)])
    trainer = TransformersModel(model_dir, device='cpu')
    features = [e.to_feature() for e in episodes]
    logps = trainer.forward_only(inputs=features).logps
    diffs = []
    for row, (episode, feature) in enumerate(zip(episodes, features, strict=True)):
        trained = logps[row, : len(feature['labels'])][torch.tensor(feature['completion_mask']).bool()]
        diffs.append(torch.tensor(episode.old_logps) - trained.float())
    diff = torch.cat(diffs)
    return {
        'episodes': args.kl_episodes,
        'turns': [len(e.turns) for e in episodes],
        'model_tokens': int(diff.numel()),
        'kl_sample_train_v1': float(diff.mean()),
        'kl_sample_train_v2': float(0.5 * (diff**2).mean()),
        'max_abs_diff': float(diff.abs().max()),
    }


def build_sampler(model_dir: str, args: argparse.Namespace) -> Any:
    if not args.vllm:
        return TorchSampler(model_dir, device='cpu')
    from twinkle.sampler import vLLMSampler

    engine = {'dtype': 'float32', 'max_model_len': 2048, 'enable_prefix_caching': not args.no_prefix_caching}
    return vLLMSampler(model_dir, engine_args=engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='small-qwen3')
    parser.add_argument('--episodes', type=int, default=32)
    parser.add_argument('--turns', type=int, default=4)
    parser.add_argument('--max-tokens', type=int, default=16)
    parser.add_argument('--prefill-turns', type=int, default=10)
    parser.add_argument('--prefill-tokens', type=int, default=96, help='new tokens a turn in the prefill part')
    parser.add_argument('--parts', nargs='+', default=['batching', 'prefill', 'agreement'])
    parser.add_argument('--kl-episodes', type=int, default=4)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument(
        '--vllm', action='store_true', help='vLLMSampler (the vLLM environment) instead of TorchSampler'
    )
    parser.add_argument('--no-prefix-caching', action='store_true', help='with --vllm: turn prefix caching off')
    parser.add_argument('--output', type=Path, default=Path(__file__).parent / 'results' / 'agent_rollout.json')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = assets.tiny_model(args.model)
    sampler, template = build_sampler(model_dir, args), Template(model_dir)
    result = {
        'sampler': type(sampler).__name__ + (' (no prefix caching)' if args.vllm and args.no_prefix_caching else ''),
        'model': args.model,
        'machine': {
            'cpu': platform.processor() or platform.machine(),
            'threads': args.threads,
            'torch': torch.__version__,
        },
    }
    parts = {
        'batching': lambda: batching(sampler, template, args),
        'prefill': lambda: prefill(sampler, template, args),
        'agreement': lambda: agreement(sampler, template, model_dir, args),
    }
    result |= {name: parts[name]() for name in args.parts}
    print(json.dumps(result, indent=1))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + '\n')


if __name__ == '__main__':
    main()
