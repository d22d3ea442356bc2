"""Self-cognition SFT through the official Tinker SDK: the seed documents' Tinker client script.

    python cookbook/tinker_sft.py      # starts a server on the embedded tiny model in this process

Only the model id, the dataset path and where the server is differ from the seed's script: the
SDK is the unpatched ``tinker`` package, and the rows are twinkle's, converted by
``input_feature_to_datum``. Against a running twinkle server (see the README)::

    python cookbook/tinker_sft.py --base-url http://127.0.0.1:8000 --api-key tml-... --model Qwen/Qwen3.5-4B \\
        --dataset ms://swift/self-cognition

``--base-url`` defaults to ``$TWINKLE_SERVER_URL`` and ``--api-key`` to ``$MODELSCOPE_TOKEN`` (as
in the seed), then to ``$TWINKLE_API_KEY`` through ``init_tinker_client()``. The printed loss is
per trained token: Tinker's ``loss:sum`` over the batch's token weights.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator

from tinker import types
from tqdm import tqdm

from twinkle import assets, init_tinker_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.server.common import input_feature_to_datum

# Initialize Tinker client (must be called before importing ServiceClient)
init_tinker_client()

from tinker import ServiceClient  # noqa: E402


def train(args: argparse.Namespace, base_url: str, api_key: str | None) -> None:
    base_model = args.model
    # Prepare dataset
    dataset = Dataset(dataset_meta=DatasetMeta(args.dataset, data_slice=range(args.samples)))
    dataset.set_template('Qwen3_5Template', model_id=tokenizer_id(base_model), max_length=256)
    dataset.map(SelfCognitionProcessor('Twinkle Model', 'ModelScope Team'), load_from_cache_file=False)
    dataset.encode(batched=True, load_from_cache_file=False)
    dataloader = DataLoader(dataset=dataset, batch_size=args.batch_size)

    # Initialize training client
    service_client = ServiceClient(base_url=base_url, api_key=api_key)
    training_client = service_client.create_lora_training_client(base_model=base_model, rank=args.rank)

    # Training loop
    for epoch in range(args.epochs):
        print(f'Epoch {epoch}')
        for step, batch in tqdm(enumerate(dataloader)):
            # Convert input format
            input_datum = [input_feature_to_datum(input_feature) for input_feature in batch]

            # Remote forward + backward
            fwdbwd_future = training_client.forward_backward(input_datum, 'cross_entropy')
            # Remote optimizer step
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=args.lr))

            # Wait for results
            fwdbwd_result = fwdbwd_future.result()
            optim_result = optim_future.result()
            print(f'epoch {epoch} step {step} loss {token_mean_loss(fwdbwd_result, input_datum):.4f}')
            print(f'Training Metrics: {optim_result}')

        # Save checkpoint
        save_future = training_client.save_state(f'twinkle-lora-{epoch}')
        save_result = save_future.result()
        print(f'Saved checkpoint to {save_result.path}')


def tokenizer_id(base_model: str) -> str:
    """Where the client finds the base model's tokenizer: the embedded model's folder, or the hub."""
    return assets.tiny_model(base_model) if base_model in assets.MODELS else f'ms://{base_model}'


def token_mean_loss(result: types.ForwardBackwardOutput, data: list[types.Datum]) -> float:
    """Tinker's summed cross-entropy over the trained tokens (the weights' sum)."""
    tokens = sum(float(datum.loss_fn_inputs['weights'].to_numpy().sum()) for datum in data)
    return result.metrics['loss:sum'] / max(tokens, 1.0)


@contextlib.contextmanager
def local_server(base_model: str) -> Iterator[tuple[str, str]]:
    """A twinkle server on a free loopback port of this process, with a fresh data directory
    and one tenant; yields its URL and the tenant's key."""
    from twinkle.server.cli import BackgroundServer
    from twinkle.server.config import ServerConfig
    from twinkle.server.store import Store

    with tempfile.TemporaryDirectory(prefix='twinkle-tinker-sft-') as data_dir:
        config = ServerConfig.build(base_model=base_model, port=0, data_dir=data_dir)
        with Store(config.db_path) as store:
            key = store.tenants.add('tinker-user')[1]
        with BackgroundServer(config) as url:
            print(f'Started a twinkle server on {url}, serving {base_model}')
            yield url, key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--base-url', default=os.environ.get('TWINKLE_SERVER_URL'), help='default: a local server')
    parser.add_argument('--api-key', default=os.environ.get('MODELSCOPE_TOKEN'))
    parser.add_argument('--model', default='tiny-qwen3', help='the served base model (default: the embedded one)')
    parser.add_argument('--dataset', default=assets.dataset('self-cognition'), help='e.g. ms://swift/self-cognition')
    parser.add_argument('--samples', type=int, default=500)
    parser.add_argument('--epochs', type=int, default=3)
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--rank', type=int, default=16)
    parser.add_argument('--lr', type=float, default=1e-4)
    args = parser.parse_args()
    if args.base_url:
        train(args, args.base_url, args.api_key)
        return
    with local_server(args.model) as (url, key):
        train(args, url, key)


if __name__ == '__main__':
    main()
