"""The import path the seed documents' Tinker scripts use:
``from twinkle.server.tinker.common import input_feature_to_datum`` (the function lives in
:mod:`twinkle.server.common`)."""

from twinkle.server.common import input_feature_to_datum

__all__ = ['input_feature_to_datum']
