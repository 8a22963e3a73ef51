"""The workspace contract every kernel module follows (DESIGN §5, invariant I7).

A kernel module exposes ``workspace_requirement(...) -> WorkspaceRequirement`` (or ``NONE``) and its
launch takes a workspace view. Both size the view with the *same* layout function, so what the
planner reserves is exactly what the launch uses; a short view raises ``WorkspaceShortfall``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from vmmstream.errors import WorkspaceShortfall

ALIGN = 256  # bytes; every sub-buffer of a workspace starts on this boundary


class Lifetime(str, Enum):
    STEP = "step"          # freed when the step ends
    SESSION = "session"    # kept at a stable VA for captured graphs


@dataclass(frozen=True)
class WorkspaceRequirement:
    bytes: int
    lifetime: Lifetime

    def __post_init__(self):
        if self.bytes < 0:
            raise ValueError("workspace bytes must be >= 0")


NONE = WorkspaceRequirement(0, Lifetime.STEP)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Layout:
    """Named, aligned sub-buffers of one workspace: ``offsets[name]`` and ``total`` bytes."""

    offsets: dict
    sizes: dict
    total: int


def layout(**sizes: int) -> Layout:
    """Lay out named buffers back to back, each aligned to ``ALIGN``."""
    offsets, off = {}, 0
    for name, n in sizes.items():
        offsets[name] = off
        off = align_up(off + int(n))
    return Layout(offsets=offsets, sizes=dict(sizes), total=off)


def check_view(kernel: str, view_nbytes: int, needed: int) -> None:
    """Raise ``WorkspaceShortfall`` when a view is short; never allocate instead."""
    if view_nbytes < needed:
        raise WorkspaceShortfall(kernel, needed, view_nbytes)
