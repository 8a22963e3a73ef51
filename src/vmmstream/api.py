"""``load_model`` and ``Model``: a Hugging Face checkpoint run under a device memory budget.

    with vmmstream.load_model("path/to/checkpoint", budget="2GiB") as model:
        print(model.plan)                                 # what fits, what streams, and why
        ids = model.generate([1, 2, 3], max_new_tokens=64)  # greedy by default
        print(model.stats())

This is the public face; the work is done below it. ``vmmstream.loading``: checkpoint headers (typed errors
before anything is allocated) -> plan (workspace peaks asked of the kernels at the planned shapes, granularity
from the driver) -> leases granted for the whole plan (CapacityError before any allocation, I9) -> the placement
(weights: pinned host copies, resident pages, slots aliased at streamed VAs; KV range, workspace, activations).
``vmmstream.execution.engine``: streams, one eager decode step (warm-up), the decode graph, and per generate
call the KV cache committed for prompt + new tokens (the only VMM calls), prefill eagerly in chunks, every
further token one replay of the captured decode step. A failure anywhere in a load releases everything taken
so far.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from .budget import format_bytes
from . import validate
from .errors import Attempts, ContextLengthError, VmmstreamError
from .execution.engine import Engine
from .loading import Placement, admit, plan_model, prepare, release_leases
from .loading import workspace_peaks  # noqa: F401  (re-exported: imported from here by tests and scripts)

_ids = itertools.count(1)


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
    max_context = validate.optional_integer("max_context", max_context, lo=1)
    slots = validate.optional_integer("slots", slots, lo=2, what="an integer >= 2 (streaming needs two slots)")
    prefill_chunk = validate.optional_integer("prefill_chunk", prefill_chunk, lo=1)
    if h2d_gbps is not None:
        h2d_gbps = validate.real("h2d_gbps", h2d_gbps, lo=0.0, lo_open=True)
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise TypeError(f"progress={progress!r}: expected True, False, None or a callable(done_bytes, total_bytes)")
    ck, memory = prepare(path, budget, memory=memory, backend=backend, quantize=quantize)
    return Model(ck, memory, max_context=max_context, slots=slots, progress=progress, h2d_gbps=h2d_gbps,
                 prefill_chunk=prefill_chunk, quantize=quantize)


class Model:
    """A loaded model: its plan, the placement of its bytes, and the engine that runs on them; ``close()`` (or
    leaving the ``with`` block) releases them. Safe to share between threads: the calls of every model on one
    device memory run one at a time (I12), never interleaved."""

    # After a generate call, re-choose the resident experts when routing has drifted (``Engine`` has the policy).
    rebalance_experts_auto = True

    def __init__(self, checkpoint, memory, *, max_context=None, slots=None, progress=None, h2d_gbps=None,
                 prefill_chunk=None, quantize=None):
        """``memory`` counts this model among its users already (``loading.prepare`` did); ``close()`` gives that
        back, also when this constructor fails."""
        self.path = Path(checkpoint.path)
        self.config = checkpoint.config
        self.memory = memory
        self.driver = memory.driver
        self.backend = self.driver.backend
        self.holder = f"model{next(_ids)}:{self.path.name}"
        self._lock = memory.lock
        self.closed = False
        self.engine = None
        self.placement = Placement(memory, self.holder)         # holds nothing until placed
        with self._lock:
            try:
                self.plan, tmax = plan_model(checkpoint, memory, max_context=max_context, slots=slots,
                                             h2d_gbps=h2d_gbps, prefill_chunk=prefill_chunk, quantize=quantize)
                admit(memory.authority, self.holder, self.plan)
                self.engine = Engine(memory, self.holder, self.config, self.plan)
                self.placement.place(checkpoint, self.plan, tmax, self.engine.ops, self.engine.C,
                                     progress=progress)
                self.engine.start(self.placement)
            except BaseException:
                self.close()
                raise

    @property
    def weights(self):
        return self.placement.weights

    @property
    def kv(self):
        return self.placement.kv

    @property
    def acts(self):
        return self.placement.acts

    # ---------------------------------------------------------------------------------- generation
    def generate(self, prompt, max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, eos_token_id=None, return_logits: bool = False):
        """Continue ``prompt`` (token ids, or text when the checkpoint has ``tokenizer.json``).

        Greedy when ``temperature`` is 0, else a draw from softmax(logits / temperature) restricted by top-k (0:
        no limit) then top-p (in (0, 1]), seeded: the same ``seed`` (an integer in [0, 2**64)) gives the same
        tokens. Returns the new token ids (or the new text for a text prompt). ``eos_token_id`` (one id or a list
        of them): decoding stops after the first of them, which is the last token returned. With
        ``return_logits`` also the fp32 logits of every new token ``[n_new, vocab]``.

        Safe to call from several threads: calls on models that share the device's memory run one at a time.
        """
        v = self.config.vocab_size
        max_new_tokens = validate.integer("max_new_tokens", max_new_tokens, lo=1)
        temperature = validate.real("temperature", temperature, lo=0.0, what="a finite number >= 0 (0: greedy)")
        top_k = validate.integer("top_k", top_k, lo=0, what="an integer >= 0 (0: no limit)")
        top_p = validate.real("top_p", top_p, lo=0.0, hi=1.0, lo_open=True)
        seed = validate.integer("seed", seed, lo=0, hi=2**64 - 1)
        stop = validate.token_id_set("eos_token_id", eos_token_id, v)
        return_logits = validate.boolean("return_logits", return_logits)
        text = isinstance(prompt, str)
        with self._lock:
            self._check_open()
            if text:
                tok = self.tokenizer
                if tok is None:
                    raise VmmstreamError(f"{self.path} has no tokenizer.json; pass token ids instead of text")
                ids = tok.encode(prompt).ids
                if not ids:
                    raise ValueError("prompt: the text encodes to no tokens; give a longer prompt")
            else:
                ids = validate.token_ids("prompt", prompt, v)
            n, m, mc = len(ids), max_new_tokens, self.plan.max_context
            if n + m > mc:
                raise ContextLengthError(
                    f"prompt of {n} tokens + max_new_tokens {m} = {n + m} positions exceeds max_context {mc}, the "
                    "KV cache this model was loaded with; load it with a larger max_context or ask for fewer "
                    "tokens", requested=n + m, max_context=mc)
            sampling = None if temperature == 0 else (temperature, top_k, top_p)
            out, logits = self.engine.run(ids, m, sampling=sampling, seed=seed, return_logits=return_logits,
                                          stop=stop)
            result = self.tokenizer.decode(out) if text else out
            if self.rebalance_experts_auto:
                self.engine.rebalance_experts()
        return (result, logits) if return_logits else result

    def rebalance_experts(self, *, force: bool = False) -> int:
        """Re-choose the resident experts from the routing counts so far (prefill and decode); returns the
        number of experts moved. Outside any graph: the units are copied and the location table rewritten,
        and the captured decode graph reads the table when it runs, so nothing is recaptured."""
        with self._lock:
            self._check_open()
            return self.engine.rebalance_experts(force=force)

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
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        c, p, snap = dict(self.engine.counters), self.plan, self.memory.snapshot()
        resident = sum(x.payload for x in p.placements if x.where == "resident")
        per_token = resident + p.streamed_bytes_per_token
        h2d_gbps = c["h2d_timed_bytes"] / (c["h2d_ms"] * 1e6) if c["h2d_ms"] > 0 else None
        dec_tps = c["decode_timed_tokens"] / (c["decode_ms"] / 1e3) if c["decode_ms"] > 0 else None
        steps = c["eager_steps"] + c["graph_replays"]
        out = {
            "strategy": p.strategy, "backend": self.backend,
            "prefill_tokens": c["prefill_tokens"], "decode_tokens": c["decode_tokens"],
            "graph_captures": c["graph_captures"], "graph_replays": c["graph_replays"],
            "graph_nodes": {str(k): g.node_count for k, g in self.engine.graphs.items()},
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
            self.engine.synchronize()
            k, dec = ex.counters, c["graph_replays"]   # per token the device decoded
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
        with self._lock:
            return self._memory_report()

    def _memory_report(self) -> str:
        s = self._stats()
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
        """Release everything the model holds (fenced: after its queued work); the process's shared memory
        closes with the last model on it. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            mem = self.memory
            attempt = Attempts()
            # The engine stops first and closes last: the memory fences the placement's frees on its streams.
            if self.engine is not None:
                attempt(self.engine.stop)
            attempt(self.placement.close)
            if self.engine is not None:
                attempt(self.engine.close)
            release_leases(mem.authority, self.holder)
            mem.models -= 1
            if mem.closes_with_models and mem.models == 0 and not mem.closed and not mem.blocks:
                attempt(mem.close)
            attempt.raise_first()

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
