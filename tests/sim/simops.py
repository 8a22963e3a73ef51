"""The CUDA launch adapter (``execution.ops.CudaOps``) running its Numba kernels in the simulator over the host
driver: the CUDA step's own kernel sequence, views, strides and workspaces, executed on a CPU.

Arrays are the host backend's memory wrapped as simulator device arrays (no copies: two views of one buffer
alias, as on a GPU); each launch is recorded with the host driver's ``launch_host_func``, so it runs in stream
order and is part of a recorded (captured) decode graph and its replays, like the host backend's references.
"""

from __future__ import annotations

import functools

from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

from vmmstream.execution.ops import CudaOps, HostOps

# the adapter's launch methods: every one takes the stream first
LAUNCHES = ("embedding", "rmsnorm", "gemv", "gemm", "gemv_multi", "gemv_gate_up_silu", "rope", "rope_kv_append",
            "kv_append", "attn_prefill", "attn_decode", "silu_mul", "argmax", "sample", "advance", "moe_route",
            "fill_zero", "expert_gather", "expert_gather_round", "moe_ffn", "moe_combine", "moe_experts_prefill")


class SimCudaOps(CudaOps):
    """``CudaOps`` whose kernels run in the Numba simulator on host-backend memory."""

    def view(self, va, shape, dtype):
        return FakeCUDAArray(HostOps.view(self, va, shape, dtype))

    def view_strided(self, va, shape, dtype, outer_stride):
        return FakeCUDAArray(HostOps.view_strided(self, va, shape, dtype, outer_stride))

    def view_strides(self, va, shape, dtype, strides):
        return FakeCUDAArray(HostOps.view_strides(self, va, shape, dtype, strides))

    @staticmethod
    def _s(stream):
        return None            # the simulator's default stream; ordering comes from the host driver's stream


def _deferred(name):
    launch = getattr(CudaOps, name)

    @functools.wraps(launch)
    def method(self, s, *args, **kwargs):
        self.driver.launch_host_func(s, lambda: launch(self, s, *args, **kwargs))
    return method


for _name in LAUNCHES:
    setattr(SimCudaOps, _name, _deferred(_name))
