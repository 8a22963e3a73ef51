"""Typed errors. Each subclasses the builtin a caller would naturally catch."""

from __future__ import annotations


class VmmstreamError(Exception):
    """Base of every error vmmstream raises on purpose."""


class BudgetError(VmmstreamError, ValueError):
    """A budget value that cannot be parsed or resolved."""


class ConfigError(VmmstreamError, ValueError):
    """A ``VMMSTREAM_*`` environment variable with a bad value."""


class CapacityError(VmmstreamError, MemoryError):
    """A request the device memory authority refuses: it would exceed the budget.

    Raised before any state changes (invariant I9).
    """

    def __init__(self, message: str, *, requested: int = 0, budget: int = 0,
                 in_use: int = 0, role: str = "", holder: str = ""):
        super().__init__(message)
        self.requested = requested
        self.budget = budget
        self.in_use = in_use
        self.role = role
        self.holder = holder


class DriverError(VmmstreamError, RuntimeError):
    """A driver call failed. ``call`` names it, ``result`` is the ``CUresult`` name."""

    def __init__(self, call: str, result: str, detail: str = ""):
        msg = f"{call} failed: {result}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)
        self.call = call
        self.result = result


class CaptureError(VmmstreamError, RuntimeError):
    """An operation that would break an open stream capture (invariant I6)."""


class WorkspaceShortfall(VmmstreamError, ValueError):
    """A kernel was handed a workspace view smaller than its layout needs (invariant I7)."""

    def __init__(self, kernel: str, needed: int, given: int):
        super().__init__(
            f"{kernel}: workspace view of {given} bytes is short of the {needed} bytes its layout needs; "
            "size it with the kernel's workspace_requirement()")
        self.kernel = kernel
        self.needed = needed
        self.given = given


class PrequantizedFormatError(VmmstreamError, ValueError):
    """A published quantized checkpoint (GPTQ, AWQ) whose layout is not one this package runs exactly."""


class ContextLengthError(VmmstreamError, ValueError):
    """A generation that would need more positions than the model's KV cache was planned for (``max_context``).

    Raised before anything is launched.
    """

    def __init__(self, message: str, *, requested: int = 0, max_context: int = 0):
        super().__init__(message)
        self.requested = requested
        self.max_context = max_context


class Attempts:
    """A teardown that goes on past a failure: ``attempts(fn, *args)`` runs each release step and keeps the
    exception, ``attempts.raise_first()`` raises the first one at the end. Every resource gets its chance to be
    released even when an earlier one fails or is interrupted; a ``KeyboardInterrupt`` is raised before any other
    error once the teardown is done. A step is never repeated: a driver call interrupted after it returned has
    happened (``vmmstream.interrupts`` keeps Ctrl-C out of the steps that pair a call with its bookkeeping)."""

    def __init__(self):
        self.errors: list[BaseException] = []

    def __call__(self, fn, *args) -> None:
        try:
            fn(*args)
        except (Exception, KeyboardInterrupt) as exc:
            self.errors.append(exc)

    def raise_first(self) -> None:
        for exc in self.errors:
            if isinstance(exc, KeyboardInterrupt):
                raise exc
        if self.errors:
            raise self.errors[0]
