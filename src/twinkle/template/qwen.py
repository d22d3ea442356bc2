from __future__ import annotations

from typing import Any

from twinkle.errors import ConfigurationError
from twinkle.template.base import TEMPLATES, Template

_QWEN_TOKENS = ('<|im_start|>', '<|im_end|>')


@TEMPLATES.register
class Qwen3_5Template(Template):
    """The Qwen3 / Qwen3.5 chat format (``<|im_start|>role\\n...<|im_end|>``), checked at
    construction: a tokenizer without Qwen's special tokens is refused rather than producing
    a conversation the model was never trained on."""

    def __init__(self, model_id: str, **kwargs: Any):
        super().__init__(model_id, **kwargs)
        vocab = self.tokenizer.get_vocab()
        missing = [token for token in _QWEN_TOKENS if token not in vocab]
        if missing:
            raise ConfigurationError(
                f'{type(self).__name__} needs a Qwen tokenizer, but the one of {model_id!r} lacks {missing}; '
                "use 'Template' for other models"
            )
