"""The engine: what runs a placed model on the device, one prompt and its new tokens at a time.

Loading decides where a model's bytes live; the engine decides when work runs on them. It owns everything that
exists only to enqueue work: the compute stream ``S`` and the copy stream ``C`` (tracked by the memory, so a
release waits for what they queued), pinned staging for the few host <-> device transfers, the ``Streamer``
(slot copies on ``C``), the ``Step`` (kernels on ``S``), the captured decode graphs (one per sampling key),
CUDA-event timing and the counters. It is apart from the public ``Model`` so that batched decode or a server
can drive it without ``generate``'s argument checks, tokenizer and end-of-sequence cut.

An engine is driven by one owner thread: nothing here is locked, every transfer shares one staging buffer, and
``run`` returns only once its work is done.

Lifecycle (``vmmstream.api.Model`` follows it):

    engine = Engine(memory, holder, config, plan)    # launch adapter, streams
    ...place the model with engine.ops and engine.C...
    engine.start(placement)                          # staging, streamer, step, constants, warm-up, decode graph
    tokens, logits = engine.run(ids, 16)
    run = engine.begin(ids, 16, stop={2})            # the same, handed out in blocks: run.advance(k), run.finish()
    engine.stop()                                    # drained; graphs, streamer, timing events gone
    ...free the placement...
    engine.close()                                   # streams, staging

The streams outlive the placement's frees because the memory fences each free on the streams it tracks.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from ..align import align_up
from ..driver import GATE
from ..errors import Attempts, DriverError
from ..interrupts import uninterruptible
from .graph import DecodeGraph
from .ops import make_ops
from .step import Step
from .weights import Streamer


class Engine:
    """Enqueues prefill and decode for one placed model and owns the streams, graphs and counters that this takes.

    Public surface: ``run``, ``begin`` (the same handed out in blocks: a ``Run``), ``graph``, ``rebalance_experts``,
    ``synchronize``, ``stop``, ``close``; ``counters`` (since construction), ``graphs`` (sampling key ->
    ``DecodeGraph``), and ``ops``, ``S``, ``C``, ``streamer``, ``step`` for the owner and tests.
    """

    # Routing drifts: the resident experts are re-chosen by routing counts when that raises the share of
    # routings that hit the device by at least REBALANCE_GAIN (and enough were seen).
    REBALANCE_GAIN = 0.05
    REBALANCE_MIN_ROUTINGS = 64

    def __init__(self, memory, holder: str, config, plan):
        self.memory, self.driver, self.holder = memory, memory.driver, holder
        self.config, self.plan = config, plan
        self.graphs: dict = {}
        self.prefill_graphs: dict = {}     # padded prompt length -> its captured prefill
        self.batch_graphs: dict = {}       # (n, sampled) -> the captured decode step of the first n slots
        self.batch_seen: set = set()       # (n, sampled) whose step ran eagerly once (kernels compiled and loaded)
        self._prefill_seen: set = set()
        self._prefill_ungraphable: set = set()
        self._prefill_copies: dict = {}
        self.counters = dict(prefill_tokens=0, decode_tokens=0, generate_calls=0, eager_steps=0,
                             page_ins=0, page_in_bytes=0, h2d_ms=0.0, h2d_timed_bytes=0, decode_ms=0.0,
                             decode_timed_tokens=0, vmm_calls_decode=0, graph_captures=0, graph_replays=0,
                             prefill_graph_captures=0, prefill_graph_replays=0, batch_graph_captures=0,
                             batch_graph_replays=0, packed_prefills=0)
        self.ops = self.S = self.C = None
        self.weights = self.kv = self.acts = self.ws_session = None
        self.streamer = self.step = None
        self.closed = False
        self._stopped = False
        self._streams = []
        self._staging, self._lay = 0, {}
        self._tev = None
        self._copies_per_replay = 0
        try:
            self.ops = make_ops(self.driver)
            with uninterruptible():        # each stream made and kept together, so close() destroys it
                self.S = self.driver.stream_create("compute")
                self._streams.append(self.S)
                self.C = self.driver.stream_create("copy")
                self._streams.append(self.C)
            for s in self._streams:
                memory.track_stream(s)
        except BaseException:
            self.close()
            raise

    def start(self, placement) -> None:
        """Run on ``placement`` (its ``weights``, ``kv``, ``acts``, ``ws_session``): upload the constants, run one
        eager decode step and capture the greedy decode graph. On failure the owner closes the engine."""
        d, plan, c = self.driver, self.plan, self.config
        self.weights, self.kv, self.acts = placement.weights, placement.kv, placement.acts
        self.ws_session = placement.ws_session
        tmax = self.acts.tmax
        lay, off = {}, 0
        for name, n in (("ids", 4 * tmax), ("pos", 4 * tmax), ("prow", 4 * tmax), ("scalars", 16), ("rng", 32),
                        ("inv_freq", 2 * c.head_dim), ("tokens", 4 * max(plan.max_context, plan.batch)),
                        ("logits", 4 * c.vocab_size), ("state", 16 * plan.batch), ("rngrows", 32 * plan.batch),
                        ("samp", 8 * plan.batch), ("sampk", 4 * plan.batch)):
            lay[name] = off
            off = align_up(off + n, 256)
        with uninterruptible():            # allocated and kept together, so close() frees it
            self._staging = d.host_alloc(off)
        self._lay = lay
        self.streamer = Streamer(d, self.S, self.C, self.weights.streamed, plan.slot_count)
        self.step = Step(self.ops, self.S, self.weights, self.kv, self.acts, self.streamer, c, self.ws_session)
        # RoPE frequencies computed as transformers does; longrope's factor list is chosen by max_context
        self._h2d(self.acts.addr("inv_freq"), "inv_freq", c.rope_inv_freq(plan.max_context))
        # warm-up: one eager decode step compiles and loads every decode kernel before the capture
        self._set_scalars(token=0, position=0, length=1)
        self._eager(lambda: self.step.decode(None, timed=True))
        d.stream_synchronize(self.S)
        self.graph(None)
        ex = self.weights.experts
        if ex is not None:          # the warm-up step's routing (token 0 at position 0) is not the user's
            d.stream_synchronize(self.S)
            ex.reset_counters()

    # ------------------------------------------------------------------------------------------ run
    # With stop tokens, the replays go in blocks of this many and the tokens are read between blocks: a stop
    # costs at most a block's tokens past it, and a read (a synchronize) comes once a block, not once a token.
    STOP_CHECK_TOKENS = 8

    def run(self, ids, max_new_tokens: int, *, sampling=None, seed: int = 0, return_logits: bool = False,
            stop=frozenset()):
        """Prefill ``ids`` and produce up to ``max_new_tokens`` tokens: ``(tokens, logits)``, logits the fp32
        ``[len(tokens), vocab]`` of every new token with ``return_logits``, else None. ``stop``: token ids after
        which decoding ends (the stop token is the last one returned).

        ``sampling``: None (greedy) or ``(temperature, top_k, top_p)``, which is also the key of its decode graph
        (captured on first use). The caller has checked the request: ``ids`` non-empty and inside the
        vocabulary, ``max_new_tokens`` >= 1, ``len(ids) + max_new_tokens`` <= ``plan.max_context``.

        ``begin`` is the same work handed out in blocks (streaming); this is it run to the end: with stop ids,
        the first token, then blocks of ``STOP_CHECK_TOKENS``; without, every replay in one block.
        """
        r = self.begin(ids, max_new_tokens, sampling=sampling, seed=seed, return_logits=return_logits, stop=stop)
        try:
            if stop:
                r.advance(0)
                while not r.done:
                    r.advance(self.STOP_CHECK_TOKENS)
            else:
                r.advance(max_new_tokens - 1)
        finally:
            r.finish()
        return r.tokens, r.logits_array()

    def begin(self, ids, max_new_tokens: int, *, sampling=None, seed: int = 0, return_logits: bool = False,
              stop=frozenset()) -> Run:
        """Commit the KV cache, prefill ``ids`` (which selects the first new token) and return the ``Run`` that
        decodes the rest in blocks of its owner's choosing (``Run.advance``). Same arguments as ``run``; the
        engine runs nothing else until the run is ``finish``ed."""
        return Run(self, ids, max_new_tokens, sampling=sampling, seed=seed, return_logits=return_logits, stop=stop)

    def graph(self, sampling) -> DecodeGraph:
        """The decode graph for ``sampling`` (None: greedy), captured on first use."""
        g = self.graphs.get(sampling)
        if g is None:
            before = self.streamer.issued
            g = DecodeGraph(self.driver, self.S, lambda: self.step.decode(sampling), key=sampling)
            self._copies_per_replay = self.streamer.issued - before
            self.graphs[sampling] = g
            self.counters["graph_captures"] += 1
        return g

    def rebalance_experts(self, *, force: bool = False) -> int:
        """Re-choose the resident experts from the routing counts so far (prefill and decode); returns the
        number of experts moved. Outside any graph: the units are copied and the location table rewritten,
        and the captured decode graph reads the table when it runs, so nothing is recaptured."""
        ex = self.weights.experts if self.weights is not None else None
        if ex is None or not ex.on_demand or not ex.n_pool:
            return 0
        self.driver.stream_synchronize(self.S)
        best = ex.best_resident()
        if set(best) == set(ex.owner):
            return 0
        gain = ex.hit_fraction(best) - ex.hit_fraction(ex.owner)
        if not force and (gain < self.REBALANCE_GAIN or int(ex.counts.sum()) < self.REBALANCE_MIN_ROUTINGS):
            return 0
        self.driver.stream_synchronize(self.S)
        return ex.rebalance(best, self.C)

    def synchronize(self) -> None:
        """Wait for the work queued on the compute stream (e.g. before reading device-side counters)."""
        self.driver.stream_synchronize(self.S)

    # ------------------------------------------------------------------------------- enqueue helpers
    def _host(self, name, dtype, count):
        return np.frombuffer((ctypes.c_uint8 * (count * np.dtype(dtype).itemsize)).from_address(
            self._staging + self._lay[name]), dtype=dtype, count=count)

    def _h2d(self, dst: int, name: str, values) -> None:
        values = np.ascontiguousarray(values)
        h = self._host(name, values.dtype, values.size)
        h[...] = values.reshape(-1)
        self.driver.memcpy_htod_async(dst, h.ctypes.data, values.nbytes, self.S)

    def _set_scalars(self, *, token=None, position: int, length: int) -> None:
        h = self._host("scalars", np.int32, 4)
        h[:] = (position, length, 0 if token is None else token, 0)
        base = h.ctypes.data
        self.driver.memcpy_htod_async(self.acts.addr("positions"), base, 4, self.S)
        self.driver.memcpy_htod_async(self.acts.addr("lens"), base + 4, 4, self.S)
        if token is not None:
            self.driver.memcpy_htod_async(self.acts.addr("inp"), base + 8, 4, self.S)

    def _eager(self, enqueue) -> None:
        """Run an eager step and count its copies (enqueued on the copy stream; timed by CUDA events)."""
        before = self.streamer.issued
        enqueue()
        self.driver.stream_synchronize(self.S)
        n = self.streamer.issued - before
        self.counters["eager_steps"] += 1
        self.counters["page_ins"] += n
        if n:
            self.counters["page_in_bytes"] += self.weights.streamed_payload
        if n and self.streamer.timed:
            self.counters["h2d_ms"] += self.streamer.copy_ms()
            self.counters["h2d_timed_bytes"] += self.weights.streamed_payload

    def _timing_events(self):
        if self._tev is None:
            with uninterruptible():
                self._tev = (self.driver.event_create(True), self.driver.event_create(True))
        return self._tev

    # A prompt of up to PREFILL_GRAPH_MAX tokens (and within one walk) is padded — to a power of two of at least
    # PREFILL_BUCKET_MIN tokens up to PREFILL_GRAPH_STEP, above it to a multiple of a sixteenth of the power of two
    # at or above it (under 1/8 of padding rows: 257 -> 288, 1,000 -> 1,024, 3,000 -> 3,072) — and, from the
    # second prompt of that padded length on, runs as one captured graph: the walk's launches from Python (a dozen
    # kernels a layer, each some tens of microseconds of Python) cost about as much as the work itself up to a
    # thousand tokens or so (checked on CUDA by tests/gpu/test_load_model_gpu.py). The PREFILL_GRAPHS_KEPT most
    # recently used graphs are kept. PREFILL_GRAPH_MAX = 0 prefills every prompt eagerly, unpadded.
    PREFILL_BUCKET_MIN = 16
    PREFILL_GRAPH_STEP = 256
    PREFILL_GRAPH_MAX = 4096
    PREFILL_GRAPHS_KEPT = 8

    def prefill_extent(self, n: int) -> int:
        """Positions a prefill of ``n`` tokens writes in the KV cache (padding included)."""
        b = self._prefill_bucket(n)
        return n if b is None else b

    def _prefill_bucket(self, n: int):
        """The padded length of a prompt of ``n`` tokens (the key of its prefill graph), or None: eager, unpadded.
        Padding rows come after the prompt, so causal attention keeps them out of every prompt row; their keys
        and values land at positions the decode overwrites before it reads them; the logits are taken from the
        prompt's last row (gathered by index). Not for a mixture of experts (padding rows would be routed and
        counted), nor with a step workspace (its address changes per call)."""
        c, plan = self.config, self.plan
        if c.is_moe or plan.workspace["step"] or n > self.PREFILL_GRAPH_MAX:
            return None
        b = max(self.PREFILL_BUCKET_MIN, 1 << max(0, n - 1).bit_length())
        if n > self.PREFILL_GRAPH_STEP:
            b = -(-n // (b // 16)) * (b // 16)
        return b if b <= min(self.acts.tmax, plan.max_context, self.PREFILL_GRAPH_MAX) else None

    def _prefill_padded(self, ids, b: int, sampling) -> None:
        """Prefill ``ids`` padded to ``b`` tokens: eagerly the first time this length is seen (which compiles
        and loads every kernel it needs), then captured once and replayed."""
        n = len(ids)
        padded = np.zeros(b, np.int32)
        padded[:n] = ids
        self._h2d(self.acts.addr("ids"), "ids", padded)
        self._h2d(self.acts.addr("pos"), "pos", np.arange(b, dtype=np.int32))
        self._set_scalars(token=n - 1, position=n - 1, length=n)     # inp = the prompt's last row: the gather index
        last = self.acts.views(1).inp

        def body(timed):
            self.streamer.begin(timed=timed)
            self.step.body(b, decode=False, start_pos=0, last=last)
            self.streamer.end()

        g = self.prefill_graphs.get(b)
        if g is None and b in self._prefill_seen:
            before = self.streamer.issued
            try:
                g = DecodeGraph(self.driver, self.S, lambda: body(False), key=("prefill", b))
            except DriverError:
                self._prefill_ungraphable.add(b)      # this length prefills eagerly from now on
                self._prefill_seen.discard(b)
                self.streamer.issued = before
            else:
                while len(self.prefill_graphs) >= self.PREFILL_GRAPHS_KEPT:   # the least recently used goes (its
                    old = next(iter(self.prefill_graphs))                      # replays were synchronized)
                    self.prefill_graphs.pop(old).close()
                self._prefill_copies[b] = self.streamer.issued - before
                self.prefill_graphs[b] = g
                self.counters["prefill_graph_captures"] += 1
        elif g is not None:
            self.prefill_graphs[b] = self.prefill_graphs.pop(b)           # most recently used last
        if g is None:
            def enqueue():
                body(True)
                self.step.select(sampling)
                self.step.advance()
            self._eager(enqueue)
            if b not in self._prefill_ungraphable:
                self._prefill_seen.add(b)             # warmed up: every kernel it needs is compiled and loaded
        else:
            g.replay()
            self.step.select(sampling)
            self.step.advance()
            self.driver.stream_synchronize(self.S)
            copies = self._prefill_copies[b]
            self.counters["prefill_graph_replays"] += 1
            self.counters["page_ins"] += copies
            if copies:
                self.counters["page_in_bytes"] += self.weights.streamed_payload
        self.counters["prefill_tokens"] += n

    def _prefill(self, ids, sampling) -> None:
        """Eager prefill in chunks of the activation buffers' size; the last chunk selects the first new token.
        A short prompt takes ``_prefill_padded``."""
        n = len(ids)
        b = self._prefill_bucket(n)
        if b is not None:
            self._prefill_padded(ids, b, sampling)
            return
        tmax = self.acts.tmax
        with self.step_workspace() as ws_view:
            for start in range(0, n, tmax):
                t = min(tmax, n - start)
                self._h2d(self.acts.addr("ids"), "ids", np.asarray(ids[start:start + t], np.int32))
                self._h2d(self.acts.addr("pos"), "pos", np.arange(start, start + t, dtype=np.int32))
                last = start + t == n

                def enqueue(t=t, start=start, last=last):
                    self.streamer.begin(timed=True)
                    self.step.body(t, decode=False, start_pos=start, ws_step=ws_view)
                    self.streamer.end()
                    if last:
                        self._set_scalars(position=n - 1, length=n)
                        self.step.select(sampling)
                        self.step.advance()
                self._eager(enqueue)
                self.counters["prefill_tokens"] += t

    @contextlib.contextmanager
    def step_workspace(self):
        """The plan's step workspace for one prefill (a uint8 view, or None when the plan has none): allocated
        here, freed on the way out (I8), even on an exception."""
        plan = self.plan
        self._free_leftover_workspace()
        ws_step = None
        if plan.workspace["step"]:
            try:
                ws_step = self.memory.allocate(plan.workspace["step"], role="workspace_step", holder=self.holder,
                                               arena="workspace")
            except KeyboardInterrupt:      # raised as the allocation ended: it exists, but was never kept here
                self._free_leftover_workspace()
                raise
        try:
            yield None if ws_step is None else self.ops.view(ws_step.va, (plan.workspace["step"],), np.uint8)
        finally:
            if ws_step is not None:       # step workspace lives for the step only (I8), even on an exception
                try:                       # fenced: unmapped once the queued prefill work is done
                    self.memory.free(ws_step)
                except DriverError:        # the failed free rolled back (I3): once more, else swept next call
                    self.memory.free(ws_step)

    def _free_leftover_workspace(self) -> None:
        """Step workspace still charged to this model between calls: a free that failed, or an allocation that
        completed while a Ctrl-C waited and whose caller never kept it. None may outlive its step (I8)."""
        for b in [b for b in self.memory.blocks if b.lease.holder == self.holder and b.lease.role == "workspace_step"]:
            self.memory.free(b)

    def _read_logits(self) -> np.ndarray:
        v = self.config.vocab_size
        h = self._host("logits", np.float32, v)
        self.driver.memcpy_dtoh_async(h.ctypes.data, self.acts.addr("logits"), 4 * v, self.S)
        self.driver.stream_synchronize(self.S)
        return h.copy()

    def _read_tokens(self, n: int, m: int) -> list:
        h = self._host("tokens", np.int32, m)
        self.driver.memcpy_dtoh_async(h.ctypes.data, self.acts.addr("out_tokens") + 4 * n, 4 * m, self.S)
        self.driver.stream_synchronize(self.S)
        return [int(x) for x in h]

    # ------------------------------------------------------------------------------------ teardown
    @uninterruptible()
    def stop(self) -> None:
        """Wait for the queued work, then drop what enqueues more: graphs, streamer, timing events. The streams
        stay until ``close()``. Idempotent; every step is attempted, the first failure raised at the end."""
        if self._stopped:
            return
        self._stopped = True
        mem, d = self.memory, self.driver
        attempt = Attempts()

        if not mem.closed and not GATE.open:    # no synchronize inside a capture (e.g. a finalizer during one)
            for s in self._streams:
                attempt(d.stream_synchronize, s)
        if not mem.closed:
            attempt(self._free_leftover_workspace)
        for g in list(self.graphs.values()) + list(self.prefill_graphs.values()) + list(self.batch_graphs.values()):
            if g is not None:                  # a batch size that could not be captured is kept as None
                attempt(g.close)
        self.graphs.clear()
        self.prefill_graphs.clear()
        self.batch_graphs.clear()
        if self.streamer is not None:
            attempt(self.streamer.close)
        if self._tev is not None:
            for e in self._tev:
                attempt(d.event_destroy, e)
        attempt.raise_first()

    @uninterruptible()
    def close(self) -> None:
        """``stop()`` if not yet, then untrack and destroy the streams and free the staging. Idempotent; every
        step is attempted, the first failure raised at the end."""
        if self.closed:
            return
        self.closed = True
        mem, d = self.memory, self.driver
        attempt = Attempts()

        attempt(self.stop)
        if not mem.closed:
            for s in self._streams:
                mem.untrack_stream(s)
        for s in self._streams:
            attempt(d.stream_destroy, s)
        if self._staging:
            attempt(d.host_free, self._staging)
            self._staging = 0
        attempt.raise_first()


class Run:
    """One prompt's generation on an engine, handed to its owner in blocks of decode replays.

        run = engine.begin(ids, 64, stop={2})   # KV committed, prefill done: the first new token is chosen
        first = run.advance(0)                  # [that token]
        while not run.done:
            new = run.advance(8)                # up to 8 more replays of the decode graph, then one read
        run.finish()                            # counters; idempotent

    ``advance(k)`` replays the captured graph up to ``k`` times back to back, then reads the tokens not handed
    out yet in one copy (one synchronize a block): what it returns, cut after the first stop id. Each block
    is timed by its own CUDA events, so a pause between blocks (a slow consumer) is not counted as decode
    time. ``truncate(n)`` ends the run early, keeping the first ``n`` tokens (stop strings). After an
    exception inside the engine the run is ``failed`` and done: no further driver call is made for it.
    """

    def __init__(self, engine, ids, max_new_tokens: int, *, sampling=None, seed: int = 0,
                 return_logits: bool = False, stop=frozenset()):
        self.engine = e = engine
        d = e.driver
        self.n, self.m = len(ids), max_new_tokens
        self.stop = frozenset(stop)
        self.return_logits = return_logits
        self.tokens: list[int] = []
        self.logits: list = []
        self.made = 1                          # tokens produced on the device (prefill made the first)
        self.done = self.finished = self.failed = False
        self._vmm = 0
        self._timed_ms, self._timed = 0.0, 0
        e.kv.ensure(max(self.n + self.m, e.prefill_extent(self.n)))   # the only VMM calls of a run
        if sampling is not None:
            from vmmstream.kernels.ops.sampling import make_rng_state
            e._h2d(e.acts.addr("rng"), "rng", make_rng_state(seed))
        e._prefill(ids, sampling)
        if return_logits:
            self.logits.append(e._read_logits())
        self.graph = e.graph(sampling)
        self._events = e._timing_events()
        self._d = d

    def advance(self, replays: int) -> list:
        """Up to ``replays`` more decode steps (not past ``max_new_tokens``); returns the tokens not returned
        before (the first call: the prefill's token too), cut after the first stop id, which makes it done."""
        if self.done:
            return []
        e, d = self.engine, self._d
        k = max(0, min(replays, self.m - self.made))
        try:
            vmm0 = d.vmm_call_count()
            if k:
                t0, t1 = self._events
                d.event_record(t0, e.S)
                for _ in range(k):
                    self.graph.replay()
                    self.made += 1
                    if self.return_logits:
                        self.logits.append(e._read_logits())
                d.event_record(t1, e.S)
            have = len(self.tokens)
            new = e._read_tokens(self.n + have, self.made - have)     # synchronizes S: the block is done
            if k:
                self._timed_ms += d.event_elapsed_ms(*self._events)
                self._timed += k
            self._vmm += d.vmm_call_count() - vmm0
        except BaseException:
            self.failed = self.done = True
            raise
        if self.stop:
            cut = next((i for i, t in enumerate(new) if t in self.stop), None)
            if cut is not None:
                new = new[:cut + 1]
                self.done = True
        self.tokens.extend(new)
        if self.made >= self.m:
            self.done = True
        return new

    def truncate(self, count: int) -> None:
        """End the run keeping its first ``count`` tokens (decoding ends there: a stop string was found)."""
        del self.tokens[count:]
        self.done = True

    def logits_array(self):
        return np.stack(self.logits[:len(self.tokens)]) if self.return_logits else None

    def finish(self) -> None:
        """Count what the run did (no driver call: every block ended with a synchronize). Idempotent; a failed
        run counts nothing, as before the run was split in blocks."""
        if self.finished:
            return
        self.finished = self.done = True
        if self.failed:
            return
        e = self.engine
        cnt = e.counters
        replays = self.made - 1
        del self.logits[len(self.tokens):]
        cnt["vmm_calls_decode"] += self._vmm
        cnt["decode_tokens"] += max(0, len(self.tokens) - 1)   # tokens returned; replays past a stop are not
        cnt["graph_replays"] += replays
        cnt["generate_calls"] += 1
        if self._timed:
            cnt["decode_ms"] += self._timed_ms
            cnt["decode_timed_tokens"] += self._timed          # the device rate counts every replay it timed
        cnt["page_ins"] += replays * e._copies_per_replay
        cnt["page_in_bytes"] += replays * (e.weights.streamed_payload if e._copies_per_replay else 0)
