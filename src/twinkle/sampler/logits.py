"""Turning raw next-token logits into a choice: repetition penalty, temperature, top-k, top-p,
then greedy or seeded sampling; and the logprobs of the distribution a token was drawn from.
Pure functions of tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twinkle.data_format import SamplingParams, TokenLogprob


def processed_scores(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None, never: Sequence[int] = ()
) -> torch.Tensor:
    """The float32 scores ``[rows, vocab]`` to sample from. ``seen`` marks, per row, the tokens
    already in the prompt or completion (for ``repetition_penalty``); ``never`` are token ids never
    chosen (a vision-language model's image pads)."""
    scores = logits.float()
    if never:
        scores = scores.index_fill(-1, torch.tensor(never, device=scores.device), float('-inf'))
    scores = _tempered(_penalized(scores, params, seen), params)
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float('-inf'))
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    return scores


def sampled_logprobs(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None, never: Sequence[int] = ()
) -> torch.Tensor:
    """The float32 log-probabilities ``[rows, vocab]`` of the distribution each row's token is drawn
    from: the log-softmax of ``processed_scores`` (after the repetition penalty, temperature, top-k
    and top-p), what vLLM returns with ``logprobs_mode='processed_logprobs'`` and Tinker returns. With
    top-k and top-p off, ``log_softmax(logits / temperature)``: at temperature 1 the trainer's own
    logprobs. At temperature 0 (greedy) the token is the argmax of the penalized logits, and the
    logprobs are theirs (no temperature, top-k or top-p, which leave the argmax alone): without a
    penalty, the raw logits' logprobs. Tokens that top-k or top-p cut get ``-inf``.

    ``never`` (the image pads ``processed_scores`` never draws, with the same ids) keep their
    probability here, as in the trainer's forward and in vLLM's: a model's pads have next to none of
    it, and leaving them out would move every logprob by that much. Top-k and top-p still choose among
    the other tokens, as the draw did, so a drawn token is never at ``-inf``.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0]])
    >>> sampled_logprobs(logits, SamplingParams(temperature=0.5), None)  # log_softmax([4, 2, 0])
    tensor([[-0.1429, -2.1429, -4.1429]])
    >>> sampled_logprobs(logits, SamplingParams(temperature=0.5, top_k=2), None)  # log_softmax([4, 2])
    tensor([[-0.1269, -2.1269,    -inf]])
    >>> sampled_logprobs(logits, SamplingParams(temperature=0.5, top_k=1), None, never=[0])  # [4, 2] again
    tensor([[-0.1269, -2.1269,    -inf]])
    >>> sampled_logprobs(logits, SamplingParams(temperature=0, top_k=1), None)  # greedy: the raw logits'
    tensor([[-0.4076, -1.4076, -2.4076]])
    """
    if params.temperature == 0:
        return torch.log_softmax(_penalized(logits.float(), params, seen), dim=-1)
    scores = processed_scores(logits, params, seen, never)
    if never:
        index = torch.tensor(never, device=scores.device)
        own = _tempered(_penalized(logits.float(), params, seen), params)
        scores = scores.index_copy(-1, index, own.index_select(-1, index))
    return torch.log_softmax(scores, dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[TokenLogprob]]:
    """Per row of ``logprobs`` ``[rows, vocab]``, its ``k`` most likely ``(token, logprob)`` pairs,
    the most likely first; tokens at ``-inf`` (cut by top-k or top-p: they cannot be drawn) are left
    out, so a row may have fewer.

    >>> top_logprobs(torch.tensor([[-0.1, float('-inf'), -2.3]]), 3)
    [[(0, -0.10000000149011612), (2, -2.299999952316284)]]
    """
    if not k:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    return [
        [(token, value) for token, value in zip(row_ids, row_values, strict=True) if value != float('-inf')]
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
    ]


def _tempered(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``scores`` over the temperature (as they are at 0, greedy, and at 1)."""
    if params.temperature > 0 and params.temperature != 1.0:
        return scores / params.temperature
    return scores


def _penalized(scores: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """``scores`` with ``repetition_penalty`` applied to the tokens ``seen`` marks (CTRL's penalty:
    positive scores divided by it, negative ones multiplied)."""
    if params.repetition_penalty == 1.0 or seen is None:
        return scores
    penalized = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
    return torch.where(seen, penalized, scores)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (the
    nucleus of Holtzman et al. 2020); the most likely token always stays."""
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float('-inf'))


def choose(scores: torch.Tensor, params: SamplingParams, generators: list[torch.Generator] | None) -> torch.Tensor:
    """One token id per row: the argmax at temperature 0, else a draw from ``softmax(scores)``.

    The draw inverts the cumulative distribution at one uniform number per row (the cumulative
    sum in float64, so a large vocabulary's tail keeps its mass): the same distribution as
    ``torch.multinomial``, which on a CPU draws a random number per vocabulary entry and costs
    about fifty times more. With ``generators`` (one per row) each row's number comes from its
    own generator, so a seeded sequence comes out the same in any batch."""
    if params.temperature == 0:
        return scores.argmax(dim=-1)
    cdf = torch.softmax(scores, dim=-1, dtype=torch.float64).cumsum(dim=-1)
    if generators is None:
        uniform = torch.rand(cdf.shape[0], 1, dtype=torch.float64, device=cdf.device)
    else:
        uniform = torch.cat([torch.rand(1, dtype=torch.float64, device=cdf.device, generator=g) for g in generators])
        uniform = uniform[:, None]
    # right=True: the first token whose cumulative mass exceeds the draw; zero-mass tokens never win.
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1)
    return tokens.clamp(max=cdf.shape[-1] - 1)
