"""The import path the seed documents' Tinker scripts use:
``from twinkle.server.common import input_feature_to_datum``. The function is client-side (a
script builds its Datums without a server) and lives in :mod:`twinkle.tinker_sdk`."""

from twinkle.tinker_sdk import MASKED_TARGET, input_feature_to_datum

__all__ = ['MASKED_TARGET', 'input_feature_to_datum']
