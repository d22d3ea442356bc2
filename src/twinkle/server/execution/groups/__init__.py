"""A hosted model's groups: its model group (host, scheduler, adapters), its sampler group, the adapter pool and the
runs' files on disk.
"""
