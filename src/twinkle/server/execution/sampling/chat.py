"""An OpenAI-style completion as a host samples it: the prompt (chat messages encoded with the base
model's chat template, or token ids as given), the sampling parameters, and each choice split at
its tokens so a route can answer it whole or stream it token by token.

The route checks the request's fields and builds a :class:`ChatRequest`; the host runs
:func:`sample_chat` on the model's worker (``Host.sample_chat``), and the route shapes the
:class:`ChatReply` into OpenAI's JSON or server-sent events.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from typing_extensions import TypedDict

from twinkle.data_format import SampledSequence, SamplingParams, StopReason
from twinkle.errors import DataError, SequenceTooLongError, TwinkleError
from twinkle.server.execution.checks.requests import SavedWeights, SavedWeightsSampler
from twinkle.template import Template

#: Tokens to sample when a request gives no ``max_tokens``, fewer if the context has less room.
DEFAULT_MAX_TOKENS = 512
#: What OpenAI reports for a logprob too small for a float (JSON has no infinity).
MIN_LOGPROB = -9999.0


class ChatTurn(TypedDict):
    """A message as the chat template takes it."""

    role: str
    content: str


class ReplyToken(TypedDict):
    """One sampled token: the text it adds to the reply (``piece``), its own text, its logprob,
    and the most likely tokens with theirs."""

    piece: str
    token: str
    logprob: float
    top: list[tuple[str, float]]


class ReplyChoice(TypedDict):
    text: str
    finish_reason: StopReason
    completion_tokens: int
    tokens: list[ReplyToken]


class ChatReply(TypedDict):
    """What sampling gives the route: the prompt's length and each choice."""

    prompt_tokens: int
    choices: list[ReplyChoice]


@dataclass(frozen=True)
class ChatRequest:
    """A completion request as a host takes it, its fields checked by the route."""

    #: The sampler's parameters; ``max_tokens`` is replaced where ``fit`` is set.
    params: SamplingParams
    #: The request's token limit: the prompt and every choice's reply (``max_tokens_per_request``).
    token_limit: int
    #: The conversation to encode with the base model's chat template (a chat completion) ...
    messages: list[ChatTurn] | None = None
    #: ... or the prompt's token ids (a text completion whose prompt the route encoded or was given).
    prompt_ids: list[int] | None = None
    #: The saved weights to sample (None: the base model).
    weights: SavedWeights | None = None
    #: Sample as many tokens as fit the context and the token limit, up to ``DEFAULT_MAX_TOKENS``
    #: (a chat request that names no ``max_tokens``: its prompt's length is known once encoded).
    fit: bool = False
    #: With ``fit``: the most tokens to sample over all the choices (``max_sampled_tokens_per_request``),
    #: an equal share each (None: no such limit).
    sampled_limit: int | None = None


def sample_chat(
    sampler: SavedWeightsSampler, template: Template, context: int | None, request: ChatRequest
) -> ChatReply:
    """Encode (or take) the prompt, sample the choices, and split each reply at its tokens."""
    prompt = request.prompt_ids if request.prompt_ids is not None else encode_messages(template, request.messages or [])
    params = sampling_params(request, len(prompt), context)
    weights = request.weights
    adapter = sampler.sampler_adapter(weights.directory, weights.shown_as) if weights is not None else None
    response = sampler.generate([{'input_ids': prompt}], params, adapter)[0]
    return {'prompt_tokens': len(prompt), 'choices': [_choice(template, seq) for seq in response.sequences]}


def encode_messages(template: Template, messages: list[ChatTurn]) -> list[int]:
    """The token ids of a conversation with the generation prompt after it."""
    try:
        feature = template.encode({'messages': messages}, add_generation_prompt=True)
    except TwinkleError:
        raise
    except Exception as e:  # the chat template refusing the messages (a jinja error, a bad type)
        raise DataError(f'the messages cannot be encoded: {type(e).__name__}: {e}') from e
    if feature is None:
        raise SequenceTooLongError("the messages are over the template's max_length")
    return list(feature['input_ids'])


def sampling_params(request: ChatRequest, prompt_tokens: int, context: int | None) -> SamplingParams:
    """The sampler's parameters for ``request`` once its prompt is ``prompt_tokens`` long."""
    if not request.fit:
        return request.params
    limit, n = request.token_limit, request.params.num_samples
    room = min(limit // n, context if context is not None else limit) - prompt_tokens
    if room < 1:
        raise SequenceTooLongError(f'the prompt takes {prompt_tokens} tokens, leaving no room to reply')
    share = DEFAULT_MAX_TOKENS if request.sampled_limit is None else max(1, request.sampled_limit // n)
    return replace(request.params, max_tokens=min(DEFAULT_MAX_TOKENS, room, share))


def _choice(template: Template, sequence: SampledSequence) -> ReplyChoice:
    text = sequence.decoded
    pieces = token_pieces(template, sequence.tokens, text)
    tokens: list[ReplyToken] = [
        {
            'piece': piece,
            'token': template.decode([token]),
            'logprob': _logprob(entries[0][1]),
            'top': [(template.decode([top]), _logprob(value)) for top, value in entries[1:]],
        }
        for piece, token, entries in zip(pieces, sequence.tokens, sequence.logprobs, strict=False)
    ]
    return {
        'text': text,
        'finish_reason': sequence.stop_reason,
        'completion_tokens': len(sequence.tokens),
        'tokens': tokens,
    }


def token_pieces(template: Template, tokens: list[int], text: str) -> list[str]:
    """``text`` split at the tokens that produced it: piece ``i`` is what token ``i`` adds ('' while
    a character's bytes are incomplete). The pieces join to ``text``; tokens past its end (the
    end-of-sequence token, a stop string's) are left out.

    Decoding is incremental over a short window of tokens (as vLLM detokenizes), so a long reply
    costs linear time, not quadratic."""
    pieces: list[str] = []
    sent = start = read = 0  # chars of text given out; the window is tokens[start:read], decoded already
    for index in range(len(tokens)):
        if sent >= len(text):
            break
        before = template.decode(tokens[start:read], skip_special_tokens=True)
        after = template.decode(tokens[start : index + 1], skip_special_tokens=True)
        added = ''
        if len(after) > len(before) and not after.endswith('\ufffd'):
            added, start, read = after[len(before) :], read, index + 1
        pieces.append(text[sent : sent + len(added)])
        sent += len(pieces[-1])
    if pieces:
        pieces[-1] += text[sent:]  # what an incomplete character or a tokenizer's clean-up left over
    return pieces


def _logprob(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


__all__ = [
    'DEFAULT_MAX_TOKENS', 'MIN_LOGPROB', 'ChatReply', 'ChatRequest', 'ChatTurn', 'ReplyChoice', 'ReplyToken',
    'encode_messages', 'sample_chat', 'sampling_params', 'token_pieces',
]  # fmt: skip
