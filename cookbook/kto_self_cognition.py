"""KTO on self-cognition: learn who you are from thumbs up and thumbs down, no pairs needed.

    python cookbook/kto_self_cognition.py            # 8 steps, ~30 s on 2 CPU cores
    python cookbook/kto_self_cognition.py --report-to jsonl --log-dir output/kto/logs

KTO (Ethayarajh et al. 2024) trains on unpaired examples, each only marked desirable or
undesirable: the kind of feedback a product collects. Here the embedded self-cognition set
gives both: its answers filled in with this model's identity (``twinkle LLM`` by ``ModelScope
Community``) are desirable, the same answers claiming another identity undesirable. Desirable
and undesirable examples come from different questions, so nothing is paired.

Each batch holds, after every example, a KL row: its prompt with the previous example's
completion (``kto_kl_rows``, TRL's mismatched pairs). KTOLoss estimates its reference point
``z0 = KL(policy || reference)`` from them; the reference is the base model with the LoRA
adapter switched off. The log shows the reward margin (mean ``beta * log pi/pi_ref`` of the
desirable answers minus the undesirable ones), which starts at 0 and rises, and ``z0``.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any, ClassVar

import torch
from peft import LoraConfig

from twinkle import assets, get_logger
from twinkle.data_format import InputFeature
from twinkle.loss import LossOutput, kto_kl_rows
from twinkle.metric import MetricWriter, add_sink_arguments
from twinkle.metric.base import RatioMetric
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.template import Template

logger = get_logger()
IDENTITY = SelfCognitionProcessor('twinkle LLM', 'ModelScope Community')
IMPOSTOR = SelfCognitionProcessor('ChatGPT', 'OpenAI')


class KTOMetric(RatioMetric):
    """Means of what KTOLoss reports: the rewards of desirable and undesirable examples, their
    margin, and the reference point z0."""

    ratios: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ('chosen_reward', 'chosen_reward', 'desirable'),
        ('rejected_reward', 'rejected_reward', 'undesirable'),
        ('kl', 'kl', 'batches'),
    )

    def accumulate(self, *, inputs: dict[str, torch.Tensor], outputs: dict[str, Any], loss: LossOutput | None) -> None:
        if loss is not None:
            self.add(loss.metrics)

    def calculate(self) -> dict[str, float]:
        result = super().calculate()
        if 'chosen_reward' in result and 'rejected_reward' in result:
            result['margin'] = result['chosen_reward'] - result['rejected_reward']
        return result


def examples(path: str, count: int, seed: int) -> list[tuple[list[dict[str, str]], bool]]:
    """``count`` (messages, desirable) examples, alternating desirable and undesirable, each
    from its own question (English rows only: the tiny tokenizer is English)."""
    with open(path, encoding='utf-8') as f:
        rows = [row for row in map(json.loads, f) if row.get('tag', 'en') == 'en']
    random.Random(seed).shuffle(rows)
    out = []
    for index, row in enumerate(rows[:count]):
        desirable = index % 2 == 0
        out.append(((IDENTITY if desirable else IMPOSTOR).preprocess(row)['messages'], desirable))
    return out


def batch_rows(template: Template, batch: list[tuple[list[dict[str, str]], bool]]) -> tuple[list[InputFeature], list]:
    """Each example followed by its KL row; ``kto_labels`` True/False for the examples, None for the KL rows."""
    prompts = [messages[:-1] for messages, _ in batch]
    completions = [messages[-1] for messages, _ in batch]
    rows: list[InputFeature] = []
    labels: list[bool | None] = []
    kl = kto_kl_rows(prompts, completions)
    for (messages, desirable), (kl_prompt, kl_completion) in zip(batch, kl, strict=True):
        for trajectory, label in ((messages, desirable), ([*kl_prompt, kl_completion], None)):
            feature = template.encode({'messages': trajectory})
            assert feature is not None  # truncation_strategy='raise' never drops a row
            rows.append(feature)
            labels.append(label)
    return rows, labels


def evaluate(model: TransformersModel, template: Template, held_out: list) -> dict[str, float]:
    for start in range(0, len(held_out), 8):
        rows, labels = batch_rows(template, held_out[start : start + 8])
        model.forward_only(inputs=rows)
        model.calculate_loss(kto_labels=labels)
    return model.calculate_metric(is_training=False)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    model_id = args.model or assets.tiny_model()
    data = examples(args.dataset or assets.dataset('self-cognition'), args.samples + 32, args.seed)
    train_set, held_out = data[: args.samples], data[args.samples :]
    template = Template(model_id, max_length=256)

    model = TransformersModel(model_id=model_id)
    model.add_adapter_to_model('default', LoraConfig(r=8, lora_alpha=16, target_modules='all-linear'))
    model.set_optimizer(optimizer_cls='AdamW', lr=args.lr)
    model.set_loss('KTOLoss', beta=args.beta)
    model.add_metric(KTOMetric())
    model.add_metric(KTOMetric(), is_training=False)
    with MetricWriter(args.report_to, args.log_dir, config=vars(args)) as writer:
        before = evaluate(model, template, held_out)
        logger.info(f'eval before training: margin {before["margin"]:.4f}')
        writer.write(before, step=0, prefix='eval')
        step = 0
        for epoch in range(args.epochs):
            random.Random(args.seed + epoch).shuffle(train_set)
            for start in range(0, len(train_set) - args.batch_size + 1, args.batch_size):
                rows, labels = batch_rows(template, train_set[start : start + args.batch_size])
                output = model.forward_backward(inputs=rows, kto_labels=labels)
                model.clip_grad_and_step()
                step += 1
                metric = model.calculate_metric(is_training=True)
                writer.write(metric, step=step)
                logger.info(
                    f'step {step:3d} loss {output.loss:.4f} margin {metric["margin"]:.4f} z0 {metric["kl"]:.4f}'
                )
        after = evaluate(model, template, held_out)
        writer.write(after, step=step, prefix='eval')
    logger.info(f'eval after training: margin {after["margin"]:.4f}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', help='model id (default: the embedded tiny-qwen3)')
    parser.add_argument('--dataset', help='a self-cognition jsonl file (default: the embedded one)')
    parser.add_argument('--samples', type=int, default=64, help='training examples (half desirable)')
    parser.add_argument('--epochs', type=int, default=1)
    parser.add_argument('--batch-size', type=int, default=8, help='examples per step (each brings a KL row)')
    parser.add_argument('--beta', type=float, default=0.1)
    parser.add_argument('--lr', type=float, default=2e-3)
    parser.add_argument('--seed', type=int, default=0)
    add_sink_arguments(parser, log_dir='output/kto-self-cognition/logs')
    train(parser.parse_args())


if __name__ == '__main__':
    main()
