"""Quantized decode GEMVs: y[B, N] = x[B, K] · W[N, K]ᵀ (+ bias) with W stored int4 or MXFP4
(``kernels/matmul/quant/formats.py`` layouts), dequantized in registers, fp32 accumulation, bf16 (uint16) out.

The public functions (``qgemv_int4``, ``qgemv_mxfp4``), their shape checks, references and byte counts, and
the dispatcher that picks one route per launch (``QgemvConfig.route``):
- ``auto`` (the default): where K is a multiple of 128 and the weights are C-contiguous, a tensor-core route,
  faster at the decode shapes (docs/bench/HISTORY.md): MXFP4 at batch 1 ``gemv_imma.py`` (int8 tensor cores; x
  rounded per block of 32 to 14 bits below the block's largest |x|, every product and sum after that exact),
  otherwise ``gemv_mma.py`` (bf16), which takes int4 zero points as integers in [0, 15], which is what
  ``quantize_int4`` stores; elsewhere ``simt``;
- ``simt``: ``gemv_simt.py``, any K that is a multiple of the group, dequantized on the CUDA cores;
- ``mma``, ``imma``: the tensor-core routes above, asked for by name; ``mx16``: ``gemv_mx16.py``, MXFP4 on f16
  tensor cores, opt-in.
x must allow 16-byte loads (``vec8_ok``): there is no scalar fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
from vmmstream.kernels.base.launch import as_stream, cdiv, check_workspace, data_ptr, vec8_ok
from vmmstream.kernels.base.workspace import NONE
from vmmstream.kernels.matmul.quant import gemv_imma, gemv_mma, gemv_mx16, gemv_simt
from vmmstream.kernels.matmul.quant.formats import (INT4, INT4_GROUP, MX_BLOCK, MXFP4, dequantize_int4,
    dequantize_mxfp4)
from vmmstream.kernels.matmul.quant.gemv_simt import SIGNATURES, SMEM_X  # noqa: F401 (the simt route's, checked here)

CAPTURE_SAFE = True  # no allocation, no synchronize, device arrays only


@dataclass(frozen=True)
class QgemvConfig:
    threads: int = 128
    rows_per_warp: int = 4
    batch_tile: int = 0      # 0: pick from B (1, 2 or 4)
    tile_k: int = 0          # 0: SMEM_X // batch_tile; else a multiple of 32 (tests use small tiles)
    route: str = "auto"      # "mma": kernels/matmul/quant/gemv_mma.py (bf16 tensor cores; K a multiple of 128, int4 zero points
                             # integers); "imma": kernels/matmul/quant/gemv_imma.py (MXFP4 at batch 1, int8 tensor cores;
                             # K a multiple of 128); "simt": this module's kernel; "auto": imma for MXFP4 at
                             # batch 1, else mma, where K allows it, else simt;
                             # "mx16": kernels/matmul/quant/gemv_mx16.py (MXFP4 at batch 1 on f16 tensor cores; measured
                             # slower than mma on the H200, docs/bench/HISTORY.md, so never chosen by "auto")
    mma_prefetch: bool = True  # mma route: load the next group while multiplying the current one
    mma_l2_ahead: int = 0    # mma route: prefetch.global.L2 the group this many iterations ahead (0: none)
    mma_stages: int = 0      # mma route: > 1: W through a per-warp cp.async ring of this many groups (3, 4 or 5)
    mma_row_tiles: int = 0   # mma route, batch 1: 16-row tiles per block sharing one staging of x (1 to 7;
                             # 0: picked for the device's SM count, ``qgemv_mma.auto_row_tiles``: 7 at N 14336
                             # on 132 SMs; there, on an H100, int4 10-13 % faster than 1 and MXFP4, with
                             # ``mma_split`` and ``mma_x_first``, within 1 %, docs/bench/HISTORY.md)
    mma_early_y: bool = False  # mma route, batch 1: load each pair's second group one step earlier (the first
                             # before x is staged): two groups in flight from the start
    mma_split: bool | None = None  # mma route, MXFP4 at batch 1: each group's 8 mma steps as two dependency
                             # chains of 4 (None: there; on an H100 at 7 row tiles 3.7 % faster, docs/bench/HISTORY.md)
    mma_x_first: bool | None = None  # mma route, MXFP4 at batch 1: the first x tile loaded before W (None: in
                             # blocks of 4 or more row tiles without pdl; True with pdl is refused)
    mma_col_tiles: int = 1   # mma route, batch 9 or more: column tiles of 8 per block (1, 2 or 4): each group of W
                             # loaded and decoded once for 8 / 16 / 32 columns (not yet measured on a GPU: 1)
    pdl: bool = False        # mma and imma routes: programmatic dependent launch (loads W while the previous
                             # kernel on the stream finishes); only where that kernel does not write these
                             # weights. With route "auto" it applies where a tensor-core route is taken (a simt
                             # launch is plain); the mma_* options do not apply to the imma route


def workspace_requirement(n: int, k: int, batch: int = 1):
    """No scratch: x tiles live in shared memory."""
    return NONE


def _launch(name, kind, packed, scales, zeros, x, out, bias, workspace, stream, config):
    check_workspace(name, workspace, 0)
    x = x.reshape(1, x.shape[0]) if x.ndim == 1 else x
    out = out.reshape(1, out.shape[0]) if out.ndim == 1 else out
    n, kh = packed.shape
    k = 2 * kh
    b = x.shape[0]
    group = INT4_GROUP if kind == INT4 else MX_BLOCK
    sshape = (n, k // group)
    if (k % group or x.shape[1] != k or out.shape != (b, n) or out.dtype != np.uint16 or packed.dtype != np.uint8
            or scales.shape != sshape or (zeros is not None and zeros.shape != sshape)
            or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"{name} shapes: packed {packed.shape} {packed.dtype}, scales {scales.shape}, "
                         f"zeros {None if zeros is None else zeros.shape}, x {x.shape}, out {out.shape} {out.dtype}, "
                         f"bias {None if bias is None else bias.shape} (K must be a multiple of {group}; "
                         f"scales/zeros {sshape}; out bf16)")
    if kind == MXFP4 and scales.dtype != np.uint8:
        raise ValueError(f"{name}: MXFP4 scales are uint8 E8M0 exponents, got {scales.dtype}")
    if kind == INT4 and (scales.dtype not in (np.float16, np.float32) or zeros.dtype != scales.dtype):
        raise ValueError(f"{name}: int4 scales/zeros must both be float16 or float32, got {scales.dtype}/{zeros.dtype}")
    if not vec8_ok(x) or packed.strides[1] != 1 or packed.strides[0] % 16 or data_ptr(packed) % 16:
        raise ValueError(f"{name}: packed weights and x must be contiguous rows on 16-byte boundaries "
                         "(16-byte loads; there is no scalar path)")
    cfg = config or QgemvConfig()
    if cfg.route not in ("auto", "simt", "mma", "imma", "mx16"):
        raise ValueError(f"{name}: route must be 'auto', 'simt', 'mma', 'imma' or 'mx16', got {cfg.route!r}")
    contiguous = packed.is_c_contiguous() and scales.is_c_contiguous() and (zeros is None or zeros.is_c_contiguous())
    tensor = k % INT4_GROUP == 0 and contiguous
    route = cfg.route if cfg.route != "auto" else (
        "imma" if tensor and kind == MXFP4 and b == 1 else "mma" if tensor else "simt")
    if cfg.pdl and cfg.route in ("simt", "mx16"):
        raise ValueError(f"{name}: pdl (programmatic dependent launch) is an mma and imma route option, the route "
                         f"is {route!r}")
    if route == "imma":
        if kind != MXFP4 or b != 1:
            raise ValueError(f"{name}: route 'imma' takes MXFP4 weights at batch 1 (got "
                             f"{'int4' if kind == INT4 else 'MXFP4'}, batch {b})")
        gemv_imma.launch(packed, scales, x, out, bias, as_stream(stream), pdl=cfg.pdl)
        return
    if route == "mx16":
        if kind != MXFP4:
            raise ValueError(f"{name}: route 'mx16' takes MXFP4 weights")
        gemv_mx16.launch(packed, scales, x, out, bias, as_stream(stream))
        return
    if route == "mma":
        gemv_mma.launch(kind, packed, scales, zeros, x, out, bias, as_stream(stream), cfg.mma_prefetch,
                        cfg.mma_l2_ahead, stages=cfg.mma_stages, pdl=cfg.pdl, row_tiles=cfg.mma_row_tiles,
                        early_y=cfg.mma_early_y, split=cfg.mma_split, x_first=cfg.mma_x_first,
                        col_tiles=cfg.mma_col_tiles)
        return
    gemv_simt.launch(kind, packed, scales, zeros, x, out, bias, as_stream(stream), cfg)


def qgemv_int4(packed, scales, zeros, x, out, *, bias=None, workspace=None, stream=None,
               config: QgemvConfig | None = None):
    """out[B, N] = x[B, K] · dequantize_int4(packed, scales, zeros)ᵀ (+ bias), bf16 out.

    packed uint8 [N, K/2]; scales, zeros fp16 or fp32 [N, K/128]; x, bias, out bf16 (uint16); x may be
    [K] with out [N]. Zero points are integers in [0, 15] (``quantize_int4``); the default tensor-core
    route would round a fractional one. Device arrays; never allocates.
    """
    _launch("qgemv_int4", INT4, packed, scales, zeros, x, out, bias, workspace, stream, config)


def qgemv_mxfp4(packed, scales, x, out, *, bias=None, workspace=None, stream=None,
                config: QgemvConfig | None = None):
    """out[B, N] = x[B, K] · dequantize_mxfp4(packed, scales)ᵀ (+ bias), bf16 out.

    packed uint8 [N, K/2] (E2M1 codes); scales uint8 [N, K/32] (E8M0); x, bias, out bf16 (uint16);
    x may be [K] with out [N]. Device arrays; never allocates.
    """
    _launch("qgemv_mxfp4", MXFP4, packed, scales, None, x, out, bias, workspace, stream, config)


def _reference(wf, x, bias):
    y = bf16_to_f32(x).astype(np.float64) @ wf.astype(np.float64).T
    if bias is not None:
        y = y + bf16_to_f32(bias)
    return y.astype(np.float32)


def reference_int4(packed, scales, zeros, x, bias=None, *, rounded: bool = True) -> np.ndarray:
    """Dequantize (fp32), matmul (fp64 accumulation), round to bf16 bits; ``rounded=False``: the fp32
    result before rounding. [B, N] or [N] like x."""
    y = _reference(dequantize_int4(packed, scales, zeros), x, bias)
    return f32_to_bf16(y) if rounded else y


def reference_mxfp4(packed, scales, x, bias=None, *, rounded: bool = True) -> np.ndarray:
    """``reference_int4`` for MXFP4 weights."""
    y = _reference(dequantize_mxfp4(packed, scales), x, bias)
    return f32_to_bf16(y) if rounded else y


def bytes_moved(n: int, k: int, batch: int = 1, *, kind: str = "int4", scale_itemsize: int = 2,
                bias: bool = False, batch_tile: int = 0) -> int:
    """HBM bytes: packed W and its scales (int4: scales + zeros) once per batch tile, x, bf16 out, bias."""
    nb = batch_tile or (1 if batch == 1 else 2 if batch == 2 else 4)
    if kind == "int4":
        w = n * k // 2 + 2 * n * (k // INT4_GROUP) * scale_itemsize
    elif kind == "mxfp4":
        w = n * k // 2 + n * (k // MX_BLOCK)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return w * cdiv(batch, nb) + 2 * batch * k + 2 * batch * n + (2 * n if bias else 0)


def flops(n: int, k: int, batch: int = 1) -> int:
    return 2 * batch * n * k


