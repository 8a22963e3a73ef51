"""The one way in for the arguments of the public API: every check names the argument, its value and what is
accepted, and nothing is coerced silently (``2.7`` tokens, ``True`` as a count, a NaN temperature or ``b"abc"`` as
token ids are refused, never rounded or read as something else).

Types that are wrong raise ``TypeError``, values out of range ``ValueError``; both say the same three things.
NumPy integer and floating scalars are accepted where Python's are (a value read from an array is a value).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np


def _is_int(value) -> bool:
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return (isinstance(value, (numbers.Real, np.floating, np.integer))
            and not isinstance(value, (bool, np.bool_)))


def integer(name: str, value, *, lo: int | None = None, hi: int | None = None, what: str | None = None) -> int:
    """``value`` as an int in [lo, hi] (either bound optional)."""
    accepted = what or _range_text("an integer", lo, hi)
    if not _is_int(value):
        raise TypeError(f"{name}={value!r}: expected {accepted}, got {type(value).__name__}")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name}={v}: expected {accepted}")
    return v


def optional_integer(name: str, value, **kw) -> int | None:
    return None if value is None else integer(name, value, **kw)


def real(name: str, value, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
         what: str | None = None) -> float:
    """``value`` as a finite float in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    accepted = what or _range_text("a finite number", lo, hi, lo_open)
    if not _is_real(value):
        raise TypeError(f"{name}={value!r}: expected {accepted}, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:                    # an int past float's range
        raise ValueError(f"{name}={_short(value)}: expected {accepted}") from None
    if not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise ValueError(f"{name}={v!r}: expected {accepted}")
    return v


def boolean(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r}: expected True or False, got {type(value).__name__}")
    return bool(value)


def token_ids(name: str, value, vocab_size: int, *, allow_empty: bool = False) -> list[int]:
    """A sequence of token ids, each an integer in [0, vocab_size)."""
    accepted = f"a sequence of integer token ids in [0, {vocab_size})"
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{name}={_short(value)}: expected {accepted}, got {type(value).__name__}")
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise ValueError(f"{name}: expected {accepted}, got an array of shape {value.shape}")
    ids = list(value)
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty: give at least one token id")
    wrong = [i for i in ids if not _is_int(i)]
    if wrong:
        raise TypeError(f"{name}: {_short(wrong)} are not integers; expected {accepted}")
    ids = [int(i) for i in ids]
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"{name}: token ids {_short(outside)} are outside the vocabulary; expected {accepted}")
    return ids


def token_id_set(name: str, value, vocab_size: int) -> frozenset[int]:
    """None, one token id, or a sequence of them (e.g. several end-of-sequence ids)."""
    if value is None:
        return frozenset()
    if _is_int(value):
        return frozenset([integer(name, value, lo=0, hi=vocab_size - 1,
                                  what=f"a token id in [0, {vocab_size}) or a list of them")])
    return frozenset(token_ids(name, value, vocab_size))


def _range_text(kind: str, lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f"{kind} <= {hi}"
    return kind


def _short(value, n: int = 5) -> str:
    if isinstance(value, list) and len(value) > n:
        return f"{value[:n]!r} (and {len(value) - n} more)"
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."
