"""What the server asks of an engine, and today's engine behind it: one ``Model``, one sequence at a time.

The ``Scheduler`` (``scheduler.py``) drives a ``SequenceEngine`` from its one worker thread in a continuous
batching loop: admit queued requests while ``can_admit`` says a slot (later: KV pages) is free, ``add`` each
(prefill: its first tokens come back), then ``step`` every active sequence once, and ``cancel`` a sequence whose
client went away. A batched engine implements the same five calls with ``max_batch`` > 1 and slots in
unchanged; ``SingleSequenceEngine`` is the batch-size-1 implementation over ``Model.stream`` / ``Model.chat``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import ContextLengthError
from .schemas import GenerationParams


@dataclass
class Prepared:
    """A request checked and encoded by ``SequenceEngine.prepare``, not started: ``payload`` is the engine's."""
    prompt_tokens: int
    max_tokens: int
    payload: Any


@dataclass(eq=False)
class Sequence:
    """A running request on an engine (hashable by identity: the scheduler keys its jobs by it).
    ``completion_tokens`` counts the tokens of the answer so far (after a stop string: those kept)."""
    payload: Any
    completion_tokens: int = 0


class SequenceEngine(Protocol):
    """The engine behind the server. Every call but ``prepare`` and ``memory`` comes from the scheduler's one
    worker thread, so the engine needs no locking of its own for them."""

    max_batch: int          # sequences decoded together at most
    max_context: int        # positions one sequence may use: prompt + max_tokens

    def prepare(self, params: GenerationParams) -> Prepared:
        """Check and encode a request (any thread; nothing runs). ``ValueError`` / ``TypeError`` (e.g.
        ``ContextLengthError``: prompt + max_tokens over ``max_context``) refuse it with a 400."""

    def can_admit(self, prepared: Prepared, active: int) -> bool:
        """Whether ``add`` may start ``prepared`` now, ``active`` sequences running (cheap; no state change)."""

    def add(self, prepared: Prepared) -> tuple[Sequence, list, str | None]:
        """Start it (prefill): the sequence, its first tokens and its finish reason if it is done already.
        ``CapacityError`` before any state change when its memory cannot be committed now (I9)."""

    def step(self) -> list[tuple[Sequence, list, str | None]]:
        """One decode step of every active sequence: for each, its new tokens (``Token``s) and finish reason
        ("stop", "length") once it is done; a finished sequence is no longer active."""

    def cancel(self, seq: Sequence) -> None:
        """End ``seq`` now and free what it holds (between steps)."""

    def memory(self) -> dict:
        """Numbers for /metrics (any thread): committed, budget, peak_committed, kv_committed, streamed_bytes."""


class SingleSequenceEngine:
    """``Model`` as a ``SequenceEngine`` of batch size 1: a request is a ``TokenStream`` (``Model.stream`` for
    completions, ``Model.chat(stream=True)`` for chat), so the server's tokens are exactly the model's. A step
    hands out one token; the stream decodes in blocks underneath (``TokenStream``)."""

    max_batch = 1

    def __init__(self, model):
        self.model = model
        self.max_context = model.plan.max_context
        self._seq: Sequence | None = None

    def prepare(self, params: GenerationParams) -> Prepared:
        m = self.model
        opts = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                    stop=list(params.stop) or None)
        if params.kind == "chat":
            n = params.max_tokens
            if n is None:                # the rest of the context
                tok = m._need_tokenizer("chat")
                used = len(tok.encode(m.render_chat(params.messages), add_special_tokens=False).ids)
                n = self.max_context - used
                if n < 1:
                    raise ContextLengthError(
                        f"the conversation is {used} tokens; max_context {self.max_context} leaves no room for an "
                        "answer", requested=used + 1, max_context=self.max_context)
            stream = m.chat(params.messages, n, stream=True, **opts)
        else:
            n = params.max_tokens
            stream = m.stream(params.prompt, n, **opts)
        return Prepared(stream.prompt_tokens, n, stream)

    def can_admit(self, prepared: Prepared, active: int) -> bool:
        return active == 0 and self._seq is None

    def add(self, prepared: Prepared):
        assert self._seq is None, "one sequence at a time"
        seq = Sequence(prepared.payload)
        self._seq = seq
        try:
            tokens, finish = self._advance(seq)
        except BaseException:
            self._seq = None
            seq.payload.close()
            raise
        return seq, tokens, finish

    def step(self):
        seq = self._seq
        if seq is None:
            return []
        try:
            tokens, finish = self._advance(seq)
        except BaseException:
            self.cancel(seq)
            raise
        return [(seq, tokens, finish)]

    def _advance(self, seq: Sequence):
        s = seq.payload
        try:
            tokens = [next(s)]           # the first: prefill; then one token a step (a block decoded at a time)
        except StopIteration:
            tokens = []
        if tokens:
            seq.completion_tokens += 1
            return tokens, None
        seq.completion_tokens = len(s.tokens)     # a stop string cuts tokens that were counted
        self._seq = None
        return tokens, s.finish_reason or "length"

    def cancel(self, seq: Sequence) -> None:
        seq.payload.close()              # gives the model back; the KV pages stay for the next sequence
        if self._seq is seq:
            self._seq = None

    def memory(self) -> dict:
        s = self.model.stats()
        return {"committed": s["committed"], "budget": s["budget"], "peak_committed": s["peak_committed"],
                "kv_committed": s["kv_committed"], "held": s["held"], "streamed_bytes": s["page_in_bytes"]}
