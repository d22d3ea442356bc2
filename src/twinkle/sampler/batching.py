"""Continuous batching: every request in flight on a ``TorchSampler`` decoded as one batch.

A request (one ``sample`` call: its prompts times ``num_samples`` rows, its adapter, sampling
parameters, seeds and stop conditions) joins the running batch at the next step, whoever drives
it, and each of its rows leaves as soon as it ends: vLLM's scheduling (Kwon et al. 2023, section
4.2: iteration-level scheduling, after Orca, Yu et al. 2022) over a plain ``DynamicCache``.

A step is: admit the rows waiting (their own prefill forward, then their cache merged into the
batch's: the shorter side's keys and values left-padded with zeros, masked out; a linear-attention
layer's conv and recurrent states, which have no length, concatenated), choose one token for every
row (the logits processed per group of rows that share parameters, each row drawing from its own
generator), let the rows that ended leave (cache rows dropped, columns that only padding uses
trimmed), then feed the others their token in one forward, each row through its own adapter.

Each row gets the tokens it would get alone: its positions, mask, seed and generator are its own,
so the batch changes only the shapes its numbers are computed on (float rounding, not choices, in
practice; tests compare across batches with a tolerance on logprobs).

Nothing here is thread-safe except ``submit``: one thread at a time drives the batch
(``TorchSampler`` holds a lock while it does, and hands it over between two steps).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

from twinkle.data_format import SamplingParams, TokenLogprob
from twinkle.model import router
from twinkle.sampler.base import Completion, PromptLogprobs
from twinkle.sampler.images import PromptImages, decode_positions, image_prefill
from twinkle.sampler.logits import choose, processed_scores, sampled_logprobs, top_logprobs

#: Sets which adapter each row of the next forward uses (None: the base model only).
AssignRows = Callable[[Sequence[str | None]], None]
#: The cache layers whose rows ``_merge`` knows how to put side by side; with any other (a sliding
#: window's), rows join only an empty batch.
MERGEABLE = (DynamicLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)


@dataclass(eq=False)
class Request:
    """What one ``sample`` call asks of the batch, and what it gets back: a completion per row
    (and with ``want_prompt`` its prompt's logprobs)."""

    rows: list[list[int]]
    images: list[PromptImages | None]
    seeds: list[int | None]
    params: SamplingParams
    adapter: str | None
    stop_ids: frozenset[int]
    want_prompt: bool = False
    #: Seconds of batch steps its rows may take part in (``max_sampling_s``): past them they end as
    #: at ``max_tokens``. None: no bound.
    limit_s: float | None = None
    out: list[Completion] = field(init=False)
    prompt_logprobs: list[PromptLogprobs] = field(init=False)
    #: Seconds of the steps its rows took part in so far.
    ran_s: float = field(default=0.0, init=False)
    #: Its rows not ended yet.
    running: int = field(init=False)
    #: Set when a step it took part in failed: its rows are gone, its caller raises it.
    error: BaseException | None = field(default=None, init=False)
    #: The last tokens whose text a stop string must lie in to have just been completed.
    window: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.out = [Completion(tokens=[], logprobs=[], stop_reason='length') for _ in self.rows]
        self.prompt_logprobs = [PromptLogprobs([], []) for _ in self.rows] if self.want_prompt else []
        self.running = len(self.rows)
        self.window = 4 * max((len(s) for s in self.params.stop_strings), default=0) + 4

    @property
    def done(self) -> bool:
        return self.running == 0 or self.error is not None


@dataclass(eq=False)
class _Row:
    """One sequence of a request: which of its rows, its generator, and with
    ``return_routed_experts`` its routing so far (pieces of [layers, tokens, K])."""

    request: Request
    index: int
    generator: torch.Generator
    routes: list[torch.Tensor] | None = None

    @property
    def prompt(self) -> list[int]:
        return self.request.rows[self.index]

    @property
    def completion(self) -> Completion:
        return self.request.out[self.index]


@dataclass(eq=False)
class _State:
    """The rows in the batch and their tensors, row for row."""

    rows: list[_Row]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, width] 1 where a cached or fed token is real, 0 on padding
    next_pos: torch.Tensor  # [rows] the position of the token each row is fed next
    logits: torch.Tensor  # [rows, vocab] each row's next-token logits
    deltas: torch.Tensor | None  # [rows, 1] multimodal RoPE shifts (images), else None
    seen: torch.Tensor | None  # [rows, vocab] tokens in each row so far (repetition_penalty), else None


class ContinuousBatch:
    """The rows of every request in flight on ``model``, decoded together, ``max_rows`` at most
    (None: all). ``decode`` turns token ids into text (stop strings); ``never`` are token ids never
    sampled (a vision-language model's image pads)."""

    def __init__(
        self,
        model: PreTrainedModel,
        pad_id: int,
        decode: Callable[..., str],
        never: Sequence[int] = (),
        max_rows: int | None = None,
    ):
        self.model, self.pad_id, self.decode, self.never, self.max_rows = model, pad_id, decode, never, max_rows
        self.device = next(model.parameters()).device
        self._waiting: deque[_Row] = deque()
        self._waiting_lock = threading.Lock()  # submit runs on any thread, while another drives
        self._state: _State | None = None
        self._recorder: router.RoutingRecorder | None = None
        #: The rows of each recent step, after admitting (how full the batch runs; the tests count them).
        self.step_sizes: deque[int] = deque(maxlen=4096)

    # ---- what callers see ---------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue ``request``'s rows; they join at the next step (thread-safe)."""
        rows = [_Row(request, i, _generator(seed, self.device)) for i, seed in enumerate(request.seeds)]
        with self._waiting_lock:
            self._waiting.extend(rows)

    def drop(self, request: Request) -> None:
        """Take ``request``'s rows out, waiting or running (its caller gave up: cancelled, failed)."""
        with self._waiting_lock:
            self._waiting = deque(row for row in self._waiting if row.request is not request)
        if self._state is not None:
            self._keep([j for j, row in enumerate(self._state.rows) if row.request is not request])
        request.running = 0

    @property
    def active(self) -> int:
        """Rows in the batch now."""
        return 0 if self._state is None else len(self._state.rows)

    @property
    def waiting(self) -> int:
        """Rows submitted that have not joined yet."""
        with self._waiting_lock:
            return len(self._waiting)

    @torch.no_grad()
    def step(self, assign: AssignRows) -> None:
        """One step of every request in the batch: admit the waiting rows that fit, choose a token
        for each row, let the ended rows leave, feed the others. A failed step fails the requests
        it holds (their ``error``) and never raises: each caller raises its own."""
        started = time.monotonic()
        self._admit(assign)
        state = self._state
        if state is None:
            return
        requests = {row.request for row in state.rows}
        self.step_sizes.append(len(state.rows))
        try:
            tokens = self._leave(state, self._choose(state))
            self._feed(assign, tokens)
        except Exception as error:
            self._state = None  # its cache is in no known state: every request in it fails
            self._fail(requests, error)
        spent = time.monotonic() - started
        for request in requests:
            request.ran_s += spent

    # ---- admitting ----------------------------------------------------------------------------------
    def _admit(self, assign: AssignRows) -> None:
        """Prefill the waiting rows that fit and merge them into the batch."""
        rows = self._joining()
        if not rows:
            return
        try:
            joined = self._prefill(rows, assign)
        except Exception as error:
            self._fail({row.request for row in rows}, error)
            return
        self._state = joined if self._state is None else _merge(self._state, joined)

    def _joining(self) -> list[_Row]:
        """The waiting rows that fit the batch, oldest first: none while the batch's cache cannot
        take rows of another length (they wait for it to empty)."""
        if self._state is not None and not mergeable(self._state.cache):
            return []
        room = None if self.max_rows is None else self.max_rows - self.active
        with self._waiting_lock:
            count = len(self._waiting) if room is None else min(room, len(self._waiting))
            return [self._waiting.popleft() for _ in range(count)]

    def _prefill(self, rows: list[_Row], assign: AssignRows) -> _State:
        """The new rows' forward over their prompts (left-padded among themselves) into a cache of
        their own; their prompt logprobs and routing where asked for."""
        ids, mask = _left_pad([row.prompt for row in rows], self.pad_id, self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        inputs: dict[str, torch.Tensor] = {'position_ids': positions}
        deltas = None
        images = image_prefill(self.model, [row.request.images[row.index] for row in rows], ids, mask, positions)
        if images is not None:
            inputs, deltas = images.model_inputs, images.deltas
        want_prompt = any(row.request.want_prompt for row in rows)
        assign([row.request.adapter for row in rows])
        with self._routing(rows) as recorder:
            logits = self.model(
                input_ids=ids,
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if want_prompt else 1,
                **inputs,
            ).logits
            if recorder is not None:
                _prefill_routes(rows, recorder.take(), ids.shape[-1])
        if want_prompt:
            _record_prompts(rows, logits, ids, mask)
        seen = None
        if any(row.request.params.repetition_penalty != 1.0 for row in rows) or self._seen_kept():
            seen = _seen(ids, mask, logits.shape[-1])
        return _State(rows, cache, mask, positions[:, -1] + 1, logits[:, -1], deltas, seen)

    def _seen_kept(self) -> bool:
        return self._state is not None and self._state.seen is not None

    # ---- one token per row --------------------------------------------------------------------------
    def _choose(self, state: _State) -> torch.Tensor:
        """Each row's next token, its logprobs recorded: the logits processed and sampled per group of
        rows with the same parameters, each row from its own generator."""
        tokens = torch.empty(len(state.rows), dtype=torch.long, device=self.device)
        for params, index in _groups(state.rows):
            rows = [state.rows[j] for j in index]
            at = torch.tensor(index, device=self.device)
            logits = state.logits[at]
            seen = state.seen[at] if state.seen is not None else None
            chosen = choose(processed_scores(logits, params, seen, self.never), params, [r.generator for r in rows])
            _record(rows, sampled_logprobs(logits, params, seen, self.never), chosen, params.logprobs or 0)
            tokens[at] = chosen
        return tokens

    def _leave(self, state: _State, tokens: torch.Tensor) -> torch.Tensor:
        """The rows that ended (a stop, ``max_tokens``, their request's time) leave the batch; the
        tokens of those that stay."""
        keep = []
        for j, row in enumerate(state.rows):
            if self._ended(row):
                row.request.running -= 1
                _finish_routes(row)
            else:
                keep.append(j)
        if len(keep) == len(state.rows):
            return tokens
        index = self._keep(keep)
        return tokens[:0] if index is None else tokens[index]

    def _ended(self, row: _Row) -> bool:
        request, completion = row.request, row.completion
        if _stopped(completion, request, self.decode):
            return True
        limit = request.limit_s
        return len(completion.tokens) >= request.params.max_tokens or (limit is not None and request.ran_s >= limit)

    def _feed(self, assign: AssignRows, tokens: torch.Tensor) -> None:
        """Feed each remaining row its token: one decode forward, each row through its adapter."""
        state = self._state
        if state is None:
            return
        if state.seen is not None:
            state.seen[torch.arange(len(state.rows), device=self.device), tokens] = True
        state.mask = torch.cat([state.mask, state.mask.new_ones(len(state.rows), 1)], dim=-1)
        assign([row.request.adapter for row in state.rows])
        with self._routing(state.rows) as recorder:
            state.logits = self.model(
                input_ids=tokens[:, None],
                attention_mask=state.mask,
                position_ids=decode_positions(state.next_pos[:, None], state.deltas),
                past_key_values=state.cache,
                use_cache=True,
            ).logits[:, -1]
            if recorder is not None:
                experts = recorder.take()
                for j, row in enumerate(state.rows):
                    if row.routes is not None:
                        row.routes.append(experts[:, j : j + 1])
        state.next_pos = state.next_pos + 1

    # ---- rows leaving -------------------------------------------------------------------------------
    def _keep(self, keep: list[int]) -> torch.Tensor | None:
        """Keep rows ``keep`` of the batch, the columns only padding uses then trimmed off; the
        index kept (None: the batch is empty now)."""
        state = self._state
        if state is None or not keep:
            self._state = None
            return None
        index = torch.tensor(keep, device=self.device)
        _keep_rows(state.cache, index)
        state.rows = [state.rows[j] for j in keep]
        state.mask, state.next_pos, state.logits = state.mask[index], state.next_pos[index], state.logits[index]
        state.deltas = state.deltas[index] if state.deltas is not None else None
        state.seen = state.seen[index] if state.seen is not None else None
        if mergeable(state.cache):
            _trim(state)
        return index

    def _fail(self, requests: set[Request], error: BaseException) -> None:
        """A step of ``requests`` failed: each gets the error and its rows go."""
        for request in requests:
            request.error = error
            self.drop(request)

    # ---- routing replay -----------------------------------------------------------------------------
    def _routing(self, rows: list[_Row]) -> _Recording:
        """Record the routers' choices in the next forward if a row asks for its routing."""
        if not any(row.request.params.return_routed_experts for row in rows):
            return _Recording(None)
        if self._recorder is None:
            self._recorder = router.RoutingRecorder(self.model)
        for row in rows:
            if row.request.params.return_routed_experts and row.routes is None:
                row.routes = []
        return _Recording(self._recorder)


def mergeable(cache: DynamicCache) -> bool:
    """Whether rows of another length can join ``cache`` (every layer's type is one ``_merge`` knows:
    exactly, as a sliding window's layer is a ``DynamicLayer`` too)."""
    return all(type(layer) in MERGEABLE for layer in cache.layers)


class _Recording:
    """``recorder`` on within the block (nothing without one)."""

    def __init__(self, recorder: router.RoutingRecorder | None):
        self.recorder = recorder

    def __enter__(self) -> router.RoutingRecorder | None:
        if self.recorder is not None:
            self.recorder.__enter__()
        return self.recorder

    def __exit__(self, *exc: object) -> None:
        if self.recorder is not None:
            self.recorder.__exit__(*exc)


def _groups(rows: list[_Row]) -> list[tuple[SamplingParams, list[int]]]:
    """Row indices by the parameters that process and record their logits (the first row's params
    stand for its group's)."""
    groups: dict[tuple[float, int, float, float, int], tuple[SamplingParams, list[int]]] = {}
    for j, row in enumerate(rows):
        p = row.request.params
        key = (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.logprobs or 0)
        groups.setdefault(key, (p, []))[1].append(j)
    return list(groups.values())


def _record(rows: list[_Row], logps: torch.Tensor, tokens: torch.Tensor, k: int) -> None:
    """Append each row's token with its logprob under ``logps``, the distribution it was drawn from
    (``sampled_logprobs``), and the ``k`` most likely of it."""
    chosen = logps.gather(-1, tokens[:, None]).squeeze(-1)
    tokens_l, chosen_l = tokens.tolist(), chosen.tolist()
    top = top_logprobs(logps, k)
    for j, row in enumerate(rows):
        row.completion.tokens.append(tokens_l[j])
        row.completion.logprobs.append([(tokens_l[j], chosen_l[j]), *top[j]])


def _stopped(completion: Completion, request: Request, decode: Callable[..., str]) -> bool:
    """Whether the completion's last token is a stop token or completes a stop string (its
    ``stop_reason`` and ``text_end`` set)."""
    if completion.tokens[-1] in request.stop_ids:
        completion.stop_reason = 'stop'
        return True
    stop_strings = request.params.stop_strings
    if not stop_strings:
        return False
    tail = decode(completion.tokens[-request.window :])
    if not any(s in tail for s in stop_strings):
        return False
    text = decode(completion.tokens, skip_special_tokens=True)
    found = [text.find(s) for s in stop_strings if s in text]
    completion.stop_reason = 'stop'
    completion.text_end = min(found) if found else len(text)
    return True


def _record_prompts(rows: list[_Row], logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The prompt logprobs of the joining rows whose request asks for them."""
    for j, row in enumerate(rows):
        request = row.request
        if request.want_prompt:
            k = request.params.topk_prompt_logprobs
            [info] = _prompt_logprobs(logits[j : j + 1], ids[j : j + 1], mask[j : j + 1], k)
            request.prompt_logprobs[row.index] = info


def _prefill_routes(rows: list[_Row], experts: torch.Tensor, width: int) -> None:
    """The prompts' routing, from the left-padded prefill of ``width`` positions."""
    experts = experts.view(experts.shape[0], len(rows), width, experts.shape[-1])
    for j, row in enumerate(rows):
        if row.routes is not None:
            row.routes.append(experts[:, j, width - len(row.prompt) :])


def _finish_routes(row: _Row) -> None:
    """An ended row's ``routed_experts`` [tokens][layers][K] over prompt plus completion; its last
    token was never fed to the model: -1 (not recorded) there."""
    if row.routes is None:
        return
    experts = torch.cat(row.routes, dim=1).permute(1, 0, 2)
    last = torch.full_like(experts[:1], router.NOT_RECORDED)
    row.completion.routed_experts = torch.cat([experts, last]).tolist()


# ---- the batch's tensors --------------------------------------------------------------------------------
def _merge(old: _State, new: _State) -> _State:
    """``old``'s rows, then ``new``'s, in one state: the narrower side's cache and mask left-padded."""
    width = max(old.mask.shape[1], new.mask.shape[1])
    old_pad, new_pad = width - old.mask.shape[1], width - new.mask.shape[1]
    for mine, theirs in zip(old.cache.layers, new.cache.layers, strict=True):
        if isinstance(mine, DynamicLayer) and isinstance(theirs, DynamicLayer) and mine.get_seq_length() > 0:
            (keys, values), (new_keys, new_values) = _kv(mine), _kv(theirs)
            mine.keys = torch.cat([_pad_left(keys, old_pad, -2), _pad_left(new_keys, new_pad, -2)])
            mine.values = torch.cat([_pad_left(values, old_pad, -2), _pad_left(new_values, new_pad, -2)])
        if isinstance(mine, LinearAttentionLayer) and isinstance(theirs, LinearAttentionLayer):
            _merge_linear(mine, theirs)
    old.rows = old.rows + new.rows
    old.mask = torch.cat([_pad_left(old.mask, old_pad, -1), _pad_left(new.mask, new_pad, -1)])
    old.next_pos = torch.cat([old.next_pos, new.next_pos])
    old.logits = torch.cat([old.logits, new.logits])
    old.deltas = _cat_or_none(old.deltas, new.deltas, len(old.rows) - len(new.rows), len(new.rows))
    old.seen = _merge_seen(old, new)
    return old


def _merge_linear(mine: LinearAttentionLayer, theirs: LinearAttentionLayer) -> None:
    """A linear-attention layer's states (Qwen3.5's gated deltanet: conv and recurrent, per row and
    of no length) side by side."""
    for i in range(mine.number_of_states):
        if mine.is_conv_states_initialized[i]:
            convs = [cast(torch.Tensor, mine.conv_states[i]), cast(torch.Tensor, theirs.conv_states[i])]
            mine.conv_states[i] = torch.cat(convs)
        if mine.is_recurrent_states_initialized[i]:
            states = [cast(torch.Tensor, mine.recurrent_states[i]), cast(torch.Tensor, theirs.recurrent_states[i])]
            mine.recurrent_states[i] = torch.cat(states)


def _cat_or_none(
    old: torch.Tensor | None, new: torch.Tensor | None, old_rows: int, new_rows: int
) -> torch.Tensor | None:
    """Per-row multimodal RoPE shifts side by side; a side without images shifts by 0."""
    if old is None and new is None:
        return None
    device = (old if old is not None else cast(torch.Tensor, new)).device
    mine = old if old is not None else torch.zeros((old_rows, 1), dtype=torch.long, device=device)
    theirs = new if new is not None else torch.zeros((new_rows, 1), dtype=torch.long, device=device)
    return torch.cat([mine, theirs])


def _merge_seen(old: _State, new: _State) -> torch.Tensor | None:
    """The rows' seen tokens side by side; a side that kept none gets them from its tokens."""
    if old.seen is None and new.seen is None:
        return None
    old_rows = old.rows[: len(old.rows) - len(new.rows)]
    mine = old.seen if old.seen is not None else _seen_of(old_rows, old.logits.shape[-1], old.logits.device)
    theirs = new.seen if new.seen is not None else _seen_of(new.rows, new.logits.shape[-1], new.logits.device)
    return torch.cat([mine, theirs])


def _seen_of(rows: list[_Row], vocab: int, device: torch.device) -> torch.Tensor:
    """Each row's seen tokens (its prompt and completion so far)."""
    seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
    for j, row in enumerate(rows):
        seen[j, torch.tensor(row.prompt + row.completion.tokens, device=device)] = True
    return seen


def _trim(state: _State) -> None:
    """Drop the leading cache columns no remaining row uses (its padding only)."""
    used = state.mask.any(dim=0)
    first = int(used.long().argmax())
    if first == 0:
        return
    for layer in state.cache.layers:
        if isinstance(layer, DynamicLayer) and layer.get_seq_length() > 0:
            keys, values = _kv(layer)
            layer.keys, layer.values = keys[..., first:, :], values[..., first:, :]
    state.mask = state.mask[:, first:]


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's keys and values, [rows, heads, width, head_dim] each."""
    return cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` with ``width`` zeros before it along ``dim``."""
    if width == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = width
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _left_pad(rows: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def _seen(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    seen = torch.zeros((ids.shape[0], vocab), dtype=torch.bool, device=ids.device)
    seen.scatter_(1, ids, mask.bool())
    return seen


def _prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, k: int) -> list[PromptLogprobs]:
    """Each prompt token's logprob given the tokens before it (``None`` for the first)."""
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    own = logps.gather(-1, ids[:, 1:, None]).squeeze(-1).tolist()
    top = torch.topk(logps, k, dim=-1) if k else None
    result = []
    for i, length in enumerate(mask.sum(-1).tolist()):
        start = ids.shape[1] - length  # the first real token; it has no logprob
        values = [None, *own[i][start:]]
        topk: list[list[TokenLogprob] | None] = [None]
        if top is not None:
            topk += [
                list(zip(t, v, strict=True))
                for t, v in zip(top.indices[i, start:].tolist(), top.values[i, start:].tolist(), strict=True)
            ]
        result.append(PromptLogprobs(logprobs=values, topk=topk))
    return result


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A row's own generator: from its seed, else from the process's random state."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return generator


def _keep_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep rows ``index`` of every cache layer. ``reorder_cache`` selects every state a layer
    holds: keys and values, and a linear-attention layer's (Qwen3.5's gated deltanet) conv and
    recurrent states, which ``batch_select_indices`` does not know."""
    cache.reorder_cache(cast(torch.LongTensor, index))


__all__ = ['MERGEABLE', 'AssignRows', 'ContinuousBatch', 'Request', 'mergeable']
