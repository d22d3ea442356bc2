"""The data types every component speaks. Rows are plain dicts, so they live in a
``datasets.Dataset`` and travel as JSON unchanged; the ``TypedDict`` s name their fields."""

from twinkle.data_format.sampling import SampledSequence, SampleResponse, SamplingParams, StopReason, TokenLogprob
from twinkle.data_format.types import IGNORE_INDEX, RL_ROW_FIELDS, InputFeature, Message, ModelOutput, Trajectory

__all__ = [
    'IGNORE_INDEX',
    'RL_ROW_FIELDS',
    'InputFeature',
    'Message',
    'ModelOutput',
    'SampleResponse',
    'SampledSequence',
    'SamplingParams',
    'StopReason',
    'TokenLogprob',
    'Trajectory',
]
