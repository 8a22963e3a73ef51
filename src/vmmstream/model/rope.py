"""Rotary position embedding as transformers computes it, for the configs this package runs: plain RoPE,
Llama-3 scaling, Phi-3's LongRoPE, and a partial rotary dimension.

What the rope kernel takes is a table of inverse frequencies ``inv_freq [rotary_dim / 2]`` (element i pairs
with element i + rotary_dim / 2 of each head; dims past ``rotary_dim`` pass unrotated) and one ``scale`` that
multiplies cos and sin (transformers' ``attention_scaling``).

LongRoPE (``rope_type`` "longrope"; Phi-3 configs also say "su" or "yarn", which transformers' ``Phi3Config``
reads as longrope): ``inv_freq[i] = 1 / (ext[i] · theta^(2i / rotary_dim))`` with ``ext`` the config's
``short_factor`` or ``long_factor`` list, and cos/sin multiplied by ``attention_factor`` (given, or
``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` with ``factor`` given or
``max_position_embeddings / original_max_position_embeddings``; 1 when that factor is at most 1).

Which list: transformers takes ``long_factor`` when the sequence of the current forward call (its largest position
+ 1) is longer than ``original_max_position_embeddings``, ``short_factor`` otherwise, decided again at every call.
A table here is fixed when the model loads, so it is chosen by ``max_context``: ``short_factor`` when
``max_context <= original_max_position_embeddings`` — then every sequence this model can run gets the set
transformers gives it — else ``long_factor`` at every position (what llama.cpp does with a context past the
original one), which is transformers' set for sequences longer than the original context but not for shorter
ones: loaded that way, a short sequence differs from transformers' result. The plan says which set it uses.
"""

from __future__ import annotations

import math
import numbers
import reprlib

import numpy as np

from vmmstream.kernels.base.rope_table import base_powers, llama3_scaled

LONGROPE = "longrope"
_LONGROPE_ALIASES = ("su", "yarn", LONGROPE)     # Phi3Config turns "su" and "yarn" into "longrope"
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
PHI3_ORIGINAL_MAX_POSITION = 4096                # Phi3Config's default original_max_position_embeddings


class RopeConfigError(ValueError):
    """A rope setting this package cannot run; ``config`` re-raises it as ``UnsupportedModelError``."""


def parse(d: dict):
    """``(rope_theta, rope_scaling, partial_rotary_factor)`` from the classic keys or transformers 5's
    ``rope_parameters``. ``rope_scaling`` is None for plain RoPE, else its dict without ``rope_theta`` and
    ``partial_rotary_factor``. The factor comes from the rope dict when it has one, else from the top level
    (transformers' ``setdefault``)."""
    theta = d.get("rope_theta")
    scaling = d.get("rope_scaling")
    params = d.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = params
    partial = d.get("partial_rotary_factor", 1.0)
    if isinstance(scaling, dict):
        partial = scaling.get("partial_rotary_factor", partial)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
        else:
            scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return (10000.0 if theta is None else theta), scaling, (1.0 if partial is None else partial)


def phi3_scaling(d: dict, scaling):
    """Phi-3's rope dict as ``Phi3Config`` reads it: "su" / "yarn" are longrope, and the original context is the
    top-level ``original_max_position_embeddings`` (default 4096), which transformers puts over the dict's own.
    Returns the normalized dict: ``rope_type``, both factor lists, the original context, and ``factor`` /
    ``attention_factor`` where given."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise RopeConfigError(f"rope_scaling={scaling!r} must be an object or null")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in _LONGROPE_ALIASES:
        raise RopeConfigError(f"rope_scaling type {kind!r} is not supported for Phi-3; transformers' Phi3 takes "
                              "only longrope (also written 'su' or 'yarn') or none")
    top = d.get("original_max_position_embeddings")
    inner = scaling.get("original_max_position_embeddings")
    orig = PHI3_ORIGINAL_MAX_POSITION if top is None else top
    if inner is not None and inner != orig:
        raise RopeConfigError(
            f"rope_scaling.original_max_position_embeddings={inner!r} differs from the "
            f"{'top-level value' if top is not None else 'Phi-3 default'} {orig!r}, which transformers uses; "
            "the config is ambiguous")
    out = {"rope_type": LONGROPE, "short_factor": scaling.get("short_factor"),
           "long_factor": scaling.get("long_factor"), "original_max_position_embeddings": orig}
    for key in ("factor", "attention_factor"):
        if scaling.get(key) is not None:
            out[key] = scaling[key]
    return out


def rotary_dim(head_dim: int, partial_rotary_factor) -> int:
    """The rotated dims of a head: ``int(head_dim · partial_rotary_factor)``, as transformers sizes them."""
    return int(head_dim * partial_rotary_factor)


def check(scaling, *, longrope_ok: bool, head_dim: int, partial_rotary_factor, max_position_embeddings: int):
    """Raise ``RopeConfigError`` for a rope setting the kernels would get wrong; ``longrope_ok``: the
    architecture runs longrope (Phi-3) and a partial rotary dimension."""
    prf = partial_rotary_factor
    if not _number(prf) or not 0 < prf <= 1:
        raise RopeConfigError(f"partial_rotary_factor={prf!r} must be a number in (0, 1]")
    if prf != 1 and not longrope_ok:
        raise RopeConfigError(f"partial_rotary_factor={prf!r}: only Phi-3 rotates part of each head here")
    rd = rotary_dim(head_dim, prf)
    if rd < 2 or rd % 2:
        raise RopeConfigError(f"partial_rotary_factor={prf!r} rotates {rd} of head_dim {head_dim} dims; RoPE "
                              "rotates pairs, the rotated dims must be a positive even number")
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise RopeConfigError(f"rope_scaling={scaling!r} must be an object or null")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3" and not longrope_ok:
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            raise RopeConfigError(f"llama3 rope_scaling lacks {', '.join(missing)}")
        return
    if kind != LONGROPE or not longrope_ok:
        raise RopeConfigError(
            f"rope_scaling type {kind!r} is not supported; only 'llama3' (Llama-family) and 'longrope' (Phi-3) "
            "are, or none. Linear, dynamic and yarn scaling would change the rotary frequencies the kernels use")
    for key in ("short_factor", "long_factor"):
        f = scaling.get(key)
        if not isinstance(f, list) or not all(_number(x) and math.isfinite(x) and x > 0 for x in f):
            raise RopeConfigError(f"longrope rope_scaling.{key} must be a list of positive numbers, got "
                                  f"{_short(f)}")
        if len(f) != rd // 2:
            raise RopeConfigError(f"longrope rope_scaling.{key} has {len(f)} entries; it needs rotary_dim / 2 = "
                                  f"{rd // 2} (head_dim {head_dim} x partial_rotary_factor {prf})")
    orig = scaling.get("original_max_position_embeddings")
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise RopeConfigError(f"longrope original_max_position_embeddings={orig!r} must be a positive integer")
    for key in ("factor", "attention_factor"):
        v = scaling.get(key)
        if v is not None and (not _number(v) or not math.isfinite(v) or v <= 0):
            raise RopeConfigError(f"longrope rope_scaling.{key}={v!r} must be a positive number")
    try:
        attention_factor(scaling, max_position_embeddings)
    except ZeroDivisionError:
        raise RopeConfigError(f"longrope: original_max_position_embeddings={orig} gives no attention factor "
                              "(log 1 = 0); give rope_scaling.attention_factor") from None


def _kind(scaling):
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def attention_factor(scaling, max_position_embeddings: int) -> float:
    """The factor on cos and sin: 1, or longrope's (transformers' ``_compute_longrope_parameters``)."""
    if _kind(scaling) != LONGROPE:
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(orig))


def factor_set(scaling, max_context: int | None) -> str | None:
    """"short" or "long": the longrope list a table for ``max_context`` uses (None: not longrope). No
    ``max_context``: "short", transformers' choice when no length is known."""
    if _kind(scaling) != LONGROPE:
        return None
    long = max_context is not None and max_context > scaling["original_max_position_embeddings"]
    return "long" if long else "short"


def inv_freq(head_dim: int, theta: float, scaling, partial_rotary_factor=1.0,
             max_context: int | None = None) -> np.ndarray:
    """``inv_freq [rotary_dim / 2]`` fp32, computed in fp32 as transformers does (arange -> float, base ** (i /
    dim)), so the values match its buffers to the last bit or so."""
    dim = rotary_dim(head_dim, partial_rotary_factor)
    power = base_powers(dim, theta)
    inv = (np.float32(1.0) / power).astype(np.float32)
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == LONGROPE:
        ext = np.asarray(scaling[f"{factor_set(scaling, max_context)}_factor"], dtype=np.float32)
        return (np.float32(1.0) / (ext * power)).astype(np.float32)
    if kind == "llama3":
        return llama3_scaled(inv, scaling)
    raise RopeConfigError(f"rope_type {kind!r} has no frequency table here")


def _number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _short(x) -> str:
    return reprlib.repr(x)
