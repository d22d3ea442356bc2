"""Preprocessors (rows to trajectories) and filters (rows to bool)."""

from twinkle.preprocessor.base import FILTERS, PREPROCESSORS, DataFilter, Preprocessor
from twinkle.preprocessor.filters import CountingFilter, ExactDedupFilter, LengthFilter, NearDedupFilter, RuleFilter
from twinkle.preprocessor.llm import (
    AlpacaProcessor,
    GSM8KProcessor,
    SelfCognitionProcessor,
    gsm8k_final_answer,
)

__all__ = [
    'FILTERS',
    'PREPROCESSORS',
    'AlpacaProcessor',
    'CountingFilter',
    'DataFilter',
    'ExactDedupFilter',
    'GSM8KProcessor',
    'LengthFilter',
    'NearDedupFilter',
    'Preprocessor',
    'RuleFilter',
    'SelfCognitionProcessor',
    'gsm8k_final_answer',
]
