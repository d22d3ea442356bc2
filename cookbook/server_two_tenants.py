"""Two tenants train their own LoRA adapters on one server at the same time.

- alice: supervised fine-tuning on self-cognition conversations (LoRA rank 8, token-mean
  cross-entropy, AdamW 5e-3, gradient accumulation 2);
- bob: pretraining-style next-token prediction on raw GSM8K answer text, every token trained
  (LoRA rank 32 on the attention projections only, token-sum cross-entropy, SGD 1e-4).

Against a running server (see the README)::

    twinkle-server --base-model tiny-qwen3 --data-dir server-data keys add alice   # prints alice's key
    twinkle-server --base-model tiny-qwen3 --data-dir server-data keys add bob
    twinkle-server --base-model tiny-qwen3 --data-dir server-data serve &
    python cookbook/server_two_tenants.py --base-url http://127.0.0.1:8000 --keys <alice key> <bob key>

or with a server started in this process on a free port: ``python cookbook/server_two_tenants.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
from typing import Any

from peft import LoraConfig

from twinkle import assets, get_logger
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle_client import TwinkleClient
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import MultiLoraTransformersModel

logger = get_logger()
MODEL_ID = assets.tiny_model()  # the server's base model; the client needs its tokenizer to encode


def sft_batches(steps: int) -> list[list[dict[str, Any]]]:
    dataset = Dataset(DatasetMeta(assets.dataset('self-cognition'), data_slice=range(8 * steps)))
    dataset.set_template('Template', model_id=MODEL_ID, max_length=256)
    dataset.map(SelfCognitionProcessor('twinkle model', 'ModelScope Community'))
    dataset.encode()
    return list(DataLoader(dataset=dataset, batch_size=4))


def pretraining_batches(steps: int) -> list[list[dict[str, Any]]]:
    dataset = Dataset(DatasetMeta(assets.dataset('gsm8k'), data_slice=range(4 * steps)))
    dataset.set_template('Template', model_id=MODEL_ID, max_length=256, truncation_strategy='right')
    dataset.map(lambda row: {'text': row['answer']})
    dataset.encode()
    return list(DataLoader(dataset=dataset, batch_size=4))


def alice(client: TwinkleClient, steps: int) -> list[float]:
    model = MultiLoraTransformersModel(client=client)
    model.add_adapter_to_model('sft', LoraConfig(r=8, lora_alpha=16, target_modules='all-linear'),
                               gradient_accumulation_steps=2)  # fmt: skip
    model.set_loss('CrossEntropyLoss')
    model.set_optimizer('AdamW', lr=5e-3)
    losses = []
    for step, batch in enumerate(sft_batches(steps)):
        losses.append(model.forward_backward(inputs=batch).loss)
        model.clip_grad_and_step()
        if step % 4 == 0:
            logger.info(f'alice step {step:3d}  loss {losses[-1]:.3f}')
    logger.info(f'alice saved {model.save("sft-final")}')
    return losses


def bob(client: TwinkleClient, steps: int) -> list[float]:
    model = MultiLoraTransformersModel(client=client)
    lora = LoraConfig(r=32, lora_alpha=32, target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'])
    model.add_adapter_to_model('pretrain', lora)
    model.set_loss('CrossEntropyLoss', reduction='sum')
    model.set_optimizer('SGD', lr=1e-4, momentum=0.9)
    losses = []
    for step, batch in enumerate(pretraining_batches(steps)):
        losses.append(model.forward_backward(inputs=batch).loss)
        model.clip_grad_and_step()
        if step % 4 == 0:
            logger.info(f'bob   step {step:3d}  loss {losses[-1]:.1f} (summed over tokens)')
    logger.info(f'bob saved {model.save("pretrain-final")}')
    return losses


def train(base_url: str, keys: list[str], steps: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {}
    tenants = {'alice': alice, 'bob': bob}

    def run(name: str, key: str) -> None:
        results[name] = tenants[name](TwinkleClient(base_url, key), steps)

    threads = [threading.Thread(target=run, args=pair) for pair in zip(tenants, keys, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, losses in results.items():
        logger.info(f'{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps')
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--base-url', help='a running server; without it one is started in this process')
    parser.add_argument('--keys', nargs=2, metavar=('ALICE_KEY', 'BOB_KEY'))
    parser.add_argument('--steps', type=int, default=24)
    args = parser.parse_args()
    if args.base_url:
        train(args.base_url, args.keys, args.steps)
        return
    from twinkle.server.cli import BackgroundServer
    from twinkle.server.config import ServerConfig
    from twinkle.server.store import Store

    with tempfile.TemporaryDirectory() as data_dir:
        config = ServerConfig.build(base_model='tiny-qwen3', port=0, data_dir=data_dir)
        with Store(config.db_path) as store:
            keys = [store.tenants.add(name)[1] for name in ('alice', 'bob')]
        with BackgroundServer(config) as url:
            logger.info(f'server on {url} (OpenAPI docs at {url}/docs)')
            train(url, keys, args.steps)


if __name__ == '__main__':
    main()
