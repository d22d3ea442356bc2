"""Where a hosted model runs: :func:`build_host` reads it from the config."""

from __future__ import annotations

from twinkle.server.config import ServerConfig
from twinkle.server.execution.host import Host
from twinkle.server.execution.hosts.model_host import ModelHost
from twinkle.server.execution.hosts.multi_rank import MultiRankHost
from twinkle.server.execution.hosts.remote_host import RemoteHost


def build_host(config: ServerConfig) -> Host:
    """The model host a config asks for: in this process, in a Ray actor (``ray:`` set), on
    worker processes of this machine (``ranks`` > 1), or on Ray actors of a cluster (both)."""
    if config.ranks > 1 and config.ray is not None:
        from twinkle.server.execution.hosts.ray_ranks import RayRanks

        return MultiRankHost(config, RayRanks)
    if config.ranks > 1:
        return MultiRankHost(config)
    return RemoteHost(config) if config.ray is not None else ModelHost(config)


__all__ = ['build_host']
