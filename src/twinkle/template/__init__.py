"""Templates turn conversations into token ids and labels."""

from twinkle.template.base import TEMPLATES, Template, load_tokenizer
from twinkle.template.qwen import Qwen3_5Template

__all__ = ['TEMPLATES', 'Qwen3_5Template', 'Template', 'load_tokenizer']
