"""The official ``tinker`` SDK's ``ServiceClient``, pointed at a twinkle server.

The SDK is used as it is, unpatched: a twinkle server speaks its wire protocol, and its API keys
start with ``tml-`` as the SDK requires. ``tinker`` is imported only when a client is made (it
imports torch; the rest of ``twinkle_client`` needs no torch to talk HTTP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinkle.tinker_sdk import check_tinker_version

if TYPE_CHECKING:
    import tinker


def init_tinker_compat_client(base_url: str, api_key: str) -> tinker.ServiceClient:
    """A ``tinker.ServiceClient`` for the twinkle server at ``base_url`` with a tenant's key,
    after checking that the installed SDK is a supported release.

    Example::

        service_client = init_tinker_compat_client('http://127.0.0.1:8000', 'tml-...')
        training_client = service_client.create_lora_training_client(base_model='Qwen/Qwen3.5-4B', rank=16)
    """
    check_tinker_version()
    import tinker

    return tinker.ServiceClient(base_url=base_url, api_key=api_key)


__all__ = ['init_tinker_compat_client']
