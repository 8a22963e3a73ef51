"""``load_model`` and ``Model``: a Hugging Face checkpoint run under a device memory budget.

    with vmmstream.load_model("path/to/checkpoint", budget="2GiB") as model:
        print(model.plan)                                 # what fits, what streams, and why
        ids = model.generate([1, 2, 3], max_new_tokens=64)  # greedy by default
        print(model.stats())

Load: checkpoint headers (typed errors before anything is allocated) -> plan (workspace peaks asked of
the kernels at the planned shapes, granularity from the driver) -> leases granted for the whole plan
(CapacityError before any allocation, I9) -> weights (pinned host copies, resident pages, slots aliased at
streamed VAs) -> KV range, workspace, activations -> one eager decode step (warm-up) -> the decode graph.
A failure anywhere releases everything taken so far.

Generate: the KV cache is committed for prompt + new tokens (the only VMM calls), prefill runs eagerly in
chunks, every further token is one replay of the captured decode step.
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import numpy as np

from .budget import format_bytes, parse_budget, parse_budget_spec
from .errors import BudgetError, ContextLengthError, VmmstreamError

_ids = itertools.count(1)
ROLES_PLANNED = ("weights_resident", "weight_slots", "kv_cache", "workspace_step", "workspace_session",
                 "activations")


def load_model(path, budget=None, *, max_context: int | None = None, slots: int | None = None,
               backend: str | None = None, memory=None, progress=None, h2d_gbps: float | None = None,
               prefill_chunk: int | None = None, quantize: str | None = None) -> "Model":
    """Load the checkpoint at ``path`` to run within ``budget`` device bytes.

    ``budget``: bytes, ``"6GiB"``, ``"80%"``, ``0.8`` or ``"auto"`` (default: ``VMMSTREAM_BUDGET``, else auto).
    ``max_context``: positions the KV cache holds (default min(4096, max_position_embeddings)).
    ``slots``: streaming slots K >= 2 (default 2). ``backend``: ``cuda``, ``host`` or ``auto``.
    ``memory``: a ``DeviceMemory`` to use instead of the process's shared one (tests, custom drivers).
    ``progress``: True / False / a callable(done_bytes, total_bytes); default: a progress line on long loads.
    ``quantize``: ``"int4"`` (group 128, fp16 scale and zero point) or ``"mxfp4"`` (OCP MX, 32-element
    blocks) stores the layers' linear weights quantized, quantized on the host while loading; the plan,
    the streamed bytes and the bound use the quantized sizes, ``model.quantization`` reports the error.
    Raises ``CheckpointError`` / ``UnsupportedModelError`` (bad checkpoint), ``BudgetError`` (bad budget),
    ``CapacityError`` (no plan fits, or the memory is taken), ``DriverError``; nothing stays allocated.
    """
    from . import memory as memmod
    from .model import open_checkpoint
    from .quantization import check_kind
    check_kind(quantize)                            # a bad choice is a ValueError before any work
    if budget is not None:
        parse_budget_spec(budget)                   # a bad budget is a BudgetError before any device work
    ck = open_checkpoint(path)                      # headers only: CheckpointError / UnsupportedModelError
    created = False
    if memory is None:
        device = 0
        existed = any(d == device and not m.closed for (_, d), m in memmod._by_device.items())
        memory = memmod.device_memory(budget, device=device, backend=backend)
        created = not existed
    elif budget is not None:
        free, total = memory.driver.mem_get_info()
        want = parse_budget(budget, total, device_free=free)
        if want != memory.authority.budget:
            raise BudgetError(f"budget {budget!r} ({want} bytes) differs from the given memory's budget "
                              f"({memory.authority.budget} bytes)")
    try:
        return Model(ck, memory, max_context=max_context, slots=slots, progress=progress, h2d_gbps=h2d_gbps,
                     prefill_chunk=prefill_chunk, owns_memory=created, quantize=quantize)
    except BaseException:
        if created and not memory.closed and not memory.blocks:
            memory.close()
        raise


class Model:
    """A loaded model. Owner of its weights, KV cache, workspace, activations, streams and graphs; ``close()``
    (or leaving the ``with`` block) releases them. Not thread-safe."""

    def __init__(self, checkpoint, memory, *, max_context=None, slots=None, progress=None, h2d_gbps=None,
                 prefill_chunk=None, owns_memory=False, quantize=None):
        from .planning import PREFILL_CHUNK, make_plan
        self.path = Path(checkpoint.path)
        self.config = c = checkpoint.config
        self.memory = mem = memory
        self.driver = d = mem.driver
        self.backend = d.backend
        self.holder = f"model{next(_ids)}:{self.path.name}"
        self._owns_memory = owns_memory
        self.closed = False
        self._graphs: dict = {}
        self._streams = []
        self._blocks = []
        self._staging = 0
        self.weights = self.kv = self.acts = self.streamer = None
        self._counters = dict(prefill_tokens=0, decode_tokens=0, generate_calls=0, eager_steps=0,
                              page_ins=0, page_in_bytes=0, h2d_ms=0.0, h2d_timed_bytes=0, decode_ms=0.0,
                              decode_timed_tokens=0, vmm_calls_decode=0, graph_captures=0, graph_replays=0)
        try:
            if d.backend == "cuda":
                _check_cuda_shapes(c)
            chunk = int(prefill_chunk or PREFILL_CHUNK)
            mc = max_context if max_context is not None else min(4096, c.max_position_embeddings)
            tmax = min(chunk, mc)
            ws = workspace_peaks(c, mc, tmax)
            a = mem.authority
            self.plan = make_plan(c, checkpoint.tensors, a.budget,
                                  budget_source=(a.budget_source.kind, a.budget_source.detail),
                                  max_context=max_context, slots=slots, granularity=mem.granularity, workspace=ws,
                                  h2d_gbps=h2d_gbps, legacy=mem.legacy, prefill_chunk=chunk,
                                  sources={"granularity": "explicit", "workspace": "inferred"}, quantize=quantize)
            self._build(checkpoint, tmax, progress)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------ load
    def _build(self, ck, tmax, progress) -> None:
        from .execution.kv import KVCache
        from .execution.ops import make_ops
        from .execution.step import Activations, Step
        from .execution.weights import Streamer, Weights
        from .memory.transaction import Transaction
        mem, d, plan, a = self.memory, self.driver, self.plan, self.memory.authority
        # Admission: grant every role its planned bytes first; a refusal changes nothing (I9).
        with Transaction() as tx:
            for role, n in plan.leases().items():
                if n:
                    lease = a.lease(self.holder, role)
                    before = lease.granted
                    a.grant(lease, n)
                    tx.on_undo(a.restore_grant, lease, before)
        self.ops = ops = make_ops(d)
        self.S = d.stream_create("compute")
        self._streams.append(self.S)
        self.C = d.stream_create("copy")
        self._streams.append(self.C)
        for s in self._streams:
            mem.track_stream(s)
        self.weights = Weights(mem, ops, plan, ck, self.holder, self.C, progress=progress)
        self.kv = KVCache(mem, ops, self.config, plan, self.holder)
        self.acts = Activations(mem, ops, self.config, plan, self.holder, tmax)
        self._blocks.append(self.acts.block)
        if self.weights.experts is not None:
            v = self.acts.views(1)
            self.weights.experts.bind((v.expert_loc, v.expert_counts, v.expert_stats))
        ws = plan.workspace["session"]
        self.ws_block = mem.allocate(ws, role="workspace_session", holder=self.holder, arena="workspace") \
            if ws else None
        if self.ws_block is not None:
            self._blocks.append(self.ws_block)
        self.ws_session = ops.view(self.ws_block.va, (ws,), np.uint8) if ws else None
        # pinned staging for the few host <-> device transfers of a generate call
        c = self.config
        lay, off = {}, 0
        for name, n in (("ids", 4 * tmax), ("pos", 4 * tmax), ("scalars", 16), ("rng", 32),
                        ("inv_freq", 2 * c.head_dim), ("tokens", 4 * plan.max_context), ("logits", 4 * c.vocab_size)):
            lay[name] = off
            off = -(-(off + n) // 256) * 256
        self._staging = d.host_alloc(off)
        self._lay = lay
        self.streamer = Streamer(d, self.S, self.C, self.weights.streamed, plan.slot_count)
        self.step = Step(ops, self.S, self.weights, self.kv, self.acts, self.streamer, self.config, self.ws_session)
        # constants: RoPE frequencies (computed as transformers does)
        from vmmstream.kernels.rope import rope_inv_freq
        inv = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        self._h2d(self.acts.addr("inv_freq"), "inv_freq", inv)
        # warm-up: one eager decode step compiles and loads every decode kernel before the capture
        self._set_scalars(token=0, position=0, length=1)
        self._eager(lambda: self.step.decode(None, timed=True))
        d.stream_synchronize(self.S)
        self._graph(None)
        ex = self.weights.experts
        if ex is not None:          # the warm-up step's routing (token 0 at position 0) is not the user's
            d.stream_synchronize(self.S)
            ex.reset_counters()

    # -------------------------------------------------------------------------------- small helpers
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
        self._counters["eager_steps"] += 1
        self._counters["page_ins"] += n
        if n:
            self._counters["page_in_bytes"] += self.weights.streamed_payload
        if n and self.streamer.timed:
            self._counters["h2d_ms"] += self.streamer.copy_ms()
            self._counters["h2d_timed_bytes"] += self.weights.streamed_payload

    def _graph(self, sampling):
        from .execution.graph import DecodeGraph
        g = self._graphs.get(sampling)
        if g is None:
            before = self.streamer.issued
            g = DecodeGraph(self.driver, self.S, lambda: self.step.decode(sampling), key=sampling)
            self._copies_per_replay = self.streamer.issued - before
            self._graphs[sampling] = g
            self._counters["graph_captures"] += 1
        return g

    # ---------------------------------------------------------------------------------- generation
    def generate(self, prompt, max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, eos_token_id: int | None = None, return_logits: bool = False):
        """Continue ``prompt`` (token ids, or text when the checkpoint has ``tokenizer.json``).

        Greedy when ``temperature`` <= 0, else a draw from softmax(logits / temperature) restricted by top-k
        then top-p (seeded: the same seed gives the same tokens). Returns the new token ids (or the new
        text for a text prompt), stopping after ``eos_token_id`` when given; with ``return_logits`` also the
        fp32 logits of every new token ``[n_new, vocab]``.
        """
        self._check_open()
        text = isinstance(prompt, str)
        if text:
            tok = self.tokenizer
            if tok is None:
                raise VmmstreamError(f"{self.path} has no tokenizer.json; pass token ids instead of text")
            ids = tok.encode(prompt).ids
        else:
            ids = [int(i) for i in prompt]
        n, m, v = len(ids), int(max_new_tokens), self.config.vocab_size
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if m < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {v})")
        mc = self.plan.max_context
        if n + m > mc:
            raise ContextLengthError(
                f"prompt of {n} tokens + max_new_tokens {m} = {n + m} positions exceeds max_context {mc}, the "
                "KV cache this model was loaded with; load it with a larger max_context or ask for fewer tokens",
                requested=n + m, max_context=mc)
        sampling = None if temperature <= 0 else (float(temperature), int(top_k), float(top_p))
        d, cnt = self.driver, self._counters
        self.kv.ensure(n + m)                                # the only VMM calls of a generate call
        if sampling is not None:
            from vmmstream.kernels.sampling import make_rng_state
            self._h2d(self.acts.addr("rng"), "rng", make_rng_state(seed))
        logits = []
        self._prefill(ids, sampling)
        if return_logits:
            logits.append(self._read_logits())
        graph = self._graph(sampling)
        vmm0 = d.vmm_call_count()
        t0, t1 = self._timing_events()
        d.event_record(t0, self.S)
        for _ in range(m - 1):
            graph.replay()
            if return_logits:
                logits.append(self._read_logits())
        d.event_record(t1, self.S)
        d.stream_synchronize(self.S)
        cnt["vmm_calls_decode"] += d.vmm_call_count() - vmm0
        cnt["decode_tokens"] += m - 1
        cnt["graph_replays"] += m - 1
        cnt["generate_calls"] += 1
        if m > 1:
            cnt["decode_ms"] += d.event_elapsed_ms(t0, t1)
            cnt["decode_timed_tokens"] += m - 1
        cnt["page_ins"] += (m - 1) * self._copies_per_replay
        cnt["page_in_bytes"] += (m - 1) * (self.weights.streamed_payload if self._copies_per_replay else 0)
        out = self._read_tokens(n, m)
        if eos_token_id is not None and eos_token_id in out:
            out = out[:out.index(eos_token_id) + 1]
            if return_logits:
                logits = logits[:len(out)]
        result = self.tokenizer.decode(out) if text else out
        if self.rebalance_experts_auto:
            self.rebalance_experts()
        return (result, np.stack(logits)) if return_logits else result

    # Routing drifts: after a generate call, the resident experts are re-chosen by routing counts when that
    # raises the share of routings that hit the device by at least REBALANCE_GAIN (and enough were seen).
    REBALANCE_GAIN = 0.05
    REBALANCE_MIN_ROUTINGS = 64
    rebalance_experts_auto = True

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

    def _timing_events(self):
        if not hasattr(self, "_tev"):
            self._tev = (self.driver.event_create(True), self.driver.event_create(True))
        return self._tev

    def _prefill(self, ids, sampling) -> None:
        """Eager prefill in chunks of the activation buffers' size; the last chunk selects the first new token."""
        d, plan, n = self.driver, self.plan, len(ids)
        tmax = self.acts.tmax
        ws_step, ws_view = None, None
        if plan.workspace["step"]:
            ws_step = self.memory.allocate(plan.workspace["step"], role="workspace_step", holder=self.holder,
                                           arena="workspace")
            ws_view = self.ops.view(ws_step.va, (plan.workspace["step"],), np.uint8)
        try:
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
                self._counters["prefill_tokens"] += t
        finally:
            if ws_step is not None:       # step workspace lives for the step only (I8), even on an exception
                self.memory.free(ws_step)  # fenced: unmapped once the queued prefill work is done

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

    # ------------------------------------------------------------------------------- observability
    @property
    def tokenizer(self):
        if not hasattr(self, "_tokenizer"):
            from .model import load_tokenizer
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    def stats(self) -> dict:
        """Counters since load. Times are device time from CUDA events (I11); on the host backend they are
        host wall time of the emulated streams. Page-ins count copies enqueued (eager steps) and copies in
        the graph times its replays."""
        c, p, snap = dict(self._counters), self.plan, self.memory.snapshot()
        resident = sum(x.payload for x in p.placements if x.where == "resident")
        per_token = resident + p.streamed_bytes_per_token
        h2d_gbps = c["h2d_timed_bytes"] / (c["h2d_ms"] * 1e6) if c["h2d_ms"] > 0 else None
        dec_tps = c["decode_timed_tokens"] / (c["decode_ms"] / 1e3) if c["decode_ms"] > 0 else None
        steps = c["eager_steps"] + c["graph_replays"]
        out = {
            "strategy": p.strategy, "backend": self.backend,
            "prefill_tokens": c["prefill_tokens"], "decode_tokens": c["decode_tokens"],
            "graph_captures": c["graph_captures"], "graph_replays": c["graph_replays"],
            "graph_nodes": {str(k): g.node_count for k, g in self._graphs.items()},
            "page_ins": c["page_ins"], "page_in_bytes": c["page_in_bytes"],
            "streamed_bytes_per_token": p.streamed_bytes_per_token,
            "measured_streamed_bytes_per_step": c["page_in_bytes"] / steps if steps else 0,
            "byte_hit_rate": resident / per_token if per_token else 1.0,
            "h2d_device_ms": c["h2d_ms"], "h2d_timed_bytes": c["h2d_timed_bytes"], "h2d_gbps": h2d_gbps,
            "decode_device_ms": c["decode_ms"], "decode_tokens_per_s": dec_tps,
            "tokens_per_s_bound": (h2d_gbps * 1e9 / p.streamed_bytes_per_token
                                   if h2d_gbps and p.streamed_bytes_per_token else None),
            "vmm_calls": snap["vmm_calls_total"], "vmm_calls_decode": c["vmm_calls_decode"],
            "vmm_calls_per_decode_token": (c["vmm_calls_decode"] / c["decode_tokens"]
                                           if c["decode_tokens"] else 0.0),
            "kv_committed": self.kv.committed if self.kv else 0, "kv_grows": self.kv.grows if self.kv else 0,
            "committed": snap["committed"], "peak_committed": snap["peak_committed"], "budget": snap["budget"],
            "held": snap["by_holder"].get(self.holder, 0),
            "quantization": self.quantization,
        }
        ex = self.weights.experts if self.weights is not None else None
        if ex is not None:
            self.driver.stream_synchronize(self.S)
            k, dec = ex.counters, c["decode_tokens"]
            out.update({
                "expert_hits": k["decode_hits"] + k["prefill_hits"],
                "expert_misses": k["decode_misses"] + k["prefill_misses"],
                "expert_hit_rate": (1.0 if not ex.on_demand else (k["decode_hits"] + k["prefill_hits"])
                                    / max(1, sum(k[x] for x in ("decode_hits", "prefill_hits", "decode_misses",
                                                                "prefill_misses")))),
                "experts_resident": ex.n_pool, "expert_slots": ex.n_slots,
                "experts_streamed_per_token": k["decode_misses"] / dec if dec else 0.0,
                "expert_bytes_per_token": k["decode_bytes"] / dec if dec else 0.0,
                "expert_bytes_gathered": k["decode_bytes"] + k["prefill_bytes"],
                "expert_rebalances": k["rebalances"], "expert_units_moved": k["units_moved"],
            })
        return out

    @property
    def quantization(self) -> dict | None:
        """With ``quantize``: kind, weights quantized, bytes before and after, and the round-trip error."""
        if self.weights is None or self.plan.quantization is None:
            return None
        return self.weights.quant.to_dict()

    def memory_report(self) -> str:
        s = self.stats()
        lines = [f"model {self.path.name}  ({self.holder}, {self.backend})", self.memory.report(), "",
                 f"strategy {s['strategy']}: {format_bytes(self.plan.resident_bytes)} resident, "
                 f"{format_bytes(s['streamed_bytes_per_token'])} streamed per token through "
                 f"{self.plan.slot_count} slots; byte hit rate {s['byte_hit_rate']:.1%}",
                 f"kv cache committed {format_bytes(s['kv_committed'])} of {format_bytes(self.plan.kv_bytes)}",
                 f"tokens: {s['prefill_tokens']} prefill, {s['decode_tokens']} decode; graph replays "
                 f"{s['graph_replays']}, captures {s['graph_captures']}; VMM calls per decode token "
                 f"{s['vmm_calls_per_decode_token']:g}"]
        return "\n".join(lines)

    def __repr__(self):
        return f"Model({self.path.name}, {self.plan.strategy if hasattr(self, 'plan') else '?'}, {self.backend})"

    # ------------------------------------------------------------------------------------ teardown
    def _check_open(self) -> None:
        if self.closed:
            raise VmmstreamError("the model is closed")

    def close(self) -> None:
        """Release everything the model holds (fenced: after its queued work). Idempotent."""
        if self.closed:
            return
        self.closed = True
        mem, d = self.memory, self.driver
        errors = []

        def attempt(fn, *args):
            try:
                fn(*args)
            except Exception as exc:        # keep releasing; report the first failure at the end
                errors.append(exc)

        if not mem.closed and not _capturing():
            for s in self._streams:
                attempt(d.stream_synchronize, s)
        for g in self._graphs.values():
            attempt(g.close)
        self._graphs.clear()
        if self.streamer is not None:
            attempt(self.streamer.close)
        if hasattr(self, "_tev"):
            for e in self._tev:
                attempt(d.event_destroy, e)
        if self.weights is not None:
            attempt(self.weights.close)
        if self.kv is not None:
            attempt(self.kv.close)
        if not mem.closed:
            for b in self._blocks:
                attempt(mem.free, b)
            attempt(mem.synchronize)
            for s in self._streams:
                mem.untrack_stream(s)
        for s in self._streams:
            attempt(d.stream_destroy, s)
        if self._staging:
            attempt(d.host_free, self._staging)
            self._staging = 0
        a = mem.authority
        for role in ROLES_PLANNED:
            lease = a.leases.get((self.holder, role))
            if lease is not None and lease.committed == 0:
                del a.leases[(self.holder, role)]
            elif lease is not None:
                a.shrink(lease)
        if self._owns_memory and not mem.closed and not mem.blocks:
            attempt(mem.close)
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):  # a backstop only: close() is the way
        try:
            if not getattr(self, "closed", True):
                self.close()
        except Exception:
            pass


def workspace_peaks(config, max_context: int, tmax: int) -> dict:
    """Workspace peaks per lifetime class, from each kernel's ``workspace_requirement`` at the planned shapes.

    The kernels of one stream run in order, so one buffer of the largest need serves each class (max, not sum).
    """
    from vmmstream.kernels import attention_decode, attention_prefill, sampling
    c = config
    session = max(attention_decode.workspace_requirement(1, c.num_attention_heads, c.num_key_value_heads,
                                                         c.head_dim, max_context).bytes,
                  sampling.workspace_requirement(1, c.vocab_size, "greedy").bytes,
                  sampling.workspace_requirement(1, c.vocab_size, "sample").bytes)
    step = attention_prefill.workspace_requirement(tmax, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                                   start_pos=max_context - tmax).bytes
    if getattr(c, "is_moe", False):
        # expert routing + h: decode (inside the graph: session lifetime) over the k slots or a layer's experts,
        # prefill rounds over the k slots
        from vmmstream.kernels import moe
        k, n = c.num_experts_per_tok, max(c.num_experts_per_tok, c.num_experts)
        session = max(session, moe.workspace_requirement(1, k, n, c.moe_intermediate_size).bytes)
        step = max(step, moe.workspace_requirement(tmax, k, n, c.moe_intermediate_size).bytes)
    return {"step": int(step), "session": int(session)}


def _check_cuda_shapes(c) -> None:
    from vmmstream.kernels import attention_decode
    from .model import UnsupportedModelError
    if c.is_moe and (c.num_experts > 128 or c.num_experts_per_tok > 8 or c.hidden_size % 8
                     or c.moe_intermediate_size % 8):
        raise UnsupportedModelError(
            f"{c.architecture}: the CUDA MoE kernels take at most 128 experts, top-k <= 8, and hidden and expert "
            "sizes that are multiples of 8")
    g = c.num_attention_heads // c.num_key_value_heads
    if c.head_dim not in attention_decode.HEAD_DIMS or g > attention_decode.MAX_GROUP:
        raise UnsupportedModelError(
            f"head_dim {c.head_dim} with {g} query heads per KV head: the CUDA decode attention takes head_dim in "
            f"{attention_decode.HEAD_DIMS} and at most {attention_decode.MAX_GROUP} query heads per KV head")


def _capturing() -> bool:
    from .driver import GATE
    return GATE.open
