"""Quantize at load: which weights, how they are laid out on the device, and what it cost in error.

``load_model(path, budget, quantize="int4" | "mxfp4")`` quantizes the decoder layers' linear weights
(q/k/v/o, gate/up/down projections; in a mixture of experts every expert's and the shared expert's, not the
router) with the host round-to-nearest quantizers of ``kernels/matmul/quant/formats.py`` while
the checkpoint is read. The embedding table, the output head, norms and biases stay bf16: the head decides
every token and is read once per step, the rest is small. A weight whose input dim is not a multiple of the
format's group (128 for int4, 32 for MXFP4) stays bf16, and the plan says so.

A quantized tensor is one payload (one VA range, one slot copy when streamed) of its parts, each 256-byte
aligned: ``packed`` (uint8 [N, K/2]), ``scales`` (int4: fp16 [N, K/128]; MXFP4: E8M0 uint8 [N, K/32]) and,
for int4, ``zeros`` (fp16 [N, K/128]). The planner, the streamed bytes per token and the bound are computed
on these sizes.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

import numpy as np

from .align import align_up

KINDS = ("int4", "mxfp4")
GROUP = {"int4": 128, "mxfp4": 32}
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                     r"|mlp\.experts\.\d+\.(gate|up|down)_proj|mlp\.shared_expert\.(gate|up|down)_proj"
                     r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")


def check_kind(kind):
    """None or one of ``KINDS``; anything else is a ``ValueError`` that names the choices."""
    if kind is None or kind in KINDS:
        return kind
    raise ValueError(f"quantize={kind!r}: expected None, {' or '.join(repr(k) for k in KINDS)}")




@dataclass(frozen=True)
class QLayout:
    """Byte offsets of a quantized weight's parts inside its payload."""
    kind: str
    n: int
    k: int
    offsets: dict = field(hash=False)
    shapes: dict = field(hash=False)
    dtypes: dict = field(hash=False)
    total: int = 0


def layout(kind: str, shape) -> QLayout:
    n, k = (int(s) for s in shape)
    g = GROUP[kind]
    parts = {"packed": ((n, k // 2), np.uint8)}
    if kind == "int4":
        parts["scales"] = ((n, k // g), np.float16)
        parts["zeros"] = ((n, k // g), np.float16)
    else:
        parts["scales"] = ((n, k // g), np.uint8)
    offsets, off = {}, 0
    for name, (shp, dt) in parts.items():
        offsets[name] = off
        off = align_up(off + int(np.prod(shp)) * np.dtype(dt).itemsize)
    return QLayout(kind, n, k, offsets, {p: s for p, (s, _) in parts.items()},
                   {p: np.dtype(d) for p, (_, d) in parts.items()}, off)


def is_linear(name: str) -> bool:
    """A decoder layer's linear weight (what ``quantize`` applies to)."""
    return _LINEAR.match(name) is not None


def quantizable(name: str, shape, kind: str | None) -> bool:
    """Whether ``quantize=kind`` stores tensor ``name`` of ``shape`` quantized."""
    return (kind is not None and _LINEAR.match(name) is not None and len(shape) == 2
            and int(shape[1]) % GROUP[kind] == 0 and int(shape[1]) > 0)


def payload(name: str, shape, kind: str | None) -> int:
    """Device bytes of tensor ``name``: its quantized layout's total, or bf16."""
    if quantizable(name, shape, kind):
        return layout(kind, shape).total
    return 2 * int(np.prod([int(s) for s in shape]))


class QWeight:
    """A quantized weight on the device (or in host memory, on the host backend): views of its parts."""
    __slots__ = ("kind", "shape", "packed", "scales", "zeros")

    def __init__(self, kind, shape, packed, scales, zeros=None):
        self.kind, self.shape = kind, tuple(shape)
        self.packed, self.scales, self.zeros = packed, scales, zeros

    def __repr__(self) -> str:
        return f"QWeight({self.kind}, {self.shape})"


def views(lay: QLayout, base: int, view) -> QWeight:
    """A ``QWeight`` over the payload at address ``base``; ``view(addr, shape, dtype)`` makes an array."""
    parts = {p: view(base + lay.offsets[p], lay.shapes[p], lay.dtypes[p]) for p in lay.offsets}
    return QWeight(lay.kind, (lay.n, lay.k), parts["packed"], parts["scales"], parts.get("zeros"))


class ErrorReport:
    """Round-trip error of every quantized weight, gathered while loading."""

    def __init__(self, kind: str | None):
        self.kind = kind
        self.tensors = 0
        self.repacked = 0                  # of which stored quantized in the checkpoint, repacked exactly
        self.kept_bf16: list[str] = []
        self.bytes_bf16 = 0
        self.bytes_quantized = 0
        self.max_abs = 0.0
        self._sq_err = 0.0
        self._sq_ref = 0.0
        self.worst_rel_rms = 0.0
        self.worst = ""
        self._lock = threading.Lock()      # weights are quantized on several threads while loading

    def quantize_into(self, name: str, w: np.ndarray, lay: QLayout, dst: np.ndarray) -> None:
        """Quantize fp32 ``w`` [N, K] into the uint8 payload ``dst`` (laid out as ``lay``) and record its error."""
        from vmmstream.kernels.matmul.quant.formats import dequantize, quantize
        qw = quantize(w, lay.kind)
        for part, arr in zip(("packed", "scales", "zeros"), qw):
            raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
            dst[lay.offsets[part]:lay.offsets[part] + raw.size] = raw
        d = dequantize(qw, lay.kind).astype(np.float64) - w
        sq_err, sq_ref = float(np.sum(d * d)), float(np.sum(w.astype(np.float64) ** 2))
        rel = (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0
        max_abs = float(np.abs(d).max()) if d.size else 0.0
        with self._lock:
            self._record(name, w.size, lay, max_abs, sq_err, sq_ref, rel)

    def record_exact(self, name: str, size: int, lay: QLayout) -> None:
        """A weight the checkpoint stores in ``lay``'s kind already (GPTQ / AWQ), repacked as is: no error."""
        with self._lock:
            self.repacked += 1
            self._record(name, size, lay, 0.0, 0.0, 0.0, 0.0)

    def _record(self, name, size, lay, max_abs, sq_err, sq_ref, rel) -> None:
        self.tensors += 1
        self.bytes_bf16 += 2 * size
        self.bytes_quantized += lay.total
        self.max_abs = max(self.max_abs, max_abs)
        self._sq_err += sq_err
        self._sq_ref += sq_ref
        if rel >= self.worst_rel_rms:
            self.worst_rel_rms, self.worst = rel, name

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tensors": self.tensors, "repacked": self.repacked,
                "kept_bf16": list(self.kept_bf16),
                "bytes_bf16": self.bytes_bf16, "bytes_quantized": self.bytes_quantized,
                "max_abs_error": self.max_abs,
                "rel_rms_error": (self._sq_err / self._sq_ref) ** 0.5 if self._sq_ref else 0.0,
                "worst_rel_rms_error": self.worst_rel_rms, "worst_tensor": self.worst}

    def __str__(self) -> str:
        if self.kind is None:
            return "quantization: none (bf16 weights)"
        d = self.to_dict()
        from .budget import format_bytes
        if self.repacked == self.tensors and self.tensors:
            return (f"quantization: {self.kind} as the checkpoint stores it, {d['tensors']} weights repacked exactly "
                    f"({format_bytes(d['bytes_bf16'])} bf16 -> {format_bytes(d['bytes_quantized'])})")
        text = (f"quantization: {self.kind}, {d['tensors']} weights, {format_bytes(d['bytes_bf16'])} bf16 -> "
                f"{format_bytes(d['bytes_quantized'])}; round-trip error: relative RMS {d['rel_rms_error']:.2%} "
                f"(worst {d['worst_rel_rms_error']:.2%} in {d['worst_tensor']}), max |err| {d['max_abs_error']:.3g}")
        if self.kept_bf16:
            text += f"; kept bf16 (input dim not a multiple of {GROUP[self.kind]}): {len(self.kept_bf16)}"
        return text
