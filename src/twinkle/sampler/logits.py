"""Turning raw next-token logits into a choice: repetition penalty, temperature, top-k, top-p,
then greedy or seeded sampling. Pure functions of tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twinkle.data_format import SamplingParams


def processed_scores(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None, never: Sequence[int] = ()
) -> torch.Tensor:
    """The float32 scores ``[rows, vocab]`` to sample from. ``seen`` marks, per row, the tokens
    already in the prompt or completion (for ``repetition_penalty``); ``never`` are token ids never
    chosen (a vision-language model's image pads)."""
    scores = logits.float()
    if never:
        scores = scores.index_fill(-1, torch.tensor(never, device=scores.device), float('-inf'))
    if params.repetition_penalty != 1.0 and seen is not None:
        penalized = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
        scores = torch.where(seen, penalized, scores)
    if params.temperature > 0 and params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float('-inf'))
    if params.top_p < 1.0:
        scores = _top_p(scores, params.top_p)
    return scores


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
