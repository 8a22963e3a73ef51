"""Ctrl-C never splits a driver call from its bookkeeping.

Python raises ``KeyboardInterrupt`` at the first bytecode after the signal. Inside a release that is usually just
*after* the driver call returned (cuda.bindings runs it without the GIL): the handle is unmapped, released or
destroyed, but the pool, the ledger and the block still say it is there, and a retry of the call is an error or,
for a destroy, undefined behaviour. So every operation that pairs driver calls with their bookkeeping runs inside
``uninterruptible``: a SIGINT that arrives there is recorded and raised as ``KeyboardInterrupt`` when the
outermost such section ends, with the books true.

Only the main thread receives SIGINT (and may swap its handler); on other threads a section costs nothing.
"""

from __future__ import annotations

import functools
import signal
import threading

_state = threading.local()


class _Section:
    __slots__ = ("previous", "pending")

    def __init__(self):
        self.previous = None
        self.pending = False


def _record(section: _Section):
    def handler(signum, frame):
        section.pending = True
    return handler


class uninterruptible:
    """Context manager (re-entrant) and decorator: SIGINT inside is raised at the end of the outermost one."""

    def __enter__(self):
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        if depth == 0 and threading.current_thread() is threading.main_thread():
            section = _Section()
            try:
                section.previous = signal.signal(signal.SIGINT, _record(section))
            except (ValueError, TypeError):     # not settable here (e.g. an embedded interpreter)
                section = None
            _state.section = section
        return self

    def __exit__(self, exc_type, exc, tb):
        _state.depth -= 1
        if _state.depth:
            return False
        section, _state.section = getattr(_state, "section", None), None
        if section is not None:
            signal.signal(signal.SIGINT, section.previous)
            if section.pending and not (exc_type is not None and issubclass(exc_type, KeyboardInterrupt)):
                if section.previous is signal.default_int_handler:
                    raise KeyboardInterrupt          # the user's Ctrl-C wins over an error under way
                if callable(section.previous):
                    section.previous(signal.SIGINT, None)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with uninterruptible():
                return fn(*args, **kwargs)
        return wrapped
