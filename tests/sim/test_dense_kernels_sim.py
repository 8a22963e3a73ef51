"""Dense decoder kernels in the Numba CUDA simulator, at small odd shapes, against their NumPy references.

Both code paths of each kernel run: the 16-byte vector path (last axis a multiple of 8, aligned) and
the scalar fallback (odd widths, unaligned halves). Blocks are kept few and small: the simulator runs
one Python thread per CUDA thread.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from vmmstream.errors import WorkspaceShortfall
from vmmstream.kernels import NONE, Lifetime
from vmmstream.kernels.ops import elementwise, embedding
from vmmstream.kernels.matmul.dense import gemm, gemv, gemv_mma
from vmmstream.kernels.ops import norm, rope, sampling, scalars
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.base.launch import vec8_ok

from simutil import HALF_ULP, bf16, dev

pytestmark = pytest.mark.sim


def assert_bf16_close(got_bits, ref_f32, abs_tol):
    """bf16 result vs an unrounded reference: one rounding plus the fp32 accumulation slack."""
    got = bf16_to_f32(got_bits).astype(np.float64)
    ref = np.asarray(ref_f32, np.float64)
    err = np.abs(got - ref)
    bound = 2 * HALF_ULP * np.abs(ref) + abs_tol
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g} (max err {err.max():.3g})"


def assert_gemv_close(got, ref, x, w):
    """A GEMV result (bf16 bits or fp32) vs its fp64 reference: the fp32 accumulation slack, plus one rounding for
    bf16."""
    slack = 1e-5 * (np.abs(bf16_to_f32(x)) @ np.abs(bf16_to_f32(w)).T) + 1e-6
    if got.dtype == np.uint16:
        assert_bf16_close(got, ref, slack)
    else:
        assert np.all(np.abs(got - ref) <= slack)


# ------------------------------------------------------------------------------------------- gemv

@pytest.mark.parametrize("n,k,b,bias,out_dtype,threads,rpb", [
    (37, 67, 1, False, np.uint16, 32, 4),     # scalar path (K % 8), bf16 out
    (13, 136, 3, True, np.float32, 32, 2),    # vector path, batch tile 4 with a clamped row, bias, fp32
    (9, 64, 2, True, np.uint16, 64, 4),       # vector path, batch tile 2, two warps
])
def test_gemv_matches_reference(n, k, b, bias, out_dtype, threads, rpb):
    rng = np.random.default_rng(n * k + b)
    w, x = bf16(rng, (n, k)), bf16(rng, (b, k))
    bb = bf16(rng, n) if bias else None
    out = cuda.device_array((b, n), out_dtype)
    assert vec8_ok(dev(w), dev(x)) == (k % 8 == 0)
    gemv.gemv(dev(w), dev(x), out, bias=None if bb is None else dev(bb),
              config=gemv.GemvConfig(threads=threads, rows_per_block=rpb))
    assert_gemv_close(out.copy_to_host(), gemv.reference(w, x, bb), x, w)


def test_gemv_vector_input():
    rng = np.random.default_rng(1)
    w, x = bf16(rng, (5, 16)), bf16(rng, 16)
    out = cuda.device_array(5, np.uint16)
    gemv.gemv(dev(w), dev(x), out, config=gemv.GemvConfig(threads=32, rows_per_block=8))
    assert_bf16_close(out.copy_to_host(), gemv.reference(w, x), 1e-5)


@pytest.mark.parametrize("ns,k,b,bias,rpb", [
    ((7, 3, 3), 24, 1, False, 2),      # q/k/v-like, vector path, a clamped row in each matrix
    ((5, 2, 4), 67, 1, True, 1),       # scalar path (K % 8), bias
    ((3, 6), 40, 2, True, 4),          # two matrices, batch tile 2, bias
])
def test_gemv_multi_matches_reference(ns, k, b, bias, rpb):
    rng = np.random.default_rng(sum(ns) * k + b)
    ws = [bf16(rng, (n, k)) for n in ns]
    x = bf16(rng, (b, k))
    bs = [bf16(rng, n) for n in ns] if bias else None
    outs = [cuda.device_array((b, n), np.uint16) for n in ns]
    gemv.gemv_multi([dev(w) for w in ws], dev(x), outs, biases=None if bs is None else [dev(v) for v in bs],
                    config=gemv.GemvConfig(threads=32, rows_per_block=rpb))
    for i, (w, ref) in enumerate(zip(ws, gemv.reference_multi(ws, x, bs))):
        assert_gemv_close(outs[i].copy_to_host(), ref, x, w)


def test_gemv_multi_rejects_mismatched_k():
    rng = np.random.default_rng(2)
    with pytest.raises(ValueError):
        gemv.gemv_multi([dev(bf16(rng, (4, 16))), dev(bf16(rng, (4, 8)))], dev(bf16(rng, 16)),
                        [cuda.device_array(4, np.uint16)] * 2)


def gate_up_bound(wg, wu, x):
    """|kernel - exact silu(G)·U|: gate and up each one bf16 rounding plus the fp32 accumulation slack
    (propagated through silu·mul, |silu'| <= 1.1), then one rounding of the product."""
    xf = bf16_to_f32(x).astype(np.float64)
    g, u = xf @ bf16_to_f32(wg).astype(np.float64).T, xf @ bf16_to_f32(wu).astype(np.float64).T
    sg = 1e-5 * (np.abs(xf) @ np.abs(bf16_to_f32(wg)).T) + 1e-6
    su = 1e-5 * (np.abs(xf) @ np.abs(bf16_to_f32(wu)).T) + 1e-6
    silu = g / (1 + np.exp(-g))
    dg, du = HALF_ULP * np.abs(g) + sg, HALF_ULP * np.abs(u) + su
    prod = silu * u
    err = 1.1 * dg * (np.abs(u) + du) + np.abs(silu) * du
    return prod, err + HALF_ULP * (np.abs(prod) + err)


@pytest.mark.parametrize("n,k,b,rpb", [(5, 24, 1, 1), (6, 67, 1, 2), (3, 40, 3, 2)])
def test_gemv_gate_up_silu_matches_reference(n, k, b, rpb):
    rng = np.random.default_rng(n * k + b)
    wg, wu, x = bf16(rng, (n, k), 0.5), bf16(rng, (n, k), 0.5), bf16(rng, (b, k))
    out = cuda.device_array((b, n), np.uint16)
    gemv.gemv_gate_up_silu(dev(wg), dev(wu), dev(x), out, config=gemv.GemvConfig(threads=32, rows_per_block=rpb))
    got = out.copy_to_host()
    ref = gemv.reference_gate_up_silu(wg, wu, x)
    # the reference is the unfused host chain, bit for bit
    g = f32_to_bf16(gemv.reference(wg, x))
    u = f32_to_bf16(gemv.reference(wu, x))
    np.testing.assert_array_equal(ref, elementwise.reference_silu_mul(g, u))
    exact, err = gate_up_bound(wg, wu, x)
    assert np.all(np.abs(bf16_to_f32(got) - exact) <= err)
    assert np.all(np.abs(bf16_to_f32(ref) - exact) <= err)
    # fp32 vs fp64 accumulation flips a gate/up rounding only rarely: nearly every element is exact
    assert np.mean(got == ref) >= 0.8
    # the launches it replaces (gate gemv, up gemv, silu_mul) accumulate each row in the same order
    gate, up = cuda.device_array((b, n), np.uint16), cuda.device_array((b, n), np.uint16)
    cfg = gemv.GemvConfig(threads=32)
    gemv.gemv(dev(wg), dev(x), gate, config=cfg)
    gemv.gemv(dev(wu), dev(x), up, config=cfg)
    elementwise.silu_mul(gate, up, gate, threads=32)
    np.testing.assert_array_equal(got, gate.copy_to_host())


# ------------------------------------------------------------------------------- gemv on tensor cores

@pytest.mark.parametrize("n,k,b,bias,out_dtype", [
    (20, 192, 9, True, np.float32),   # 2 row blocks (rows clamped), 3 K chunks over 4 warps, 2 n8 tiles, B clamped
    (16, 256, 8, False, np.uint16),   # one block, every warp one chunk, one n8 tile
])
def test_gemv_batch_takes_tensor_cores(n, k, b, bias, out_dtype):
    """B >= 8 with K % 64 == 0: ``gemv`` takes ``gemv_mma`` (W as the mma's A operand, the k order inside a chunk
    permuted alike for W and x); the sums are the reference's."""
    rng = np.random.default_rng(n + k + b)
    w, x = bf16(rng, (n, k)), bf16(rng, (b, k))
    bb = bf16(rng, n) if bias else None
    assert gemv_mma.usable(dev(w), dev(x))
    out = cuda.device_array((b, n), out_dtype)
    gemv.gemv(dev(w), dev(x), out, bias=None if bb is None else dev(bb))
    assert_gemv_close(out.copy_to_host(), gemv.reference(w, x, bb), x, w)


def test_gemv_multi_and_gate_up_take_tensor_cores():
    rng = np.random.default_rng(5)
    b, k = 10, 128
    x = bf16(rng, (b, k))
    for ns, bias in (((24, 8, 8), True), ((16, 40), False)):
        ws = [bf16(rng, (n, k)) for n in ns]
        bs = [bf16(rng, n) for n in ns] if bias else None
        outs = [cuda.device_array((b, n), np.uint16) for n in ns]
        gemv.gemv_multi([dev(w) for w in ws], dev(x), outs, biases=None if bs is None else [dev(v) for v in bs])
        for i, (w, ref) in enumerate(zip(ws, gemv.reference_multi(ws, x, bs))):
            assert_gemv_close(outs[i].copy_to_host(), ref, x, w)
    n = 18
    wg, wu = bf16(rng, (n, k), 0.5), bf16(rng, (n, k), 0.5)
    out = cuda.device_array((b, n), np.uint16)
    gemv.gemv_gate_up_silu(dev(wg), dev(wu), dev(x), out)
    exact, err = gate_up_bound(wg, wu, x)
    assert np.all(np.abs(bf16_to_f32(out.copy_to_host()) - exact) <= err)
    # equal, bit for bit, to the tensor-core gate and up launches it replaces followed by silu_mul
    gate, up = cuda.device_array((b, n), np.uint16), cuda.device_array((b, n), np.uint16)
    gemv.gemv(dev(wg), dev(x), gate)
    gemv.gemv(dev(wu), dev(x), up)
    elementwise.silu_mul(gate, up, gate, threads=32)
    np.testing.assert_array_equal(out.copy_to_host(), gate.copy_to_host())


def test_gemv_small_batches_and_odd_k_stay_on_simt():
    rng = np.random.default_rng(6)
    assert not gemv_mma.usable(dev(bf16(rng, (16, 128))), dev(bf16(rng, (7, 128))))     # B < 8
    assert not gemv_mma.usable(dev(bf16(rng, (16, 96))), dev(bf16(rng, (8, 96))))       # K % 64
    assert not gemv_mma.usable(dev(bf16(rng, (16, 128))), dev(bf16(rng, (33, 128))))    # B > 32


# ------------------------------------------------------------------------------------------- gemm

@pytest.mark.parametrize("m,n,k,bias,out_dtype,tm", [
    (5, 37, 67, True, np.uint16, 2),
    (17, 9, 20, False, np.float32, 1),
])
def test_gemm_matches_reference(m, n, k, bias, out_dtype, tm):
    rng = np.random.default_rng(m + n + k)
    x, w = bf16(rng, (m, k)), bf16(rng, (n, k))
    bb = bf16(rng, n) if bias else None
    out = cuda.device_array((m, n), out_dtype)
    gemm.gemm(dev(x), dev(w), out, bias=None if bb is None else dev(bb), tm=tm)
    ref = gemm.reference(x, w, bb)
    slack = 1e-5 * (np.abs(bf16_to_f32(x)) @ np.abs(bf16_to_f32(w)).T) + 1e-6
    if out_dtype == np.uint16:
        assert_bf16_close(out.copy_to_host(), ref, slack)
    else:
        assert np.all(np.abs(out.copy_to_host() - ref) <= slack)


@pytest.mark.parametrize("m,n,k,bias,out_dtype", [
    (70, 136, 64, True, np.uint16),     # edges in M and N (a second, partial tile of each), two K steps, bias
    (9, 24, 32, False, np.float32),     # one K step, fp32 out
])
def test_gemm_tensor_core_route_matches_reference(m, n, k, bias, out_dtype):
    """The mma route (emulated warp-wide mma in the simulator): fragments, stages and edges."""
    rng = np.random.default_rng(m + n + k)
    x, w = bf16(rng, (m, k)), bf16(rng, (n, k))
    bb = bf16(rng, n) if bias else None
    out = cuda.device_array((m, n), out_dtype)
    gemm.gemm(dev(x), dev(w), out, bias=None if bb is None else dev(bb), route="mma")
    ref = gemm.reference(x, w, bb)
    slack = 1e-5 * (np.abs(bf16_to_f32(x)) @ np.abs(bf16_to_f32(w)).T) + 1e-6
    if out_dtype == np.uint16:
        assert_bf16_close(out.copy_to_host(), ref, slack)
    else:
        assert np.all(np.abs(out.copy_to_host() - ref) <= slack)


def test_gemm_routes_and_refusals():
    rng = np.random.default_rng(0)
    x, w = dev(bf16(rng, (4, 40))), dev(bf16(rng, (8, 40)))
    out = cuda.device_array((4, 8), np.uint16)
    assert gemm.choose_route(x, w) == "simt"                 # K = 40: not a multiple of 32
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm.gemm(x, w, out, route="mma")
    with pytest.raises(ValueError, match="route"):
        gemm.gemm(x, w, out, route="wgmma")


# ---------------------------------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("t,h", [(3, 67), (2, 136)])
@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm_matches_reference(t, h, fused):
    rng = np.random.default_rng(t * h)
    x, w = bf16(rng, (t, h), 3.0), bf16(rng, h)
    r = bf16(rng, (t, h)) if fused else None
    dx, out = dev(x), cuda.device_array((t, h), np.uint16)
    dr = dev(r) if fused else None
    norm.rmsnorm(dx, dev(w), out, eps=1e-5, residual=dr, threads=32)
    ref = norm.reference(x, w, 1e-5, residual=r)
    if fused:
        ref, new_res = ref
        np.testing.assert_array_equal(dr.copy_to_host(), new_res)   # same rounded sum, bit for bit
    # the reference is rounded too: allow one bf16 ulp between two roundings of nearly equal values
    got, want = bf16_to_f32(out.copy_to_host()), bf16_to_f32(ref)
    assert np.all(np.abs(got - want) <= 2 ** -7 * np.abs(want) + 1e-6)


def test_rmsnorm_in_place():
    rng = np.random.default_rng(5)
    x, w = bf16(rng, (2, 40)), bf16(rng, 40)
    dx = dev(x)
    norm.rmsnorm(dx, dev(w), dx, eps=1e-6, threads=32)
    want = bf16_to_f32(norm.reference(x, w, 1e-6))
    assert np.all(np.abs(bf16_to_f32(dx.copy_to_host()) - want) <= 2 ** -7 * np.abs(want) + 1e-6)


# ------------------------------------------------------------------------------------------- rope

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("d,scaling", [(16, LLAMA3), (10, None)])
def test_rope_matches_reference(d, scaling):
    rng = np.random.default_rng(d)
    t, hq, hkv = 3, 4, 2
    q, k = bf16(rng, (t, hq, d)), bf16(rng, (t, hkv, d))
    pos = np.array([0, 7, 4099], np.int32)
    inv = rope.rope_inv_freq(d, 500000.0 if scaling else 10000.0, scaling)
    dq, dk = dev(q), dev(k)
    rope.apply_rope(dq, dk, dev(pos), dev(inv), threads=32)
    for got, x in ((dq, q), (dk, k)):
        want = bf16_to_f32(rope.reference(x, pos, inv))
        g = bf16_to_f32(got.copy_to_host())
        scale = np.abs(bf16_to_f32(x)).max()
        assert np.all(np.abs(g - want) <= 2 ** -7 * np.abs(want) + 1e-6 * scale)
    np.testing.assert_array_equal(bf16_to_f32(dq.copy_to_host())[0], bf16_to_f32(q)[0])  # position 0


@pytest.mark.parametrize("d", [16, 10])
def test_rope_append_kv_matches_rope_then_append(d):
    """The fused RoPE + KV-append launch: q and k rotated like ``apply_rope``, rotated k and v written to
    the cache rows at the device positions (a strided per-layer view of a layer-interleaved cache, like the
    executor's), a position past the cache writes nothing, other rows untouched."""
    rng = np.random.default_rng(d + 1)
    t, hq, hkv, s_max, layers = 3, 4, 2, 9, 2
    q, k, v = bf16(rng, (t, hq, d)), bf16(rng, (t, hkv, d)), bf16(rng, (t, hkv, d))
    cache = bf16(rng, (s_max, layers, 2, hkv, d))           # position-major: [pos, layer, k|v, head, dim]
    pos = np.array([5, 0, 12], np.int32)                     # 12 >= s_max: not written
    inv = rope.rope_inv_freq(d, 10000.0)
    dq, dk, dv, dc = dev(q), dev(k), dev(v), dev(cache)
    ck, cv = dc[:, 1, 0], dc[:, 1, 1]                        # layer 1's K and V: strided rows
    rope.apply_rope_append_kv(dq, dk, dv, ck, cv, dev(pos), dev(inv), threads=32)
    wq, wk, wck, wcv = rope.reference_append_kv(q, k, v, cache[:, 1, 0], cache[:, 1, 1], pos, inv)
    for got, want in ((dq, wq), (dk, wk)):
        g, w = bf16_to_f32(got.copy_to_host()), bf16_to_f32(want)
        assert np.all(np.abs(g - w) <= 2 ** -7 * np.abs(w) + 1e-6)
    out = dc.copy_to_host()
    g = bf16_to_f32(out[:, 1, 0])
    assert np.all(np.abs(g - bf16_to_f32(wck)) <= 2 ** -7 * np.abs(bf16_to_f32(wck)) + 1e-6)
    np.testing.assert_array_equal(out[:, 1, 1], wcv)                   # v copied bit for bit
    np.testing.assert_array_equal(out[:, 0], cache[:, 0])              # the other layer untouched
    untouched = [p for p in range(s_max) if p not in (5, 0)]
    np.testing.assert_array_equal(out[untouched], cache[untouched])
    np.testing.assert_array_equal(out[5, 1, 0], dk.copy_to_host()[0])  # the cache holds the rotated k


@pytest.mark.parametrize("d,rot,scale", [(32, 16, 1.25), (16, 12, 1.5), (10, 6, 1.0)])
def test_partial_rope_and_scale_match_reference(d, rot, scale):
    """A partial rotary factor (only the first ``rot`` dims rotate, pairs i and i + rot/2; Phi-4-mini) and cos/sin
    times ``scale`` (longrope's attention factor): the 8-wide path (rot/2 % 8 == 0) and the scalar one; the
    unrotated dims come back bit for bit, in q and k and in the cache rows the fused append writes."""
    rng = np.random.default_rng(d + rot)
    t, hq, hkv, s_max = 3, 4, 2, 6
    q, k, v = bf16(rng, (t, hq, d)), bf16(rng, (t, hkv, d)), bf16(rng, (t, hkv, d))
    pos = np.array([2, 0, 5], np.int32)
    inv = rope.rope_inv_freq(rot, 10000.0)
    assert inv.shape == (rot // 2,)
    dq, dk = dev(q), dev(k)
    rope.apply_rope(dq, dk, dev(pos), dev(inv), scale=scale, threads=32)
    for got, x in ((dq, q), (dk, k)):
        want = rope.reference(x, pos, inv, scale)
        g = got.copy_to_host()
        np.testing.assert_array_equal(g[..., rot:], x[..., rot:])
        gf, wf = bf16_to_f32(g), bf16_to_f32(want)
        assert np.all(np.abs(gf - wf) <= 2 ** -7 * np.abs(wf) + 1e-6)
    # position 0: cos 1, sin 0, so the rotated dims are only scaled
    np.testing.assert_allclose(bf16_to_f32(dq.copy_to_host())[1, :, :rot], bf16_to_f32(q)[1, :, :rot] * scale,
                               rtol=2 ** -8)
    cache = bf16(rng, (s_max, 2, hkv, d))
    dq, dk, dv, dc = dev(q), dev(k), dev(v), dev(cache)
    rope.apply_rope_append_kv(dq, dk, dv, dc[:, 0], dc[:, 1], dev(pos), dev(inv), scale=scale, threads=32)
    wq, wk, wck, wcv = rope.reference_append_kv(q, k, v, cache[:, 0], cache[:, 1], pos, inv, scale)
    out = dc.copy_to_host()
    for got, want in ((dq.copy_to_host(), wq), (dk.copy_to_host(), wk), (out[:, 0], wck)):
        np.testing.assert_array_equal(got[..., rot:], want[..., rot:])
        g, w = bf16_to_f32(got), bf16_to_f32(want)
        assert np.all(np.abs(g - w) <= 2 ** -7 * np.abs(w) + 1e-6)
    np.testing.assert_array_equal(out[:, 1], wcv)
    np.testing.assert_array_equal(out[pos, 0], dk.copy_to_host())     # the cache rows hold all of the new k
    with pytest.raises(ValueError, match="rope shapes"):
        rope.apply_rope(dq, dk, dev(pos), dev(np.ones(d // 2 + 1, np.float32)))


def test_rope_inv_freq_semantics():
    d, theta = 128, 500000.0
    base = rope.rope_inv_freq(d, theta)
    np.testing.assert_allclose(base, 1.0 / theta ** (np.arange(0, d, 2) / d), rtol=1e-6)
    assert base.dtype == np.float32 and base.shape == (d // 2,)
    scaled = rope.rope_inv_freq(d, theta, LLAMA3)
    wavelen = 2 * np.pi / base
    high = wavelen < 8192 / 4.0            # short wavelengths: unchanged
    low = wavelen > 8192 / 1.0             # long wavelengths: divided by the factor
    mid = ~high & ~low
    np.testing.assert_array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8.0, rtol=1e-6)
    assert mid.any() and np.all(scaled[mid] <= base[mid]) and np.all(scaled[mid] >= base[mid] / 8.0)
    np.testing.assert_allclose(rope.rope_inv_freq(d, theta, {"type": "linear", "factor": 2.0}), base / 2)
    with pytest.raises(NotImplementedError):
        rope.rope_inv_freq(d, theta, {"rope_type": "yarn", "factor": 4.0})


# ------------------------------------------------------------------------------------ elementwise

@pytest.mark.parametrize("t,i", [(3, 67), (2, 24)])
def test_silu_mul_and_residual_add(t, i):
    rng = np.random.default_rng(t + i)
    g, u = bf16(rng, (t, i), 4.0), bf16(rng, (t, i))
    out = cuda.device_array((t, i), np.uint16)
    elementwise.silu_mul(dev(g), dev(u), out, threads=32)
    gf = bf16_to_f32(g).astype(np.float64)
    want = gf / (1 + np.exp(-gf)) * bf16_to_f32(u)
    assert_bf16_close(out.copy_to_host(), want, 1e-6)
    da = dev(g)
    elementwise.residual_add(da, dev(u), da, threads=32)          # in place
    np.testing.assert_array_equal(da.copy_to_host(), elementwise.reference("residual_add", g, u))


@pytest.mark.parametrize("i", [24, 12])   # halves 16-byte aligned (vector path) / not (scalar path)
def test_silu_mul_fused_gate_up(i):
    rng = np.random.default_rng(i)
    gu = bf16(rng, (3, 2 * i), 3.0)
    dgu, out = dev(gu), cuda.device_array((3, i), np.uint16)
    assert vec8_ok(dgu[:, :i], dgu[:, i:]) == (i % 8 == 0)
    elementwise.silu_mul_fused(dgu, out, threads=32)
    np.testing.assert_array_equal(out.copy_to_host(),
                                  elementwise.reference_silu_mul(gu[:, :i], gu[:, i:]))


# -------------------------------------------------------------------------------------- embedding

@pytest.mark.parametrize("h", [67, 24])
def test_embedding_gathers_rows(h):
    rng = np.random.default_rng(h)
    table = bf16(rng, (11, h))
    ids = np.array([3, 0, 10, 3, -1, 11], np.int32)
    out = cuda.device_array((ids.size, h), np.uint16)
    embedding.embedding(dev(table), dev(ids), out, threads=32)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:4], embedding.reference(table, ids[:4]))
    assert not got[4:].any()                              # out-of-range ids give zero rows
    with pytest.raises(IndexError):
        embedding.reference(table, ids)


# --------------------------------------------------------------------------------------- sampling

def logits_with_unique_max(rng, b, v):
    x = rng.standard_normal((b, v)).astype(np.float32) * 3
    x[np.arange(b), rng.integers(0, v, b)] = 20.0
    return x


@pytest.mark.parametrize("as_bf16", [False, True])
def test_argmax_two_pass(as_bf16):
    rng = np.random.default_rng(7)
    b, v = 3, 1000
    x = logits_with_unique_max(rng, b, v)
    x[1, 200] = x[1, 900] = 50.0                            # a tie: the lower index wins
    logits = f32_to_bf16(x) if as_bf16 else x
    req = sampling.workspace_requirement(b, v, nsplit=4)
    assert req.lifetime is Lifetime.SESSION
    assert req.bytes == sampling._layout(b, v, 4)[1].total
    ws = cuda.device_array(req.bytes, np.uint8)
    out = cuda.device_array(b, np.int32)
    sampling.argmax(dev(logits), out, workspace=ws, nsplit=4, threads=32)
    np.testing.assert_array_equal(out.copy_to_host(), sampling.reference_argmax(logits))
    assert out.copy_to_host()[1] == 200


def test_argmax_workspace_shortfall():
    b, v = 2, 5000
    req = sampling.workspace_requirement(b, v)
    out = cuda.device_array(b, np.int32)
    logits = cuda.device_array((b, v), np.float32)
    for ws in (None, cuda.device_array(req.bytes - 1, np.uint8)):
        with pytest.raises(WorkspaceShortfall) as e:
            sampling.argmax(logits, out, workspace=ws)
        assert e.value.needed == req.bytes


SAMPLE_CASES = [(1.0, 1, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 20, 0.5), (0.0, 0, 1.0), (2.0, 0, 1.0)]


def spread_logits(rng, v):
    """Row 0: 50 strong candidates over a flat tail; row 1: flat. Sampling is spread over many tokens,
    so a filter that kept too much would show up within a few draws."""
    x = rng.standard_normal((2, v)).astype(np.float32)
    x[0] *= 2.0
    x[0, rng.permutation(v)[:50]] = np.linspace(4.0, 6.0, 50, dtype=np.float32)
    return x


@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLE_CASES)
def test_sample_properties(temperature, top_k, top_p):
    rng = np.random.default_rng(11)
    b, v = 2, 301
    x = spread_logits(rng, v)
    logits = f32_to_bf16(x) if top_k == 20 else x               # bf16 logits in one case
    xf = bf16_to_f32(logits) if logits.dtype == np.uint16 else logits
    keep = sampling.reference_keep_mask(xf, temperature, top_k, top_p)
    if 0 < top_k < v and top_p == 1.0:
        assert (keep.sum(axis=1) >= top_k).all() and (keep.sum(axis=1) <= top_k + 1).all()  # (+ ties)
    state0 = sampling.make_rng_state(1234, offset=5)
    dl, out, st = dev(logits), cuda.device_array(b, np.int32), dev(state0)
    draws = []
    for rep in range(4):
        sampling.sample(dl, out, st, temperature=temperature, top_k=top_k, top_p=top_p, threads=32)
        ids = out.copy_to_host()
        state = st.copy_to_host()
        assert state[1] == 5 + rep + 1 and state[2] == 0      # offset advanced once, counter reset
        assert keep[np.arange(b), ids].all()                  # always inside the top-k / top-p set
        want = sampling.reference_sample(xf, state0 + np.array([0, rep, 0, 0], np.uint64),
                                         temperature, top_k, top_p)
        np.testing.assert_array_equal(ids, want)              # same Philox stream, same Gumbel draw
        draws.append(ids)
    if temperature <= 0 or top_k == 1:
        for ids in draws:
            np.testing.assert_array_equal(ids, sampling.reference_argmax(xf))
    elif top_k != 5:
        assert len({tuple(d) for d in draws}) > 1             # replays really draw differently
    # a fixed (seed, offset) reproduces the draw
    st2 = dev(state0)
    sampling.sample(dl, out, st2, temperature=temperature, top_k=top_k, top_p=top_p, threads=32)
    np.testing.assert_array_equal(out.copy_to_host(), draws[0])


def test_sample_rows_draws_each_row_as_sample_does_alone():
    """Rows with their own (temperature, top_k, top_p) and Philox state: each drawing row gets what ``sample``
    draws for that row alone with that state (counter row 0); a greedy row keeps what was in out_ids; the states
    are not advanced."""
    rng = np.random.default_rng(12)
    v = 301
    x = np.concatenate([spread_logits(rng, v), spread_logits(rng, v)])          # 4 rows
    rows = [(0.8, 20, 1.0, 3, 7), (0.0, 0, 1.0, 0, 0), (1.3, 0, 0.9, 11, 2), (1.0, 5, 0.8, 3, 7)]
    params = np.array([sampling.row_params(t, k, p)[:2] for t, k, p, _, _ in rows], np.float32)
    top_ks = np.array([sampling.row_params(t, k, p)[2] for t, k, p, _, _ in rows], np.int32)
    states = np.stack([sampling.make_rng_state(sd, off) for *_, sd, off in rows])
    out, st = dev(np.full(4, -5, np.int32)), dev(states)
    sampling.sample_rows(dev(x), out, st, dev(params), dev(top_ks), threads=32)
    got = out.copy_to_host()
    np.testing.assert_array_equal(st.copy_to_host(), states)
    np.testing.assert_array_equal(got, sampling.reference_sample_rows(x, np.full(4, -5, np.int32), states, params,
                                                                      top_ks))
    assert got[1] == -5
    for b, (t, k, p, sd, off) in enumerate(rows):
        if t > 0:
            one = cuda.device_array(1, np.int32)
            sampling.sample(dev(x[b:b + 1]), one, dev(sampling.make_rng_state(sd, off)), temperature=t, top_k=k,
                            top_p=p, threads=32)
            assert got[b] == one.copy_to_host()[0], b


def test_sample_needs_no_workspace():
    assert sampling.workspace_requirement(4, 32000, route="sample").bytes == 0


# ---------------------------------------------------------------------------------------- scalars

@pytest.mark.parametrize("append", [False, True])
def test_advance_decode_scalars(append):
    nxt = np.array([5, 9, 2], np.int32)
    inp = np.zeros(3, np.int32)
    pos = np.array([10, 3, 7], np.int32)
    lens = np.array([11, 4, 6], np.int32)          # the last sequence's buffer is full
    toks = np.full((3, 6), -1, np.int32)
    d = [dev(a) for a in (nxt, inp, pos, lens)]
    dt = dev(toks) if append else None
    scalars.advance(*d, out_tokens=dt)
    want = scalars.reference(nxt, inp, pos, lens, toks if append else None)
    for got, w in zip(d[1:] + ([dt] if append else []), want):
        np.testing.assert_array_equal(got.copy_to_host(), w)
    if append:
        assert want[3][0].tolist() == [-1] * 6 and want[3][1, 4] == 9 and (want[3][2] == -1).all()


# -------------------------------------------------------------------------------------- workspace

@pytest.mark.parametrize("mod,args", [
    (gemv, (14336, 4096)), (gemm, (2048, 4096, 4096)), (norm, (4096, 4096)), (rope, (1, 32, 8, 128)),
    (elementwise, (1, 14336)), (embedding, (1, 4096)), (scalars, (1,)),
])
def test_no_scratch_kernels_declare_none(mod, args):
    assert mod.workspace_requirement(*args) == NONE
    assert mod.CAPTURE_SAFE is True
    assert mod.SIGNATURES


def test_none_workspace_launch_accepts_any_view():
    rng = np.random.default_rng(3)
    a = bf16(rng, (1, 8))
    out = cuda.device_array((1, 8), np.uint16)
    elementwise.residual_add(dev(a), dev(a), out, workspace=cuda.device_array(0, np.uint8), threads=32)
    np.testing.assert_array_equal(out.copy_to_host(), elementwise.reference("residual_add", a, a))


def test_rope_append_kv_writes_each_token_at_its_own_row():
    """A batch: token t rotated at its sequence position positions[t] but written to cache row rows[t] (its
    sequence's range of a flat cache); the rows are not the positions."""
    rng = np.random.default_rng(7)
    t, hq, hkv, d, s = 3, 2, 1, 16, 12
    q, k, v = bf16(rng, (t, hq, d)), bf16(rng, (t, hkv, d)), bf16(rng, (t, hkv, d))
    ck, cv = bf16(rng, (s, hkv, d)), bf16(rng, (s, hkv, d))
    pos, rows = np.array([3, 0, 5], np.int32), np.array([3, 4, 9], np.int32)    # sequences at 0, 4, 8
    inv = rope.rope_inv_freq(d, 10000.0)
    dq, dk, dck, dcv = dev(q), dev(k), dev(ck), dev(cv)
    rope.apply_rope_append_kv(dq, dk, dev(v), dck, dcv, dev(pos), dev(inv), rows=dev(rows), threads=32)
    wq, wk, wck, wcv = rope.reference_append_kv(q, k, v, ck, cv, pos, inv, rows=rows)
    np.testing.assert_array_equal(dcv.copy_to_host(), wcv)
    got = bf16_to_f32(dck.copy_to_host())
    assert np.all(np.abs(got - bf16_to_f32(wck)) <= 2 ** -7 * np.abs(bf16_to_f32(wck)) + 1e-6)
    assert not np.array_equal(wck[[3, 4, 9]], ck[[3, 4, 9]]) and np.array_equal(wck[[0, 5]], ck[[0, 5]])
