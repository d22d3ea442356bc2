from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from typing_extensions import NotRequired

#: Label value of a position that is not trained on (the Hugging Face / PyTorch convention).
IGNORE_INDEX = -100


class Message(TypedDict):
    """One chat turn."""

    role: Literal['system', 'user', 'assistant', 'tool']
    content: str
    tool_calls: NotRequired[list[dict[str, Any]]]
    reasoning_content: NotRequired[str]


class Trajectory(TypedDict):
    """A conversation before encoding: what preprocessors produce and templates consume."""

    messages: list[Message]
    tools: NotRequired[list[dict[str, Any]]]
    #: Anything a reward or metric needs later (a ground-truth answer, a task id...).
    user_data: NotRequired[dict[str, Any]]


#: Per-sequence RL loss inputs a row may carry (a packed row: one entry per row packed into it).
RL_ROW_FIELDS = ('advantages', 'old_logps', 'ref_logps')


class InputFeature(TypedDict):
    """One encoded sequence of ``length`` tokens, ready to collate.

    ``labels`` are pre-shifted: ``labels[i]`` is the token position ``i`` must predict (that is
    ``input_ids[i + 1]``) or ``IGNORE_INDEX``. ``completion_mask[i]`` is 1 exactly where
    ``labels[i]`` is trained on, so ``logits[i]`` scores a completion token.

    A template's rows have every field; a row encoded elsewhere (a client's, say) needs only
    ``input_ids`` and ``labels``, and the collator pads the other token fields it has.
    """

    input_ids: list[int]
    labels: list[int]
    attention_mask: NotRequired[list[int]]
    position_ids: NotRequired[list[int]]
    completion_mask: NotRequired[list[int]]
    length: NotRequired[int]
    user_data: NotRequired[dict[str, Any]]
    #: The conversation the tokens encode, on a row a sampler made (its completion the last turn).
    messages: NotRequired[list[Message]]
    #: The experts a sampler's MoE router chose for each token: [tokens][MoE layers][top_k] (-1:
    #: none recorded); the trainer's forward routes the same (``router.replay_routing``).
    routed_experts: NotRequired[list[list[list[int]]]]
    #: How many rows ``PackingDataset`` packed into this one; its ``advantages``, ``old_logps`` and
    #: ``ref_logps``, when it carries them, hold one entry per packed row, in order.
    packed_rows: NotRequired[int]
    #: A row with images (``VisionTemplate``): 1 on each image token, else 0 (one per token); every
    #: image's patches in order, ``[patches, channels * patch volume]`` (a tensor, or its nested
    #: lists after a round trip through Arrow); each image's (temporal, height, width) patches.
    mm_token_type_ids: NotRequired[list[int]]
    pixel_values: NotRequired[Any]
    image_grid_thw: NotRequired[list[list[int]]]
    advantages: NotRequired[Any]
    old_logps: NotRequired[Any]
    ref_logps: NotRequired[Any]


@dataclass
class ModelOutput:
    """What ``forward``/``forward_only``/``forward_backward`` return.

    ``loss`` is the reduced loss of this call (a float, ``None`` before a loss is computed);
    ``num_tokens`` counts the trained label tokens. ``logits`` and ``logps`` (log-probability of
    each label token, 0 where the label is ignored; shape ``[batch, seq]``) are kept only by
    ``forward`` and ``forward_only``.
    """

    loss: float | None = None
    num_tokens: int = 0
    logits: Any = None
    logps: Any = None
    #: A critic's value of each position ``[batch, seq]`` (an adapter with a value head; else None).
    values: Any = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        loss = 'None' if self.loss is None else f'{self.loss:.4f}'
        return f'ModelOutput(loss={loss}, num_tokens={self.num_tokens})'
