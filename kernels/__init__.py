"""Numba CUDA kernels, each beside its NumPy reference, its workspace requirement and its bytes/flops formulas.

Numba is imported only inside the kernel modules (and the launch adapter), never here, so importing
``vmmstream.kernels`` costs nothing until a kernel is used.
"""

from .workspace import NONE, Lifetime, WorkspaceRequirement  # noqa: F401
