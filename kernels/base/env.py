"""On / off switches the kernels read from the environment when they are imported. ``vmmstream.config`` lists and
documents each of them (``vmmstream env``); the kernels do not import the package's configuration."""

from __future__ import annotations

import os

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str, default: bool) -> bool:
    """``name`` unset or empty: ``default``; one of ``ON`` / ``OFF`` (any case): True / False; anything else is an
    error that names the variable (a typo must not switch silently)."""
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return default
    if v in ON:
        return True
    if v in OFF:
        return False
    raise ValueError(f"{name}={v!r}: expected 1/true/yes/on or 0/false/no/off")
