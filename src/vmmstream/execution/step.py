"""The op sequence of one step of a dense Llama / Mistral / Qwen2 decoder, for prefill (T tokens) and decode (1).

Per layer (x: the residual stream, xn: its normed copy):
    q, k, v = xn · Wq/k/vᵀ (+ bias)         gemm (prefill) | gemv (decode; one gemv_multi launch)
    rope(q, k) at the device positions; k, v appended to the cache at those positions (one launch)
    attn = attention(q, cache[:len])         prefill: causal from start_pos; decode: seq_len read on device
    proj = attn · Woᵀ;  x += proj; xn = norm(x) · post_ln             (one fused rmsnorm)
    gate, up = xn · Wg/Wuᵀ;  gate = silu(gate) · up;  proj = gate · Wdᵀ    (decode: gemv_gate_up_silu)
    x += proj; xn = norm(x) · (next layer's input_layernorm | model.norm)
then logits = xn[last] · lm_headᵀ (fp32). Weights are read in exactly ``config.decode_schedule()`` order;
every read of a streamed tensor is bracketed by the ``Streamer`` (wait for its copy, free its slot after).

Decode fuses q/k/v into one launch and gate/up/silu·mul into another when the group's streamed tensors
fit in the slots at once: a fused launch waits for all of them before it starts, and tensor i's copy is
issued only after tensor i - K is read, so a group of more than K streamed tensors could never be filled
(it then runs unfused). Fused and unfused give the same bits (the fused kernels round gate and up to bf16
before silu·mul, as the separate GEMVs store them).

Everything lives at a stable VA (weights, slots, KV, workspace, activations, device scalars), so the same
sequence is launched eagerly and inside a capture.
"""

from __future__ import annotations

import math

import numpy as np

from ..align import align_up
from ..errors import VmmstreamError
from . import experts as experts_mod


class Activations:
    """Named buffers for up to ``tmax`` tokens, sub-allocated in one block at a stable VA (role ``activations``)."""

    def __init__(self, mem, ops, config, plan, holder: str, tmax: int, sub: int | None = None):
        self.batch = max(1, int(getattr(plan, "batch", 1)))
        c = config
        h, qd, kvd, v = c.hidden_size, c.q_dim, c.kv_dim, c.vocab_size
        inter = max(c.intermediate_size, c.moe_intermediate_size, c.shared_expert_intermediate_size)
        self.tmax, self.ops = tmax, ops
        # A dense model's prefill walks ``tmax`` tokens through each layer (each weight read once for all of
        # them) but computes ``up`` and silu(gate)·up ``sub`` tokens at a time: only gate is walk-sized.
        self.sub = tmax if c.is_moe else min(tmax, sub or tmax)
        # name -> (per-token shape or fixed shape, dtype, scales with T: True (tmax rows), "sub" or False)
        self.spec = {
            "x": ((h,), np.uint16, True), "xn": ((h,), np.uint16, True), "proj": ((h,), np.uint16, True),
            "attn": ((qd,), np.uint16, True), "q": ((qd,), np.uint16, True), "k": ((kvd,), np.uint16, True),
            "v": ((kvd,), np.uint16, True), "gate": ((inter,), np.uint16, True), "up": ((inter,), np.uint16, "sub"),
            "ids": ((), np.int32, True), "pos": ((), np.int32, True),
            "prow": ((), np.int32, True),            # a packed prefill's KV cache row of each token
            # decode state, one row per sequence of a batch (a one-sequence step uses row 0)
            "logits": ((v,), np.float32, "batch"),
            "next": ((), np.int32, "batch"), "inp": ((), np.int32, "batch"),
            "positions": ((), np.int32, "batch"), "lens": ((), np.int32, "batch"),
            "rows": ((), np.int32, "batch"),          # KV cache row of each sequence's new token (batch)
            "rng_rows": ((4,), np.uint64, "batch"),   # each sequence's Philox state (batch, sampled rows)
            "samp": ((2,), np.float32, "batch"),      # each sequence's (1 / temperature, top_p); 0: greedy
            "samp_k": ((), np.int32, "batch"),        # and its top_k (0: off)
            "rng": ((4,), np.uint64, False), "out_tokens": ((1, plan.max_context), np.int32, False),
            "inv_freq": ((c.rotary_dim // 2,), np.float32, False),     # RoPE table: the rotated pairs only
        }
        if c.is_moe:
            E, k = c.num_experts, c.num_experts_per_tok
            self.spec.update({"router": ((E,), np.float32, True), "moe_acc": ((h,), np.float32, True),
                              "topk_ids": ((k,), np.int32, True), "topk_w": ((k,), np.float32, True),
                              "sgate": ((1,), np.float32, True), "moe_y": ((k * h,), np.float32, True),
                              "moe_mapped": ((k,), np.int32, True),
                              "expert_loc": ((c.num_hidden_layers, E), np.int32, False),
                              "expert_counts": ((c.num_hidden_layers, E), np.int64, False),
                              "expert_stats": ((3,), np.int64, False)})
        self.offsets, off = {}, 0

        def size(name):
            shape, dt, per_t = self.spec[name]
            return math.prod(shape) * np.dtype(dt).itemsize * (self.batch if per_t == "batch"
                                                                else self._rows(per_t, tmax))
        shared = set(self.SHARED[0] + self.SHARED[1])
        for name in self.spec:
            if name in shared:
                continue
            self.offsets[name] = off
            off = align_up(off + size(name))
        # The attention buffers are dead once the output projection has read ``attn``; the MLP's are written only
        # after it, and every step's launches run in order on one stream: the two groups share one region.
        top = off
        for group in self.SHARED:
            g = off
            for name in group:
                self.offsets[name] = g
                g = align_up(g + size(name))
            top = max(top, g)
        off = top
        self.nbytes = off
        if off > plan.activations:
            raise VmmstreamError(f"activation layout needs {off} bytes, the plan has {plan.activations}; "
                                 "the planner's activation estimate is too small for this model")
        self.block = mem.allocate(plan.activations, role="activations", holder=holder, arena="activations")
        self.va = self.block.va
        self._views: dict = {}
        self._row_views: dict = {}
        self.config = c

    # Buffers live only in a layer's attention half, and only in its MLP half (a mixture's experts included):
    # laid over each other.
    SHARED = (("q", "k", "v", "attn"), ("gate", "up"))

    def _rows(self, per_t, t: int) -> int:
        if per_t == "batch":
            return min(t, self.batch)
        return (min(t, self.sub) if per_t == "sub" else t) if per_t else 1

    def addr(self, name: str) -> int:
        return self.va + self.offsets[name]

    def row(self, name: str, b: int):
        """Row ``b`` of a per-token or per-sequence buffer, with its row shape (a scalar row: shape (1,))."""
        key = (name, b)
        v = self._row_views.get(key)
        if v is None:
            shape, dt, _ = self.spec[name]
            n = math.prod(shape)
            v = self._row_views[key] = self.ops.view(self.addr(name) + b * n * np.dtype(dt).itemsize,
                                                     shape or (1,), dt)
        return v

    def rows(self, name: str, start: int, count: int, shape: tuple = ()):
        """Rows ``start:start + count`` of a per-token buffer as a ``[count, width]`` view, or ``[count, *shape]``
        (made once, kept)."""
        key = (name, start, count, shape)
        v = self._row_views.get(key)
        if v is None:
            if len(self._row_views) >= 4 * self.VIEW_SETS + 8 * -(-self.tmax // self.sub):   # a whole walk's
                self._row_views.pop(next(iter(self._row_views)))
            row, dt, _ = self.spec[name]
            width = math.prod(row)
            v = self._row_views[key] = self.ops.view(self.addr(name) + start * width * np.dtype(dt).itemsize,
                                                     (count,) + (shape or (width,)), dt)
        return v

    VIEW_SETS = 64        # view sets kept (one per token count; prompts of many lengths would grow it forever)

    def views(self, t: int):
        """Views of every buffer for ``t`` tokens (prefixes of the ``tmax`` buffers); the last ``VIEW_SETS``
        token counts used are kept."""
        if t in self._views:
            self._views[t] = self._views.pop(t)          # most recently used last
        else:
            while len(self._views) >= self.VIEW_SETS:
                self._views.pop(next(iter(self._views)))
            c, v = self.config, {}
            for name, (shape, dt, per_t) in self.spec.items():
                full = ((self._rows(per_t, t),) + shape) if per_t else shape
                v[name] = self.ops.view(self.addr(name), full, dt)
            v["q3"] = self.ops.view(self.addr("q"), (t, c.num_attention_heads, c.head_dim), np.uint16)
            v["k3"] = self.ops.view(self.addr("k"), (t, c.num_key_value_heads, c.head_dim), np.uint16)
            v["v3"] = self.ops.view(self.addr("v"), (t, c.num_key_value_heads, c.head_dim), np.uint16)
            v["attn3"] = self.ops.view(self.addr("attn"), (t, c.num_attention_heads, c.head_dim), np.uint16)
            v["qh"] = self.ops.view(self.addr("q"), (t * c.num_attention_heads, c.head_dim), np.uint16)
            v["kh"] = self.ops.view(self.addr("k"), (t * c.num_key_value_heads, c.head_dim), np.uint16)
            if c.is_moe:
                k = c.num_experts_per_tok
                v["moe_y3"] = self.ops.view(self.addr("moe_y"), (t, k, c.hidden_size), np.float32)
                v["eg"] = self.ops.view(self.addr("gate"), (t, c.moe_intermediate_size), np.uint16)
                v["eu"] = self.ops.view(self.addr("up"), (t, c.moe_intermediate_size), np.uint16)
                si = c.shared_expert_intermediate_size
                if si:
                    v["sg"] = self.ops.view(self.addr("gate"), (t, si), np.uint16)
                    v["su"] = self.ops.view(self.addr("up"), (t, si), np.uint16)
            v["xn_last"] = self.ops.view(self.addr("xn") + (t - 1) * c.hidden_size * 2, (1, c.hidden_size),
                                         np.uint16)
            self._views[t] = _NS(v)
        return self._views[t]


class _NS:
    def __init__(self, d):
        self.__dict__.update(d)


class Step:
    """Enqueues steps on the compute stream ``S``; the ``Streamer`` puts the slot copies on the copy stream."""

    def __init__(self, ops, stream, weights, kv, acts, streamer, config, ws_session):
        self.ops, self.S, self.w, self.kv, self.acts = ops, stream, weights, kv, acts
        self.streamer, self.c, self.ws_session = streamer, config, ws_session
        self.eps = float(config.rms_norm_eps)
        self.rope_scale = float(config.rope_attention_factor)     # on cos and sin: 1 except for longrope
        self.head = config.decode_schedule()[-1]

    def _fusable(self, names) -> bool:
        """Whether one launch may read ``names`` together: bf16 weights (the fused GEMVs take no quantized
        ones) whose streamed tensors fit in the K slots."""
        if any(self.w.tensors[n].qlayout is not None for n in names):
            return False
        streamed = sum(1 for n in names if n in self.streamer.index)
        return streamed <= self.streamer.K

    def _use(self, names, launch) -> None:
        self.streamer.before(names)
        launch()
        self.streamer.after(names)

    def body(self, t: int, *, decode: bool, start_pos: int = 0, ws_step=None, last=None, kv=None,
             packed=None) -> None:
        """Embedding, every layer and the logits of the last token, for ``t`` tokens. ``last`` (prefill): a device
        int32[1] holding the row whose logits are wanted (a padded prompt's last real row), else row t - 1.
        ``kv`` (a batch's decode, ``t`` sequences): the cache to use instead of the step's own; token b's K and V go
        to row ``rows[b]`` of its flat cache, and each row's logits are computed.
        ``packed`` (with ``kv``, a prefill): several prompts in one walk, ``[(slot cache, first row, tokens), ...]``:
        token i's K and V go to row ``prow[i]`` of the flat cache, each prompt attends over its own slot, and
        ``last`` holds one row per prompt whose logits are wanted (rows of ``logits``)."""
        self._ws_step = ws_step
        kv_of, batched = self.kv, kv is not None
        if batched:
            self.kv = kv
        try:
            self._body(t, decode, start_pos, ws_step, last, batched, packed)
        finally:
            self.kv = kv_of

    def _body(self, t, decode, start_pos, ws_step, last, batched, packed=None) -> None:
        o, S, c, W = self.ops, self.S, self.c, self.w.array
        a = self.acts.views(t)
        ids, pos = (a.inp, a.positions) if decode else (a.ids, a.pos)
        mm = (lambda out, w, x, b=None: o.gemv(S, w, x, out, bias=b)) if decode else \
             (lambda out, w, x, b=None: o.gemm(S, x, w, out, bias=b, ws=self.ws_session))
        o.embedding(S, self.w.embedding_table, ids, a.x)
        first = "model.layers.0.input_layernorm.weight"
        self._use([first], lambda: o.rmsnorm(S, a.x, W(first), a.xn, self.eps))
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}."
            qkv = [(p + f"self_attn.{n}_proj.weight", p + f"self_attn.{n}_proj.bias" if c.attention_bias else None,
                    out) for n, out in (("q", a.q), ("k", a.k), ("v", a.v))]
            qkv_names = [n for wn, bn, _ in qkv for n in (wn, bn) if n]
            if decode and self._fusable(qkv_names):
                self._use(qkv_names, lambda: o.gemv_multi(
                    S, [W(wn) for wn, _, _ in qkv], a.xn, [out for _, _, out in qkv],
                    [W(bn) for _, bn, _ in qkv] if c.attention_bias else None))
            else:
                for wn, bn, out in qkv:
                    names = [wn] + ([bn] if bn else [])
                    self._use(names, lambda wn=wn, bn=bn, out=out: mm(out, W(wn), a.xn, W(bn) if bn else None))
            if c.qk_norm:               # Qwen3: RMSNorm over each head of q and of k, before RoPE
                qn, kn = p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"
                self._use([qn, kn], lambda: (o.rmsnorm(S, a.qh, W(qn), a.qh, self.eps),
                                             o.rmsnorm(S, a.kh, W(kn), a.kh, self.eps)))
            o.rope_kv_append(S, a.q3, a.k3, a.v3, self.kv.k(layer), self.kv.v(layer), pos, a.inv_freq,
                             self.rope_scale, rows=(a.prow if packed else a.rows) if batched else None)
            if decode:
                o.attn_decode(S, a.q3, self.kv.k4(layer), self.kv.v4(layer), a.lens, a.attn3, self.ws_session)
            elif packed:
                self._attn_packed(layer, packed, ws_step)
            elif ws_step is None or t <= self.acts.sub:
                # q and attn are tmax-row buffers of their own; the cache holds capacity() committed rows
                o.attn_prefill(S, a.q3, self.kv.k(layer), self.kv.v(layer), a.attn3, ws_step, start_pos,
                               session=self.ws_session, spare_rows=self.acts.tmax - t,
                               spare_keys=self._spare_keys(start_pos + t))
            else:                   # materialized scores: the step workspace holds a sub-chunk's
                self._attn_in_parts(layer, t, start_pos, ws_step)
            wo = p + "self_attn.o_proj.weight"
            self._use([wo], lambda: mm(a.proj, W(wo), a.attn))
            ln2 = p + "post_attention_layernorm.weight"
            self._use([ln2], lambda: o.rmsnorm(S, a.proj, W(ln2), a.xn, self.eps, residual=a.x))
            if c.is_moe:
                self._moe(layer, a, mm, decode)
            else:
                self._mlp(p, a, mm, decode)
            nxt = (f"model.layers.{layer + 1}.input_layernorm.weight" if layer + 1 < c.num_hidden_layers
                   else "model.norm.weight")
            self._use([nxt], lambda: o.rmsnorm(S, a.proj, W(nxt), a.xn, self.eps, residual=a.x))
        if decode:
            row = a.xn
        elif last is not None:          # gather the wanted rows into the (free by now) projection buffer
            row = self.acts.views(last.shape[0]).proj
            o.embedding(S, a.xn, last, row)
        else:
            row = a.xn_last
        logits = a.logits if decode else self.acts.views(1 if last is None else last.shape[0]).logits
        self._use([self.head], lambda: o.gemv(S, W(self.head), row, logits))

    def _spare_keys(self, n_keys: int) -> int:
        """Committed cache rows past ``n_keys`` (0 for a cache that does not say)."""
        cap = getattr(self.kv, "capacity", None)
        return max(0, cap() - n_keys) if callable(cap) else 0

    def _attn_packed(self, layer: int, packed, ws) -> None:
        """Causal prefill attention of each packed prompt over its own slot's cache (it starts at position 0); with
        a step workspace (materialized scores), ``sub`` query rows at a time."""
        for slot_kv, r0, n in packed:
            self._attn_rows(layer, slot_kv, r0, n, 0, ws, n if ws is None else self.acts.sub)

    def _attn_in_parts(self, layer: int, t: int, start_pos: int, ws) -> None:
        """Causal prefill attention of a walk, ``sub`` query rows at a time (each sees the keys before it)."""
        self._attn_rows(layer, self.kv, 0, t, start_pos, ws, self.acts.sub)

    def _attn_rows(self, layer: int, kv, r0: int, t: int, start_pos: int, ws, part: int) -> None:
        """Attention of query rows ``r0 .. r0 + t`` (positions from ``start_pos``) over ``kv``, ``part`` rows a launch."""
        hq, d = self.c.num_attention_heads, self.c.head_dim
        for s0 in range(0, t, part):
            n = min(part, t - s0)
            q = self.acts.rows("q", r0 + s0, n, (hq, d))
            out = self.acts.rows("attn", r0 + s0, n, (hq, d))
            self.ops.attn_prefill(self.S, q, kv.k(layer), kv.v(layer), out, ws, start_pos + s0, session=self.ws_session)

    def _mlp(self, p, a, mm, decode) -> None:
        """proj = (silu(xn · Wgᵀ) * (xn · Wuᵀ)) · Wdᵀ."""
        o, S, W = self.ops, self.S, self.w.array
        wg, wu, wd = (p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
        t, sub = a.xn.shape[0], self.acts.sub
        if decode and self._fusable([wg, wu]):
            self._use([wg, wu], lambda: o.gemv_gate_up_silu(S, W(wg), W(wu), a.xn, a.gate))
        elif t > sub:               # a walk longer than the up buffer: up and silu·mul a sub-chunk at a time
            self._use([wg], lambda: mm(a.gate, W(wg), a.xn))

            def up_in_parts():
                rows = self.acts.rows
                for s0 in range(0, t, sub):
                    n = min(sub, t - s0)
                    up = rows("up", 0, n)
                    mm(up, W(wu), rows("xn", s0, n))
                    g = rows("gate", s0, n)
                    o.silu_mul(S, g, up, g)
            self._use([wu], up_in_parts)
        else:
            self._use([wg], lambda: mm(a.gate, W(wg), a.xn))
            self._use([wu], lambda: mm(a.up, W(wu), a.xn))
            o.silu_mul(S, a.gate, a.up, a.gate)
        self._use([wd], lambda: mm(a.proj, W(wd), a.gate))

    def _moe(self, layer, a, mm, decode) -> None:
        """proj = Σ_k weight_k · expert_k(xn) (+ sigmoid(xn · w_sgᵀ) · shared(xn)): router logits (fp32),
        softmax + top-k (routing counted), then the routed experts — resident ones read in place, the others
        gathered into the expert slots first (``Experts``) — accumulated with their routing weights in fp32,
        then the shared expert and the bf16 output. The routing is read from device memory when the ops
        run, so one captured graph serves every routing."""
        o, S, W, c = self.ops, self.S, self.w.array, self.c
        ex = self.w.experts
        rn = c.router_name(layer)
        self._use([rn], lambda: mm(a.router, W(rn), a.xn))
        o.moe_route(S, a.router, a.topk_ids, a.topk_w, c.norm_topk_prob, counts=ex.counts_dev[layer],
                    scoring=c.model_type)
        shared = sgate = None
        if c.shared_expert_intermediate_size:
            sg, su, sd, sgn = c.shared_expert_names(layer)
            self._use([sg], lambda: mm(a.sg, W(sg), a.xn))
            self._use([su], lambda: mm(a.su, W(su), a.xn))
            o.silu_mul(S, a.sg, a.su, a.sg)
            self._use([sd], lambda: mm(a.proj, W(sd), a.sg))
            self._use([sgn], lambda: mm(a.sgate, W(sgn), a.xn))
            shared, sgate = a.proj, a.sgate
        if o.backend == "host":
            o.fill_zero(S, a.moe_acc)
            o.moe_experts(S, ex, layer, a.xn, a.topk_ids, a.topk_w, a.eg, a.moe_acc, decode)
            o.moe_finish(S, a.moe_acc, a.proj, shared, sgate)
            return
        # CUDA: decode gathers the routed units into the slots inside the graph; a batch's decode step (its tokens
        # may route to more experts than there are slots) in rounds decided on the device where
        # BATCH_GATHER_IN_GRAPH, else host-driven rounds over the slots, like prefill
        n = a.xn.shape[0]
        if not ex.on_demand:
            o.moe_ffn(S, ex.stack("pool", layer), a.topk_ids, a.xn, a.moe_y3, self._moe_ws(decode),
                      c.num_experts)
        elif decode and n == 1:
            o.expert_gather(S, ex, layer, a.topk_ids, a.moe_mapped)
            o.moe_ffn(S, ex.stack("slots"), a.moe_mapped, a.xn, a.moe_y3, self._moe_ws(decode), ex.n_slots)
        elif decode and experts_mod.BATCH_GATHER_IN_GRAPH:
            from vmmstream.kernels.moe.gather import rounds
            for r in range(rounds(n, c.num_experts_per_tok, c.num_experts, ex.n_slots)):
                o.expert_gather_round(S, ex, layer, a.topk_ids, a.moe_mapped, r)
                o.moe_ffn(S, ex.stack("slots"), a.moe_mapped, a.xn, a.moe_y3, self._moe_ws(decode), ex.n_slots)
        else:
            o.moe_experts_prefill(S, ex, layer, a.xn, a.topk_ids, a.moe_mapped, a.moe_y3, self._moe_ws(decode))
        o.moe_combine(S, a.moe_y3, a.topk_w, a.proj, shared, sgate)

    def _moe_ws(self, decode: bool):
        return self.ws_session if decode else self._ws_step

    def decode_batch(self, n: int, kv, *, timed: bool = True, sampled: bool = False) -> None:
        """One decode step of ``n`` sequences (the decode state's first ``n`` rows; ``kv`` the batch's cache view):
        next[b] = argmax of sequence b's logits; with ``sampled``, then a draw for each row whose ``samp`` says
        so, with its own parameters and Philox state (``rng_rows[b]``), all read from device memory, so a
        captured step draws with whatever the owner uploaded before the replay. Untimed in a capture."""
        self.streamer.begin(timed=timed)
        self.body(n, decode=True, kv=kv)
        self.streamer.end()
        a = self.acts.views(n)
        self.ops.argmax(self.S, a.logits, a.next, self.ws_session)
        if sampled:
            self.ops.sample_rows(self.S, a.logits, a.next, a.rng_rows, a.samp, a.samp_k)

    def select(self, sampling) -> None:
        """next = argmax(logits) (``sampling`` None) or a draw with (temperature, top_k, top_p)."""
        a = self.acts.views(1)
        if sampling is None:
            self.ops.argmax(self.S, a.logits, a.next, self.ws_session)
        else:
            self.ops.sample(self.S, a.logits, a.next, a.rng, *sampling)

    def advance(self) -> None:
        a = self.acts.views(1)
        self.ops.advance(self.S, a.next, a.inp, a.positions, a.lens, a.out_tokens)

    def decode(self, sampling, *, timed: bool = False) -> None:
        """One whole decode step: what the graph captures (untimed there; ``timed`` for an eager step)."""
        self.streamer.begin(timed=timed)
        self.body(1, decode=True)
        self.streamer.end()
        self.select(sampling)
        self.advance()
