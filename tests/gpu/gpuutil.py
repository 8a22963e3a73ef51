"""Helpers shared by the GPU kernel tests."""

from __future__ import annotations

import numpy as np

HALF_ULP = 2.0 ** -8     # bf16 round to nearest: |round(v) - v| <= 2^-8 |v|


def to_dev(a, stream):
    from numba import cuda
    return cuda.to_device(np.ascontiguousarray(a), stream=stream)


def get(d, stream):
    """Copy back and wait for the stream."""
    out = d.copy_to_host(stream=stream)
    stream.synchronize()
    return out


class captured:
    """``with captured(stream, fn) as replay:`` — ``fn()`` captured once on ``stream`` in global capture mode
    (any allocation or synchronize inside fails the capture) and instantiated; ``replay()`` launches the graph
    on the same stream. The graph and its executable are destroyed on exit."""

    def __init__(self, stream, fn):
        self.stream, self.fn = stream, fn

    def __enter__(self):
        from cuda.bindings import driver as drv
        ok = drv.CUresult.CUDA_SUCCESS
        self.hs = drv.CUstream(int(self.stream))
        (err,) = drv.cuStreamBeginCapture(self.hs, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        assert err == ok, err
        self.fn()
        err, self.graph = drv.cuStreamEndCapture(self.hs)
        assert err == ok, err
        err, self.gexec = drv.cuGraphInstantiate(self.graph, 0)
        assert err == ok, err
        return self.replay

    def replay(self):
        from cuda.bindings import driver as drv
        (err,) = drv.cuGraphLaunch(self.gexec, self.hs)
        assert err == drv.CUresult.CUDA_SUCCESS, err

    def __exit__(self, *exc):
        from cuda.bindings import driver as drv
        drv.cuGraphExecDestroy(self.gexec)
        drv.cuGraphDestroy(self.graph)
        return False
