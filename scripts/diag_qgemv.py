"""Where the tensor-core quantized GEMV's time goes, 1x4096 . [14336, 4096]: the full kernel, its memory side
alone (probe), its compute side alone (all blocks read the same 16 rows of W, which stay in L1/L2), both off.

    python scripts/diag_qgemv.py OUT.json
    DIAG_MODULES=qgemv_mma DIAG_KINDS=mxfp4 DIAG_MODES=full,compute python scripts/diag_qgemv.py OUT.json   # a subset
    DIAG_ROW_TILES=1,7 DIAG_MODES=full,compute python scripts/diag_qgemv.py OUT.json   # 16-row tiles per block

Row tiles other than 1 apply to ``qgemv_mma`` without the probe (the batch-1 register loop).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from test_bench_dense_kernels import capture, device_seconds, nb  # noqa: E402

from vmmstream.kernels import mma_helpers as mh, qgemv  # noqa: E402
from vmmstream.kernels.quant import quantize_int4, quantize_mxfp4  # noqa: E402

H, I = 4096, 14336
MODS = [m for m in os.environ.get("DIAG_MODULES", "qgemv_mma").split(",") if m]
MODES = [m for m in os.environ.get("DIAG_MODES", "full,probe,compute,compute+probe").split(",") if m]
KINDS = [m for m in os.environ.get("DIAG_KINDS", "int4,mxfp4").split(",") if m]
ROW_TILES = [int(r) for r in os.environ.get("DIAG_ROW_TILES", "1").split(",") if r]
if set(KINDS) - {"int4", "mxfp4"}:
    sys.exit(f"DIAG_KINDS takes int4 and mxfp4, got {','.join(KINDS)}")


def main(out):
    import importlib
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((I, H)) * 0.02).astype(np.float32)
    x = nb(torch.randn(1, H, device="cuda", dtype=torch.bfloat16))
    y = nb(torch.empty(1, I, device="cuda", dtype=torch.bfloat16))
    rows = []
    src = torch.zeros(16 * 1024 * 1024, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    t = device_seconds(capture(lambda s: dst.copy_(src)))
    rows.append(dict(kind="copy", us=t * 1e6, gbps=2 * src.nbytes / t / 1e9))
    print(f"copy 32 MiB: {t * 1e6:.1f} us {2 * src.nbytes / t / 1e9:.0f} GB/s", flush=True)
    for kind in KINDS:
        qw = quantize_int4(w) if kind == "int4" else quantize_mxfp4(w)
        kid = qgemv.INT4 if kind == "int4" else qgemv.MXFP4
        parts = [nb(torch.from_numpy(np.ascontiguousarray(a)).cuda()) for a in qw]
        nbytes = sum(a.nbytes for a in qw) + 2 * H + 2 * I
        pk, sc = parts[0], parts[1]
        zr = parts[2] if kind == "int4" else parts[1]
        flat = [a.reshape(a.shape[0] * a.shape[1]) for a in (pk, sc, zr)]
        for modname in MODS:
            mod = importlib.import_module(f"vmmstream.kernels.{modname}")
            variants = getattr(mod, "DIAG_VARIANTS", {"default": {}})
            for vname, kw in variants.items():
                if kind == "int4" and not kw.get("int4_ok", True):
                    continue
                kw = {k: v for k, v in kw.items() if k != "int4_ok"}
                for mode in MODES:
                    probe = "probe" in mode
                    if probe and not getattr(mod, "HAS_PROBE", True):
                        continue
                    for rt in ROW_TILES:
                        if rt != 1 and (probe or modname == "qgemv_mx16"):
                            continue
                        n_rows = 16 if "compute" in mode else I
                        grid = (-(-I // (16 * rt)), 1)
                        if modname == "qgemv_mx16":
                            if kind != "mxfp4":
                                continue
                            kern = mod.make(False, probe=probe, **kw)
                            args = (flat[0].view(np.uint32), flat[1].view(np.uint32), x, x, y, n_rows, H)
                        else:
                            kern = mod.make(kid, False, 1, probe=probe, **kw, **({} if rt == 1 else {"row_tiles": rt}))
                            args = (*flat, x, x, y, n_rows, 1, H)

                        def fn(s):
                            kern[grid, mh.THREADS * rt, s](*args)
                        t = device_seconds(capture(fn))
                        rows.append(dict(kind=kind, module=modname, variant=vname, mode=mode, row_tiles=rt,
                                         us=t * 1e6, gbps=nbytes / t / 1e9))
                        print(f"{kind:5s} {modname} {vname:12s} {mode:14s} rt {rt} {t * 1e6:6.1f} us "
                              f"{nbytes / t / 1e9:6.0f} GB/s", flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
