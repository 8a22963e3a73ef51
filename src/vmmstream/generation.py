"""One request's generation, run to its end or handed out as it is produced: the checked request, the
``_Generation`` that drives the engine's ``Run`` in blocks and turns tokens into text (stop ids, stop strings),
and the ``TokenStream`` a caller iterates. ``vmmstream.api.Model`` makes them and lends them its lock; the
rules for who owns the engine while a stream is unfinished are in ``Model._take_engine``.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import VmmstreamError
from .text import TokenText


def _is_empty_sequence(value) -> bool:
    try:
        return not isinstance(value, (str, bytes)) and len(value) == 0
    except TypeError:
        return False


_OPTIONS = ("temperature", "top_k", "top_p", "seed", "eos_token_id", "stop", "return_logits")


def _options(what: str, options: dict) -> dict:
    wrong = sorted(set(options) - set(_OPTIONS))
    if wrong:
        raise TypeError(f"{what}() got unexpected keyword argument(s) {', '.join(wrong)}; its options are "
                        f"{', '.join(_OPTIONS)}")
    return dict(options)


@dataclass(frozen=True)
class _Request:
    ids: list
    max_new_tokens: int
    sampling: tuple | None
    seed: int
    eos: frozenset
    stop: tuple
    return_logits: bool
    want_text: bool


class Token(NamedTuple):
    """One new token of a stream: its ``id``; ``text``, the text it adds to the answer ("" while a character or
    a possible stop string is incomplete; None without a tokenizer); its fp32 ``logits`` with return_logits."""
    id: int
    text: str | None
    logits: Any = None


class _Generation:
    """One request on the engine: its ``Run`` (blocks of decode replays) and the text of its tokens. Every
    method runs with the model's lock held; while it lives it is the model's ``_active`` generation."""

    def __init__(self, model, req: _Request, owner=None):
        self.model, self.req = model, req
        self.owner = weakref.ref(owner) if owner is not None else None
        self.thread = threading.get_ident()
        self.ended: str | None = None          # why it was ended before its last token
        self.text = TokenText(model.tokenizer, req.stop) if req.want_text else None
        self.handed = 0
        self.run = model.engine.begin(req.ids, req.max_new_tokens, sampling=req.sampling, seed=req.seed,
                                      return_logits=req.return_logits, stop=req.eos)
        model._active = self

    @property
    def finish_reason(self) -> str | None:
        if not self.run.done:
            return None
        if self.ended is not None:
            return "cancelled"
        if self.text is not None and self.text.stopped:
            return "stop"
        if self.run.tokens and self.run.tokens[-1] in self.req.eos:
            return "stop"
        return "length"

    def step(self, replays: int) -> list:
        """Advance the run by up to ``replays`` replays: the new ``Token``s (all of them when it ends)."""
        try:
            new = self.run.advance(replays)
            if self.text is not None:
                pairs = self.text.feed(new, last=self.run.done)
                if self.text.stopped:
                    self.run.truncate(len(self.text.tokens))
            else:
                pairs = [(t, None) for t in new]
        except BaseException:
            self.close()
            raise
        lg = self.run.logits
        out = [Token(t, piece, lg[self.handed + i] if self.req.return_logits else None)
               for i, (t, piece) in enumerate(pairs)]
        self.handed += len(out)
        if self.run.done:
            self.close()
        return out

    def close(self) -> None:
        """Count the run and give the engine back (idempotent)."""
        self.run.finish()
        if self.model._active is self:
            self.model._active = None
            self.model._engine_free.notify_all()

    def after(self) -> None:
        """After a run that ended by itself: re-choose the resident experts if routing drifted."""
        if not self.run.failed and self.ended is None and self.model.rebalance_experts_auto:
            self.model.engine.rebalance_experts()

    def end(self, reason: str) -> None:
        """End it from outside (its stream was closed or dropped, another call took the engine, the model
        closed): no driver call, the blocks already ran to their end."""
        if not self.run.finished:
            self.ended = reason
        self.close()


class TokenStream:
    """The tokens of one request as they are produced (``Model.stream``, ``Model.chat(stream=True)``): iterate
    for ``Token(id, text, logits)``; afterwards ``tokens``, ``text`` (the answer; None without a tokenizer)
    and ``finish_reason`` ("stop": an end-of-sequence id or a stop string, "length": max_new_tokens, or
    "cancelled"). ``close()`` ends it early and gives the model back; so does leaving its ``with`` block or
    dropping it. Advancing a stream that another call ended raises ``VmmstreamError``."""

    # After the first token, this many tokens are handed out one replay at a time (the first words show at
    # once); then blocks of up to the engine's STOP_CHECK_TOKENS replays, sized to about STREAM_BLOCK_SECONDS
    # of decoding: a read (a synchronize) per block, not per token, while text still arrives 20 times a second.
    STREAM_FIRST_TOKENS = 4
    STREAM_BLOCK_SECONDS = 0.05

    def __init__(self, model, req: _Request):
        self._model, self._req = model, req
        self._gen: _Generation | None = None
        self._queue: collections.deque = collections.deque()
        self._done = False
        self._per_token: float | None = None
        self.finish_reason: str | None = None

    @property
    def prompt_tokens(self) -> int:
        """How many tokens the prompt is, as encoded (for ``chat``: the rendered conversation)."""
        return len(self._req.ids)

    @property
    def tokens(self) -> list:
        return list(self._gen.run.tokens) if self._gen is not None else []

    @property
    def text(self) -> str | None:
        if self._gen is None:
            return "" if self._req.want_text else None
        return self._gen.text.text if self._gen.text is not None else None

    def __iter__(self):
        return self

    def __next__(self) -> Token:
        while not self._queue:
            if self._done:
                raise StopIteration
            self._pull()
        return self._queue.popleft()

    def _block(self) -> int:
        if len(self._gen.run.tokens) <= self.STREAM_FIRST_TOKENS or not self._per_token:
            return 1
        cap = self._model.engine.STOP_CHECK_TOKENS
        return max(1, min(cap, int(self.STREAM_BLOCK_SECONDS / self._per_token)))

    def _pull(self) -> None:
        m = self._model
        with m._lock:
            g = self._gen
            if g is None:
                try:
                    m._take_engine()
                    if self._done:             # closed by another thread while this one waited: start nothing
                        raise StopIteration
                    g = self._gen = _Generation(m, self._req, owner=self)
                except BaseException:
                    self._done = True          # as a generator that raised: it is over
                    raise
                replays = 0
            else:
                if g.ended is not None:
                    self._done = True
                    self.finish_reason = "cancelled"
                    raise VmmstreamError(f"this stream was ended before its last token: {g.ended}")
                g.thread = threading.get_ident()
                replays = self._block()
            t0 = time.perf_counter()
            try:
                out = g.step(replays)
            except BaseException:
                self._done = True
                raise
            if replays:
                self._per_token = (time.perf_counter() - t0) / replays
            self._queue.extend(out)           # handed out even if what follows the last block fails
            if g.run.done:
                self._done = True
                self.finish_reason = g.finish_reason
                g.after()

    def close(self) -> None:
        """End the stream now (its tokens so far stay in ``tokens`` / ``text``) and give the model back."""
        m = self._model
        with m._lock:
            self._end("the stream was closed")

    def _end(self, reason: str) -> None:
        self._queue.clear()
        if not self._done:
            self._done = True
            self.finish_reason = "cancelled" if self._gen is not None else None
        if self._gen is not None:
            self._gen.end(reason)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # Dropped unfinished: give the model back now if its lock is free (never wait in a finalizer); else the
        # next call on the model finds the stream gone and ends it (Model._take_engine).
        try:
            g = getattr(self, "_gen", None)
            if g is not None and not g.run.finished:
                lock = self._model._lock
                if lock.acquire(blocking=False):
                    try:
                        g.end("the stream was dropped")
                    finally:
                        lock.release()
        except Exception:
            pass
