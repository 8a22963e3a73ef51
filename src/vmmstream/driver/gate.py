"""The process-wide capture gate (invariant I6).

While any stream capture is open in the process, a VMM call, an allocation or a synchronize would
either invalidate the capture or be baked into it. The gate refuses them with ``CaptureError``
*before* the driver sees them, so the capture stays valid and the caller learns what it did.
"""

from __future__ import annotations

import threading

from ..errors import CaptureError


class CaptureGate:
    def __init__(self):
        self._lock = threading.Lock()
        self._open = 0

    @property
    def open(self) -> bool:
        return self._open > 0

    def check(self, what: str) -> None:
        if self._open:
            raise CaptureError(
                f"{what} refused: a stream capture is open in this process (no VMM call, allocation or "
                "synchronize may run during capture); do it before begin_capture or after end_capture")

    def enter(self) -> None:
        with self._lock:
            self._open += 1

    def exit(self) -> None:
        with self._lock:
            if self._open <= 0:
                raise AssertionError("capture gate closed more often than opened")
            self._open -= 1


GATE = CaptureGate()
