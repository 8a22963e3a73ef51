"""The launch adapter: one place that turns a device address + shape into an array and launches a kernel.

Both backends offer the same methods, each taking the stream first and arrays made by ``view``:

* ``cuda``: ``view`` wraps the address as a Numba device array (``__cuda_array_interface__``); a method
  launches the kernel module's Numba kernel on the package's stream (an external Numba stream over our
  ``CUstream``), so launches join stream captures.
* ``host``: ``view`` is a NumPy view over the same address (the host backend's memory is real process
  memory); a method records the kernel module's NumPy reference with ``driver.launch_host_func`` — in
  stream order, and inside captures, where it becomes a node of the recorded graph. A reference reads its
  inputs when it runs, not when it is recorded, so a replayed graph sees what earlier nodes wrote.

Numba is imported here and in the kernel modules only, and only when an adapter is made.
"""

from __future__ import annotations

import collections
import ctypes
import math

import numpy as np


def _is_q(w) -> bool:
    from vmmstream.quantization import QWeight
    return isinstance(w, QWeight)


def make_ops(driver):
    return CudaOps(driver) if driver.backend == "cuda" else HostOps(driver)


class HostOps:
    backend = "host"

    def __init__(self, driver):
        from vmmstream.kernels.attention import decode as attention_decode
        from vmmstream.kernels.attention import prefill as attention_prefill
        from vmmstream.kernels.base.dtypes import f32_to_bf16
        from vmmstream.kernels.matmul.dense import gemm, gemv
        from vmmstream.kernels.ops import elementwise, embedding, norm, rope, sampling, scalars
        self.driver = driver
        self.k = dict(attention_decode=attention_decode, attention_prefill=attention_prefill,
                      elementwise=elementwise, embedding=embedding, gemm=gemm, gemv=gemv, norm=norm, rope=rope,
                      sampling=sampling, scalars=scalars)
        self._bf16 = f32_to_bf16
        self.launches = 0
        self.attn_routes = collections.Counter()     # prefill attention launches by route (``stats()``)

    # -- arrays --
    def view(self, va: int, shape, dtype):
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        n = math.prod(shape) * dtype.itemsize
        buf = (ctypes.c_uint8 * max(n, 1)).from_address(va)
        return np.frombuffer(buf, dtype=np.uint8, count=n).view(dtype).reshape(shape)

    def view_strided(self, va: int, shape, dtype, outer_stride: int):
        """[n, ...] with ``outer_stride`` bytes between the n rows, each row a C-contiguous ``shape[1:]``."""
        dtype = np.dtype(dtype)
        shape = tuple(int(x) for x in shape)
        inner = math.prod(shape[1:]) * dtype.itemsize
        n = (shape[0] - 1) * outer_stride + inner if shape[0] else 0
        buf = np.frombuffer((ctypes.c_uint8 * max(n, 1)).from_address(va), dtype=np.uint8, count=max(n, 1))
        strides = (outer_stride,) + tuple(np.empty(shape[1:], dtype).strides)
        return np.lib.stride_tricks.as_strided(buf.view(np.uint8), shape=shape + (dtype.itemsize,),
                                               strides=strides + (1,)).view(dtype).reshape(shape)

    def view_strides(self, va: int, shape, dtype, strides):
        """A view with explicit byte ``strides`` (e.g. one layer's K in the position-major KV cache)."""
        dtype = np.dtype(dtype)
        shape, strides = tuple(int(x) for x in shape), tuple(int(x) for x in strides)
        extent = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize if all(shape) else 0
        buf = (ctypes.c_uint8 * max(extent, 1)).from_address(va)
        return np.ndarray(shape, dtype, buffer=buf, strides=strides)

    @staticmethod
    def to_device(view, values) -> None:
        view[...] = np.asarray(values).reshape(view.shape)

    @staticmethod
    def to_host(view):
        return np.array(view)

    def _run(self, stream, fn):
        self.launches += 1
        self.driver.launch_host_func(stream, fn)

    def _store(self, out, value):
        """Write an fp32 result into ``out``: rounded to bf16 when ``out`` holds bf16 bits."""
        value = np.asarray(value)
        out[...] = self._bf16(value).reshape(out.shape) if out.dtype == np.uint16 else value.reshape(out.shape)

    # -- kernels (NumPy references) --
    def embedding(self, s, table, ids, out):
        self._run(s, lambda: self._copy(out, self.k["embedding"].reference(table, ids)))

    @staticmethod
    def _copy(out, value):
        out[...] = value

    def rmsnorm(self, s, x, w, out, eps, residual=None):
        ref = self.k["norm"].reference

        def run():
            if residual is None:
                out[...] = ref(x, w, eps)
            else:
                o, r = ref(x, w, eps, residual=residual)
                residual[...] = r
                out[...] = o
        self._run(s, run)

    def gemv(self, s, w, x, out, bias=None):
        if _is_q(w):
            self._run(s, lambda: self._store(out, self._qref(w, x, bias)))
        else:
            self._run(s, lambda: self._store(out, self.k["gemv"].reference(w, x, bias)))

    def gemm(self, s, x, w, out, bias=None, ws=None):
        if _is_q(w):
            self._run(s, lambda: self._store(out, self._qref(w, x, bias)))
        else:
            self._run(s, lambda: self._store(out, self.k["gemm"].reference(x, w, bias)))

    @staticmethod
    def _qref(w, x, bias):
        """x · dequantized(w)ᵀ (+ bias) in fp32: the quantized kernels' reference (one bf16 rounding on store)."""
        from vmmstream.kernels.matmul.quant import gemv as qgemv
        if w.kind == "int4":
            return qgemv.reference_int4(w.packed, w.scales, w.zeros, x, bias, rounded=False)
        return qgemv.reference_mxfp4(w.packed, w.scales, x, bias, rounded=False)

    def gemv_multi(self, s, ws, x, outs, biases=None):
        ref = self.k["gemv"].reference_multi

        def run():
            for out, y in zip(outs, ref(ws, x, biases)):
                self._store(out, y)
        self._run(s, run)

    def gemv_gate_up_silu(self, s, w_gate, w_up, x, out):
        ref = self.k["gemv"].reference_gate_up_silu
        self._run(s, lambda: self._copy(out, ref(w_gate, w_up, x).reshape(out.shape)))

    def rope(self, s, q, k, positions, inv_freq, scale: float = 1.0):
        ref = self.k["rope"].reference

        def run():
            q[...] = ref(q, positions, inv_freq, scale)
            k[...] = ref(k, positions, inv_freq, scale)
        self._run(s, run)

    def rope_kv_append(self, s, q, k, v, ck, cv, positions, inv_freq, scale: float = 1.0, rows=None):
        self.rope(s, q, k, positions, inv_freq, scale)
        self.kv_append(s, k, v, ck, cv, positions if rows is None else rows)

    def kv_append(self, s, k, v, ck, cv, positions):
        def run():
            for t, p in enumerate(np.asarray(positions)):
                if 0 <= p < ck.shape[0]:
                    ck[p] = k[t]
                    cv[p] = v[t]
        self._run(s, run)

    def attn_prefill(self, s, q, ck, cv, out, ws, start_pos, session=None, spare_rows=0, spare_keys=0):
        ref = self.k["attention_prefill"].reference
        self.attn_routes["reference"] += 1
        self._run(s, lambda: self._store(out, ref(q, ck, cv, start_pos=start_pos)))

    def attn_decode(self, s, q, ck, cv, seq_len, out, ws):
        ref = self.k["attention_decode"].reference
        self._run(s, lambda: self._store(out, ref(q, ck, cv, seq_len)))

    def silu_mul(self, s, gate, up, out):
        ref = self.k["elementwise"].reference_silu_mul
        self._run(s, lambda: self._copy(out, ref(gate, up)))

    # -- mixture of experts (host references; the tokens routed to an expert are read from the device
    #    buffers when the op runs, so one recorded graph serves every routing) --
    def moe_route(self, s, logits, topk_ids, topk_w, norm: bool, counts=None, scoring=None):
        """softmax over the experts (fp64), top-k (ties: the lower expert id), optionally renormalised
        (Mixtral's softmax over the top-k logits is the renormalised case); ``counts[e]`` += tokens routed to e."""
        def run():
            lg = np.asarray(logits, np.float64)
            p = np.exp(lg - lg.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            k = topk_ids.shape[1]
            ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
            w = np.take_along_axis(p, ids, axis=1)
            if norm:
                w = w / w.sum(axis=1, keepdims=True)
            topk_ids[...] = ids.astype(np.int32)
            topk_w[...] = w.astype(np.float32)
            if counts is not None:
                np.add(counts, np.bincount(ids.reshape(-1), minlength=counts.shape[0])[:counts.shape[0]], out=counts)
        self._run(s, run)

    def moe_experts(self, s, ex, layer, x, topk_ids, topk_w, h, acc, decode: bool):
        """acc[t] += Σ_k weight · expert(x[t]) over the routed experts of ``layer``: resident units are read
        in place; the others are copied from their pinned host copies into the gather slots, as many at a
        time as there are slots, before their math. Counts hits, misses and bytes gathered."""
        gemv, silu_mul = self.k["gemv"], self.k["elementwise"].reference_silu_mul

        def expert(views, e, ids, wts):
            hit = ids == e
            rows = np.nonzero(hit.any(axis=1))[0]
            wg, wu, wd = views
            xr = x[rows]
            g = self._bf16(self._mm(gemv, wg, xr))
            u = self._bf16(self._mm(gemv, wu, xr))
            hr = silu_mul(g, u)
            wt = (wts * hit).sum(axis=1)[rows]
            acc[rows] += (wt[:, None].astype(np.float64) * self._mm(gemv, wd, hr)).astype(np.float32)

        def run():
            ids, wts = np.asarray(topk_ids), np.asarray(topk_w)
            routed = np.unique(ids)
            loc = ex.loc_dev[layer]
            here = [int(e) for e in routed if loc[e] >= 0]
            away = [int(e) for e in routed if loc[e] < 0]
            for e in here:
                expert(ex.pool_views[loc[e]], e, ids, wts)
            n = ex.n_slots
            for i in range(0, len(away), max(n, 1)):
                for j, e in enumerate(away[i:i + n]):
                    ex.gather_host(j, (layer, e))
                    expert(ex.slot_views[j], e, ids, wts)
            if not ex.on_demand:
                return          # every expert resident: nothing to count (the CUDA path runs no gather either)
            if decode:          # the device counters, as the CUDA gather keeps them
                ex.stats_dev[0] += len(here)
                ex.stats_dev[1] += len(away)
                ex.stats_dev[2] += len(away) * ex.ep.unit_payload
            else:
                ex.host_counters["prefill_hits"] += len(here)
                ex.host_counters["prefill_misses"] += len(away)
                ex.host_counters["prefill_bytes"] += len(away) * ex.ep.unit_payload
        self._run(s, run)

    def fill_zero(self, s, buf):
        self._run(s, lambda: self._copy(buf, 0))

    def moe_finish(self, s, acc, out, shared=None, shared_gate=None):
        """out = acc (+ sigmoid(shared_gate) * shared), rounded to bf16."""
        def run():
            y = np.asarray(acc, np.float64)
            if shared is not None:
                from vmmstream.kernels.base.dtypes import bf16_to_f32
                sh = bf16_to_f32(shared).astype(np.float64)
                g = 1.0 / (1.0 + np.exp(-np.asarray(shared_gate, np.float64))) if shared_gate is not None else 1.0
                y = y + g * sh
            out[...] = self._bf16(y.astype(np.float32))
        self._run(s, run)

    def _mm(self, gemv, w, x):
        """x · wᵀ in fp32 for a bf16 or quantized weight."""
        return self._qref(w, x, None) if _is_q(w) else gemv.reference(w, x)

    def argmax(self, s, logits, out_ids, ws):
        ref = self.k["sampling"].reference_argmax
        self._run(s, lambda: self._copy(out_ids, ref(logits)))

    def sample(self, s, logits, out_ids, rng, temperature, top_k, top_p):
        smp = self.k["sampling"]
        if temperature > 0:          # the parameters as the kernel holds them (fp32 1 / T and top_p), as a batch row's
            inv, p32, _ = smp.row_params(temperature, top_k, top_p)
            temperature, top_p = float(1.0 / np.float64(inv)), float(p32)
        ref = smp.reference_sample

        def run():
            out_ids[...] = ref(logits, rng.copy(), temperature, top_k, top_p)
            rng[1] += np.uint64(1)         # the kernel advances its Philox offset once per launch
        self._run(s, run)

    def sample_rows(self, s, logits, out_ids, rng_rows, params, top_ks):
        ref = self.k["sampling"].reference_sample_rows
        self._run(s, lambda: self._copy(out_ids, ref(logits, out_ids, rng_rows, params, top_ks)))

    def advance(self, s, next_ids, input_ids, positions, seq_lens, out_tokens):
        ref = self.k["scalars"].reference

        def run():
            inp, pos, lens, toks = ref(next_ids, input_ids, positions, seq_lens, out_tokens)
            input_ids[...], positions[...], seq_lens[...], out_tokens[...] = inp, pos, lens, toks
        self._run(s, run)


class CudaOps:
    backend = "cuda"

    def __init__(self, driver):
        from numba import cuda

        from vmmstream.kernels.attention import decode as attention_decode
        from vmmstream.kernels.attention import prefill as attention_prefill
        from vmmstream.kernels.matmul.dense import gemm, gemv
        from vmmstream.kernels.ops import elementwise, embedding, norm, rope, sampling, scalars
        self.cuda = cuda
        self.driver = driver
        self.k = dict(attention_decode=attention_decode, attention_prefill=attention_prefill,
                      elementwise=elementwise, embedding=embedding, gemm=gemm, gemv=gemv, norm=norm, rope=rope,
                      sampling=sampling, scalars=scalars)
        self._kv_kernel = None
        self.launches = 0
        self.attn_routes = collections.Counter()     # prefill attention launches by route (``stats()``)

    def view(self, va: int, shape, dtype):
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)

        class _Cai:
            __cuda_array_interface__ = {"shape": shape, "typestr": dtype.str, "data": (int(va), False),
                                        "version": 3, "strides": None}
        return self.cuda.as_cuda_array(_Cai(), sync=False)

    def view_strided(self, va: int, shape, dtype, outer_stride: int):
        dtype = np.dtype(dtype)
        shape = tuple(int(x) for x in shape)
        strides = (int(outer_stride),) + tuple(np.empty(shape[1:], dtype).strides)

        class _Cai:
            __cuda_array_interface__ = {"shape": shape, "typestr": dtype.str, "data": (int(va), False),
                                        "version": 3, "strides": strides}
        return self.cuda.as_cuda_array(_Cai(), sync=False)

    def view_strides(self, va: int, shape, dtype, strides):
        """A device array with explicit byte ``strides``, made from its pointer: slicing a Numba device array
        instead walks every element of the view in Python (seconds for a KV cache's layers)."""
        dtype = np.dtype(dtype)
        shape, strides = tuple(int(x) for x in shape), tuple(int(x) for x in strides)

        class _Cai:
            __cuda_array_interface__ = {"shape": shape, "typestr": dtype.str, "data": (int(va), False),
                                        "version": 3, "strides": strides}
        return self.cuda.as_cuda_array(_Cai(), sync=False)

    @staticmethod
    def to_device(view, values) -> None:
        """Synchronous host -> device copy into a view (outside captures: set-up and re-planning only)."""
        view.copy_to_device(np.ascontiguousarray(np.asarray(values, dtype=view.dtype).reshape(view.shape)))

    @staticmethod
    def to_host(view):
        return view.copy_to_host()

    @staticmethod
    def _s(stream):
        return stream.handle

    @staticmethod
    def _va(arr) -> int:
        from vmmstream.kernels.base.launch import data_ptr
        return data_ptr(arr)

    # -- mixture of experts --
    def moe_route(self, s, logits, topk_ids, topk_w, norm: bool, counts=None, scoring=None):
        """Router top-k on the device (counts are kept by the gather, on the decode path)."""
        self.launches += 1
        self.k_moe().router_topk(logits, topk_ids, topk_w, scoring=scoring or "mixtral",
                                 norm_topk_prob=None if scoring in (None, "mixtral") else bool(norm),
                                 stream=self._s(s))

    def k_moe(self):
        from vmmstream.kernels import moe
        return moe

    def fill_zero(self, s, buf):
        self.launches += 1
        self.driver.memset_d8_async(self._va(buf), 0, int(buf.nbytes), s)

    def expert_gather(self, s, ex, layer, topk_ids, mapped):
        """Decode: the routed experts' units into the slots, from the pool or the pinned host copy."""
        from vmmstream.kernels.moe import gather as expert_gather
        self.launches += 1
        pool, host, slots = self._unit_views(ex, layer)
        expert_gather.gather(topk_ids, ex.loc_dev[layer], pool, host, slots, mapped, ex.counts_dev[layer],
                             ex.stats_dev, stream=self._s(s))

    def _unit_views(self, ex, layer):
        """The gathers' byte views: the pool's units [R, U] (the slots where none is resident: never read), this
        layer's host copies [E, U] and the slots [S, U]."""
        E, U = ex.ep.per_layer, ex.U
        host = self.view(ex.host_base + layer * E * U, (E, U), np.uint8)
        slots = self.view(ex.slot_block.va, (ex.n_slots, U), np.uint8)
        pool = self.view(ex.pool_block.va, (ex.n_pool, U), np.uint8) if ex.n_pool else slots
        return pool, host, slots

    def expert_gather_round(self, s, ex, layer, topk_ids, mapped, rnd):
        """A batch's decode: round ``rnd`` of its routed experts' units into the slots (``gather.gather_round``)."""
        from vmmstream.kernels.moe import gather as expert_gather
        self.launches += 1
        pool, host, slots = self._unit_views(ex, layer)
        expert_gather.gather_round(topk_ids, ex.loc_dev[layer], pool, host, slots, mapped, ex.counts_dev[layer],
                                   ex.stats_dev, rnd, stream=self._s(s))

    def moe_ffn(self, s, stack, ids, x, y, ws, n_experts):
        """Group the (token, slot) pairs of ``ids`` by expert and run the SwiGLU FFN over ``stack``."""
        moe = self.k_moe()
        self.launches += 3
        g, u, d = stack
        # bf16 experts: tiles of 8 rows for the tensor-core kernels where they apply (both calls take the same tile)
        rt = 0 if _is_q(g) else moe.mma_row_tile(x.shape[0], g.shape[2], g.shape[1])
        moe.group_by_expert(ids, workspace=ws, num_experts=n_experts, row_tile=rt, stream=self._s(s))
        if _is_q(g):
            parts = [(w.packed, w.scales, w.zeros) if w.kind == "int4" else (w.packed, w.scales) for w in stack]
            fn = moe.expert_ffn_int4 if g.kind == "int4" else moe.expert_ffn_mxfp4
            fn(x, *parts, y, workspace=ws, stream=self._s(s))
        else:
            moe.expert_ffn(x, g, u, d, y, workspace=ws, row_tile=rt, stream=self._s(s))

    def moe_combine(self, s, y, topk_w, out, shared=None, shared_gate=None):
        self.launches += 1
        self.k_moe().combine(y, topk_w, out, shared=shared, shared_gate=shared_gate, stream=self._s(s))

    def moe_experts_prefill(self, s, ex, layer, x, topk_ids, mapped, y, ws):
        """Prefill (eager): the routed experts in rounds of at most k slots, driven from the host — read the
        routing, copy each round's units into the slots (pool: device to device; others: host to device),
        run the FFN over the slots for the pairs of that round (other pairs masked), y zeroed first."""
        d = self.driver
        self.fill_zero(s, y)
        d.stream_synchronize(s)
        ids = self.to_host(topk_ids)
        routed = [int(e) for e in np.unique(ids)]
        k = ex.n_slots
        for i in range(0, len(routed), k):
            chunk = routed[i:i + k]
            m = np.full(ids.shape, -1, np.int32)
            for j, e in enumerate(chunk):
                r = int(ex.loc[layer, e])
                if r >= 0:
                    d.memcpy_dtod_async(ex.slot_va(j), ex.pool_va(r), ex.ep.unit_payload, s)
                    ex.host_counters["prefill_hits"] += 1
                else:
                    d.memcpy_htod_async(ex.slot_va(j), ex.host[(layer, e)], ex.ep.unit_payload, s)
                    ex.host_counters["prefill_misses"] += 1
                    ex.host_counters["prefill_bytes"] += ex.ep.unit_payload
                m[ids == e] = j
            d.stream_synchronize(s)
            self.to_device(mapped, m)
            self.moe_ffn(s, ex.stack("slots"), mapped, x, y, ws, k)
            d.stream_synchronize(s)         # the slots are refilled by the next round
        counts = ex.counts
        counts[layer] += np.bincount(ids.reshape(-1), minlength=ex.ep.per_layer)[:ex.ep.per_layer]
        self.to_device(ex.counts_dev, counts)

    def embedding(self, s, table, ids, out):
        self.launches += 1
        self.k["embedding"].embedding(table, ids, out, stream=self._s(s))

    def rmsnorm(self, s, x, w, out, eps, residual=None):
        self.launches += 1
        self.k["norm"].rmsnorm(x, w, out, eps=eps, residual=residual, stream=self._s(s))

    def gemv(self, s, w, x, out, bias=None):
        self.launches += 1
        if _is_q(w):
            self._qgemv(s, w, x, out, bias)
        else:
            self.k["gemv"].gemv(w, x, out, bias=bias, stream=self._s(s))

    def _qgemv(self, s, w, x, out, bias):
        # Programmatic dependent launch: the GEMV loads W while the kernel before it finishes, and reads x only
        # after it. Safe here because no kernel writes a dense weight: streamed layers are copied on the copy
        # stream, and this stream waits for them (an event) before the layer's first kernel. The only kernel
        # that writes weights, the MoE expert gather, is followed by the expert kernels, never by this GEMV.
        from vmmstream.kernels.matmul.quant import gemv as qgemv
        cfg = qgemv.QgemvConfig(pdl=True)
        if w.kind == "int4":
            qgemv.qgemv_int4(w.packed, w.scales, w.zeros, x, out, bias=bias, stream=self._s(s), config=cfg)
        else:
            qgemv.qgemv_mxfp4(w.packed, w.scales, x, out, bias=bias, stream=self._s(s), config=cfg)

    def gemm(self, s, x, w, out, bias=None, ws=None):
        """``ws``: the session workspace, for the cuBLASLt route (bf16 weights) where it is planned."""
        self.launches += 1
        if _is_q(w):
            # prefill over quantized weights: W decoded in the load path, no cache (tensor cores on a GPU)
            from vmmstream.kernels.matmul.quant import gemm as qgemm
            route = qgemm.choose_route(x.shape[0], w.packed.shape[0], x.shape[1], w.kind)
            if w.kind == "int4":
                qgemm.qgemm_int4(w.packed, w.scales, w.zeros, x, out, bias=bias, route=route, stream=self._s(s))
            else:
                qgemm.qgemm_mxfp4(w.packed, w.scales, x, out, bias=bias, route=route, stream=self._s(s))
        else:
            self.k["gemm"].gemm(x, w, out, bias=bias, workspace=ws, stream=self._s(s))

    def gemv_multi(self, s, ws, x, outs, biases=None):
        self.launches += 1
        self.k["gemv"].gemv_multi(ws, x, outs, biases=biases, stream=self._s(s))

    def gemv_gate_up_silu(self, s, w_gate, w_up, x, out):
        self.launches += 1
        self.k["gemv"].gemv_gate_up_silu(w_gate, w_up, x, out, stream=self._s(s))

    def rope(self, s, q, k, positions, inv_freq, scale: float = 1.0):
        self.launches += 1
        self.k["rope"].apply_rope(q, k, positions, inv_freq, scale=scale, stream=self._s(s))

    def rope_kv_append(self, s, q, k, v, ck, cv, positions, inv_freq, scale: float = 1.0, rows=None):
        self.launches += 1
        self.k["rope"].apply_rope_append_kv(q, k, v, ck, cv, positions, inv_freq, rows=rows, scale=scale,
                                            stream=self._s(s))

    def kv_append(self, s, k, v, ck, cv, positions):
        if self._kv_kernel is None:
            from .kv_kernel import kv_append_kernel
            self._kv_kernel = kv_append_kernel
        t, h, d = k.shape
        n = t * h * d
        if n:
            from vmmstream.kernels.base.launch import as_stream
            self.launches += 1
            self._kv_kernel[(n + 255) // 256, 256, as_stream(self._s(s))](k, v, ck, cv, positions, h, d, n)

    def attn_prefill(self, s, q, ck, cv, out, ws, start_pos, session=None, spare_rows=0, spare_keys=0):
        """``session``: the session workspace, for the cuDNN route (long prompts) where it is planned;
        ``spare_rows`` / ``spare_keys``: what that route's length buckets may touch past the call's rows."""
        self.launches += 1
        stream = self._s(s)
        route = self.k["attention_prefill"].launch(q, ck, cv, out, ws, start_pos=start_pos, stream=stream,
                                                   session_workspace=session, spare_rows=spare_rows,
                                                   spare_keys=spare_keys)
        from vmmstream.kernels.base.launch import capturing
        if not capturing(stream):       # a captured launch runs only in its graph's replays (counted as those)
            self.attn_routes[route] += 1

    def attn_decode(self, s, q, ck, cv, seq_len, out, ws):
        self.launches += 1
        self.k["attention_decode"].launch(q, ck, cv, seq_len, out, ws, stream=self._s(s))

    def silu_mul(self, s, gate, up, out):
        self.launches += 1
        self.k["elementwise"].silu_mul(gate, up, out, stream=self._s(s))

    def argmax(self, s, logits, out_ids, ws):
        self.launches += 1
        self.k["sampling"].argmax(logits, out_ids, workspace=ws, stream=self._s(s))

    def sample(self, s, logits, out_ids, rng, temperature, top_k, top_p):
        self.launches += 1
        self.k["sampling"].sample(logits, out_ids, rng, temperature=temperature, top_k=top_k, top_p=top_p,
                                  stream=self._s(s))

    def sample_rows(self, s, logits, out_ids, rng_rows, params, top_ks):
        self.launches += 1
        self.k["sampling"].sample_rows(logits, out_ids, rng_rows, params, top_ks, stream=self._s(s))

    def advance(self, s, next_ids, input_ids, positions, seq_lens, out_tokens):
        self.launches += 1
        self.k["scalars"].advance(next_ids, input_ids, positions, seq_lens, out_tokens=out_tokens,
                                  stream=self._s(s))

