"""How a checkpoint's stored tensors became the device's values, per stored format, and what it cost in error.

A tensor stored in a form the kernels do not read (a GGUF block type, GPTQ / AWQ parts, fp16 or fp32 in a GGUF
file) is converted while loading: into the int4 layout where that holds its values exactly (GPTQ and AWQ
4-bit), else decoded to fp32 and rounded to bf16. ``ConversionReport`` gathers, per stored format, the tensors,
what they became and the error of the device values against the stored values (decoded exactly in fp32):
relative RMS ``‖device - stored‖₂ / ‖stored‖₂`` and max ``|device - stored|``. ``model.conversion`` shows it.
"""

from __future__ import annotations

import threading

import numpy as np

_SLAB = 1 << 20       # values per error slab

class ConversionReport:
    def __init__(self):
        self.formats: dict[str, dict] = {}
        self._lock = threading.Lock()      # tensors are converted on several threads while loading

    def record(self, fmt: str, name: str, stored_as: str, stored=None, device=None) -> None:
        """Tensor ``name`` of format ``fmt`` became ``stored_as`` ("int4" / "bf16"); ``stored`` and ``device``
        (fp32 arrays of its values) give the error, None for an exact conversion."""
        sq_err = sq_ref = max_abs = 0.0
        if stored is not None:
            a, b = np.reshape(stored, -1), np.reshape(device, -1)
            for i in range(0, a.size, _SLAB):        # bounded temporaries for a vocabulary-sized table
                s = a[i:i + _SLAB].astype(np.float32, copy=False)
                d = b[i:i + _SLAB] - s               # a rounding error: exact in fp32
                sq_err += float(np.dot(d, d))        # fp32 sums of a slab, added up in fp64
                sq_ref += float(np.dot(s, s))
                max_abs = max(max_abs, float(d.max()), -float(d.min()))
        rel = (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0
        with self._lock:
            f = self.formats.setdefault(fmt, {"tensors": 0, "stored_as": stored_as, "_sq_err": 0.0, "_sq_ref": 0.0,
                                              "max_abs_error": 0.0, "worst_rel_rms_error": 0.0, "worst_tensor": ""})
            f["tensors"] += 1
            if f["stored_as"] != stored_as:
                f["stored_as"] = "mixed"
            f["_sq_err"] += sq_err
            f["_sq_ref"] += sq_ref
            f["max_abs_error"] = max(f["max_abs_error"], max_abs)
            if rel > f["worst_rel_rms_error"] or not f["worst_tensor"]:
                f["worst_rel_rms_error"], f["worst_tensor"] = rel, name

    def to_dict(self) -> dict:
        out = {}
        for fmt, f in sorted(self.formats.items()):
            d = {k: v for k, v in f.items() if not k.startswith("_")}
            d["rel_rms_error"] = (f["_sq_err"] / f["_sq_ref"]) ** 0.5 if f["_sq_ref"] else 0.0
            d["exact"] = f["_sq_err"] == 0.0
            out[fmt] = d
        return out

    def __str__(self) -> str:
        if not self.formats:
            return "conversion: none (every tensor loaded as stored)"
        lines = ["conversion of the stored tensors:"]
        for fmt, d in self.to_dict().items():
            err = ("exact" if d["exact"] else
                   f"relative RMS error {d['rel_rms_error']:.3g} (worst {d['worst_rel_rms_error']:.3g} in "
                   f"{d['worst_tensor']}), max |err| {d['max_abs_error']:.3g}")
            lines.append(f"  {fmt}: {d['tensors']} tensors -> {d['stored_as']}, {err}")
        return "\n".join(lines)


def convert(info, payload: int, qlayout, quant, report: ConversionReport) -> np.ndarray:
    """Tensor ``info`` (with a ``source``) as its device payload (uint8 [payload]): int4 parts as the source
    repacked them when the plan stores it int4 (``qlayout``), else quantized at load from its values (the
    ``quantize`` option, error in ``quant``), else bf16. Its conversion is recorded in ``report``."""
    from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16
    from vmmstream.kernels.matmul.quant.formats import (
        Int4Weights,
        dequantize,
        dequantize_int4,
    )

    from .model.quantized import Int4Parts
    from .prequantized import repack
    src, shape = info.source, tuple(info.shape)
    vals = src.read()
    if isinstance(vals, Int4Parts):
        vals = repack(vals)
    out = np.zeros(payload, np.uint8)
    if isinstance(vals, Int4Weights):
        if qlayout is not None and qlayout.kind == "int4":
            for part, arr in zip(("packed", "scales", "zeros"), vals):
                arr = np.ascontiguousarray(arr, qlayout.dtypes[part])
                if arr.shape != qlayout.shapes[part]:
                    raise ValueError(f"{info.name}: int4 {part} {arr.shape}, the layout's is {qlayout.shapes[part]}")
                raw = arr.view(np.uint8).reshape(-1)
                out[qlayout.offsets[part]:qlayout.offsets[part] + raw.size] = raw
            quant.record_exact(info.name, int(np.prod(shape)), qlayout)
            report.record(src.format, info.name, "int4")
            return out
        vals = dequantize_int4(*vals)                 # kept bf16 (a quantized output head, say)
    vals = np.asarray(vals, np.float32).reshape(shape)
    if qlayout is not None:
        quant.quantize_into(info.name, vals, qlayout, out)
        parts = [out[qlayout.offsets[p]:].view(qlayout.dtypes[p])[:int(np.prod(qlayout.shapes[p]))]
                 .reshape(qlayout.shapes[p]) for p in qlayout.offsets]
        report.record(src.format, info.name, qlayout.kind, vals, dequantize(parts, qlayout.kind))
        return out
    bits = f32_to_bf16(vals)
    report.record(src.format, info.name, "bf16", vals, bf16_to_f32(bits))
    raw = np.ascontiguousarray(bits).view(np.uint8).reshape(-1)
    out[:raw.size] = raw
    return out
