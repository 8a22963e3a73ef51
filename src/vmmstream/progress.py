"""Progress of long work (reading a checkpoint's weights) for a person watching, wherever the output goes.

On a terminal a ``tqdm`` bar, redrawn in place. Anywhere else (a pipe, a log file, CI) a bar's carriage returns
turn into one line of joined redraws, so there the progress is a plain line at every tenth of the work and at
the end: ``loading weights: 1.20 GiB of 7.77 GiB (15%)``.
"""

from __future__ import annotations

import sys

from .budget import format_bytes

TENTHS = 10


class ByteProgress:
    """``progress(done_bytes, total_bytes, info=None, final=False)``; ``close()`` ends the bar (idempotent)."""

    def __init__(self, total: int, desc: str = "loading weights", file=None):
        self.total, self.desc = int(total), desc
        self.file = file if file is not None else sys.stderr
        self._bar = None
        self._shown = -1
        self._done = 0
        self._closed = False
        isatty = getattr(self.file, "isatty", None)
        if isatty is not None and isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=self.total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=self.file, leave=True, dynamic_ncols=True)

    def __call__(self, done: int, total: int | None = None, info=None, final: bool = False) -> None:
        if self._closed:
            return
        done = min(int(done), self.total)
        if self._bar is not None:
            self._bar.update(done - self._done)
            self._done = done
            if final:
                self.close()
            return
        tenth = TENTHS * done // max(1, self.total)
        if tenth > self._shown or (final and self._shown < TENTHS):
            self._shown = TENTHS if final else tenth
            pct = 100 * done // max(1, self.total)
            print(f"{self.desc}: {format_bytes(done)} of {format_bytes(self.total)} ({pct}%)", file=self.file,
                  flush=True)

    def close(self) -> None:
        if self._bar is None:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
