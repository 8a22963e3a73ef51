"""Quantized prefill GEMM (int4, MXFP4; in-register and dense-cache routes) in the Numba CUDA simulator,
at small odd shapes, against the NumPy reference (quant.py dequantization, fp64 matmul). Blocks are
16×16 threads and grids one to a few blocks: the simulator runs one Python thread per CUDA thread.

Tolerance (``check``): fp32 accumulation of K products plus the bias is a dot product of K + 1 terms, so
|acc - exact| <= γ(K+1)·(Σ|xᵢ·wᵢ| + |bias|) <= s = (K + 2)·2⁻²⁴·(Σ|xᵢ·wᵢ| + |bias|) (the products
are even exact in fp32 except with fp32 int4 scales: a bf16 x has 8 significant bits, an fp16-scaled
int4 value at most 15, an MXFP4 value 2, a cached bf16 weight 8; an FMA-contracted accumulation only
rounds less).
The stored bf16 adds one round-to-nearest, at most 2⁻⁸ of the value: |got - exact| <= 2⁻⁸·(|exact| + s) + s.
``exact`` is the route's reference (the dense cache's weights are the dequantized values rounded to bf16).
Besides that bound, nearly every element must equal the bf16-rounded reference bit for bit (fp32 vs fp64
accumulation only tips a rounding that lies within s of a tie).
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from vmmstream.errors import WorkspaceShortfall
from vmmstream.kernels import NONE, Lifetime
from vmmstream.kernels.matmul.quant import gemm as qgemm
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.matmul.quant.formats import quantize_int4, quantize_mxfp4
from vmmstream.kernels.base.workspace import ALIGN, align_up

from simutil import dev

pytestmark = pytest.mark.sim

BF16_U = 2.0 ** -8     # bf16 round to nearest: |round(v) - v| <= 2^-8 |v|
F32_U = 2.0 ** -24


def make_case(seed, fmt, m, n, k, bias, scale_dtype=np.float16):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :32] *= 1e-3                                 # a group/block with a very different scale
    if n > 2:
        w[2] = np.abs(w[2])                           # an all-positive row: int4 zero point 0
    qw = quantize_int4(w, scale_dtype=scale_dtype) if fmt == "int4" else quantize_mxfp4(w)
    x = f32_to_bf16(rng.standard_normal((m, k)).astype(np.float32))
    bb = f32_to_bf16(rng.standard_normal(n).astype(np.float32)) if bias else None
    return qw, x, bb


def launch(fmt, qw, x, out, bb=None, **kw):
    bias = None if bb is None else dev(bb)
    if fmt == "int4":
        qgemm.qgemm_int4(*(dev(a) for a in qw), dev(x), out, bias=bias, **kw)
    else:
        qgemm.qgemm_mxfp4(*(dev(a) for a in qw), dev(x), out, bias=bias, **kw)


def check(got_bits, x, qw, fmt, bb, route):
    k = x.shape[1]
    wf = qgemm.dequantized(qw, fmt, route).astype(np.float64)
    xf = bf16_to_f32(x).astype(np.float64)
    exact = xf @ wf.T
    absb = 0.0
    if bb is not None:
        exact = exact + bf16_to_f32(bb)
        absb = np.abs(bf16_to_f32(bb)).astype(np.float64)
    s = (k + 2) * F32_U * (np.abs(xf) @ np.abs(wf).T + absb)
    got = bf16_to_f32(got_bits).astype(np.float64)
    excess = np.abs(got - exact) - (BF16_U * (np.abs(exact) + s) + s)
    assert np.all(excess <= 0), f"max excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}"
    ref = qgemm.reference(x, qw, fmt, bb, route=route, rounded=True)
    assert ref.shape == got_bits.shape and ref.dtype == np.uint16
    np.testing.assert_allclose(qgemm.reference(x, qw, fmt, bb, route=route), exact.astype(np.float32), rtol=1e-6)
    assert np.mean(got_bits == ref) >= 0.95


# fmt, M, N, K, bias, tm, int4 scale dtype. N never a multiple of the tile edge 16·tm; K one group/block
# (int4 128, MXFP4 32) or several.
IN_REGISTER_CASES = [
    ("int4", 1, 37, 128, False, 2, np.float16),     # one group, two N tiles (the second clamped)
    ("int4", 3, 21, 384, True, 2, np.float32),      # three groups (12 K steps), fp32 scales, bias
    ("int4", 17, 37, 256, True, 4, np.float16),     # 64×64 tile, M and N both partial
    ("mxfp4", 1, 21, 32, True, 2, None),            # one block: a single K step
    ("mxfp4", 3, 37, 160, False, 2, None),          # five blocks
    ("mxfp4", 17, 21, 64, False, 4, None),
    ("mxfp4", 3, 37, 32, True, 8, None),            # 128×128 tile: two staged pieces per thread
]


@pytest.mark.parametrize("fmt,m,n,k,bias,tm,sdt", IN_REGISTER_CASES)
def test_qgemm_in_register_matches_reference(fmt, m, n, k, bias, tm, sdt):
    qw, x, bb = make_case(m * 1000 + n * 10 + k, fmt, m, n, k, bias, sdt or np.float16)
    out = cuda.device_array((m, n), np.uint16)
    launch(fmt, qw, x, out, bb, route="in_register", tm=tm, workspace=None)
    check(out.copy_to_host(), x, qw, fmt, bb, "in_register")


DENSE_CASES = [
    ("int4", 17, 21, 256, True, 2),
    ("int4", 1, 37, 128, False, 2),      # two N tiles of the dense GEMM
    ("mxfp4", 3, 21, 96, False, 2),
    ("mxfp4", 17, 21, 32, True, 4),
]


@pytest.mark.parametrize("fmt,m,n,k,bias,tm", DENSE_CASES)
def test_qgemm_dense_cache_matches_reference(fmt, m, n, k, bias, tm):
    qw, x, bb = make_case(m * 1000 + n * 10 + k + 1, fmt, m, n, k, bias)
    req = qgemm.workspace_requirement(m, n, k, fmt, route="dense_cache")
    ws = cuda.device_array(req.bytes, np.uint8)
    out = cuda.device_array((m, n), np.uint16)
    launch(fmt, qw, x, out, bb, route="dense_cache", workspace=ws, tm=tm)
    check(out.copy_to_host(), x, qw, fmt, bb, "dense_cache")
    # the cache is exactly the dequantized weight rounded to bf16 (MXFP4: exact in bf16)
    cache = ws.copy_to_host()[:n * k * 2].view(np.uint16).reshape(n, k)
    wf = qgemm.dequantized(qw, fmt)
    np.testing.assert_array_equal(cache, f32_to_bf16(wf))
    if fmt == "mxfp4":
        np.testing.assert_array_equal(bf16_to_f32(cache), wf)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_expand_standalone(fmt):
    qw, _, _ = make_case(5, fmt, 1, 5, 256, False)
    dense = cuda.device_array((5, 256), np.uint16)
    if fmt == "int4":
        qgemm.expand_int4(*(dev(a) for a in qw), dense)
    else:
        qgemm.expand_mxfp4(*(dev(a) for a in qw), dense)
    np.testing.assert_array_equal(dense.copy_to_host(), f32_to_bf16(qgemm.dequantized(qw, fmt)))


def test_dense_cache_requirement_is_session_and_matches_layout():
    m, n, k = 512, 37, 384
    for fmt in ("int4", "mxfp4"):
        req = qgemm.workspace_requirement(m, n, k, fmt, route="dense_cache")
        assert req.lifetime is Lifetime.SESSION
        assert req.bytes == qgemm._layout(n, k, "dense_cache").total == align_up(n * k * 2)
        assert req.bytes % ALIGN == 0 and req.bytes >= n * k * 2
        assert qgemm.workspace_requirement(m, n, k, fmt) == NONE           # the cache is never chosen
        assert qgemm.workspace_requirement(m, n, k, fmt, route="in_register") == NONE


def test_dense_cache_short_view_raises_shortfall():
    qw, x, _ = make_case(11, "int4", 3, 5, 128, False)
    req = qgemm.workspace_requirement(3, 5, 128, "int4", route="dense_cache")
    out = cuda.device_array((3, 5), np.uint16)
    for ws in (None, cuda.device_array(req.bytes - 1, np.uint8), cuda.device_array(5 * 128 * 2 - 2, np.uint8)):
        with pytest.raises(WorkspaceShortfall) as e:
            launch("int4", qw, x, out, route="dense_cache", workspace=ws)
        assert e.value.needed == req.bytes
        assert e.value.given == (0 if ws is None else ws.nbytes)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_fill_false_reuses_filled_cache(fmt):
    m, n, k = 3, 21, (128 if fmt == "int4" else 64)
    qw, x, _ = make_case(21, fmt, m, n, k, False)
    req = qgemm.workspace_requirement(m, n, k, fmt, route="dense_cache")
    ws = cuda.device_array(req.bytes, np.uint8)
    packed = dev(qw.packed)
    rest = [dev(a) for a in qw[1:]]
    dx = dev(x)

    def run(fill):
        out = cuda.device_array((m, n), np.uint16)
        if fmt == "int4":
            qgemm.qgemm_int4(packed, *rest, dx, out, route="dense_cache", workspace=ws, fill=fill, tm=2)
        else:
            qgemm.qgemm_mxfp4(packed, *rest, dx, out, route="dense_cache", workspace=ws, fill=fill, tm=2)
        return out.copy_to_host()

    first = run(True)
    check(first, x, qw, fmt, None, "dense_cache")
    # corrupt the packed weights on the device: every nibble flipped
    packed.copy_to_device(np.ascontiguousarray(qw.packed ^ np.uint8(0xFF)))
    np.testing.assert_array_equal(run(False), first)        # the cache, not the weights, was read
    refilled = run(True)                                    # a fill does read the (now corrupt) weights
    assert not np.array_equal(refilled, first)


def test_choose_route_rule():
    """The simulator takes in_register whatever the shape (a GPU takes mma: tests/gpu/test_load_model_gpu.py)."""
    for fmt in ("int4", "mxfp4"):
        for m in (1, 63, 64, 2048):
            assert qgemm.choose_route(m, 4096, 4096, fmt) == "in_register"
            assert qgemm.workspace_requirement(m, 4096, 4096, fmt, route="mma") == NONE
    with pytest.raises(ValueError, match="format"):
        qgemm.choose_route(1, 8, 128, "fp8")


MMA_CASES = [
    ("int4", 17, 130, 128, True, np.float16),    # one group (4 K steps), M partial, two N tiles (the second
                                                 # clamped), bias
    ("mxfp4", 70, 21, 64, True, None),           # two M tiles (the second partial), two blocks
    ("mxfp4", 1, 9, 32, False, None),            # one block: a single K step
]


@pytest.mark.parametrize("fmt,m,n,k,bias,sdt", MMA_CASES)
def test_qgemm_tensor_core_route_matches_reference(fmt, m, n, k, bias, sdt):
    """W decoded to bf16 in the load path, multiplied on the (emulated) tensor cores: the dense-cache numbers."""
    qw, x, bb = make_case(m * 1000 + n * 10 + k, fmt, m, n, k, bias, sdt or np.float16)
    out = cuda.device_array((m, n), np.uint16)
    launch(fmt, qw, x, out, bb, route="mma", workspace=None)
    check(out.copy_to_host(), x, qw, fmt, bb, "mma")


def test_default_route_small_m_needs_no_workspace():
    qw, x, _ = make_case(31, "mxfp4", 3, 5, 64, False)
    out = cuda.device_array((3, 5), np.uint16)
    launch("mxfp4", qw, x, out, tm=1)       # route=None -> in_register; no workspace. tm = 1: 64 of 256 threads stage
    check(out.copy_to_host(), x, qw, "mxfp4", None, "in_register")


def test_qgemm_rejects_bad_inputs():
    qw, x, _ = make_case(41, "int4", 2, 4, 256, False)
    p, s, z = (dev(a) for a in qw)
    dx, out = dev(x), cuda.device_array((2, 4), np.uint16)
    with pytest.raises(ValueError, match="scales must be"):
        qgemm.qgemm_int4(p, dev(qw.scales[:, :1]), z, dx, out)
    with pytest.raises(ValueError, match="zeros must be"):
        qgemm.qgemm_int4(p, s, dev(qw.zeros[:, :1]), dx, out)
    with pytest.raises(ValueError, match="float16 or float32"):
        qgemm.qgemm_int4(p, s, dev(qw.zeros.astype(np.float32)), dx, out)
    with pytest.raises(ValueError, match="multiple of the int4 group"):
        qgemm.qgemm_int4(dev(qw.packed[:, :96]), s, z, dev(x[:, :192]), out)
    with pytest.raises(ValueError, match="multiple of the MXFP4 block"):
        qgemm.qgemm_mxfp4(dev(np.zeros((4, 8), np.uint8)), dev(np.zeros((4, 1), np.uint8)),
                          dev(np.zeros((2, 16), np.uint16)), out)
    with pytest.raises(ValueError, match="x must be 2-D bf16"):
        qgemm.qgemm_int4(p, s, z, dev(x[:, :128]), out)
    with pytest.raises(ValueError, match="x must be 2-D bf16"):
        qgemm.qgemm_int4(p, s, z, dev(bf16_to_f32(x)), out)
    with pytest.raises(ValueError, match="x must have contiguous rows"):
        qgemm.qgemm_int4(p, s, z, dev(np.zeros((2, 264), np.uint16))[:, 4:260], out)
    with pytest.raises(ValueError, match="out must be bf16"):
        qgemm.qgemm_int4(p, s, z, dx, cuda.device_array((2, 4), np.float32))
    with pytest.raises(ValueError, match="out must be bf16"):
        qgemm.qgemm_int4(p, s, z, dx, cuda.device_array((3, 4), np.uint16))
    with pytest.raises(ValueError, match="bias must be bf16"):
        qgemm.qgemm_int4(p, s, z, dx, out, bias=dev(np.zeros(5, np.uint16)))
    with pytest.raises(ValueError, match="packed weights must be 2-D uint8"):
        qgemm.qgemm_int4(dev(qw.packed.astype(np.uint16)), s, z, dx, out)
    with pytest.raises(ValueError, match="MXFP4 scales are uint8"):
        qgemm.qgemm_mxfp4(p, dev(np.zeros((4, 8), np.float16)), dx, out)
    with pytest.raises(ValueError, match="unknown qgemm route"):
        qgemm.qgemm_int4(p, s, z, dx, out, route="tensor_core")
    with pytest.raises(ValueError, match="micro-tile"):
        qgemm.qgemm_int4(p, s, z, dx, out, tm=3)
    with pytest.raises(ValueError, match="workspace must be a 1-D uint8"):
        req = qgemm.workspace_requirement(2, 4, 256, "int4", route="dense_cache")
        qgemm.qgemm_int4(p, s, z, dx, out, route="dense_cache",
                         workspace=cuda.device_array(req.bytes // 2, np.uint16))
    with pytest.raises(ValueError, match="dense must be bf16"):
        qgemm.expand_int4(p, s, z, cuda.device_array((4, 128), np.uint16))


def test_qgemm_formulas_and_exports():
    assert qgemm.CAPTURE_SAFE is True and qgemm.SIGNATURES
    m, n, k = 2048, 4096, 14336
    assert qgemm.flops(m, n, k) == 2 * m * n * k
    io = 2 * m * k + 2 * m * n
    assert qgemm.bytes_moved(m, n, k, "int4", "in_register") == n * k // 2 + 4 * n * k // 128 + io
    assert qgemm.bytes_moved(m, n, k, "mxfp4", "in_register", bias=True) == n * k // 2 + n * k // 32 + io + 2 * n
    assert qgemm.bytes_moved(m, n, k, "int4", "dense_cache", fill=False) == io + 2 * n * k
    assert qgemm.bytes_moved(m, n, k, "mxfp4", "dense_cache") == io + 2 * n * k + n * k // 2 + n * k // 32 + 2 * n * k
    assert qgemm.bytes_moved(m, n, k, "int4") == qgemm.bytes_moved(m, n, k, "int4", "in_register")
    assert qgemm.bytes_moved(m, n, k, "int4", "mma") == qgemm.bytes_moved(m, n, k, "int4", "in_register")
