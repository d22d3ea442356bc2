"""The import path the seed documents' Tinker scripts use:
``from twinkle.server.tinker.common import input_feature_to_datum``. The function is client-side
(a script builds its Datums without a server) and lives in :mod:`twinkle.tinker_sdk`."""

from twinkle.tinker_sdk import input_feature_to_datum

__all__ = ['input_feature_to_datum']
