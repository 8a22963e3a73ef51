"""Budget parsing and resolution: bytes, '6GiB'/'512MB'/'1.5 GB', a fraction (0.8, '80%'), 'auto'."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass


from .errors import BudgetError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*%\s*$")

AUTO_FRACTION_OF_FREE = 0.9


@dataclass(frozen=True)
class BudgetSpec:
    """A parsed budget before it meets a device: exactly one of the fields is set."""
    nbytes: int | None = None
    fraction: float | None = None
    auto: bool = False


def parse_budget_spec(value) -> BudgetSpec:
    """Parse without a device. Raises ``BudgetError`` (a ``ValueError``) on anything unclear."""
    if isinstance(value, bool) or value is None or type(value).__name__ == "bool_":
        raise BudgetError(f"budget {value!r} is not a size; give bytes, '6GiB', '80%', 0.8 or 'auto'")
    # a value read from an array is a value (NumPy's scalars register as these; numpy is not imported here)
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif isinstance(value, numbers.Real):
        value = float(value)
    if isinstance(value, int):
        if value <= 0:
            raise BudgetError(f"budget {value} bytes must be positive")
        return BudgetSpec(nbytes=value)
    if isinstance(value, float):
        return BudgetSpec(fraction=_check_fraction(value, value))
    if not isinstance(value, str):
        raise BudgetError(f"budget {value!r} of type {type(value).__name__} is not understood")
    text = value.strip()
    if text.lower() == "auto":
        return BudgetSpec(auto=True)
    m = _PERCENT.match(text)
    if m:
        return BudgetSpec(fraction=_check_fraction(float(m.group(1)) / 100.0, value))
    m = _SIZE.match(text)
    if not m:
        raise BudgetError(f"budget {value!r} is not understood; examples: 6GiB, 512MB, 1.5 GB, 80%, 0.8, auto")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        raise BudgetError(f"budget {value!r}: unknown unit {m.group(2)!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    if unit == "" and "." in number:
        # "0.8" as text is a fraction, as the float 0.8 is.
        return BudgetSpec(fraction=_check_fraction(float(number), value))
    nbytes = math.floor(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]
    if nbytes <= 0:
        raise BudgetError(f"budget {value!r} must be positive")
    return BudgetSpec(nbytes=nbytes)


def _check_fraction(f: float, original) -> float:
    if not (math.isfinite(f) and 0.0 < f <= 1.0):
        raise BudgetError(f"budget {original!r} as a fraction of device memory must be in (0, 1]")
    return f


def parse_budget(value, device_total: int | None = None, *, device_free: int | None = None) -> int:
    """Resolve a budget to bytes.

    A fraction needs ``device_total``; ``'auto'`` needs ``device_free`` (0.9 × free). Unknown capacity
    stays unknown: without the number a relative budget raises ``BudgetError``.
    """
    spec = parse_budget_spec(value)
    if spec.nbytes is not None:
        if device_total is not None and spec.nbytes > device_total:
            raise BudgetError(f"budget {value!r} ({format_bytes(spec.nbytes)}) is more than the device has "
                              f"({format_bytes(device_total)}); give at most that, or a fraction such as '90%'")
        return spec.nbytes
    if spec.fraction is not None:
        if device_total is None:
            raise BudgetError(f"budget {value!r} is a fraction of device memory, but the device total is unknown; "
                              "give bytes such as '6GiB'")
        return max(1, math.floor(spec.fraction * device_total))
    if device_free is None:
        raise BudgetError("budget 'auto' needs the device's free memory, which is unknown here; give bytes")
    return max(1, math.floor(AUTO_FRACTION_OF_FREE * device_free))


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "unknown"
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
