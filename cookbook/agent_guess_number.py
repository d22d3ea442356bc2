"""A multi-turn agent learns to guess a number, from scratch, on the embedded tiny model.

Each episode is a game of ``GuessNumberEnv``: the environment thinks of a number from 1 to 9,
the model guesses, the environment answers "Higher." or "Lower.", for up to ``--max-guesses``
turns. Finding the number is worth 1; every guess the answers so far allow earns up to 0.5 for
how close it came, so a middle first guess and guesses that follow the answers pay before
finding the number often does.

The random tiny model writes a digit in about one token of 350, too rarely for RL to start from,
so a short cold start comes first (as DeepSeek-R1's does): ``--warmup-steps`` of supervised
steps on games played with random guesses, which teach the format (a digit a turn) and nothing
of the strategy. RL then learns to search: over the default 80 steps (seed 0) the mean reward
went from 0.88 in the first 10 steps to 1.01 in the last 10, and the share of games won from
0.25 to 0.35 (``benchmarks/results/agent_guess_number.json``; about 5 minutes on 2 cores).

The loop is the GRPO loop of the seeds with ``engine.rollout`` where ``sampler.sample`` was:
sync the adapter to the sampler, roll out a group of episodes per game, take each episode's
return as its reward, advantages against the game's mean (scaled by the batch's spread), one
policy-gradient step on the episodes' own tokens (only the model's are trained; ``old_logps``
are the sampler's). ``start`` (over ``twinkle.recipe``) is the only code that knows the mode:

    python cookbook/agent_guess_number.py                      # one process
    python cookbook/agent_guess_number.py --mode ray           # model and sampler on Ray groups
    python cookbook/agent_guess_number.py --mode server        # against a server started here
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peft import LoraConfig
from tqdm import tqdm

from twinkle import assets, get_logger
from twinkle.advantage import GRPOAdvantage
from twinkle.agent import Action, RolloutEngine
from twinkle.agent.tasks.guess_number import GuessNumberEnv, guess_number_envs
from twinkle.data_format import SamplingParams
from twinkle.metric import MetricWriter, add_sink_arguments
from twinkle.recipe import RECIPE_MODES, ModeSettings, RecipeParts, add_config_arguments, start_parts
from twinkle.template import Template

logger = get_logger()
ADAPTER = 'default'
# The output layer too: the tiny model is random, and with its output layer and final norm frozen no
# logit moves more than about 2.6 nats, too little to make 9 digits of 4096 tokens likely (the
# cold start's loss stalls at 2.4 nats a token, against 1.1 for a uniform digit; with it, 1.1).
LORA_TARGETS = ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', 'lm_head']


@dataclass
class Config:
    steps: int = 80
    warmup_steps: int = 15  # supervised cold start on random-guess games (the format only)
    warmup_lr: float = 3e-3
    games_per_step: int = 8  # GRPO groups: each game is played by group_size episodes
    group_size: int = 8
    max_guesses: int = 3
    closeness_reward: float = 1.5  # up to 0.5 a guess for how close it came (finding the number: 1)
    max_tokens: int = 6  # per turn
    lr: float = 1e-3  # RL's: at 3e-3 the policy soon stops exploring (every episode of a game alike)
    lora_rank: int = 16
    temperature: float = 1.0
    seed: int = 0
    mode: str = 'local'  # 'local', 'ray' or 'server'
    model: str = 'tiny-qwen3'
    output: str = ''  # a JSON file for the per-step log, if given


@contextmanager
def start(config: Config) -> Iterator[RecipeParts]:
    """The model (its adapter, the cold start's optimizer), the sampler and their weight sync in ``config.mode``."""
    mode = ModeSettings.of(config, device='cpu')
    with start_parts(mode, assets.tiny_model(config.model)) as parts:
        lora = LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, target_modules=LORA_TARGETS)
        parts.model.add_adapter_to_model(ADAPTER, lora)
        parts.model.set_optimizer('AdamW', lr=config.warmup_lr)
        yield parts


def warm_up(model: Any, template: Template, config: Config) -> None:
    """Supervised steps on games where the guesses are random digits: the format, not the search."""
    model.set_loss('CrossEntropyLoss')
    rng = random.Random(config.seed)
    for step in range(1, config.warmup_steps + 1):
        rows = [template.encode(random_game(rng, config.max_guesses)) for _ in range(16)]
        output = model.forward_backward(inputs=rows)
        model.clip_grad_and_step()
        logger.info(f'warm-up {step:3d}  loss {output.loss:.3f}')
    model.set_optimizer('AdamW', lr=config.lr)  # a new optimizer, at RL's rate
    model.set_loss('GRPOLoss', epsilon=0.2, beta=0.0)


def random_game(rng: random.Random, max_guesses: int) -> dict[str, Any]:
    """A game of ``GuessNumberEnv``'s words, its guesses random digits, as a conversation."""
    env = GuessNumberEnv(rng.randrange(1 << 30), max_guesses=max_guesses)
    messages = env.reset()
    for _ in range(max_guesses):
        guess = str(rng.randint(env.low, env.high))
        messages.append({'role': 'assistant', 'content': guess})
        result = env.step(Action(text=guess, tool_calls=[], tokens=[], truncated=False))
        if result.done:
            break
        messages += result.messages
    return {'messages': messages}


def train(config: Config, writer: MetricWriter | None = None) -> list[dict[str, float]]:
    """The loop; each step's record also goes to ``writer`` when given."""
    history = []
    with start(config) as parts:
        template = Template(assets.tiny_model(config.model))
        params = SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature)
        engine = RolloutEngine(parts.sampler, template, params, max_turns=config.max_guesses)
        warm_up(parts.model, template, config)
        progress = tqdm(total=config.steps, desc='agent', unit='step')
        for step in range(1, config.steps + 1):
            parts.sync_weights()
            record = rl_step(parts.model, engine, config, step)
            history.append(record)
            if writer is not None:
                writer.write({k: v for k, v in record.items() if k != 'step'}, step=step)
            progress.update()
            progress.set_postfix(reward=f'{record["reward"]:.3f}', found=f'{record["found"]:.2f}')
            if step % 5 == 0 or step == config.steps:
                progress.write(
                    f'step {step:4d}  reward {record["reward"]:.3f}  found {record["found"]:.2f}  '
                    f'turns {record["turns_per_episode"]:.2f}  {record["tokens_per_s"]:.0f} tokens/s'
                )
        progress.close()
    return history


def rl_step(model: Any, engine: RolloutEngine, config: Config, step: int) -> dict[str, float]:
    """Roll out a group of episodes per game, and one GRPO step on them; the step's record."""
    seed = config.seed * 100_003 + step
    episodes = engine.rollout(
        guess_number_envs(
            config.games_per_step,
            config.group_size,
            seed,
            max_guesses=config.max_guesses,
            closeness_reward=config.closeness_reward,
        )
    )
    rewards = [episode.reward for episode in episodes]
    advantages = GRPOAdvantage()(rewards, num_generations=config.group_size, scale='batch').tolist()
    output = model.forward_backward(
        inputs=[episode.to_feature() for episode in episodes],
        old_logps=[episode.old_logps for episode in episodes],
        advantages=advantages,
    )
    model.clip_grad_and_step()
    found = sum(episode.turns[-1].metrics.get('found', 0.0) for episode in episodes if episode.turns)
    record = {'step': step, 'loss': float(output.loss), 'reward': sum(rewards) / len(rewards)}
    record['found'] = found / len(episodes)
    return record | {k: v for k, v in engine.stats.as_metrics().items() if k != 'episodes'}


def parse_args() -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_config_arguments(parser, Config(), choices={'mode': RECIPE_MODES})
    add_sink_arguments(parser, log_dir='output/agent-guess-number/logs')
    args = vars(parser.parse_args())
    sinks = argparse.Namespace(report_to=args.pop('report_to'), log_dir=args.pop('log_dir'))
    return Config(**args), sinks


def main() -> None:
    config, sinks = parse_args()
    with MetricWriter(sinks.report_to, sinks.log_dir, config=asdict(config)) as writer:
        history = train(config, writer)
    window = min(10, len(history))
    first = sum(r['reward'] for r in history[:window]) / window
    last = sum(r['reward'] for r in history[-window:]) / window
    logger.info(f'mean reward: first {window} steps {first:.3f}, last {window} steps {last:.3f}')
    if config.output:
        Path(config.output).write_text(json.dumps({'config': asdict(config), 'history': history}, indent=1))


if __name__ == '__main__':
    main()
