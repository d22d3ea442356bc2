"""Kept for the import path of the seed documents' Tinker scripts
(``from twinkle.server.tinker.common import input_feature_to_datum``); the Tinker routes are in
:mod:`twinkle.server.api.tinker`."""
