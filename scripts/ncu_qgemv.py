"""Eager launches of the tensor-core quantized GEMV for a profiler (ncu): argv[1] kind (int4 | mxfp4),
argv[2] mode (full | compute), argv[3] module (default qgemv_mma), argv[4] variant kwargs (Python dict; with
``row_tiles`` the grid and block take that many 16-row tiles per block)."""
from __future__ import annotations

import ast
import importlib
import sys

import numpy as np
from numba import cuda

from vmmstream.kernels import mma_helpers as mh, qgemv
from vmmstream.kernels.dtypes import f32_to_bf16
from vmmstream.kernels.quant import quantize_int4, quantize_mxfp4

H, I = 4096, 14336
kind, mode = sys.argv[1], sys.argv[2]
mod = importlib.import_module(f"vmmstream.kernels.{sys.argv[3] if len(sys.argv) > 3 else 'qgemv_mma'}")
kw = ast.literal_eval(sys.argv[4]) if len(sys.argv) > 4 else {}
rng = np.random.default_rng(0)
w = (rng.standard_normal((I, H)) * 0.02).astype(np.float32)
qw = quantize_int4(w) if kind == "int4" else quantize_mxfp4(w)
flat = [cuda.to_device(np.ascontiguousarray(a).reshape(-1)) for a in qw]
if len(flat) == 2:
    flat.append(flat[1])
x = cuda.to_device(f32_to_bf16(rng.standard_normal((1, H)).astype(np.float32)))
y = cuda.device_array((1, I), np.uint16)
kern = mod.make(qgemv.INT4 if kind == "int4" else qgemv.MXFP4, False, 1, **kw)
n_rows = 16 if mode == "compute" else I
rt = kw.get("row_tiles", 1)
for _ in range(4):
    kern[(-(-I // (16 * rt)), 1), mh.THREADS * rt](*flat, x, x, y, n_rows, 1, H)
cuda.synchronize()
