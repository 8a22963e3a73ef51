"""Fault injection shared by the host and GPU tiers: a driver call that raises ``KeyboardInterrupt`` (a user's
Ctrl-C lands inside some driver call), and the loop that fails each call of an operation in turn."""

from __future__ import annotations

from vmmstream.errors import DriverError


class Interrupt:
    """Fault injector: the ``n``-th driver call raises ``KeyboardInterrupt``."""

    def __init__(self, n: int):
        self.n, self.seen, self.fired = n, 0, None

    def __call__(self, name: str) -> None:
        self.seen += 1
        if self.seen == self.n and self.fired is None:
            self.fired = name
            raise KeyboardInterrupt(f"injected at {name}")


def each_call(driver, make_injector, run, on_fault):
    """Run ``run()`` with its n-th driver call failing (``make_injector(n)``), for n = 1, 2, ... until it completes;
    ``on_fault(exc)`` checks the state after each failure (``exc`` None where the operation absorbed it and went
    on). Returns (calls failed with an exception, the result of the first run no fault reached)."""
    failed = 0
    for n in range(1, 100_000):
        inj = make_injector(n)
        driver.fault_injector = inj
        try:
            result = run()
        except (DriverError, KeyboardInterrupt) as exc:
            assert inj.fired, f"{type(exc).__name__} without the injected fault: {exc}"
            failed += 1
            driver.fault_injector = None
            on_fault(exc)
            continue
        finally:
            driver.fault_injector = None
        if inj.fired is not None:      # absorbed where that is the design (a failed release is kept and retried)
            on_fault(None)
            continue
        return failed, result
    raise AssertionError("never completed")
