"""The twinkle client: train on a twinkle server with the local API's names and results.

Example::

    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel

    client = init_twinkle_client(base_url='http://127.0.0.1:8000', api_key='tk-...')
    model = MultiLoraTransformersModel(model_id='ms://Qwen/Qwen3.5-4B')   # uses the client above
    model.add_adapter_to_model('default', {'r': 8, 'target_modules': 'all-linear'})  # or peft's LoraConfig

The official Tinker SDK works against the same server, unpatched:
``init_tinker_compat_client(base_url, api_key)`` returns a ``tinker.ServiceClient`` for it.

The client imports without torch, peft or transformers: it talks HTTP and reads a LoRA config by
its fields. Only exporting a checkpoint here (``MultiLoraTransformersModel.export``) needs them.

State lives in the ``TwinkleClient`` object. ``init_twinkle_client`` also makes it the default
that components use when built without ``client=``; pass ``client=`` to talk to two servers.
"""

from twinkle_client.client import (
    Checkpoint,
    RemoteError,
    TrainingRun,
    TwinkleClient,
    default_client,
    init_twinkle_client,
)
from twinkle_client.tinker_compat import init_tinker_compat_client

__all__ = [
    'Checkpoint',
    'RemoteError',
    'TrainingRun',
    'TwinkleClient',
    'default_client',
    'init_tinker_compat_client',
    'init_twinkle_client',
]
