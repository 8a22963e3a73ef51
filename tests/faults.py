"""Fault injection shared by the host and GPU tiers: a Ctrl-C (a real SIGINT) before or after a driver call, and
the loop that fails each call of an operation in turn."""

from __future__ import annotations

import signal
import warnings

from vmmstream.errors import DriverError


def default_sigint() -> None:
    """Python's own SIGINT handler in place, so an injected Ctrl-C raises ``KeyboardInterrupt`` — whatever the
    process started with (a suite started as a background job, ``... &``, inherits SIGINT ignored)."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        warnings.warn(f"SIGINT handler {handler!r} found in place of Python's default; restored for the "
                      "injected Ctrl-C", stacklevel=3)
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Interrupt:
    """SIGINT at the ``n``-th driver call, just before it runs (``after=True``: just after it returned, which is
    where a Ctrl-C usually lands while the driver works without the GIL). Python turns it into
    ``KeyboardInterrupt`` at once, or at the end of an uninterruptible section (``vmmstream.interrupts``)."""

    def __init__(self, n: int, after: bool = False):
        self.n, self.after, self.seen, self.fired = n, after, 0, None

    def __call__(self, name: str) -> None:
        self.seen += 1
        if self.seen == self.n and self.fired is None:
            self.fired = name
            signal.raise_signal(signal.SIGINT)

    def install(self, driver) -> None:
        default_sigint()
        if self.after:
            driver.after_call = self
        else:
            driver.fault_injector = self


def interrupt_after(n: int) -> Interrupt:
    return Interrupt(n, after=True)


def _install(driver, inj) -> None:
    if hasattr(inj, "install"):
        inj.install(driver)
    else:
        driver.fault_injector = inj


def _remove(driver) -> None:
    driver.fault_injector = None
    driver.after_call = None


def each_call(driver, make_injector, run, on_fault):
    """Run ``run()`` with its n-th driver call failing (``make_injector(n)``), for n = 1, 2, ... until it completes;
    ``on_fault(exc)`` checks the state after each failure (``exc`` None where the operation absorbed it and went
    on). Returns (calls failed with an exception, the result of the first run no fault reached)."""
    default_sigint()
    failed = 0
    for n in range(1, 100_000):
        inj = make_injector(n)
        _install(driver, inj)
        try:
            result = run()
        except (DriverError, KeyboardInterrupt) as exc:
            assert inj.fired, f"{type(exc).__name__} without the injected fault: {exc}"
            failed += 1
            _remove(driver)
            on_fault(exc)
            continue
        finally:
            _remove(driver)
        if inj.fired is not None:      # absorbed where that is the design (a failed release is kept and retried)
            on_fault(None)
            continue
        return failed, result
    raise AssertionError("never completed")
