"""Preprocessors (rows to trajectories) and filters (rows to bool)."""

from twinkle.preprocessor.base import FILTERS, PREPROCESSORS, DataFilter, Preprocessor
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
    'DataFilter',
    'GSM8KProcessor',
    'Preprocessor',
    'SelfCognitionProcessor',
    'gsm8k_final_answer',
]
