"""Self-cognition SFT with LoRA: the seed documents' first loop, on the embedded tiny model.

    python cookbook/sft_self_cognition.py            # ~1 minute on 2 CPU cores
    python cookbook/sft_self_cognition.py --report-to tensorboard jsonl
    tensorboard --logdir output/sft-self-cognition/logs   # the curves

The model is a random-weight Qwen3 (``twinkle.assets.tiny_model()``); the data is the embedded
self-cognition set. Swap in ``ms://Qwen/Qwen3.5-4B`` and ``ms://swift/self-cognition`` for the
real thing: nothing else changes.
"""

from __future__ import annotations

import argparse

from peft import LoraConfig
from tqdm import tqdm

from twinkle import assets, get_logger
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import MetricWriter, add_sink_arguments
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

logger = get_logger()


def build_dataset(model_id: str, dataset_id: str, rows: range) -> Dataset:
    dataset = Dataset(dataset_meta=DatasetMeta(dataset_id, data_slice=rows))
    dataset.set_template('Template', model_id=model_id, max_length=256)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()
    return dataset


def evaluate(model: TransformersModel, dataset: Dataset) -> dict[str, float]:
    for batch in DataLoader(dataset=dataset, batch_size=16):
        model.forward_only(inputs=batch)
        model.calculate_loss()
    return model.calculate_metric(is_training=False)


def train(args: argparse.Namespace) -> None:
    model_id, dataset_id = args.model or assets.tiny_model(), args.dataset or assets.dataset('self-cognition')
    dataset = build_dataset(model_id, dataset_id, range(args.samples))
    eval_dataset = build_dataset(model_id, dataset_id, range(args.samples, args.samples + 64))
    dataloader = DataLoader(dataset=dataset, batch_size=args.batch_size, shuffle=True)

    model = TransformersModel(model_id=model_id)
    lora_config = LoraConfig(r=16, lora_alpha=32, target_modules='all-linear')
    model.add_adapter_to_model('default', lora_config, gradient_accumulation_steps=1)
    model.set_optimizer(optimizer_cls='AdamW', lr=args.lr)
    total_steps = args.epochs * len(dataloader)
    model.set_lr_scheduler(scheduler_cls='CosineWarmupScheduler', num_warmup_steps=10, num_training_steps=total_steps)
    logger.info(model.get_train_configs())
    with MetricWriter(args.report_to, args.log_dir, config=vars(args)) as writer:
        before = evaluate(model, eval_dataset)
        logger.info(f'eval before training: {_short(before)}')
        writer.write(before, step=0, prefix='eval')
        progress = tqdm(total=total_steps, desc='sft', unit='step')
        global_step = 0
        for epoch in range(args.epochs):
            for batch in dataloader:
                output = model.forward_backward(inputs=batch)
                model.clip_grad_and_step()
                global_step += 1
                progress.update()
                progress.set_postfix(epoch=epoch, loss=f'{output.loss:.3f}')
                if global_step % args.log_every == 0:
                    metric = model.calculate_metric(is_training=True)
                    writer.write(metric, step=global_step)
                    if global_step % (4 * args.log_every) == 0:
                        progress.write(f'epoch {epoch} step {global_step}/{total_steps}: {_short(metric)}')
        progress.close()
        after = evaluate(model, eval_dataset)
        writer.write(after, step=total_steps, prefix='eval')
    logger.info(f'eval after training: {_short(after)}')
    logger.info(f'metrics in {args.log_dir} ({", ".join(args.report_to)})')
    logger.info(f'saved adapter to {model.save("last-checkpoint", output_dir=args.output_dir)}')


def _short(metric: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4 if k != 'lr' else 6) for k, v in metric.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', help='model id (default: the embedded tiny-qwen3)')
    parser.add_argument('--dataset', help='dataset id (default: the embedded self-cognition set)')
    parser.add_argument('--samples', type=int, default=256)
    parser.add_argument('--epochs', type=int, default=4)
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--lr', type=float, default=5e-3)
    parser.add_argument('--output-dir', default='output/sft-self-cognition')
    parser.add_argument('--log-every', type=int, default=5, help='write metrics every this many steps')
    add_sink_arguments(parser, log_dir='output/sft-self-cognition/logs')
    train(parser.parse_args())


if __name__ == '__main__':
    main()
