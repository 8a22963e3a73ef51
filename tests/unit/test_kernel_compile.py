"""Every kernel compiles for sm_90 (H200) at the signatures a model launches — no GPU needed.

Each kernel module lists ``SIGNATURES = [(python_function, "signature"), ...]``; this tier compiles
each entry to PTX with ``numba.cuda.compile_ptx(..., cc=(9, 0))``, which needs NVVM but no device, so
typing errors, unsupported intrinsics and register-promotion surprises show up in CI rather than on
the GPU machine. Device helpers must be IR-inlined (``inline="always"``): compiling a separately
compiled device function asks the driver for the current device and fails without a GPU.

The simulator has no compiler: run this tier without NUMBA_ENABLE_CUDASIM.
"""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.unit

KERNEL_MODULES = ["matmul.dense.gemv", "matmul.dense.gemv_mma", "matmul.dense.gemm", "matmul.dense.gemm_mma", "matmul.quant.gemv", "matmul.quant.gemv_mma",
                  "matmul.quant.gemv_mx16", "matmul.quant.gemv_imma", "matmul.quant.gemm", "matmul.quant.gemm_mma", "moe.gather", "moe",
                  "ops.norm", "ops.rope", "ops.elementwise", "ops.embedding", "ops.sampling", "ops.scalars",
                  "attention.prefill", "attention.decode"]
CC = (9, 0)


def _require_compiler():
    from numba import config
    if config.ENABLE_CUDASIM:
        pytest.fail("compile_ptx is not available under the Numba CUDA simulator: run the unit tier "
                    "without NUMBA_ENABLE_CUDASIM=1", pytrace=False)


def _import(name: str):
    return importlib.import_module(f"vmmstream.kernels.{name}")


# Variants that are not a default route and take 10-30 s each to compile on a CI core: `scripts/test.sh full`
# compiles them (their kernels run in the gpu tier either way): int4 GEMV with fp32 scales, with several columns,
# and with 2 row tiles.
SLOW = {("matmul.quant.gemv_mma", 2), ("matmul.quant.gemv_mma", 3), ("matmul.quant.gemv_mma", 7)}
# The batched tensor-core GEMV's other tile counts and bias / fp32-logit variants (the same body as the ones kept),
# and the cp.async prefill attention at head dims 64 and 96 (128 is kept).
SLOW |= {("matmul.dense.gemv_mma", i) for i in (1, 2, 3, 4, 5, 7, 8, 9, 11, 13, 14)}
SLOW |= {("attention.prefill", 5), ("attention.prefill", 6)}


def _signature_cases():
    """One case per signature, so that pytest-xdist spreads the compiles evenly over its workers (one module's
    signatures take from 5 s to over two minutes)."""
    cases = []
    for name in KERNEL_MODULES:
        for i, (pyfunc, _) in enumerate(getattr(_import(name), "SIGNATURES", ())):
            cases.append(pytest.param(name, i, id=f"{name}-{i}-{getattr(pyfunc, '__name__', '?')}",
                                      marks=[pytest.mark.slow] if (name, i) in SLOW else []))
    return cases


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_kernel_module_contract(name):
    mod = _import(name)
    for attr in ("SIGNATURES", "CAPTURE_SAFE", "workspace_requirement", "bytes_moved", "flops"):
        assert hasattr(mod, attr), f"kernel module {name} lacks {attr}"
    assert mod.SIGNATURES, f"{name}.SIGNATURES is empty"


@pytest.mark.parametrize("name,index", _signature_cases())
def test_kernel_compiles_for_sm90(name, index):
    _require_compiler()
    from numba import cuda
    pyfunc, sig = _import(name).SIGNATURES[index]
    ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=CC)
    assert ".target sm_90" in ptx


def test_device_helpers_emit_vector_memory_ops():
    """The 16-byte load/store intrinsics really are single v4 instructions (the GEMV's speed relies on it)."""
    _require_compiler()
    from numba import cuda
    from vmmstream.kernels.matmul.dense import gemv
    from vmmstream.kernels.ops import norm
    ptx, _ = cuda.compile_ptx(*gemv.SIGNATURES[0], cc=CC)
    assert "ld.global.nc.v4.u32" in ptx and "shfl.sync.bfly" in ptx
    ptx, _ = cuda.compile_ptx(*norm.SIGNATURES[0], cc=CC)
    assert "st.global.v4.u32" in ptx and "ld.global.v4.u32" in ptx


def test_integer_gemv_emits_imma_and_prmt():
    """The integer-tensor-core GEMV's two instructions are there: ``mma.sync`` m16n8k32 on s8 (8 per loop step of
    two groups) and ``prmt`` (the E2M1 table lookups)."""
    _require_compiler()
    from numba import cuda
    from vmmstream.kernels.matmul.quant import gemv_imma as qgemv_imma
    ptx, _ = cuda.compile_ptx(*qgemv_imma.SIGNATURES[0], cc=CC)
    assert ptx.count("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32") == 8
    assert "prmt.b32" in ptx


def test_launch_pdl_hands_cuda_core_its_own_stream_type():
    """``launch_pdl`` gives cuda.core's ``launch`` a cuda.core ``Stream`` over the caller's handle (cuda.core
    deprecates foreign stream objects): a ``__cuda_stream__`` object keeps its handle, 0 is the default
    stream, a cuda.core stream passes through, anything else is a ``TypeError``."""
    from cuda.core import Stream
    from vmmstream.kernels.base.launch import _core_stream

    class Foreign:
        def __init__(self, version, handle):
            self.v, self.h = version, handle

        def __cuda_stream__(self):
            return (self.v, self.h)

    s = _core_stream(Foreign(0, 0x1234))
    assert isinstance(s, Stream) and int(s.handle) == 0x1234
    assert int(_core_stream(0).handle) == 0
    assert _core_stream(s) is s
    with pytest.raises(TypeError, match="version 1"):
        _core_stream(Foreign(1, 0x1234))
    with pytest.raises(TypeError, match="got str"):
        _core_stream("stream")
