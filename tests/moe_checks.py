"""Checks shared by the MoE kernel tests (simulator and GPU tiers): routing against the reference, the
kernels' h and y against fp64 with the bf16 roundings the kernels make, and the grouped h read back.

Tolerances: the expert kernels accumulate in fp32 (slack ``slack`` · Σ|xᵢ·wᵢ|: 1e-5 at the simulator's small
K, 3e-5 at real shapes, as the GEMV tests); gate and up are rounded to bf16 before silu·mul, so h is checked
against the exact silu(G)·U with that rounding propagated, and y against h as the kernel stored it.
"""

from __future__ import annotations

import numpy as np

from vmmstream.kernels import moe
from vmmstream.kernels.base.dtypes import bf16_to_f32

HALF_ULP = 2.0 ** -8     # bf16 round to nearest: |round(v) - v| <= 2^-8 |v|


def check_routing(rt, ref):
    for name in ("counts", "offsets", "perm"):
        np.testing.assert_array_equal(getattr(rt, name).copy_to_host(), ref[name], err_msg=name)
    n = int(rt.n_tiles.copy_to_host()[0])
    assert n == ref["n_tiles"] <= rt.max_tiles
    np.testing.assert_array_equal(rt.tile_expert.copy_to_host()[:n], ref["tile_expert"])
    np.testing.assert_array_equal(rt.tile_row.copy_to_host()[:n], ref["tile_row"])
    assert rt.row_tile == ref["row_tile"]


def gate_up_bound(xf, wgf, wuf, slack=1e-5):
    """|h - exact silu(G)·U|: gate and up each one bf16 rounding plus the fp32 accumulation slack (through
    silu·mul, |silu'| <= 1.1), then one rounding of the product."""
    g, u = xf @ wgf.T, xf @ wuf.T
    sg = slack * (np.abs(xf) @ np.abs(wgf).T) + 1e-6
    su = slack * (np.abs(xf) @ np.abs(wuf).T) + 1e-6
    silu = g / (1 + np.exp(-g))
    dg, du = HALF_ULP * np.abs(g) + sg, HALF_ULP * np.abs(u) + su
    prod = silu * u
    err = 1.1 * dg * (np.abs(u) + du) + np.abs(silu) * du
    return prod, err + HALF_ULP * (np.abs(prod) + err)


def kernel_h(ws, rt, t, k, e, i):
    """The kernel's h, moved from grouped-row order to [T, k, I]."""
    hg = moe.h_view(ws, t, k, e, i, rt.row_tile).copy_to_host()
    perm = rt.perm.copy_to_host()
    h = np.empty((t * k, i), np.uint16)
    h[perm] = hg
    return h.reshape(t, k, i)


def check_experts(x, ids, wgf, wuf, wdf, h_got, y_got, h_ref, slack=1e-5):
    """wgf/wuf/wdf: fp32 [E, ...] (dequantized) weights; y_got fp32 or bf16 bits."""
    xf = bf16_to_f32(x).astype(np.float64)
    t, k = ids.shape
    for tt in range(t):
        for s in range(k):
            ex = ids[tt, s]
            exact, err = gate_up_bound(xf[tt:tt + 1], wgf[ex].astype(np.float64), wuf[ex].astype(np.float64),
                                       slack)
            hk = bf16_to_f32(h_got[tt, s]).astype(np.float64)
            assert np.all(np.abs(hk - exact[0]) <= err[0]), f"h of token {tt} slot {s} (expert {ex})"
            # y against the h the kernel stored: only the fp32 accumulation (and y's own rounding) differ
            wd = wdf[ex].astype(np.float64)
            want = wd @ hk
            bound = slack * (np.abs(wd) @ np.abs(hk)) + 1e-6
            if y_got.dtype == np.uint16:
                got = bf16_to_f32(y_got[tt, s]).astype(np.float64)
                bound = bound + 2 * HALF_ULP * np.abs(want)
            else:
                got = y_got[tt, s].astype(np.float64)
            assert np.all(np.abs(got - want) <= bound), f"y of token {tt} slot {s} (expert {ex})"
    # fp32 vs fp64 accumulation flips a gate/up rounding only rarely: nearly every h is the reference's
    assert np.mean(h_got == h_ref) >= 0.8
