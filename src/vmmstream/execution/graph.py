"""Capture the decode step once and replay it per token (DESIGN §6).

The step is captured on the compute stream; the copy stream joins the capture through the step's first
event and rejoins it through its last (see ``Streamer``), so slot copies, event edges and kernels are one
graph. Nothing in a capture allocates, maps or synchronizes (the capture gate refuses it, I6); every
kernel was launched eagerly once before (warm-up), so none compiles or loads a module during the capture.

Owner: ``DecodeGraph`` owns its instantiated graph; ``close()`` destroys it and is idempotent.
"""

from __future__ import annotations

from ..interrupts import uninterruptible


class DecodeGraph:
    def __init__(self, driver, stream, emit, *, key=None):
        self.driver, self.stream, self.key = driver, stream, key
        self.replays = 0
        self.exec = None
        driver.begin_capture(stream)
        try:
            emit()
        except BaseException:
            try:                                   # end the capture (the gate closes) and drop what it made
                driver.graph_destroy(driver.end_capture(stream))
            except Exception:
                pass
            raise
        with uninterruptible():           # the graph is kept as soon as it exists, so close() destroys it
            graph = driver.end_capture(stream)
            try:
                self.exec = driver.graph_instantiate(graph)
            finally:
                if driver.backend != "cuda":
                    driver.graph_destroy(graph)
        self.node_count = graph.node_count

    def replay(self) -> None:
        self.driver.graph_launch(self.exec, self.stream)
        self.replays += 1

    @uninterruptible()
    def close(self) -> None:
        if self.exec is not None:
            self.driver.graph_destroy(self.exec)   # cuda: the exec and the captured graph it was made from
            self.exec = None
