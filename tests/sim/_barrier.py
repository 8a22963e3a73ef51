"""A blocking barrier for the Numba CUDA simulator's thread blocks.

The simulator's block manager finds out that every thread has reached ``syncthreads`` by polling each
thread's flag in a loop that holds the GIL; with a few hundred threads a block's progress then depends on
how the interpreter happens to hand the GIL around, and the same test has been seen to take 3 s or more
than ten minutes. Here a barrier is a condition variable: the last thread to arrive (or to exit, since an
exited thread no longer takes part, as on a GPU) releases the others, and the manager only joins its threads.
Semantics are the simulator's own: a thread that raises aborts the block and the manager re-raises it.

Also here: ``cuda.shared.array`` made atomic. The simulator's ``FakeCUDAShared.array`` looks the call site up in
a dict and, when absent, creates the array and stores it: an unlocked check-then-act run by every thread of the
block. A thread preempted between the check and the store lets another thread create a second array for the
same call site; from then on the two threads use different "shared" memory (one of them uninitialised
``np.empty``), and whatever they exchange through it is garbage: NaN or wrong values, rarely, and only under
unlucky scheduling.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

_shared_lock = threading.Lock()


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


def _shared_array(self, shape, dtype, alignment=None):
    """``FakeCUDAShared.array`` with the look-up, the creation and the store under one lock (same keys: the
    caller's file and line, so every thread of a launch gets the one array of that call site)."""
    from numba.core import types
    from numba.np import numpy_support

    if alignment is not None:
        raise RuntimeError("Array alignment is not supported in cudasim")
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:      # dynamic shared memory: one buffer made with the launch, nothing to race on
        count = self._dynshared_size // dtype.itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    caller = sys._getframe(1)
    key = (caller.f_code.co_filename, caller.f_lineno)
    with _shared_lock:
        res = self._allocations.get(key)
        if res is None:
            res = self._allocations[key] = np.empty(shape, dtype)
    return res


def install():
    from numba.cuda.simulator import kernel, kernelapi

    kernel.BlockThread.syncthreads = _syncthreads
    kernel.BlockManager.run = _run
    kernelapi.FakeCUDAShared.array = _shared_array
