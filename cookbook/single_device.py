"""The "Single GPU" loop of the runtime-modes page: full-parameter training, no adapter, every
default left as is (CrossEntropyLoss, AdamW at lr 1e-5 unless set, the model's own template).

    python cookbook/single_device.py
"""

from __future__ import annotations

from twinkle import assets, get_logger
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor

logger = get_logger()


def train() -> None:
    model_id = assets.tiny_model()  # the seed uses 'ms://Qwen/Qwen3.5-4B'
    dataset = Dataset(dataset_meta=DatasetMeta(assets.dataset('self-cognition'), data_slice=range(128)))
    dataset.set_template('Template', model_id=model_id)
    dataset.map(SelfCognitionProcessor('twinkle LLM', 'ModelScope Community'))
    dataset.encode()

    dataloader = DataLoader(dataset=dataset, batch_size=8)
    model = TransformersModel(model_id=model_id)
    model.set_optimizer('AdamW', lr=1e-3)

    for step, batch in enumerate(dataloader):
        output = model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        logger.info(f'step {step}/{len(dataloader)} loss {output.loss:.4f}')


if __name__ == '__main__':
    train()
