"""Numba CUDA kernels, each beside its NumPy reference, its workspace requirement and its bytes/flops formulas.

The families live in the repository's ``kernels/`` folder and are installed here: ``base`` (launch adapter,
dtypes, workspace contract, PTX helpers; imports no family), ``ops`` (norm, rope, elementwise, embedding,
sampling, scalars), ``matmul`` (``dense`` and ``quant``), ``attention`` and ``moe``. ``kernels/`` itself has no
``__init__.py``, so Python started in the repository root never takes it for a top-level package named
``kernels``.

Numba is imported only inside the kernel modules, never here, so importing ``vmmstream.kernels`` costs
nothing until a kernel is used.
"""

from vmmstream.kernels.base.workspace import NONE, Lifetime, WorkspaceRequirement  # noqa: F401
