"""A blocking barrier for the Numba CUDA simulator's thread blocks.

The simulator's block manager finds out that every thread has reached ``syncthreads`` by polling each
thread's flag in a loop that holds the GIL; with a few hundred threads a block's progress then depends on
how the interpreter happens to hand the GIL around, and the same test has been seen to take 3 s or more
than ten minutes. Here a barrier is a condition variable: the last thread to arrive (or to exit, since an
exited thread no longer takes part, as on a GPU) releases the others, and the manager only joins its threads.
Semantics are the simulator's own: a thread that raises aborts the block and the manager re-raises it.
"""

from __future__ import annotations

import threading

import numpy as np


class _Block:
    def __init__(self, n):
        self.cond = threading.Condition()
        self.live = n
        self.waiting = 0
        self.generation = 0
        self.abort = False

    def release_if_all_waiting(self):          # call with cond held
        if self.live and self.waiting == self.live:
            self.waiting = 0
            self.generation += 1
            self.cond.notify_all()


def _syncthreads(self):
    blk = self._manager._vmm_block
    with blk.cond:
        if blk.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        gen = blk.generation
        blk.waiting += 1
        blk.release_if_all_waiting()
        while blk.generation == gen and not blk.abort:
            blk.cond.wait()
        if blk.abort:
            raise RuntimeError("abort flag set on syncthreads clear")


def _run(self, grid_point, *args):
    from numba.cuda.simulator.kernel import BlockThread

    blk = self._vmm_block = _Block(int(np.prod(self._block_dim)))

    def target():
        try:
            self._f(*args)
        except BaseException:
            with blk.cond:
                blk.abort = True
                blk.cond.notify_all()
            raise
        finally:
            with blk.cond:
                blk.live -= 1
                blk.release_if_all_waiting()

    threads = [BlockThread(target, self, grid_point, block_point, self._debug)
               for block_point in np.ndindex(*self._block_dim)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the first real failure, not the "abort flag" errors it caused in the other threads
    failed = [t for t in threads if t.exception]
    failed.sort(key=lambda t: "abort flag set" in str(t.exception[0]))
    if failed:
        raise failed[0].exception[0].with_traceback(failed[0].exception[1])


def install():
    from numba.cuda.simulator import kernel

    kernel.BlockThread.syncthreads = _syncthreads
    kernel.BlockManager.run = _run
