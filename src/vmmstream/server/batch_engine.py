"""A model loaded with ``max_batch`` > 1 as the server's engine: requests decode together, joining and leaving
between steps (continuous batching) in the model's ``BatchDecoder``.

Each request becomes a batch sequence with its own sampling parameters, seed and stop ids (what it gets alone:
``generate`` on the same arguments); its text comes through a ``TokenText``, which also finds stop strings (the
sequence then leaves the batch at once). Every call but ``prepare`` and ``memory`` comes from the scheduler's one
worker thread and holds the model's lock while it runs.
"""

from __future__ import annotations

from ..errors import ContextLengthError
from ..generation import Token
from ..text import TokenText
from .engine import Prepared, Sequence
from .schemas import GenerationParams


class BatchSequenceEngine:
    def __init__(self, model):
        if model.placement.batch_kv is None:
            raise ValueError("a batched engine needs a model loaded with max_batch > 1")
        self.model = model
        self.max_batch = model.plan.batch
        self.max_context = model.plan.max_context
        self._dec = None
        self._seqs: dict = {}      # id(batch sequence) -> its server Sequence, while it decodes

    def _decoder(self):
        if self._dec is None:
            from ..execution.batch import BatchDecoder
            self._dec = BatchDecoder(self.model.engine, self.model.placement.batch_kv)
        return self._dec

    def warm(self) -> dict:
        """Compile (or load from the disk cache) and capture what requests will run, before the first comes
        (``BatchDecoder.warm``)."""
        m = self.model
        with m._lock:
            m._take_engine(batch=True)
            return self._decoder().warm()

    def prepare(self, params: GenerationParams) -> Prepared:
        m = self.model
        opts = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                    stop=list(params.stop) or None)
        if params.kind == "chat":
            ids, eos = m.chat_prompt(params.messages)
            n = params.max_tokens if params.max_tokens is not None else self.max_context - len(ids)
            if n < 1:
                raise ContextLengthError(f"the conversation is {len(ids)} tokens; max_context {self.max_context} "
                                         "leaves no room for an answer", requested=len(ids) + 1,
                                         max_context=self.max_context)
            req = m._request(ids, n, eos_token_id=eos, want_text=True, **opts)
        else:
            req = m._request(params.prompt, params.max_tokens, want_text=True, **opts)
        return Prepared(len(req.ids), req.max_new_tokens, req)

    def can_admit(self, prepared: Prepared, active: int) -> bool:
        return self._decoder().free_slots() > 0

    def add(self, prepared: Prepared):
        m, r = self.model, prepared.payload
        with m._lock:
            m._take_engine(batch=True)
            b = self._decoder().add(r.ids, r.max_new_tokens, stop=r.eos, sampling=r.sampling, seed=r.seed)
        return self._joined(b, r)

    def add_many(self, prepared: list[Prepared]):
        """Start several at once, their prompts prefilled together (``BatchDecoder.add_many``): the started ones,
        in order, each as ``add`` returns it; those after the first that could not join are not started
        (``CapacityError`` when none could)."""
        m, rs = self.model, [p.payload for p in prepared]
        with m._lock:
            m._take_engine(batch=True)
            bs = self._decoder().add_many([(r.ids, r.max_new_tokens, dict(stop=r.eos, sampling=r.sampling,
                                                                           seed=r.seed)) for r in rs])
        return [self._joined(b, r) for b, r in zip(bs, rs)]

    def _joined(self, b, r):
        text = TokenText(self.model.tokenizer, r.stop) if self.model.tokenizer is not None else None
        seq = Sequence((b, text))
        tokens, finish = self._hand_out(seq, b.tokens)
        return seq, tokens, finish

    def step(self):
        m = self.model
        with m._lock:
            m._take_engine(batch=True)
            out = self._decoder().step()
        by = {}
        for b, tok in out:
            by.setdefault(id(b), (b, []))[1].append(tok)
        seqs = {id(s.payload[0]): s for s in self._live()}
        result = []
        for key, (b, toks) in by.items():
            seq = seqs.get(key)
            if seq is not None:
                tokens, finish = self._hand_out(seq, toks)
                result.append((seq, tokens, finish))
        return result

    def _live(self):
        return list(self._seqs.values())

    def _hand_out(self, seq: Sequence, ids):
        """Tokens (with their text) for ``ids`` of ``seq``, and its finish reason once it is done."""
        b, text = seq.payload
        self._seqs[id(b)] = seq
        last = b.done
        if text is None:
            tokens = [Token(int(t), None) for t in ids]
            seq.completion_tokens += len(tokens)
        else:
            tokens = [Token(t, piece) for t, piece in text.feed(ids, last=last)]
            seq.completion_tokens = len(text.tokens)
            if text.stopped and not b.done:
                self._leave(b)
                last = True
        if not last:
            return tokens, None
        self._seqs.pop(id(b), None)
        stopped = (text is not None and text.stopped) or (b.tokens and b.tokens[-1] in b.stop)
        return tokens, "stop" if stopped else "length"

    def _leave(self, b) -> None:
        m = self.model
        with m._lock:
            self._decoder().finish(b)

    def cancel(self, seq: Sequence) -> None:
        b, _ = seq.payload
        self._seqs.pop(id(b), None)
        self._leave(b)

    def memory(self) -> dict:
        s = self.model.stats()
        return {"committed": s["committed"], "budget": s["budget"], "peak_committed": s["peak_committed"],
                "kv_committed": self.model.placement.batch_kv.committed(), "held": s["held"],
                "streamed_bytes": s["page_in_bytes"]}
