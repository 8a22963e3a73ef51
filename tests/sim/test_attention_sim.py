"""Attention kernels in the Numba CUDA simulator, at small odd shapes, against their NumPy references,
plus the workspace contract (invariant I7).

Covered here: every prefill route (fused fp32-FMA, fused tensor-core, materialized scores), a prefill
chunk at a start offset into a longer cache, decode with device-held lengths below S_max (zero
included) and a partial last split, GQA head mapping, short workspace views.

What the simulator cannot check, left to tests/gpu/test_attention_gpu.py:
- the real ``mma.sync`` and ``cvt.rn.bf16x2`` inline PTX and the ``shfl.xor`` quad reductions of the
  ``fused_mma`` route: here they are twins in ``kernels/base/mma.py`` that implement the documented fragment
  layouts in NumPy (so the kernel's fragment indexing IS checked, the hardware's layout is not);
- the 16-byte vector loads of decode (``launch.ld8_ro``), likewise twins;
- real shapes, real speed, launch bounds and register pressure.
The simulator runs one Python thread per CUDA thread: cases are kept to a few thousand threads.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from numba import cuda

from vmmstream.errors import WorkspaceShortfall
from vmmstream.kernels import NONE, Lifetime
from vmmstream.kernels.attention import decode as ad, prefill as ap
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.base.workspace import align_up

pytestmark = pytest.mark.sim

HALF_ULP = 2.0 ** -8


@pytest.fixture
def switch_interval(request):
    # One Python thread per CUDA thread: barrier-heavy kernels run far faster with quick GIL hand-offs,
    # arithmetic-heavy ones slower. Each test says which it is.
    old = sys.getswitchinterval()
    sys.setswitchinterval(getattr(request, "param", 5e-4))
    yield
    sys.setswitchinterval(old)


def bf16(rng, shape):
    return f32_to_bf16(rng.standard_normal(shape).astype(np.float32))


def assert_bf16_close(got_bits, ref, abs_tol):
    """A bf16 result vs the fp64-computed reference: one output rounding plus ``abs_tol``."""
    got = bf16_to_f32(got_bits).astype(np.float64)
    err = np.abs(got - ref)
    bound = HALF_ULP * np.abs(ref) + abs_tol
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g} (max err {err.max():.3g})"


def run_prefill(T, Hq, Hkv, D, start_pos, route, seed=0):
    rng = np.random.default_rng(seed)
    S = start_pos + T + 3                        # a cache longer than the keys attended to
    q, k, v = bf16(rng, (T, Hq, D)), bf16(rng, (S, Hkv, D)), bf16(rng, (S, Hkv, D))
    req = ap.workspace_requirement(T, Hq, Hkv, D, start_pos=start_pos, route=route)
    ws = cuda.to_device(np.zeros(req.bytes, np.uint8)) if req.bytes else None
    out = cuda.to_device(np.zeros_like(q))
    stream = cuda.stream()
    ap.launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, ws,
              start_pos=start_pos, route=route, stream=stream)
    stream.synchronize()
    return out.copy_to_host(), ap.reference(q, k, v, start_pos=start_pos)


# --------------------------------------------------------------------------------------- prefill

@pytest.mark.parametrize("switch_interval", [5e-3], indirect=True)
@pytest.mark.parametrize("T,Hq,Hkv,D,start_pos", [
    (7, 4, 2, 64, 0),       # one key tile, two KV heads (GQA mapping), rows past T masked off
    (9, 2, 1, 64, 30),      # chunk at an offset: keys [0, 39) span two 32-key tiles, diagonal in the second
    (3, 1, 1, 128, 2),
])
def test_prefill_fused(switch_interval, T, Hq, Hkv, D, start_pos):
    got, ref = run_prefill(T, Hq, Hkv, D, start_pos, ap.FUSED)
    assert_bf16_close(got, ref, 2e-3)


@pytest.mark.parametrize("switch_interval", [5e-4], indirect=True)
@pytest.mark.parametrize("T,Hq,Hkv,D,start_pos", [
    (11, 2, 1, 64, 60),     # keys [0, 71): two 64-key tiles, the diagonal in the second
    (5, 1, 1, 128, 66),
    (7, 2, 1, 80, 3),       # head_dim 80: the V tile's last load round is partial (2.5 rounds of 128 threads)
    (6, 1, 1, 48, 0),       # head_dim 48: a partial V round (1.5 rounds of 128 threads)
])
def test_prefill_fused_mma_fragment_indexing(switch_interval, T, Hq, Hkv, D, start_pos):
    # P is rounded to bf16 for the P @ V mma (as on the GPU), hence the looser tolerance.
    got, ref = run_prefill(T, Hq, Hkv, D, start_pos, ap.FUSED_MMA)
    assert_bf16_close(got, ref, 1e-2)


@pytest.mark.parametrize("switch_interval", [5e-4], indirect=True)
@pytest.mark.parametrize("T,Hq,Hkv,D,start_pos", [
    (11, 2, 1, 64, 60),     # keys [0, 71): a full tile (no mask for rows past 63) then the diagonal tile
    (70, 2, 1, 64, 0),      # two query blocks; the first block's warps see clear tiles and diagonal tiles
    (5, 1, 1, 96, 130),     # head_dim 96 (three ldmatrix.x4 per n-tile), three tiles, the last partial
])
def test_prefill_fused_mma_async_cp_async_and_ldmatrix(switch_interval, T, Hq, Hkv, D, start_pos):
    # The ldmatrix twins move the words the documented fragment layouts say; cp.async copies at once here.
    got, ref = run_prefill(T, Hq, Hkv, D, start_pos, ap.FUSED_MMA_ASYNC)
    assert_bf16_close(got, ref, 1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("switch_interval", [5e-4], indirect=True)
@pytest.mark.parametrize("shape,T,D,start_pos", [
    ((64, 4, True, None), 70, 64, 3),      # Q tile from shared memory by ldmatrix; rows past T zero-filled
    ((32, 4, True, None), 21, 96, 40),     # 32-key tiles, Q in shared memory (D = 96: 12 pieces a row)
    ((32, 8, False, None), 130, 96, 0),    # 8 warps, 128 rows a block: two blocks, one partial; 384 pieces a
                                           # K / V tile for 256 threads, so the second copy round is partial
    ((64, 4, False, None, True), 70, 64, 100),   # K and V double-buffered: three tiles through both buffers
    ((32, 4, False, None, True), 21, 96, 40),    # the same at 32 keys a tile, the last tile partial
])
def test_prefill_async_block_shapes(switch_interval, monkeypatch, shape, T, D, start_pos):
    # Every block shape the async route can be set to computes the same attention (the GPU bench picks one).
    monkeypatch.setitem(ap.ASYNC_SHAPE, D, shape)
    got, ref = run_prefill(T, 2, 1, D, start_pos, ap.FUSED_MMA_ASYNC)
    assert_bf16_close(got, ref, 1e-2)


def test_prefill_async_shape_over_static_shared_memory_is_refused():
    with pytest.raises(ValueError, match="48 KiB"):
        ap._make_mma_async(128, 64, 4, True)       # Q (17 KiB) + K and V tiles of 64 keys (35 KiB)


def test_prefill_async_route_refuses_other_head_dims():
    with pytest.raises(ValueError, match="head_dim"):
        ap.launch(*(cuda.to_device(np.zeros(sh, np.uint16)) for sh in ((4, 1, 80), (4, 1, 80), (4, 1, 80),
                                                                         (4, 1, 80))),
                  None, route=ap.FUSED_MMA_ASYNC, stream=cuda.stream())


@pytest.mark.parametrize("switch_interval", [5e-4], indirect=True)
def test_prefill_materialized_odd_head_dim(switch_interval):
    # D = 40: a head dim the fused routes do not take, so choose_route sends it here
    assert ap.choose_route(5, 4, 2, 40, start_pos=11) == ap.MATERIALIZED
    got, ref = run_prefill(5, 4, 2, 40, 11, None)
    assert_bf16_close(got, ref, 2e-3)


def test_i7_prefill_requirements():
    assert ap.choose_route(2048, 32, 8, 128) == ap.FUSED_MMA_ASYNC
    assert ap.choose_route(2048, 32, 8, 80) == ap.FUSED_MMA
    for route in (ap.FUSED, ap.FUSED_MMA, ap.FUSED_MMA_ASYNC):
        assert ap.workspace_requirement(2048, 32, 8, 128, route=route) == NONE
    req = ap.workspace_requirement(5, 4, 2, 40, start_pos=11, route=ap.MATERIALIZED)
    assert req.lifetime == Lifetime.STEP
    assert req.bytes == align_up(1 * 4 * 5 * (11 + 5) * 4)      # B * H * Sq * Sk * fp32
    assert req.bytes == ap._layout(5, 4, 40, 11, ap.MATERIALIZED).total
    with pytest.raises(ValueError):
        ap.workspace_requirement(5, 4, 2, 64, route="nope")


def test_i7_prefill_short_view_refused():
    T, Hq, Hkv, D, sp = 5, 4, 2, 40, 11
    q = cuda.to_device(np.zeros((T, Hq, D), np.uint16))
    kv = cuda.to_device(np.zeros((sp + T, Hkv, D), np.uint16))
    out = cuda.to_device(np.zeros((T, Hq, D), np.uint16))
    need = ap.workspace_requirement(T, Hq, Hkv, D, start_pos=sp).bytes
    for ws in (None, cuda.to_device(np.zeros(need - 1, np.uint8))):
        with pytest.raises(WorkspaceShortfall) as e:
            ap.launch(q, kv, kv, out, ws, start_pos=sp, stream=cuda.stream())
        assert e.value.needed == need
    with pytest.raises(ValueError):      # the fused routes take head dims 64 and 128 only
        ap.launch(q, kv, kv, out, None, start_pos=sp, route=ap.FUSED, stream=cuda.stream())


def test_prefill_formulas():
    assert ap.flops(4, 2, 8, start_pos=3) == 4 * 8 * 2 * (4 * 3 + 10)
    assert ap.bytes_moved(4, 2, 1, 64, route=ap.FUSED) == 2 * (2 * 4 * 2 * 64 + 2 * 4 * 1 * 64)


# ---------------------------------------------------------------------------------------- decode

@pytest.fixture(autouse=True)
def _small_decode_combine(monkeypatch):
    # one Python thread per CUDA thread: a 128-thread combine (4 or 8 split lanes) keeps the decode cases fast
    monkeypatch.setattr(ad, "C_THREADS", 128)


def run_decode(B, Hq, Hkv, D, S_max, lengths, three_d=False, seed=1):
    rng = np.random.default_rng(seed)
    q = bf16(rng, (B, Hq, D))
    k, v = bf16(rng, (B, S_max, Hkv, D)), bf16(rng, (B, S_max, Hkv, D))
    lens = np.asarray(lengths, np.int32)
    req = ad.workspace_requirement(B, Hq, Hkv, D, S_max)
    ws = cuda.to_device(np.full(req.bytes, 0xFF, np.uint8))      # garbage partials must not leak in
    out = cuda.to_device(np.full((B, Hq, D), 0x7FC0, np.uint16))
    dk, dv = (cuda.to_device(x[0] if three_d else x) for x in (k, v))
    stream = cuda.stream()
    ad.launch(cuda.to_device(q), dk, dv, cuda.to_device(lens), out, ws, stream=stream)
    stream.synchronize()
    return out.copy_to_host(), ad.reference(q, k, v, lens)


@pytest.mark.parametrize("switch_interval", [5e-4], indirect=True)
@pytest.mark.parametrize("B,D,S_max,lengths,three_d", [
    (2, 64, 100, [37, 70], False),     # 2 splits of 64: one sequence uses one, the other a partial second
    (1, 128, 150, [129], True),        # [S_max, Hkv, D] cache, 3 splits, last one holds a single key
    (2, 64, 70, [0, 5], False),        # an empty sequence gives zeros; only split 0 active
    (1, 256, 40, [33], True),          # head_dim 256: one lane group per warp (32 lanes x 8 dims)
    (1, 80, 40, [33], True),           # head_dim 80: 10 live lanes of 16; pass 2 in whole split lanes (120 threads)
    (2, 96, 24, [21, 3], False),       # head_dim 96: 12 live lanes of 16
])
def test_decode_device_length(switch_interval, B, D, S_max, lengths, three_d):
    got, ref = run_decode(B, 4, 2, D, S_max, lengths, three_d)
    assert_bf16_close(got, ref, 2e-3)


@pytest.mark.parametrize("switch_interval", [5e-4], indirect=True)
@pytest.mark.parametrize("B,Hq,Hkv,lengths", [
    (1, 18, 2, [20]),         # 9 query heads per KV head: groups of 3, two KV heads (multi-query is Hkv = 1)
    (2, 16, 1, [20, 7]),      # multi-query, two sequences: 2 groups of 8 heads on the grid's y, per sequence
])
def test_decode_wide_groups_go_in_head_groups(switch_interval, B, Hq, Hkv, lengths):
    assert ad.head_group(Hq // Hkv) < Hq // Hkv
    got, ref = run_decode(B, Hq, Hkv, 64, 40, lengths, seed=5)
    assert_bf16_close(got, ref, 2e-3)


@pytest.mark.parametrize("switch_interval", [5e-4], indirect=True)
@pytest.mark.parametrize("W,U,PF,FLAT,RS,Hq,D,S_max,lengths", [
    (2, 2, False, True, False, 4, 128, 150, [129]),   # no prefetch; 16 keys a step, 4 steps in a full split, 1 key in the last
    (1, 8, True, True, False, 4, 64, 100, [37, 70]),  # prefetch across 2 steps of 32 keys; one warp, four streams
    (4, 4, True, True, False, 4, 128, 150, [129]),    # the default shape with running-offset loads
    # reduce-scatter sums: 8 scores over 16 lanes (scatter 3 levels, then a plain butterfly), 16 over 8 lanes
    # (two per lane), 12 padded to 16 over 16 lanes (G = 3, the 3B preset's grouping)
    (2, 4, True, False, True, 4, 128, 150, [129]),
    (1, 4, True, True, True, 4, 64, 100, [37, 70]),
    (1, 4, True, True, True, 6, 128, 80, [77]),
])
def test_decode_pass1_variants(switch_interval, monkeypatch, W, U, PF, FLAT, RS, Hq, D, S_max, lengths):
    # the swept pass-1 shapes (warps per block, keys per stream step, prefetch, load addressing, how the
    # dot products are summed over a lane group) index the same keys
    for name, val in (("WARPS", W), ("KEYS", U), ("PREFETCH", PF), ("FLAT_LOADS", FLAT), ("SCATTER_SUM", RS)):
        monkeypatch.setattr(ad, name, val)
    got, ref = run_decode(len(lengths), Hq, 2, D, S_max, lengths, seed=3)
    assert_bf16_close(got, ref, 2e-3)


def test_i7_decode_requirement_and_short_view():
    B, Hq, Hkv, D, S_max = 2, 4, 2, 64, 100
    chunk, ns = ad.plan(B, Hkv, S_max, Hq // Hkv)
    assert (chunk, ns) == (32, 4)                  # the smallest chunk: 4 blocks of a wave of 396
    req = ad.workspace_requirement(B, Hq, Hkv, D, S_max)
    assert req.lifetime == Lifetime.SESSION
    assert req.bytes == 2 * align_up(B * Hq * ns * 4) + align_up(B * Hq * ns * D * 4)
    assert req.bytes == ad._layout(B, Hq, Hkv, D, S_max).total
    q = cuda.to_device(np.zeros((B, Hq, D), np.uint16))
    kv = cuda.to_device(np.zeros((B, S_max, Hkv, D), np.uint16))
    lens = cuda.to_device(np.array([3, 4], np.int32))
    for ws in (None, cuda.to_device(np.zeros(req.bytes - 1, np.uint8))):
        with pytest.raises(WorkspaceShortfall):
            ad.launch(q, kv, kv, lens, q, ws, stream=cuda.stream())


def test_decode_plan_fills_an_h200():
    # 32 query / 8 KV heads: one wave of resident pass-1 blocks at S_max (the capture bound), not at the
    # length; the split count follows S_max. S=32768 gives the swept best, 672 keys x 49 splits.
    assert ad.plan(1, 8, 32768, 4) == (672, 49)
    for B, S_max in ((1, 4096), (1, 32768), (2, 1000), (1, 7), (64, 32768)):
        chunk, ns = ad.plan(B, 8, S_max, 4)
        assert chunk % ad.CHUNK_STEP == 0 and chunk <= ad.CHUNK_MAX and ns == -(-S_max // chunk)
        assert B * 8 * ns <= ad.RESIDENT_BLOCKS or chunk == ad.CHUNK_MAX          # one wave, or the largest chunk
        smaller = chunk - ad.CHUNK_STEP                                           # a smaller chunk overfills it
        assert smaller == 0 or B * 8 * -(-S_max // smaller) > ad.RESIDENT_BLOCKS
    assert ad.plan(1, 8, 32768, 8) == ad.plan(1, 8, 32768, 4)
    assert ad.flops(1, 32, 128, [100]) == 4 * 128 * 32 * 100


@pytest.mark.parametrize("switch_interval", [5e-4], indirect=True)
def test_prefill_cudnn_route_falls_back_to_ours_for_a_refused_shape(switch_interval, monkeypatch):
    """Where cuDNN is chosen (a session workspace, a long enough prompt) but refuses the shape, ``launch`` runs
    the route ``choose_route`` takes without it, with the same result; asked for by name, the refusal is raised.
    Where cuDNN runs, nothing of ours is launched."""
    from vmmstream.kernels.attention import cudnn_sdpa
    T, Hq, Hkv, D, sp = 11, 2, 1, 64, 60
    monkeypatch.setattr(ap, "cudnn_usable", lambda: True)
    monkeypatch.setattr(ap, "CUDNN_MIN_QUERIES", 1)
    monkeypatch.setattr(ap, "CUDNN_MIN_PAIRS", 1)
    calls = []

    def refuse(q, k, v, out, ws, *, start_pos, scale, stream, spare_rows=0, spare_keys=0):
        calls.append((start_pos, scale))
        raise cudnn_sdpa.Unsupported("no engine")
    monkeypatch.setattr(cudnn_sdpa, "launch", refuse)
    rng = np.random.default_rng(7)
    q, k, v = bf16(rng, (T, Hq, D)), bf16(rng, (sp + T, Hkv, D)), bf16(rng, (sp + T, Hkv, D))
    sess = cuda.to_device(np.zeros(cudnn_sdpa.WORKSPACE, np.uint8))
    assert ap.choose_route(T, Hq, Hkv, D, start_pos=sp, session_workspace_bytes=sess.shape[0]) == ap.CUDNN
    out = cuda.to_device(np.full_like(q, 0x7FC0))
    stream = cuda.stream()
    args = (cuda.to_device(q), cuda.to_device(k), cuda.to_device(v))
    ap.launch(*args, out, None, start_pos=sp, stream=stream, session_workspace=sess)
    stream.synchronize()
    assert calls == [(sp, 1.0 / np.sqrt(D))]
    assert_bf16_close(out.copy_to_host(), ap.reference(q, k, v, start_pos=sp), 1e-2)
    with pytest.raises(cudnn_sdpa.Unsupported):
        ap.launch(*args, out, None, start_pos=sp, route=ap.CUDNN, stream=stream, session_workspace=sess)
    # where cuDNN runs, its output is the launch's (a marker, here): nothing of ours overwrites it
    monkeypatch.setattr(cudnn_sdpa, "launch", lambda q, k, v, out, ws, **kw: out.copy_to_device(np.full_like(q, 7)))
    ap.launch(*args, out, None, start_pos=sp, stream=stream, session_workspace=sess)
    stream.synchronize()
    assert (out.copy_to_host() == 7).all()
