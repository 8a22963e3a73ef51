"""Many sequences per decode step: each in its own slot of a ``BatchKV``, every weight read once per step for all.

    dec = BatchDecoder(engine, placement.batch_kv)
    seq = dec.add(ids, 64, stop={2})      # KV pages committed for prompt + new tokens, prompt prefilled: 1st token
    while dec.active():
        dec.step()                        # one greedy decode step of every active sequence
    dec.finish(seq)                       # or it leaves by itself at its stop id / max_new_tokens

``add`` may be called between any two steps (continuous batching): a joining sequence's prefill runs eagerly in
its own slot, with that slot's cache views. ``add_many`` joins several at once and prefills them in one walk (each
weight read once for the group; each prompt's attention over its own slot). A sequence's KV pages are committed when it joins — for its prompt and
every token it may produce, so a step never maps any — and unmapped when it leaves; a join whose pages cannot be
committed raises (``CapacityError`` from the memory authority) with nothing of it left mapped. The decode state (last token, position,
length and KV row of each slot) lives on the host and is uploaded before each step; the step runs the first
``n`` slots, ``n`` one past the highest slot in use rounded up to a power of two (``bucket``; a free slot inside
has length 0: attention reads nothing and its K / V row is none). Each sequence is greedy or samples with its own (temperature, top_k, top_p) and seed,
drawing what it draws alone. A step of ``n`` slots runs eagerly the first time, then as a captured graph (one
per bucket, greedy or with draws, kept by the engine; the draws' parameters and Philox states are uploaded before
each step, like the decode state); each step ends with a read of the new tokens. ``warm()`` takes all of these once (a server does before it listens).
"""

from __future__ import annotations

import numpy as np

from ..errors import CapacityError, ContextLengthError, VmmstreamError
from . import experts as experts_mod


class Sequence:
    """One prompt's generation in a batch: ``tokens`` (new ids so far), ``logits`` (with ``return_logits``),
    ``done``."""

    def __init__(self, slot: int, n: int, max_new_tokens: int, stop, return_logits: bool, sampling=None,
                 seed: int = 0):
        self.slot, self.n, self.m = slot, n, max_new_tokens
        self.sampling, self.seed = sampling, seed     # (temperature, top_k, top_p) or None: greedy
        self.stop = frozenset(stop)
        self.tokens: list[int] = []
        self.logits: list = [] if return_logits else None
        self.done = False

    def _take(self, token: int, logits=None) -> None:
        self.tokens.append(int(token))
        if self.logits is not None:
            self.logits.append(logits)
        if token in self.stop or len(self.tokens) >= self.m:
            self.done = True


class BatchDecoder:
    def __init__(self, engine, kv):
        if kv is None:
            raise VmmstreamError("this model was loaded for one sequence at a time: load it with max_batch > 1")
        self.e, self.kv = engine, kv
        self.slots: list[Sequence | None] = [None] * kv.slots
        self.steps = 0
        self.peak = 0              # the most sequences one step advanced
        kv.owner = self

    def active(self) -> list[Sequence]:
        return [q for q in self.slots if q is not None and not q.done]

    def free_slots(self) -> int:
        return sum(q is None for q in self.slots)

    def add(self, ids, max_new_tokens: int, *, stop=frozenset(), return_logits: bool = False, sampling=None,
            seed: int = 0) -> Sequence:
        """Take a free slot, commit its KV pages and prefill ``ids`` (the caller checked them: non-empty, in the
        vocabulary, ``len(ids) + max_new_tokens <= max_context``); the sequence holds its first new token.
        ``sampling`` (temperature, top_k, top_p) with ``seed``: its draws are the ones it makes alone (its own
        Philox stream, one offset a token)."""
        e, kv = self.e, self.kv
        n = len(ids)
        s = next((i for i, q in enumerate(self.slots) if q is None), None)
        if s is None:
            raise VmmstreamError(f"every one of the {kv.slots} sequence slots is taken: add after one leaves")
        seq = self._join(s, n, max_new_tokens, stop, return_logits, sampling, seed)
        try:
            step, own = e.step, e.step.kv
            step.kv = kv.slot(s)
            graph_max, e.PREFILL_GRAPH_MAX = e.PREFILL_GRAPH_MAX, 0     # graphs hold slot 0's views: eager here
            try:
                if sampling is not None:
                    from vmmstream.kernels.ops.sampling import make_rng_state
                    e._h2d(e.acts.addr("rng"), "rng", make_rng_state(seed))
                e._prefill(ids, sampling)
            finally:
                step.kv, e.PREFILL_GRAPH_MAX = own, graph_max
            first = e._read_tokens(n, 1)[0]
            seq._take(first, e._read_logits() if return_logits else None)
        except BaseException:
            self.slots[s] = None
            kv.release(s)
            raise
        if seq.done:                         # its first token ended it: it leaves at once
            self.finish(seq)
        return seq

    def _join(self, s: int, n: int, m: int, stop, return_logits, sampling, seed) -> Sequence:
        """Slot ``s`` takes a sequence of an ``n``-token prompt and up to ``m`` new tokens: its KV pages committed
        (``CapacityError`` with none of them left mapped), the slot held. Not yet prefilled."""
        kv = self.kv
        if n < 1 or m < 1 or n + m > kv.max_context:
            raise ContextLengthError(f"a prompt of {n} tokens + {m} new needs 1 to {kv.max_context} "
                                     "positions (max_context)", requested=n + m, max_context=kv.max_context)
        try:
            kv.ensure(s, n + m)
        except BaseException:
            kv.release(s)                    # the chunks mapped before the refusal
            raise
        seq = self.slots[s] = Sequence(s, n, m, stop, return_logits, sampling, seed)
        return seq

    def add_many(self, requests) -> list[Sequence]:
        """Several joins at once: ``requests`` are ``(ids, max_new_tokens, kwargs of add)``, taken in order while
        slots are free and pages can be committed (the first refusal ends the list; with none joined it is
        raised). Their prompts are prefilled together (``packable``): one walk through the layers over all their
        tokens, so each weight is read — or, streamed, copied — once for the group instead of once per prompt;
        each prompt attends over its own slot and gets the first token it gets alone. Otherwise one by one."""
        reqs = list(requests)
        if not self.packable(reqs):
            out: list[Sequence] = []
            for ids, m, kw in reqs:
                if not self.free_slots():
                    break
                try:
                    out.append(self.add(ids, m, **kw))
                except CapacityError:
                    if out:
                        break
                    raise
                except BaseException:
                    for q in out:              # all or nothing, as a packed group: none of them joined
                        self.finish(q)
                    raise
            return out
        e, kv = self.e, self.kv
        group: list[Sequence] = []
        prompts: list = []
        try:
            for ids, m, kw in reqs:
                s = next((i for i, q in enumerate(self.slots) if q is None), None)
                if s is None or (group and sum(q.n for q in group) + len(ids) > e.acts.tmax):
                    break
                try:
                    seq = self._join(s, len(ids), m, kw.get("stop", frozenset()), kw.get("return_logits", False),
                                     kw.get("sampling"), kw.get("seed", 0))
                except CapacityError:
                    if group:
                        break                      # the ones committed so far join; this one waits
                    raise
                group.append(seq)
                prompts.append(ids)
            if not group:
                return []
            self._prefill_packed(group, prompts)
        except BaseException:
            for q in group:
                self.slots[q.slot] = None
                kv.release(q.slot)
            raise
        for q in group:
            if q.done:
                self.finish(q)
        return group

    def packable(self, reqs) -> bool:
        """Whether these joins may prefill together: more than one, each prompt within one walk of the activation
        buffers."""
        return len(reqs) > 1 and all(0 < len(ids) <= self.e.acts.tmax for ids, _, _ in reqs)

    def _prefill_packed(self, group, prompts) -> None:
        """One eager walk over the prompts of ``group`` (each in its own slot), then each one's first token: greedy
        rows by argmax, sampled rows drawn with their own Philox stream at offset 0 (as alone)."""
        e, kv, d = self.e, self.kv, self.e.driver
        k = len(group)
        ids = np.concatenate([np.asarray(p, np.int32) for p in prompts])
        pos = np.concatenate([np.arange(q.n, dtype=np.int32) for q in group])
        prow = np.concatenate([kv.row(q.slot, 0) + np.arange(q.n, dtype=np.int32) for q in group])
        ends = np.cumsum([q.n for q in group]).astype(np.int32)
        t = int(ends[-1])
        packed = [(kv.slot(q.slot), int(r0), q.n) for q, r0 in zip(group, ends - [q.n for q in group])]
        e._h2d(e.acts.addr("ids"), "ids", ids)
        e._h2d(e.acts.addr("pos"), "pos", pos)
        e._h2d(e.acts.addr("prow"), "prow", prow)
        last = e._host("tokens", np.int32, k)
        last[:] = ends - 1
        d.memcpy_htod_async(e.acts.addr("inp"), last.ctypes.data, 4 * k, e.S)
        sampled = any(q.sampling is not None for q in group)
        if sampled:                  # row j: prompt j's first draw, at offset 0 of its Philox stream (as alone)
            self._upload_draws(k, [(j, q, 0) for j, q in enumerate(group)])
        st, a = e.step, e.acts.views(k)

        def enqueue(ws):
            st.streamer.begin(timed=True)
            st.body(t, decode=False, start_pos=0, last=a.inp, kv=kv.view(kv.slots), packed=packed, ws_step=ws)
            st.streamer.end()
            st.ops.argmax(st.S, a.logits, a.next, st.ws_session)
            if sampled:
                st.ops.sample_rows(st.S, a.logits, a.next, a.rng_rows, a.samp, a.samp_k)
        with e.step_workspace() as ws:
            e._eager(lambda: enqueue(ws))
        e.counters["prefill_tokens"] += t
        e.counters["packed_prefills"] += 1
        nxt, logits = self._read_next(k, group)
        for j, q in enumerate(group):
            q._take(int(nxt[j]), None if logits is None or q.logits is None else logits[j].copy())

    def step(self) -> list[tuple[Sequence, int]]:
        """One decode step of every active sequence; returns (sequence, new token) pairs. Sequences that
        are done (stop id, ``max_new_tokens``) leave: their pages are unmapped, their slots freed."""
        live = self.active()
        if not live:
            return []
        e = self.e
        n = self.bucket(1 + max(q.slot for q in live))
        self.peak = max(self.peak, len(live))
        self._upload_state(n, live)
        sampled = any(q.sampling is not None for q in live)
        if sampled:                 # each sampled row drawn with its own parameters and Philox stream, at the
            # offset of its next token (its k-th new token is at k - 1: the prefill drew the first)
            self._upload_draws(n, [(q.slot, q, len(q.tokens)) for q in live])
        self._run_step(n, sampled)
        nxt, logits = self._read_next(n, live)
        self.steps += 1
        e.counters["decode_tokens"] += len(live)
        out = []
        for q in live:
            tok = int(nxt[q.slot])
            q._take(tok, None if logits is None or q.logits is None else logits[q.slot].copy())
            out.append((q, tok))
            if q.done:
                self.finish(q)
        return out

    def _upload_state(self, n: int, live) -> None:
        """The decode state of the first ``n`` slots (inp, positions, lens, KV rows): each live sequence's last
        token at its position; every other slot free (length 0, its K / V go nowhere)."""
        e, kv, d = self.e, self.kv, self.e.driver
        h = e._host("state", np.int32, 4 * n)
        state = h.reshape(4, n)
        state[:] = 0
        state[3] = -1
        for q in live:
            p = q.n + len(q.tokens) - 1                     # the position of the token this step reads
            state[:, q.slot] = (q.tokens[-1], p, p + 1, kv.row(q.slot, p))
        for i, name in enumerate(("inp", "positions", "lens", "rows")):
            d.memcpy_htod_async(e.acts.addr(name), h.ctypes.data + 4 * n * i, 4 * n, e.S)

    def _upload_draws(self, n: int, rows) -> None:
        """The sampling rows of the first ``n`` rows: for each ``(row, sequence, offset)`` of ``rows`` whose
        sequence samples, its (1 / temperature, top_p), top_k and Philox state at ``offset``; every other row
        greedy (0: its argmax stands)."""
        from vmmstream.kernels.ops.sampling import make_rng_state, row_params
        e, d = self.e, self.e.driver
        rng, prm, tk = e._host("rngrows", np.uint64, 4 * n), e._host("samp", np.float32, 2 * n), \
            e._host("sampk", np.int32, n)
        rng[:], prm[:], tk[:] = 0, 0, 0
        for r, q, offset in rows:
            if q.sampling is not None:
                rng[4 * r:4 * r + 4] = make_rng_state(q.seed, offset)
                prm[2 * r], prm[2 * r + 1], tk[r] = row_params(*q.sampling)
        for name, h, size in (("rng_rows", rng, 32), ("samp", prm, 8), ("samp_k", tk, 4)):
            d.memcpy_htod_async(e.acts.addr(name), h.ctypes.data, size * n, e.S)

    def bucket(self, n: int) -> int:
        """The step that runs the first ``n`` slots: the next power of two, at most every slot (the rows past
        ``n`` are free: they read and write nothing). So a batch has a handful of step sizes — of kernels'
        shapes, eager first steps and captured graphs — however its sequences come and go. Not for a mixture of
        experts: a free row would still be routed (counted, and with experts on demand, gathered)."""
        if self.e.config.is_moe:
            return n
        b = 1
        while b < n:
            b *= 2
        return min(b, self.kv.slots)

    def buckets(self) -> list[int]:
        return sorted({self.bucket(n) for n in range(1, self.kv.slots + 1)})

    def warm(self) -> dict:
        """Take every path a batch's requests take once, before the first one comes: a packed prefill, a lone
        one, a sampled step, and each bucket's step, greedy and with draws, twice (eagerly, which compiles or
        loads its kernels, then captured). A server calls it after loading, so its requests find these compiled
        and captured (a long prompt on a split attention route may still compile its own). The bucket steps run
        with every slot free; the prefills join short sequences that leave at once; the statistics are put back
        as they were. Returns
        what it did: ``buckets``, and ``joins`` (False when the pages of a join could not be committed now)."""
        if any(q is not None for q in self.slots):
            raise VmmstreamError("warm() runs before any sequence joins")
        e, d = self.e, self.e.driver
        kept = self._counts()
        joins = True
        try:
            try:
                for q in self.add_many([([1, 2], 2, {}), ([1], 2, {})]):
                    if not q.done:
                        self.step()
                q = self.add([1], 2, sampling=(1.0, 0, 1.0), seed=0)
                while q in self.active():
                    self.step()
            except CapacityError:
                joins = False
            finally:
                for q in [q for q in self.slots if q is not None]:
                    self.finish(q)
            for n in self.buckets():
                self._upload_state(n, [])                   # every slot free
                self._upload_draws(n, [])                   # no row draws: the sampled step's kernels still run
                for sampled in (False, True):
                    for _ in range(2):
                        self._run_step(n, sampled)
                d.stream_synchronize(e.S)
        finally:
            self._counts(kept)          # the warm-up is no work of anyone's: statistics as they were
        return {"buckets": self.buckets(), "joins": joins}

    def _counts(self, kept=None):
        """The statistics a warm-up would move (the engine's counters, this decoder's, a mixture's routing
        counts), or with ``kept`` put them back."""
        e = self.e
        ex = e.weights.experts if e.weights is not None else None
        if kept is None:
            routing = None if ex is None else (ex.counts, e.ops.to_host(ex.stats_dev).copy(),
                                               dict(ex.host_counters))
            return dict(e.counters), self.steps, self.peak, routing
        counters, self.steps, self.peak, routing = kept
        e.counters.clear()
        e.counters.update(counters)
        if routing is not None:
            e.ops.to_device(ex.counts_dev, routing[0])
            e.ops.to_device(ex.stats_dev, routing[1])
            ex.host_counters.clear()
            ex.host_counters.update(routing[2])

    def _read_next(self, n: int, seqs):
        """The first ``n`` rows of ``next`` (and of ``logits`` when one of ``seqs`` keeps them), after the queued work."""
        e, d = self.e, self.e.driver
        nxt = e._host("tokens", np.int32, n)
        d.memcpy_dtoh_async(nxt.ctypes.data, e.acts.addr("next"), 4 * n, e.S)
        logits = None
        if any(q.logits is not None for q in seqs):
            logits = np.empty((n, e.config.vocab_size), np.float32)
            d.memcpy_dtoh_async(logits.ctypes.data, e.acts.addr("logits"), logits.nbytes, e.S)
        d.stream_synchronize(e.S)
        return nxt, logits

    def _run_step(self, n: int, sampled: bool = False) -> None:
        """The step of the first ``n`` slots (``sampled``: with the draws of ``_upload_draws``): eagerly the first
        time it is seen (which compiles and loads every kernel it needs), then captured once and replayed; the
        state it reads was uploaded before."""
        e, kv, key = self.e, self.kv, (n, sampled)
        g = e.batch_graphs.get(key)
        ex = e.weights.experts if e.weights is not None else None
        if ex is not None and ex.on_demand and e.ops.backend != "host" and not experts_mod.BATCH_GATHER_IN_GRAPH:
            e.batch_graphs[key] = None   # experts streamed on demand: host-driven rounds, so the steps run eagerly
        if g is None and key in e.batch_seen:
            from ..errors import DriverError
            from .graph import DecodeGraph
            before = e.streamer.issued
            try:
                g = DecodeGraph(e.driver, e.S, lambda: e.step.decode_batch(n, kv.view(n), timed=False,
                                                                           sampled=sampled),
                                key=("batch", n, sampled))
            except DriverError:
                e.streamer.issued = before
                e.batch_seen.discard(key)         # never captured: this step runs eagerly from now on
                e.batch_graphs[key] = None
            else:
                g.copies = e.streamer.issued - before
                e.batch_graphs[key] = g
                e.counters["batch_graph_captures"] += 1
        if g is None:
            e._eager(lambda: e.step.decode_batch(n, kv.view(n), sampled=sampled))
            if key not in e.batch_graphs:
                e.batch_seen.add(key)
            return
        g.replay()
        e.counters["batch_graph_replays"] += 1
        e.counters["page_ins"] += g.copies
        if g.copies:
            e.counters["page_in_bytes"] += e.weights.streamed_payload

    def finish(self, seq: Sequence) -> None:
        """``seq`` leaves the batch: its pages are unmapped (after the queued work), its slot is free."""
        if self.slots[seq.slot] is seq:
            seq.done = True
            self.slots[seq.slot] = None
            self.kv.release(seq.slot)

    def close(self) -> None:
        for q in list(self.slots):
            if q is not None:
                self.finish(q)
        if self.kv.owner is self:
            self.kv.owner = None
