"""Fingerprint the sm_90 PTX of every kernel module's ``SIGNATURES``: one line per kernel (module, index, Python
name, PTX lines, a hash of the PTX with Numba's mangled names masked). Two trees whose lines are equal compile to
the same PTX, hence the same machine code: how a change that only moves or renames code is shown to leave every
kernel as it was, without a GPU (``compile_ptx`` needs NVVM only).

    python bench/tools/ptx_fingerprint.py > head.txt                  # every module of KERNEL_MODULES
    python bench/tools/ptx_fingerprint.py matmul.quant.gemv moe        # some
    PYTHONPATH=/tmp/site-old python bench/tools/ptx_fingerprint.py > base.txt && diff base.txt head.txt

(``pip install --no-deps --target /tmp/site-old OLD_TREE`` puts an older tree's package there.) Not under the
Numba simulator.
"""
from __future__ import annotations

import hashlib
import importlib
import re
import sys

MODULES = ["matmul.dense.gemv", "matmul.dense.gemm", "matmul.dense.gemm_mma", "matmul.quant.gemm_mma", "matmul.quant.gemv", "matmul.quant.gemv_mma",
           "matmul.quant.gemv_mx16", "matmul.quant.gemv_imma", "matmul.quant.gemm", "moe.gather", "ops.norm",
           "ops.rope", "ops.elementwise", "ops.embedding", "ops.sampling", "ops.scalars", "moe", "attention.prefill",
           "attention.decode"]
_MANGLED = re.compile(r"_Z\w+|_cudapy\w*|\$\w+")


def fingerprint(ptx: str) -> tuple[int, str]:
    lines = [_MANGLED.sub("X", ln) for ln in ptx.splitlines() if ln.strip() and not ln.lstrip().startswith("//")]
    return len(lines), hashlib.md5("\n".join(lines).encode()).hexdigest()[:12]


def main(names: list[str]) -> None:
    from numba import cuda
    for name in names:
        mod = importlib.import_module(f"vmmstream.kernels.{name}")
        for i, (fn, sig) in enumerate(mod.SIGNATURES):
            ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
            n, digest = fingerprint(ptx)
            print(name, i, getattr(fn, "__name__", "?"), n, digest, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or MODULES)
