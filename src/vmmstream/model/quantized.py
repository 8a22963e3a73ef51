"""GPTQ and AWQ checkpoints (4-bit safetensors as published on the hub) seen as ordinary checkpoints.

A quantized linear layer ``X`` is stored as ``X.qweight``, ``X.qzeros``, ``X.scales`` (and for GPTQ ``X.g_idx``);
``prequantized_tensors`` presents it as one logical tensor ``X.weight`` [N, K] whose ``source`` reads the parts,
which the loader repacks into the int4 layout (``vmmstream.prequantized``: the same codes, zero points and scales), so
the planner, the streamer and the step see it exactly as a weight quantized at load with ``quantize="int4"``.
Everything else (embeddings, norms, an unquantized ``lm_head``, biases) stays as stored.

What ``config.json``'s ``quantization_config`` must say: ``quant_method`` gptq or awq, ``bits`` 4, ``group_size``
128; GPTQ without act-order (``desc_act`` false), in the ``gptq`` or ``gptq_v2`` checkpoint format; AWQ in its
GEMM packing (``version: gemm``) with zero points. Anything else is a ``PrequantizedFormatError`` naming it,
before any weight byte is read; so is a checkpoint that leaves some layer linear weights unquantized (checked by
``load_model``, which knows which weights are linear). A ``g_idx`` that is not the trivial ``k // 128`` (act-order
saved with ``desc_act`` false) is found when that layer is read, during the load: refused then, naming the layer,
and everything the load took is released.
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import PrequantizedFormatError
from .checkpoint import TensorInfo, read_span

PARTS = ("qweight", "qzeros", "scales", "g_idx")
_DTYPES = {"qweight": "I32", "qzeros": "I32", "scales": "F16", "g_idx": "I32"}


class Int4Parts(NamedTuple):
    """One stored layer as read: ``arrays`` {part: array} as the checkpoint has them (``vmmstream.prequantized.
    repack`` turns them into ``Int4Weights``)."""
    method: str           # "gptq" | "awq"
    name: str             # the layer (``model.layers.0.mlp.down_proj``)
    arrays: dict
    group_size: int
    v2: bool              # gptq_v2: zero points stored as they are, not minus 1


class Int4Source:
    """Reads one GPTQ / AWQ layer's parts (``read() -> Int4Parts``); the int4 layout holds them exactly."""
    exact = True

    def __init__(self, method: str, name: str, parts: dict, group_size: int, v2: bool):
        self.format, self.name, self.parts, self.group_size, self.v2 = method, name, parts, group_size, v2

    def _read(self, part):
        import numpy as np
        info = self.parts[part]
        raw = read_span(info.file, info.offset, info.nbytes, info.name)
        return raw.view({"I32": "<i4", "F16": "<f2"}[info.dtype]).astype({"I32": np.int32, "F16": np.float16}
                                                                          [info.dtype]).reshape(info.shape)

    def read(self) -> Int4Parts:
        return Int4Parts(self.format, self.name, {p: self._read(p) for p in self.parts}, self.group_size, self.v2)


def _settings(qc) -> tuple[str, int, bool]:
    """(method, group size, gptq_v2) from ``quantization_config``, or a ``PrequantizedFormatError``."""
    if not isinstance(qc, dict):
        raise PrequantizedFormatError(f"quantization_config is {type(qc).__name__}; expected an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise PrequantizedFormatError(f"quantization_config quant_method {qc.get('quant_method')!r}: the "
                                      "checkpoints that load quantized are gptq and awq (4 bits, groups of 128)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise PrequantizedFormatError(f"{method} with bits {bits!r}: only 4-bit checkpoints map onto the int4 layout")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group != 128:
        raise PrequantizedFormatError(f"{method} with group_size {group!r}: the int4 layout here groups 128 values "
                                      "along K (per-channel or other group sizes are not supported)")
    v2 = False
    if method == "gptq":
        if qc.get("desc_act"):
            raise PrequantizedFormatError("gptq with desc_act true (act-order): its groups are permuted along K, "
                                          "which the int4 layout cannot express; use a checkpoint without act-order")
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq")) or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise PrequantizedFormatError(f"gptq checkpoint_format {fmt!r}: only 'gptq' and 'gptq_v2' are read")
        v2 = fmt == "gptq_v2"
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise PrequantizedFormatError(f"awq version {version!r}: only the GEMM packing ('gemm') is read")
        if qc.get("zero_point", True) is not True:
            raise PrequantizedFormatError("awq without zero points (zero_point false) is not supported")
    return method, group, v2


def prequantized_tensors(config, qc, tensors: dict) -> tuple[str, dict, tuple]:
    """``(format, tensors, notes)``: ``tensors`` (safetensors headers by name) with every quantized layer's parts
    replaced by its logical ``.weight``. Raises ``PrequantizedFormatError`` for a layout not run exactly."""
    method, group, v2 = _settings(qc)
    out = {n: t for n, t in tensors.items() if not n.endswith(tuple("." + p for p in PARTS))}
    bases = [n[:-len(".qweight")] for n in tensors if n.endswith(".qweight")]
    for base in bases:
        parts = {p: tensors.get(f"{base}.{p}") for p in PARTS}
        parts = {p: t for p, t in parts.items() if t is not None}
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
        if missing:
            raise PrequantizedFormatError(f"{base}: {method} layer without {', '.join(missing)}")
        for p, t in parts.items():
            if t.dtype != _DTYPES[p] or len(t.shape) != (1 if p == "g_idx" else 2):
                raise PrequantizedFormatError(f"{t.name}: {t.dtype}{list(t.shape)}, expected {_DTYPES[p]} "
                                              f"{'[K]' if p == 'g_idx' else '2-D'}")
        qw = parts["qweight"].shape
        n, k = (qw[1], 8 * qw[0]) if method == "gptq" else (8 * qw[1], qw[0])
        want = {"qzeros": (k // group, n // 8), "scales": (k // group, n), "g_idx": (k,)}
        for p, shape in want.items():
            if p in parts and tuple(parts[p].shape) != shape:
                raise PrequantizedFormatError(f"{parts[p].name}: shape {list(parts[p].shape)}, expected "
                                              f"{list(shape)} for a {method} layer of {n} x {k} in groups of {group}")
        if k % group or n % 8:
            raise PrequantizedFormatError(f"{base}: {n} x {k} is not in whole groups of {group} along K and words "
                                          "of 8 along N")
        name = f"{base}.weight"
        if name in tensors:
            raise PrequantizedFormatError(f"{base} is stored both quantized and as {name}")
        q = parts["qweight"]
        out[name] = TensorInfo(name, f"{method.upper()}-INT4", (n, k), sum(t.nbytes for t in parts.values()), q.file,
                               q.offset, Int4Source(method, base, parts, group, v2))
    notes = (f"{method} checkpoint: {len(bases)} 4-bit linear weights repacked into the int4 layout exactly (their "
             "codes, zero points and scales as stored; nothing re-quantized)"),
    return method, out, notes
