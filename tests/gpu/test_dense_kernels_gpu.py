"""Dense decoder kernels on a real GPU at model shapes (hidden 4096, intermediate 14336, vocab 32000,
up to 2048 tokens), on a non-default stream, against their NumPy references. Fails (never skips)
without a GPU (root conftest).

Tolerances: a bf16 output may differ from the unrounded fp64 reference by one rounding (2⁻⁸·|ref|)
plus the fp32 accumulation slack, taken as 3e-5 · Σ|aᵢ·bᵢ| for dot products. Bitwise ops (gather,
residual add) must match exactly. A captured graph replays the decode tail and must match the host chain.
"""

from __future__ import annotations

import numpy as np
import pytest

from vmmstream.kernels.ops import elementwise, embedding
from vmmstream.kernels.matmul.dense import gemm, gemv
from vmmstream.kernels.ops import norm, rope, sampling, scalars
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16

from gpuutil import HALF_ULP, captured, get, to_dev

pytestmark = pytest.mark.gpu

H, I, V, HQ, HKV, D = 4096, 14336, 32000, 32, 8, 128


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(2026)


def bf16(rng, shape, scale=1.0):
    return f32_to_bf16(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def assert_bf16_close(got_bits, ref, slack):
    got = bf16_to_f32(got_bits).astype(np.float64)
    ref = np.asarray(ref, np.float64)
    excess = np.abs(got - ref) - (2 * HALF_ULP * np.abs(ref) + slack)
    assert np.all(excess <= 0), f"max excess {excess.max():.3g}"


def dot_slack(x, w):
    return 3e-5 * (np.abs(bf16_to_f32(x)).astype(np.float64) @ np.abs(bf16_to_f32(w)).astype(np.float64).T) + 1e-6


@pytest.mark.parametrize("n,k,b,bias,out_dtype", [
    (I, H, 1, False, np.uint16),        # gate/up projection
    (H, I, 1, False, np.uint16),        # down projection
    (H, H, 4, True, np.uint16),         # batch decode, Qwen2-style bias
    (V, H, 2, False, np.float32),       # lm_head, fp32 logits
    (37, 67, 1, False, np.uint16),      # scalar fallback
    (I, H, 16, False, np.uint16),       # batched decode on tensor cores (gemv_mma), two n8 tiles
    (H, H, 11, True, np.uint16),        # the same with bias, 11 of 16 sequence columns used
    (V, H, 32, False, np.float32),      # lm_head of 32 sequences, fp32 logits, four n8 tiles
])
def test_gemv(stream, rng, n, k, b, bias, out_dtype):
    from numba import cuda
    w, x = bf16(rng, (n, k), 0.05), bf16(rng, (b, k))
    bb = bf16(rng, n) if bias else None
    out = cuda.device_array((b, n), out_dtype, stream=stream)
    gemv.gemv(to_dev(w, stream), to_dev(x, stream), out, bias=None if bb is None else to_dev(bb, stream),
              stream=stream)
    ref, slack = gemv.reference(w, x, bb), dot_slack(x, w)
    got = get(out, stream)
    if out_dtype == np.uint16:
        assert_bf16_close(got, ref, slack)
    else:
        assert np.all(np.abs(got - ref) <= slack)


def test_gemv_unaligned_view_takes_scalar_path(stream, rng):
    w, x = bf16(rng, (64, 257)), bf16(rng, (1, 257))
    dw, dx = to_dev(w, stream), to_dev(x, stream)
    from numba import cuda
    out = cuda.device_array((1, 64), np.uint16, stream=stream)
    gemv.gemv(dw[:, 1:], dx[:, 1:], out, stream=stream)      # views 2 bytes off 16-byte alignment
    assert_bf16_close(get(out, stream), gemv.reference(w[:, 1:], x[:, 1:]), dot_slack(x[:, 1:], w[:, 1:]))


# The 3.0B Llama-shaped preset's decode projections: hidden 3072, 24 q / 8 kv heads of 128, MLP 8192.
H3, QD3, KVD3, I3 = 3072, 3072, 1024, 8192


@pytest.mark.parametrize("ns,k,b,bias", [
    ((QD3, KVD3, KVD3), H3, 1, False),     # 3B q/k/v
    ((H, 1024, 1024), H, 1, True),         # Qwen2-style bias, 4096-wide
    ((QD3, KVD3), H3, 4, False),           # two matrices, batch 4
    ((37, 5, 11), 67, 1, True),            # scalar fallback
    ((QD3, KVD3, KVD3), H3, 16, True),     # batched decode on tensor cores, Qwen2-style bias
    ((QD3, KVD3), H3, 8, False),           # two matrices, one n8 tile
])
def test_gemv_multi(stream, rng, ns, k, b, bias):
    from numba import cuda
    ws = [bf16(rng, (n, k), 0.05) for n in ns]
    x = bf16(rng, (b, k))
    bs = [bf16(rng, n) for n in ns] if bias else None
    outs = [cuda.device_array((b, n), np.uint16, stream=stream) for n in ns]
    gemv.gemv_multi([to_dev(w, stream) for w in ws], to_dev(x, stream), outs,
                    biases=None if bs is None else [to_dev(v, stream) for v in bs], stream=stream)
    for w, out, ref in zip(ws, outs, gemv.reference_multi(ws, x, bs)):
        assert_bf16_close(get(out, stream), ref, dot_slack(x, w))


@pytest.mark.parametrize("n,k,b", [(I3, H3, 1), (I, H, 1), (I3, H3, 3), (37, 67, 1), (I3, H3, 16), (I, H, 32)])
def test_gemv_gate_up_silu(stream, rng, n, k, b):
    from numba import cuda
    wg, wu, x = bf16(rng, (n, k), 0.05), bf16(rng, (n, k), 0.05), bf16(rng, (b, k))
    dwg, dwu, dx = to_dev(wg, stream), to_dev(wu, stream), to_dev(x, stream)
    out = cuda.device_array((b, n), np.uint16, stream=stream)
    gemv.gemv_gate_up_silu(dwg, dwu, dx, out, stream=stream)
    got = get(out, stream)
    ref = gemv.reference_gate_up_silu(wg, wu, x)
    # vs the exact silu(G)·U: one rounding each of gate, up (plus the accumulation slack) and the product
    xf = bf16_to_f32(x).astype(np.float64)
    g, u = xf @ bf16_to_f32(wg).astype(np.float64).T, xf @ bf16_to_f32(wu).astype(np.float64).T
    dg, du = HALF_ULP * np.abs(g) + dot_slack(x, wg), HALF_ULP * np.abs(u) + dot_slack(x, wu)
    silu = g / (1 + np.exp(-g))
    prod = silu * u
    err = 1.1 * dg * (np.abs(u) + du) + np.abs(silu) * du
    err = err + HALF_ULP * (np.abs(prod) + err) + 1e-6
    assert np.all(np.abs(bf16_to_f32(got) - prod) <= err)
    assert np.mean(got == ref) >= 0.95       # fp32 accumulation flips a gate/up rounding only rarely
    # the separate launches it replaces (gate gemv, up gemv, silu_mul) give the same bits almost everywhere
    gate, up = (cuda.device_array((b, n), np.uint16, stream=stream) for _ in range(2))
    gemv.gemv(dwg, dx, gate, stream=stream)
    gemv.gemv(dwu, dx, up, stream=stream)
    elementwise.silu_mul(gate, up, gate, stream=stream)
    sep = get(gate, stream)
    assert np.all(np.abs(bf16_to_f32(sep) - bf16_to_f32(got)) <= 2 ** -6 * np.abs(bf16_to_f32(sep)) + 1e-6)
    assert np.mean(sep == got) >= 0.95


@pytest.mark.parametrize("m,n,k,bias,tm,route", [
    (2048, H, H, False, 4, "simt"), (77, I, H, True, 8, "simt"), (333, 96, 200, False, 4, "simt"),
    (2048, H, H, False, 4, "mma"), (77, I, H, True, 4, "mma"), (333, 96, 224, True, 4, "mma"),
    (1, 3584, 3584, True, 4, "mma"), (4096, 1000, 512, False, 4, "mma"),
    (2048, H, H, False, 4, "cublaslt"), (77, I, H, True, 4, "cublaslt"), (333, 96, 224, True, 4, "cublaslt"),
    (1, 3584, 3584, True, 4, "cublaslt"), (4096, 1000, 512, False, 4, "cublaslt")])
def test_gemm(stream, rng, m, n, k, bias, tm, route):
    from numba import cuda

    from vmmstream.kernels.matmul.dense import cublaslt
    x, w = bf16(rng, (m, k)), bf16(rng, (n, k), 0.05)
    bb = bf16(rng, n) if bias else None
    out = cuda.device_array((m, n), np.uint16, stream=stream)
    ws = cuda.device_array(cublaslt.WORKSPACE, np.uint8, stream=stream) if route == "cublaslt" else None
    assert route != "cublaslt" or cublaslt.available(), cublaslt.unavailable_reason()
    gemm.gemm(to_dev(x, stream), to_dev(w, stream), out, bias=None if bb is None else to_dev(bb, stream),
              stream=stream, tm=tm, route=route, workspace=ws)
    got = get(out, stream)
    rows = np.unique(np.concatenate([rng.integers(0, m, 48), [0, m - 1]]))   # fp64 reference on a sample
    assert_bf16_close(got[rows], gemm.reference(x[rows], w, bb), dot_slack(x[rows], w))


@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm(stream, rng, fused):
    from numba import cuda
    t = 2048
    x, w = bf16(rng, (t, H), 2.0), bf16(rng, H)
    r = bf16(rng, (t, H)) if fused else None
    dr = to_dev(r, stream) if fused else None
    out = cuda.device_array((t, H), np.uint16, stream=stream)
    norm.rmsnorm(to_dev(x, stream), to_dev(w, stream), out, eps=1e-5, residual=dr, stream=stream)
    ref = norm.reference(x, w, 1e-5, residual=r)
    if fused:
        ref, new_res = ref
        np.testing.assert_array_equal(get(dr, stream), new_res)
    got, want = bf16_to_f32(get(out, stream)), bf16_to_f32(ref)
    assert np.all(np.abs(got - want) <= 2 ** -7 * np.abs(want) + 1e-6)     # ≤ 1 bf16 ulp


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_rope_llama3(stream, rng):
    t = 2048
    q, k = bf16(rng, (t, HQ, D)), bf16(rng, (t, HKV, D))
    pos = np.concatenate([np.arange(t - 8), rng.integers(0, 131072, 8)]).astype(np.int32)
    inv = rope.rope_inv_freq(D, 500000.0, LLAMA3)
    dq, dk = to_dev(q, stream), to_dev(k, stream)
    rope.apply_rope(dq, dk, to_dev(pos, stream), to_dev(inv, stream), stream=stream)
    for got, x in ((get(dq, stream), q), (get(dk, stream), k)):
        want = bf16_to_f32(rope.reference(x, pos, inv))
        # device sincosf vs NumPy: a few fp32 ulps of the angle's cos/sin, then one bf16 rounding
        assert np.all(np.abs(bf16_to_f32(got) - want) <= 2 ** -7 * np.abs(want) + 1e-4)


def test_rope_append_kv_is_rope_then_append_bit_for_bit(stream, rng):
    """The fused launch the step uses equals the RoPE kernel followed by the KV-append kernel, bit for bit,
    at the 3B preset's decode shape (24 q / 8 kv heads, d = 128) into a layer-interleaved cache."""
    from vmmstream.execution.kv_kernel import kv_append_kernel
    t, hq, hkv, d, s_max, layers = 1, 24, 8, 128, 64, 3
    q, k, v = (bf16(rng, (t, h, d)) for h in (hq, hkv, hkv))
    cache = np.zeros((s_max, layers, 2, hkv, d), np.uint16)
    pos = np.array([37], np.int32)
    inv = rope.rope_inv_freq(d, 500000.0, LLAMA3)
    outs = []
    for fused in (False, True):
        dq, dk, dv, dc, dp, di = (to_dev(a, stream) for a in (q, k, v, cache, pos, inv))
        ck, cv = dc[:, 1, 0], dc[:, 1, 1]
        if fused:
            rope.apply_rope_append_kv(dq, dk, dv, ck, cv, dp, di, stream=stream)
        else:
            rope.apply_rope(dq, dk, dp, di, stream=stream)
            n = t * hkv * d
            kv_append_kernel[(n + 255) // 256, 256, stream](dk, dv, ck, cv, dp, hkv, d, n)
        outs.append([get(a, stream) for a in (dq, dk, dc)])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    assert outs[1][2][37, 1, 1].any() and not outs[1][2][36].any()


def test_silu_mul_fused_and_residual_add(stream, rng):
    from numba import cuda
    t = 2048
    gu = bf16(rng, (t, 2 * I), 3.0)
    out = cuda.device_array((t, I), np.uint16, stream=stream)
    elementwise.silu_mul_fused(to_dev(gu, stream), out, stream=stream)
    g = bf16_to_f32(gu[:, :I]).astype(np.float64)
    assert_bf16_close(get(out, stream), g / (1 + np.exp(-g)) * bf16_to_f32(gu[:, I:]), 1e-6)
    a, b = bf16(rng, (t, H)), bf16(rng, (t, H))
    da = to_dev(a, stream)
    elementwise.residual_add(da, to_dev(b, stream), da, stream=stream)
    np.testing.assert_array_equal(get(da, stream), elementwise.reference_residual_add(a, b))


@pytest.mark.parametrize("mapped", [False, True])
def test_embedding_device_and_host_mapped(stream, rng, mapped):
    from numba import cuda
    table = bf16(rng, (V, H))
    if mapped:   # pinned host memory the kernel reads through its device pointer
        dt = cuda.mapped_array((V, H), np.uint16)
        dt[:] = table
    else:
        dt = to_dev(table, stream)
    ids = rng.integers(0, V, 64).astype(np.int32)
    out = cuda.device_array((64, H), np.uint16, stream=stream)
    embedding.embedding(dt, to_dev(ids, stream), out, stream=stream)
    np.testing.assert_array_equal(get(out, stream), embedding.reference(table, ids))


@pytest.mark.parametrize("vocab,as_bf16", [(V, False), (V, True), (152064, False)])
def test_argmax(stream, rng, vocab, as_bf16):
    from numba import cuda
    x = rng.standard_normal((4, vocab), dtype=np.float32)
    x[2, 17] = x[2, vocab - 3] = 9.0          # tie: lowest index
    logits = f32_to_bf16(x) if as_bf16 else x
    ws = cuda.device_array(sampling.workspace_requirement(4, vocab).bytes, np.uint8, stream=stream)
    out = cuda.device_array(4, np.int32, stream=stream)
    sampling.argmax(to_dev(logits, stream), out, workspace=ws, stream=stream)
    np.testing.assert_array_equal(get(out, stream), sampling.reference_argmax(logits))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 1, 1.0), (0.8, 50, 1.0), (1.0, 0, 0.9),
                                                     (0.7, 40, 0.8), (0.0, 0, 1.0)])
def test_sample(stream, rng, temperature, top_k, top_p):
    from numba import cuda
    x = rng.standard_normal((4, V), dtype=np.float32) * 2
    keep = sampling.reference_keep_mask(x, temperature, top_k, top_p)
    dl, out = to_dev(x, stream), cuda.device_array(4, np.int32, stream=stream)
    st = to_dev(sampling.make_rng_state(99), stream)
    mismatches = 0
    for rep in range(8):
        sampling.sample(dl, out, st, temperature=temperature, top_k=top_k, top_p=top_p, stream=stream)
        ids = get(out, stream)
        assert keep[np.arange(4), ids].all()
        want = sampling.reference_sample(x, sampling.make_rng_state(99, rep), temperature, top_k, top_p)
        mismatches += int((ids != want).sum())
    # fp32 logs on device vs fp64 on the host: a near-tie may flip once in a long while
    assert mismatches <= 1
    assert get(st, stream)[1] == 8
    if temperature <= 0 or top_k == 1:
        np.testing.assert_array_equal(ids, sampling.reference_argmax(x))


def test_sample_rows_matches_each_rows_own_sample(stream, rng):
    """A batch of rows, each with its own parameters and state (one greedy, left as argmax wrote it), against
    ``sample`` launched for each row alone with the same state."""
    from numba import cuda
    x = rng.standard_normal((4, V), dtype=np.float32) * 2
    rows = [(0.8, 50, 1.0, 1, 3), (0.0, 0, 1.0, 0, 0), (1.0, 0, 0.9, 2, 9), (0.7, 40, 0.8, 1, 3)]
    params = np.array([sampling.row_params(t, k, p)[:2] for t, k, p, _, _ in rows], np.float32)
    top_ks = np.array([sampling.row_params(t, k, p)[2] for t, k, p, _, _ in rows], np.int32)
    states = np.stack([sampling.make_rng_state(sd, off) for *_, sd, off in rows])
    out = to_dev(np.full(4, -5, np.int32), stream)
    sampling.sample_rows(to_dev(x, stream), out, to_dev(states, stream), to_dev(params, stream),
                         to_dev(top_ks, stream), stream=stream)
    got = get(out, stream)
    assert got[1] == -5
    for b, (t, k, p, sd, off) in enumerate(rows):
        if t > 0:
            one = cuda.device_array(1, np.int32, stream=stream)
            sampling.sample(to_dev(x[b:b + 1].copy(), stream), one, to_dev(sampling.make_rng_state(sd, off), stream),
                            temperature=t, top_k=k, top_p=p, stream=stream)
            assert got[b] == get(one, stream)[0], b


def test_captured_decode_tail_replays(stream, rng):
    """embedding -> rmsnorm -> lm_head gemv -> argmax -> advance, captured once and replayed: every
    launch is capture-safe (global capture mode rejects any allocation or synchronize) and the graph
    reads the token and position it wrote on the previous replay."""
    from numba import cuda
    vocab, hid, steps = 4096, 1024, 5
    table, wn, head = bf16(rng, (vocab, hid)), bf16(rng, hid), bf16(rng, (vocab, hid), 0.05)
    d_table, d_wn, d_head = (to_dev(a, stream) for a in (table, wn, head))
    ids, nxt = to_dev(np.array([7], np.int32), stream), cuda.device_array(1, np.int32, stream=stream)
    pos, lens = to_dev(np.array([3], np.int32), stream), to_dev(np.array([4], np.int32), stream)
    toks = to_dev(np.full((1, 16), -1, np.int32), stream)
    hbuf = cuda.device_array((1, hid), np.uint16, stream=stream)
    logits = cuda.device_array((1, vocab), np.float32, stream=stream)
    ws = cuda.device_array(sampling.workspace_requirement(1, vocab).bytes, np.uint8, stream=stream)

    def step():
        embedding.embedding(d_table, ids, hbuf, stream=stream)
        norm.rmsnorm(hbuf, d_wn, hbuf, eps=1e-5, stream=stream)
        gemv.gemv(d_head, hbuf, logits, stream=stream)
        sampling.argmax(logits, nxt, workspace=ws, stream=stream)
        scalars.advance(nxt, ids, pos, lens, out_tokens=toks, stream=stream)

    step()                                   # warm-up: compile and load every kernel
    stream.synchronize()
    tok = 7
    expect = []
    for _ in range(steps + 1):               # host chain of the same ops
        hn = norm.reference(table[tok][None, :], wn, 1e-5)
        tok = int(np.argmax(gemv.reference(head, hn)[0]))
        expect.append(tok)
    with captured(stream, step) as replay:
        for _ in range(steps):
            replay()
        stream.synchronize()
    assert get(toks, stream)[0, 4:4 + steps + 1].tolist() == expect
    assert get(pos, stream)[0] == 3 + steps + 1 and get(lens, stream)[0] == 4 + steps + 1


def test_captured_decode_layer_replays_bit_identically(stream, rng):
    decode_layer_eager_vs_captured(stream, rng, 3072, 24, 8, 128, 8192, 512, 300)


def decode_layer_eager_vs_captured(stream, rng, hid, hq, hkv, d, mlp, s_max, p0, capture=True):
    """One decode layer of the 3B preset as the step launches it (RMSNorm, q/k/v in one GEMV launch, RoPE +
    KV append, split-K decode attention with the length read from device memory, o_proj, fused residual
    RMSNorm, gate/up/SiLU in one launch, down_proj, residual RMSNorm), captured once in global capture mode
    and replayed from the same starting state: every output and the KV cache equal the eager launches', bit
    for bit; a second replay at the next position equals a second eager step."""
    from numba import cuda
    from vmmstream.kernels.attention import decode as ad
    eps = 1e-5
    w = dict(ln1=bf16(rng, hid), ln2=bf16(rng, hid), lnf=bf16(rng, hid),
             q=bf16(rng, (hq * d, hid), 0.02), k=bf16(rng, (hkv * d, hid), 0.02), v=bf16(rng, (hkv * d, hid), 0.02),
             o=bf16(rng, (hid, hq * d), 0.02), g=bf16(rng, (mlp, hid), 0.02), u=bf16(rng, (mlp, hid), 0.02),
             dn=bf16(rng, (hid, mlp), 0.02))
    dw = {n: to_dev(a, stream) for n, a in w.items()}
    x0 = bf16(rng, (1, hid))
    cache0 = np.zeros((2, 1, s_max, hkv, d), np.uint16)
    cache0[:, 0, :p0] = bf16(rng, (2, p0, hkv, d))               # a context of p0 tokens already in the cache
    st0 = dict(x=x0, cache=cache0, pos=np.array([p0], np.int32), lens=np.array([p0 + 1], np.int32))
    st = {n: to_dev(a, stream) for n, a in st0.items()}
    inv = to_dev(rope.rope_inv_freq(d, 500000.0, LLAMA3), stream)
    xn = cuda.device_array((1, hid), np.uint16, stream=stream)
    q, k, v = (cuda.device_array((1, n * d), np.uint16, stream=stream) for n in (hq, hkv, hkv))
    attn = cuda.device_array((1, hq * d), np.uint16, stream=stream)
    proj = cuda.device_array((1, hid), np.uint16, stream=stream)
    gate = cuda.device_array((1, mlp), np.uint16, stream=stream)
    ws = cuda.device_array(ad.workspace_requirement(1, hq, hkv, d, s_max).bytes, np.uint8, stream=stream)
    ck4, cv4 = st["cache"][0], st["cache"][1]                       # [1, S_max, Hkv, D]

    def layer():
        norm.rmsnorm(st["x"], dw["ln1"], xn, eps=eps, stream=stream)
        gemv.gemv_multi([dw["q"], dw["k"], dw["v"]], xn, [q, k, v], stream=stream)
        rope.apply_rope_append_kv(q.reshape(1, hq, d), k.reshape(1, hkv, d), v.reshape(1, hkv, d), ck4[0], cv4[0],
                                  st["pos"], inv, stream=stream)
        ad.launch(q.reshape(1, hq, d), ck4, cv4, st["lens"], attn.reshape(1, hq, d), ws, stream=stream)
        gemv.gemv(dw["o"], attn, proj, stream=stream)
        norm.rmsnorm(proj, dw["ln2"], xn, eps=eps, residual=st["x"], stream=stream)
        gemv.gemv_gate_up_silu(dw["g"], dw["u"], xn, gate, stream=stream)
        gemv.gemv(dw["dn"], gate, proj, stream=stream)
        norm.rmsnorm(proj, dw["lnf"], xn, eps=eps, residual=st["x"], stream=stream)

    def reset():
        for n, a in st0.items():
            st[n].copy_to_device(a, stream=stream)

    def step_to(p):
        st["pos"].copy_to_device(np.array([p], np.int32), stream=stream)
        st["lens"].copy_to_device(np.array([p + 1], np.int32), stream=stream)

    def snapshot():
        return [get(a, stream).copy() for a in (xn, st["x"], st["cache"], q, attn, gate)]

    reset()
    layer()                                   # eager: compile, load, and the expected result
    eager1 = snapshot()
    step_to(p0 + 1)
    layer()
    eager2 = snapshot()
    assert eager1[2][0, 0, p0].any() and not eager1[2][0, 0, p0 + 1].any() and eager2[2][0, 0, p0 + 1].any()
    assert not np.array_equal(eager1[0], eager2[0])
    if not capture:
        return eager1, eager2

    reset()
    with captured(stream, layer) as replay:
        reset()                               # capture ran nothing: replay from the starting state
        for p, want in ((p0, eager1), (p0 + 1, eager2)):
            step_to(p)
            replay()
            for a, b in zip(snapshot(), want):
                np.testing.assert_array_equal(a, b)
