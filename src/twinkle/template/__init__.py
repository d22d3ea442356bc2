"""Templates turn conversations into token ids and labels (and, for images, pixels and grids)."""

from twinkle.template.base import TEMPLATES, Template, load_tokenizer
from twinkle.template.qwen import Qwen3_5Template
from twinkle.template.vision import VisionTemplate

__all__ = ['TEMPLATES', 'Qwen3_5Template', 'Template', 'VisionTemplate', 'load_tokenizer']
