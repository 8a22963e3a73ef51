"""Multi-step driver work as a transaction that undoes itself (invariant I3)."""

from __future__ import annotations


class Transaction:
    """Collect an undo action after each step; on an exception, run them in reverse.

        with Transaction() as tx:
            h = driver.mem_create(n); tx.on_undo(driver.mem_release, h)
            driver.mem_map(va, n, h); tx.on_undo(driver.mem_unmap, va, n)

    An undo that itself fails does not stop the others; the first such failure is attached to
    the original exception as a note, never hiding it.
    """

    def __init__(self):
        self._undo: list = []

    def on_undo(self, fn, *args) -> None:
        self._undo.append((fn, args))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self._undo.clear()
            return False
        while self._undo:
            fn, args = self._undo.pop()
            try:
                fn(*args)
            except BaseException as undo_exc:  # keep unwinding; report, don't mask
                if exc is not None and hasattr(exc, "add_note"):
                    exc.add_note(f"rollback step {getattr(fn, '__name__', fn)} also failed: {undo_exc!r}")
        return False
