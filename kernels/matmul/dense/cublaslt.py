"""Prefill GEMM through cuBLASLt (nvmath-python's bindings): out[M, N] = x[M, K] · W[N, K]ᵀ (+ bias[N]), bf16 in,
fp32 accumulate, bf16 out — the library's tuned Hopper kernels instead of ours (``bench/test_bench_dense_kernels.py``
compares them in one run).

Optional: ``available()`` is False when nvmath-python or libcublasLt cannot be loaded (then ``gemm.choose_route``
takes the tensor-core kernel of ``gemm_mma``). Everything the call needs is fixed before any capture:

- the workspace is a session-lifetime buffer of ``WORKSPACE`` bytes drawn from the governed pool like any kernel's
  (``workspace_requirement``), passed at its stable address; cuBLASLt allocates nothing;
- the algorithm of each shape is chosen once by cuBLASLt's heuristic (within that workspace) and kept, with its
  descriptors, so an eager call and a captured one launch the same kernel.

Row-major to cuBLASLt's column-major: outᵀ[N, M] = op_T(W as K×N, ld K) · x as K×M (ld K), ld N.
"""

from __future__ import annotations

import threading

import numpy as np
from vmmstream.kernels.base.launch import data_ptr, stream_handle as _stream_handle
from vmmstream.kernels.base.workspace import Lifetime, WorkspaceRequirement

CAPTURE_SAFE = True       # no allocation, no synchronize once a shape's plan exists (made on first, eager, use)
WORKSPACE = 4 << 20       # split-K partials of the GEMMs a prefill runs; shared with the session workspace
_CUDA_R_16BF, _CUDA_R_32F, _COMPUTE_32F = 14, 0, 68
_OP_T = 1
_PLANS_MAX = 1024       # host descriptors: a plan made eagerly stays for the capture that follows

_lock = threading.Lock()
_state: dict = {}         # "lib": the bindings module or None, "handle", "plans": {key: _Plan}, "error": why not


def workspace_requirement(m: int, n: int, k: int) -> WorkspaceRequirement:
    """A session buffer: the same address in every captured graph that calls cuBLASLt."""
    return WorkspaceRequirement(WORKSPACE, Lifetime.SESSION)


def _lib():
    with _lock:
        if "lib" not in _state:
            try:
                from nvmath.bindings import cublasLt
                _state["handle"] = cublasLt.create()
                _state["lib"], _state["plans"] = cublasLt, {}
            except Exception as e:          # not installed, or no libcublasLt / GPU: the caller falls back
                _state["lib"], _state["error"] = None, f"{type(e).__name__}: {e}"
        return _state["lib"]


def available() -> bool:
    return _lib() is not None


def unavailable_reason() -> str | None:
    return None if available() else _state.get("error")


class Unsupported(RuntimeError):
    """cuBLASLt offers no algorithm for a shape (raised before anything is enqueued: the caller may fall back)."""


class _Plan:
    """Descriptors and the chosen algorithm of one (M, N, K, bias) shape."""

    def __init__(self, L, handle, m: int, n: int, k: int, has_bias: bool, align: int):
        self.L = L
        self.desc, self.a, self.b, self.d = L.matmul_desc_create(_COMPUTE_32F, _CUDA_R_32F), 0, 0, 0
        try:
            self._build(handle, m, n, k, has_bias, align)
        except BaseException as e:
            self.close()
            if isinstance(e, Exception) and not isinstance(e, Unsupported):
                raise Unsupported(f"cuBLASLt cannot plan bf16 [{m}, {k}] x [{n}, {k}]^T: {e}") from e
            raise
        self.algo_ptr = self.result.ptr       # cublasLtMatmulAlgo_t is the first member of the result
        self.bias_ptr = np.zeros(1, np.uint64)

    def _build(self, handle, m, n, k, has_bias, align) -> None:
        L = self.L
        self._attr(L.MatmulDescAttribute.TRANSA, np.int32(_OP_T))
        if has_bias:
            self._attr(L.MatmulDescAttribute.EPILOGUE, np.int32(L.Epilogue.BIAS))
            self._attr(L.MatmulDescAttribute.BIAS_DATA_TYPE, np.int32(_CUDA_R_16BF))
        self.a = L.matrix_layout_create(_CUDA_R_16BF, k, n, k)      # W [N, K] row-major = K×N column-major
        self.b = L.matrix_layout_create(_CUDA_R_16BF, k, m, k)      # x [M, K]
        self.d = L.matrix_layout_create(_CUDA_R_16BF, n, m, n)      # out [M, N]
        pref = L.matmul_preference_create()
        try:
            ws = np.array([WORKSPACE], np.uint64)     # attribute values are read through pointers
            L.matmul_preference_set_attribute(pref, L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                                              ws.ctypes.data, ws.nbytes)
            al = np.array([align], np.uint32)      # the operands' address alignment: only algorithms that take it
            P = L.MatmulPreferenceAttribute
            for attr in (P.MIN_ALIGNMENT_A_BYTES, P.MIN_ALIGNMENT_B_BYTES, P.MIN_ALIGNMENT_C_BYTES,
                         P.MIN_ALIGNMENT_D_BYTES):
                L.matmul_preference_set_attribute(pref, attr, al.ctypes.data, al.nbytes)
            self.result = L.MatmulHeuristicResult()
            count = np.zeros(1, np.int32)
            L.matmul_algo_get_heuristic(handle, self.desc, self.a, self.b, self.d, self.d, pref, 1,
                                        self.result.ptr, count.ctypes.data)
        finally:
            L.matmul_preference_destroy(pref)
        if count[0] < 1:
            raise Unsupported(f"cuBLASLt has no algorithm for bf16 [{m}, {k}] x [{n}, {k}]^T")

    def _attr(self, attr, value: np.ndarray) -> None:
        v = np.asarray(value)
        self.L.matmul_desc_set_attribute(self.desc, attr, v.ctypes.data, v.nbytes)

    def close(self) -> None:
        L = self.L
        for lay in (self.a, self.b, self.d):
            if lay:
                L.matrix_layout_destroy(lay)
        if self.desc:
            L.matmul_desc_destroy(self.desc)
        self.desc = self.a = self.b = self.d = 0


_ALPHA, _BETA = np.ones(1, np.float32), np.zeros(1, np.float32)


def _rows_packed(a) -> bool:
    st = getattr(a, "strides", None)
    return st is None or (st[-1] == a.dtype.itemsize and st[0] == a.shape[-1] * a.dtype.itemsize)


def launch(x, w, out, *, bias=None, workspace, stream=None) -> None:
    """out = x · wᵀ (+ bias) on ``stream``; ``workspace`` (uint8, ≥ ``WORKSPACE`` bytes) is cuBLASLt's."""
    L = _lib()
    if L is None:
        raise RuntimeError(f"cuBLASLt is not available: {_state.get('error')}")
    m, k = x.shape
    n = w.shape[0]
    if not (x.dtype == w.dtype == out.dtype == np.uint16) or (bias is not None and bias.dtype != np.uint16):
        raise ValueError("the cuBLASLt route takes bf16 (uint16) operands only")
    if not all(_rows_packed(a) for a in (x, w, out)):
        raise ValueError("the cuBLASLt route takes row-major operands with packed rows")
    if workspace is None or workspace.shape[0] * workspace.dtype.itemsize < WORKSPACE:
        raise ValueError(f"the cuBLASLt route needs a workspace of {WORKSPACE} bytes")
    ptrs = [data_ptr(a) for a in (x, w, out)] + ([data_ptr(bias)] if bias is not None else [])
    align = min(256, *(p & -p if p else 256 for p in ptrs))
    key = (m, n, k, bias is not None, align)
    with _lock:
        plans = _state["plans"]
        plan = plans.pop(key, None)
        if plan is None:
            while len(plans) >= _PLANS_MAX:
                plans.pop(next(iter(plans))).close()
            plan = _Plan(L, _state["handle"], m, n, k, bias is not None, align)
        plans[key] = plan                      # most recently used last
        if bias is not None:
            plan.bias_ptr[0] = data_ptr(bias)
            plan._attr(L.MatmulDescAttribute.BIAS_POINTER, plan.bias_ptr)
        L.matmul(_state["handle"], plan.desc, _ALPHA.ctypes.data, data_ptr(w), plan.a, data_ptr(x), plan.b,
                 _BETA.ctypes.data, data_ptr(out), plan.d, data_ptr(out), plan.d, plan.algo_ptr,
                 data_ptr(workspace), WORKSPACE, _stream_handle(stream))
