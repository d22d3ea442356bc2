"""Every ``vLLMSampler.sample`` call in flight stepped as one generation of vLLM's own engine.

vLLM schedules at token granularity (continuous batching: a request joins at the engine's next step
and leaves when it ends) over the requests its engine holds; ``LLM.generate`` adds a call's
requests and steps the engine until none is left, so a second call made meanwhile, on another thread
or in the server's next sampling job, waits for the whole first one. ``EngineCalls`` keeps vLLM's
scheduler and drives its ``LLMEngine`` itself: a call adds its requests (``LLM.enqueue``, vLLM's own
rendering of the prompts and LoRA requests) at the next step, whoever steps, and each thread steps
the engine, advancing every call's requests, until its own have ended; each finished output goes to
the call it belongs to. Between two steps a call may give the engine up (``turns``: the server's
sampling slices, ``twinkle.server.execution.sampling.slicing``), its requests waiting in the engine, so a
sampling job that arrives while another generates adds its requests to the running generation
instead of waiting for it to end.

Each request keeps its own seed, parameters, adapter and stop conditions (vLLM's per-request
``SamplingParams``), so a call gets the tokens it would get alone. Written here, not taken from
vLLM: its ``AsyncLLM`` does this with an asyncio loop of its own, where twinkle's samplers are called
from threads that hand the device over between steps.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinkle.sampler.base import Turns


@dataclass(eq=False)
class EngineCall:
    """One call's requests, as ``LLM.enqueue`` takes them, and their outputs once they end."""

    prompts: list[dict[str, Any]]
    params: list[Any]  # vllm.SamplingParams, one per request
    loras: list[Any] | None  # vllm LoRARequest (or None) per request; None: no LoRA anywhere
    outputs: list[Any] = field(init=False)  # vllm RequestOutput per request, in order
    left: int = field(init=False)
    error: BaseException | None = field(default=None, init=False)
    #: The engine's ids of its requests once added: (internal, as ``abort_request`` takes them;
    #: external, as its outputs carry them).
    ids: list[tuple[str, str]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.outputs = [None] * len(self.prompts)
        self.left = len(self.prompts)

    @property
    def done(self) -> bool:
        return self.left == 0 or self.error is not None


class EngineCalls:
    """The calls in flight on one ``vllm.LLM``: ``run`` adds one and returns its outputs."""

    def __init__(self, llm: Any, on_end: Callable[[], None] = lambda: None):
        self.llm = llm
        self._on_end = on_end  # after each call leaves (the adapter removals put off while in use)
        self._waiting: deque[EngineCall] = deque()  # submitted, not added to the engine yet
        self._owners: dict[str, tuple[EngineCall, int]] = {}  # request id -> its call and index
        self._calls: set[EngineCall] = set()  # every call in flight, waiting or in the engine
        self._submit = threading.Lock()
        self._driving = threading.Lock()  # held by the one thread that adds to or steps the engine
        #: The most requests one engine step held (what the batching test and benchmark read).
        self.widest = 0

    @property
    def in_flight(self) -> int:
        """Requests in the engine or waiting to join it."""
        with self._submit:
            return len(self._owners) + sum(len(call.prompts) for call in self._waiting)

    def uses(self, lora_int_id: int) -> bool:
        """Whether a call in flight has a request on the LoRA adapter of this id."""
        with self._submit:
            loras = (lora for call in self._calls for lora in call.loras or ())
            return any(lora is not None and lora.lora_int_id == lora_int_id for lora in loras)

    def run(self, call: EngineCall, turns: Turns | None = None) -> list[Any]:
        """Add ``call``'s requests at the next step and step the engine until they end; its
        outputs, in order. With ``turns``, it may give the engine up between two steps (before its
        first too, so calls that arrive together join one step); each later turn steps at least once.
        A call unwound meanwhile (its job cancelled) takes its requests out of the engine."""
        with self._submit:
            self._waiting.append(call)
            self._calls.add(call)
        may_yield = True
        with self._driving:
            try:
                while not call.done:
                    if may_yield and turns is not None and turns.due():
                        self._give_way(turns)
                        may_yield = False
                        continue
                    self._step()
                    may_yield = True
            finally:
                if not call.done:
                    self._drop(call)
                with self._submit:
                    self._calls.discard(call)
                self._on_end()
        if call.error is not None:
            raise call.error
        return call.outputs

    def _give_way(self, turns: Turns) -> None:
        self._driving.release()
        try:
            turns.give_way()
        finally:
            self._driving.acquire()

    def _step(self) -> None:
        """Add the calls waiting, then one engine step; finished requests go to their calls. A step
        that fails (the engine died) fails every call in flight."""
        self._add_waiting()
        if not self._owners:
            return
        self.widest = max(self.widest, len(self._owners))
        try:
            outputs = self.llm.llm_engine.step()
        except Exception as error:
            for owner, _ in list(self._owners.values()):
                owner.error = error
            self._owners.clear()
            return
        for output in outputs:
            if not output.finished or output.request_id not in self._owners:
                continue
            owner, index = self._owners.pop(output.request_id)
            owner.outputs[index] = output
            owner.left -= 1

    def _add_waiting(self) -> None:
        while True:
            with self._submit:
                if not self._waiting:
                    return
                call = self._waiting.popleft()
            try:  # vLLM renders and checks each prompt here; on an error it aborts those it added
                ids = self.llm.enqueue(call.prompts, call.params, lora_request=call.loras, use_tqdm=False)
            except Exception as error:
                call.error = error
                continue
            states = self.llm.llm_engine.output_processor.request_states
            call.ids = [(i, states[i].external_req_id if i in states else i) for i in ids]
            with self._submit:
                self._owners.update({external: (call, index) for index, (_, external) in enumerate(call.ids)})

    def _drop(self, call: EngineCall) -> None:
        with self._submit:
            if call in self._waiting:
                self._waiting.remove(call)
            running = [(internal, external) for internal, external in call.ids if external in self._owners]
            for _, external in running:
                del self._owners[external]
        if running:
            self.llm.llm_engine.abort_request([internal for internal, _ in running], internal=True)


__all__ = ['EngineCall', 'EngineCalls']
