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

import dataclasses
import itertools
import threading
from pathlib import Path

from . import chat as chat_mod
from . import validate
from .budget import format_bytes
from .driver import GATE
from .errors import Attempts, ContextLengthError, VmmstreamError
from .execution.engine import Engine
from .generation import (  # noqa: F401  (public: re-exported with vmmstream.Token)
    Token,
    TokenStream,
    _Generation,
    _is_empty_sequence,
    _options,
    _Request,
)
from .interrupts import uninterruptible
from .loading import (
    Placement,
    admit,
    plan_model,
    prepare,
    release_leases,
    stored_quantization,
    workspace_peaks,  # noqa: F401  (re-exported: imported from here by tests and scripts)
)
from .batching import is_prompt_list
from .text import check_stop_strings

_ids = itertools.count(1)
# Below this a draw is greedy in effect; far below it (< 3e-39) 1 / T overflows the sampling kernel's fp32 scores
# into NaN and a wrong token. Such a temperature is refused: 0 asks for greedy.
MIN_TEMPERATURE = 1e-3


def load_model(path, budget=None, *, max_context: int | None = None, slots: int | None = None,
               backend: str | None = None, memory=None, progress=None, h2d_gbps: float | None = None,
               prefill_chunk: int | None = None, quantize: str | None = None, max_batch: int | None = None) -> Model:
    """Load the checkpoint at ``path`` to run within ``budget`` device bytes.

    ``budget``: bytes, ``"6GiB"``, ``"80%"``, ``0.8`` or ``"auto"`` (default: ``VMMSTREAM_BUDGET``, else auto).
    ``max_context``: positions the KV cache holds (default min(4096, max_position_embeddings, sliding_window)).
    ``slots``: streaming slots K >= 2 (default 2). ``backend``: ``cuda``, ``host`` or ``auto``.
    ``memory``: a ``DeviceMemory`` to use instead of the process's shared one (tests, custom drivers).
    ``progress``: True / False / a callable(done_bytes, total_bytes); default: a progress line on long loads.
    ``quantize``: ``"int4"`` (group 128, fp16 scale and zero point) or ``"mxfp4"`` (OCP MX, 32-element
    blocks) stores the layers' linear weights quantized, quantized on the host while loading; the plan,
    the streamed bytes and the bound use the quantized sizes, ``model.quantization`` reports the error.
    ``max_batch``: sequences one decode step may advance together (``generate`` given a list of prompts); the
    plan holds a KV range of ``max_context`` positions for each, whose pages are committed for the sequence's
    prompt and new tokens when it joins and unmapped when it ends.
    Raises ``CheckpointError`` / ``UnsupportedModelError`` (bad checkpoint), ``BudgetError`` (bad budget),
    ``CapacityError`` (no plan fits, or the memory is taken), ``DriverError``; nothing stays allocated.
    """
    max_context = validate.optional_integer("max_context", max_context, lo=1)
    slots = validate.optional_integer("slots", slots, lo=2, what="an integer >= 2 (streaming needs two slots)")
    prefill_chunk = validate.optional_integer("prefill_chunk", prefill_chunk, lo=1)
    max_batch = validate.optional_integer("max_batch", max_batch, lo=1)
    if h2d_gbps is not None:
        h2d_gbps = validate.real("h2d_gbps", h2d_gbps, lo=0.0, lo_open=True)
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise TypeError(f"progress={progress!r}: expected True, False, None or a callable(done_bytes, total_bytes)")
    ck, memory = prepare(path, budget, memory=memory, backend=backend, quantize=quantize)
    return Model(ck, memory, max_context=max_context, slots=slots, progress=progress, h2d_gbps=h2d_gbps,
                 prefill_chunk=prefill_chunk, quantize=quantize, max_batch=max_batch)


class Model:
    """A loaded model: its plan, the placement of its bytes, and the engine that runs on them; ``close()`` (or
    leaving the ``with`` block) releases them. Safe to share between threads: the calls of every model on one
    device memory run one at a time (I12), never interleaved.

    Generation: ``generate`` (ids or text), ``stream`` (the same, token by token with its text), ``chat``
    (messages through the checkpoint's chat template), ``render_chat``; ``eos_token_ids`` are the checkpoint's
    end-of-sequence ids, where decoding stops by default."""

    # After a generate call, re-choose the resident experts when routing has drifted (``Engine`` has the policy).
    rebalance_experts_auto = True

    def __init__(self, checkpoint, memory, *, max_context=None, slots=None, progress=None, h2d_gbps=None,
                 prefill_chunk=None, quantize=None, max_batch=None):
        """``memory`` counts this model among its users already (``loading.prepare`` did); ``close()`` gives that
        back, also when this constructor fails."""
        self.path = Path(checkpoint.path)
        self.config = checkpoint.config
        self.memory = memory
        self.driver = memory.driver
        self.backend = self.driver.backend
        self.holder = f"model{next(_ids)}:{self.path.name}"
        self._lock = memory.lock
        self._engine_free = threading.Condition(self._lock)   # a stream that held the engine ended
        self._active = None                                    # the _Generation running on the engine
        self.closed = False
        self.engine = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.placement = Placement(memory, self.holder)         # holds nothing until placed
        with self._lock:
            try:
                from .model.companions import read_eos_token_ids
                self.eos_token_ids = read_eos_token_ids(self.path, self.config.vocab_size)
                quantize = stored_quantization(checkpoint, quantize)
                self.plan, tmax = plan_model(checkpoint, memory, max_context=max_context, slots=slots,
                                             h2d_gbps=h2d_gbps, prefill_chunk=prefill_chunk, quantize=quantize,
                                             batch=max_batch)
                if self.plan.batch > tmax:
                    raise ValueError(f"max_batch={self.plan.batch}: a decode step of that many sequences uses one "
                                     f"row of the {tmax}-token prefill buffers each; raise prefill_chunk or "
                                     "max_context, or lower max_batch")
                if checkpoint.notes:      # what loading this checkpoint's format does, beside the plan's own notes
                    self.plan = dataclasses.replace(self.plan, notes=self.plan.notes + tuple(checkpoint.notes))
                admit(memory.authority, self.holder, self.plan)
                self.engine = Engine(memory, self.holder, self.config, self.plan)
                self.placement.place(checkpoint, self.plan, tmax, self.engine.ops, self.engine.C,
                                     progress=progress)
                self.engine.start(self.placement)
            except BaseException as exc:
                try:
                    self.close()
                except BaseException as failed:      # the load's own error is the one to see
                    exc.add_note(f"and releasing what the load had taken failed too: {failed!r}")
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
                 top_p: float = 1.0, seed: int = 0, eos_token_id=None, stop=None, return_logits: bool = False):
        """Continue ``prompt`` (token ids, or text when the checkpoint has ``tokenizer.json``).

        Greedy when ``temperature`` is 0, else a draw from softmax(logits / temperature) restricted by top-k (0:
        no limit) then top-p (in (0, 1]), seeded: the same ``seed`` (an integer in [0, 2**64)) gives the same
        tokens. Returns the new token ids (or the new text for a text prompt). With ``return_logits`` also the
        fp32 logits of every new token ``[n_new, vocab]``.

        ``eos_token_id``: decoding stops after the first of these ids, which is the last token returned. None
        (the default): the checkpoint's end-of-sequence ids (``model.eos_token_ids``: ``generation_config.json``,
        else ``config.json``); one id or a list of them; ``[]``: none, every ``max_new_tokens`` is decoded.
        ``stop``: a string or a list of them (needs the tokenizer): decoding stops once the new text contains
        one; the text returned ends before it. For a token-id prompt the ids returned end with the token that
        completed the stop string.

        A list of prompts (each ids or text) on a model loaded with ``max_batch`` > 1: one result per prompt,
        decoded together, up to ``max_batch`` sequences a step, a prompt joining as a slot frees; each gets what it
        gets alone with the same arguments (``seed`` may be a list, one per prompt).

        Safe to call from several threads: calls on models that share the device's memory run one at a time.
        """
        if is_prompt_list(prompt):
            from .batching import generate_many
            return generate_many(self, prompt, max_new_tokens, eos_token_id=eos_token_id, stop=stop,
                                 return_logits=return_logits, seed=seed,
                                 sampling=dict(temperature=temperature, top_k=top_k, top_p=top_p))
        req = self._request(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, eos_token_id=eos_token_id, stop=stop, return_logits=return_logits,
                            want_text=isinstance(prompt, str) or bool(stop))
        g = self._complete(req)
        result = g.text.text if isinstance(prompt, str) else list(g.run.tokens)
        return (result, g.run.logits_array()) if return_logits else result

    def _complete(self, req: _Request) -> _Generation:
        """Run ``req`` to its end with the lock held throughout: the same ``_Generation`` a stream advances, in
        the engine's blocks (with stop ids or strings: the first token, then ``STOP_CHECK_TOKENS`` replays a
        read; without: every replay, then one read)."""
        stops = bool(req.eos or req.stop)
        block = self.engine.STOP_CHECK_TOKENS if stops else req.max_new_tokens
        with self._lock:
            self._take_engine()
            g = _Generation(self, req)
            try:
                if stops:
                    g.step(0)                       # the prefill's token: it may be a stop already
                while not g.run.done:
                    g.step(block)
            finally:
                g.close()
            g.after()
        return g

    def stream(self, prompt, max_new_tokens: int = 32, **options) -> TokenStream:
        """``generate`` handed out as it is produced: an iterator of ``Token(id, text, logits)``, one per new
        token, in order. Same arguments as ``generate``.

        ``text`` is the text the token adds (None when the checkpoint has no tokenizer): it may be "" while the
        token ends inside a UTF-8 character or inside what may become a stop string, and the held text comes
        with a later token, so the pieces join to ``tokenizer.decode(tokens)`` (cut before a stop string): the
        text ``generate`` returns. ``logits`` with ``return_logits``.

        Nothing runs until the first ``next()``: then the prompt is prefilled and its first token handed out;
        the next tokens come one replay of the decode graph at a time, then (after ``STREAM_FIRST_TOKENS``) in
        blocks of up to ``engine.STOP_CHECK_TOKENS`` replays sized so that a block takes about
        ``STREAM_BLOCK_SECONDS``. The model is this stream's until it ends: a call from another thread waits
        for it, a call from the thread that last advanced it ends it (advancing it again then raises), and
        ``close()`` (or leaving ``with model.stream(...) as s:``) ends it at once, and so does dropping the last
        reference to it (or, if the lock is busy then, the next call on the model). The model's lock is held
        only while a block runs, so models sharing the memory run between the blocks.
        """
        req = self._request(prompt, max_new_tokens, want_text=self.tokenizer is not None,
                            **_options("stream", options))
        return TokenStream(self, req)

    def chat(self, messages, max_new_tokens: int = 256, *, stream: bool = False, **options):
        """The assistant's answer to ``messages`` (a list of ``{"role": ..., "content": ...}``): the checkpoint's
        chat template rendered (``render_chat``) with the generation prompt, encoded without adding special
        tokens, and generated. Returns the answer's text (with ``return_logits``: and the logits), or with
        ``stream=True`` a ``TokenStream`` of it (``max_new_tokens`` and the whole conversation must fit
        ``max_context``: a ``ContextLengthError`` otherwise).
        ``options`` are ``generate``'s; ``eos_token_id`` defaults to the checkpoint's end-of-sequence ids and
        the id of ``tokenizer_config.json``'s ``eos_token`` (the template's end of turn)."""
        stream = validate.boolean("stream", stream)
        options = _options("chat", options)
        ids, eos = self.chat_prompt(messages)
        if options.get("eos_token_id") is None:
            options["eos_token_id"] = eos
        req = self._request(ids, max_new_tokens, want_text=True, **options)
        if stream:
            return TokenStream(self, req)
        g = self._complete(req)
        return (g.text.text, g.run.logits_array()) if req.return_logits else g.text.text

    def chat_prompt(self, messages) -> tuple[list, list]:
        """(the token ids ``chat`` generates from, its default stop ids): ``messages`` rendered by the chat template
        and encoded without added special tokens; the checkpoint's end-of-sequence ids and the template's end of
        turn (``tokenizer_config.json``'s ``eos_token``)."""
        tok = self._need_tokenizer("chat")
        ids = tok.encode(self.render_chat(messages), add_special_tokens=False).ids
        if not ids:
            raise ValueError("messages: the rendered chat encodes to no tokens")
        eos = list(self.eos_token_ids)
        end = chat_mod.special_tokens(self._tokenizer_config()).get("eos_token")
        end_id = tok.token_to_id(end) if end is not None else None
        if end_id is not None and end_id not in eos and end_id < self.config.vocab_size:
            eos.append(end_id)
        return ids, eos

    def render_chat(self, messages, *, add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text of ``messages`` in the checkpoint's chat template (``tokenizer_config.json``'s
        ``chat_template``, the one named "default" of a list, or ``chat_template.jinja``), rendered as
        transformers' ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` does.
        ``ChatTemplateError`` when there is none or it needs what is not given (tools, unknown globals)."""
        add_generation_prompt = validate.boolean("add_generation_prompt", add_generation_prompt)
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)

    @property
    def chat_template(self) -> chat_mod.ChatTemplate:
        """The checkpoint's chat template, compiled (``ChatTemplateError`` when it has none or it cannot be)."""
        if getattr(self, "_chat_template", None) is None:
            from .model.companions import read_chat_template
            source = chat_mod.select_template(read_chat_template(self.path))
            self._chat_template = chat_mod.ChatTemplate(source, chat_mod.special_tokens(self._tokenizer_config()))
        return self._chat_template

    def _tokenizer_config(self) -> dict:
        if getattr(self, "_tok_config", None) is None:
            from .model.companions import read_tokenizer_config
            self._tok_config = read_tokenizer_config(self.path)
        return self._tok_config

    def _need_tokenizer(self, what: str):
        tok = self.tokenizer
        if tok is None:
            raise VmmstreamError(f"{self.path} has no tokenizer.json; {what} needs it")
        return tok

    def _request(self, prompt, max_new_tokens, *, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                 eos_token_id=None, stop=None, return_logits=False, want_text=False) -> _Request:
        """The checked arguments of a generate / stream call (each refused with its name before any work)."""
        self._check_open()
        v = self.config.vocab_size
        max_new_tokens = validate.integer("max_new_tokens", max_new_tokens, lo=1)
        temperature = validate.real("temperature", temperature, lo=0.0, what="a finite number >= 0 (0: greedy)")
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature={temperature!r}: expected 0 (greedy) or at least {MIN_TEMPERATURE}")
        top_k = validate.integer("top_k", top_k, lo=0, what="an integer >= 0 (0: no limit)")
        if top_k >= v:                           # no limit: one decode graph for every such value
            top_k = 0
        top_p = validate.real("top_p", top_p, lo=0.0, hi=1.0, lo_open=True)
        seed = validate.integer("seed", seed, lo=0, hi=2**64 - 1)
        if eos_token_id is None:
            eos = frozenset(self.eos_token_ids)
        elif _is_empty_sequence(eos_token_id):
            eos = frozenset()
        else:
            eos = validate.token_id_set("eos_token_id", eos_token_id, v)
        stops = check_stop_strings(stop)
        return_logits = validate.boolean("return_logits", return_logits)
        if isinstance(prompt, str):
            tok = self.tokenizer
            if tok is None:
                raise VmmstreamError(f"{self.path} has no tokenizer.json; pass token ids instead of text")
            ids = tok.encode(prompt).ids
            if not ids:
                raise ValueError("prompt: the text encodes to no tokens; give a longer prompt")
            ids = validate.token_ids("prompt (as the tokenizer encoded it)", ids, v)
        else:
            ids = validate.token_ids("prompt", prompt, v)
        if stops and self.tokenizer is None:
            raise VmmstreamError(f"{self.path} has no tokenizer.json; stop strings need it to read the new tokens "
                                 "as text (pass eos_token_id for stop ids)")
        n, m, mc = len(ids), max_new_tokens, self.plan.max_context
        if n + m > mc:
            raise ContextLengthError(
                f"prompt of {n} tokens + max_new_tokens {m} = {n + m} positions exceeds max_context {mc}, the "
                "KV cache this model was loaded with; load it with a larger max_context or ask for fewer "
                "tokens", requested=n + m, max_context=mc)
        sampling = None if temperature == 0 else (temperature, top_k, top_p)
        return _Request(ids, m, sampling, seed, eos, stops, return_logits, want_text or bool(stops))

    def _take_engine(self, batch: bool = False) -> None:
        """With the lock held: make the engine free for a new generation. A stream that holds it is ended when
        it is gone (garbage) or was last advanced by this thread (which cannot wait for itself); one that another
        thread is consuming is waited for (the lock is let go meanwhile). A one-sequence generation (``batch``
        False) runs in the first KV slot, so it is refused while a batch decoder (a server's) holds sequences."""
        kv = self.placement.batch_kv
        if not batch and kv is not None and kv.owner is not None and kv.owner.active():
            raise VmmstreamError("the model is decoding a batch (a server's engine holds it): wait until its "
                                 "sequences end, or load the model again for one-sequence calls")
        while True:
            self._check_open()
            g = self._active
            if g is None:
                return
            # never hold the stream in a local while waiting: that reference alone would keep a dropped
            # stream alive, and this wait would never end
            alive = g.owner is not None and g.owner() is not None
            if not alive or g.thread == threading.get_ident():
                g.end("another call on the model from the same thread took the engine" if alive
                      else "the stream was dropped")
                continue
            del g
            self._engine_free.wait(0.05)

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
            from .model.companions import load_tokenizer
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
        steps = c["eager_steps"] + c["graph_replays"] + c["prefill_graph_replays"]
        out = {
            "strategy": p.strategy, "backend": self.backend,
            "prefill_tokens": c["prefill_tokens"], "decode_tokens": c["decode_tokens"],
            "graph_captures": c["graph_captures"], "graph_replays": c["graph_replays"],
            "prefill_graph_captures": c["prefill_graph_captures"], "prefill_graph_replays": c["prefill_graph_replays"],
            "batch_graph_captures": c["batch_graph_captures"], "batch_graph_replays": c["batch_graph_replays"],
            "eager_steps": c["eager_steps"], "packed_prefills": c["packed_prefills"],
            "graph_nodes": {str(k): g.node_count for k, g in self.engine.graphs.items()},
            "page_ins": c["page_ins"], "page_in_bytes": c["page_in_bytes"],
            "streamed_bytes_per_token": p.streamed_bytes_per_token,
            "measured_streamed_bytes_per_step": c["page_in_bytes"] / steps if steps else 0,
            "byte_hit_rate": resident / per_token if per_token else 1.0,
            "h2d_device_ms": c["h2d_ms"], "h2d_timed_bytes": c["h2d_timed_bytes"], "h2d_gbps": h2d_gbps,
            "decode_device_ms": c["decode_ms"], "decode_timed_tokens": c["decode_timed_tokens"],
            "decode_tokens_per_s": dec_tps,
            "tokens_per_s_bound": (h2d_gbps * 1e9 / p.streamed_bytes_per_token
                                   if h2d_gbps and p.streamed_bytes_per_token else None),
            "vmm_calls": snap["vmm_calls_total"], "vmm_calls_decode": c["vmm_calls_decode"],
            "vmm_calls_per_decode_token": (c["vmm_calls_decode"] / c["decode_tokens"]
                                           if c["decode_tokens"] else 0.0),
            "kv_committed": self.kv.committed if self.kv else 0, "kv_grows": self.kv.grows if self.kv else 0,
            "committed": snap["committed"], "peak_committed": snap["peak_committed"], "budget": snap["budget"],
            "held": snap["by_holder"].get(self.holder, 0),
            "quantization": self.quantization,
            "conversion": self.conversion,
            # prefill attention launches by the route that ran ("cudnn", our kernels' names; "reference": host)
            "prefill_attention_routes": dict(getattr(self.engine.ops, "attn_routes", {})),
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

    @property
    def conversion(self) -> dict | None:
        """How tensors stored in another form (GGUF block types, GPTQ / AWQ parts) became the device values: per
        stored format, the tensors, what they became (int4 / bf16), whether exactly, and the error against the
        stored values. None when every tensor loaded as stored (bf16) or converted as usual (f16 / f32)."""
        if self.weights is None or not self.weights.conversion.formats:
            return None
        return self.weights.conversion.to_dict()

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

    @uninterruptible()
    def close(self) -> None:
        """Release everything the model holds (fenced: after its queued work); the process's shared memory
        closes with the last model on it. Idempotent. A Ctrl-C meanwhile is raised once all is released."""
        with self._lock:
            if self.closed:
                return
            if getattr(self, "_active", None) is not None:
                self._active.end("the model was closed")
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
        # Never wait here (a collection can run on any thread, in the middle of another call), and never
        # release during a capture: then the memory's own close takes what is left.
        lock = getattr(self, "_lock", None)
        if getattr(self, "closed", True) or lock is None or GATE.open or not lock.acquire(blocking=False):
            return
        try:
            self.close()
        except BaseException:
            pass
        finally:
            lock.release()
