"""vmmstream: run language models larger than the GPU memory you give them.

Weights that fit stay resident; the rest stream from pinned host memory through a no-spill VMM
pool whose virtual addresses never move, so the decode step is captured once as a CUDA graph.
"""

from .errors import (  # noqa: F401
    BudgetError,
    CapacityError,
    CaptureError,
    ConfigError,
    ContextLengthError,
    DriverError,
    VmmstreamError,
    WorkspaceShortfall,
)

__version__ = "0.1.0"

from .budget import parse_budget  # noqa: E402,F401


def __getattr__(name):
    # load_model and Model import the execution layer (and, at load time, Numba): only when asked for.
    if name in ("load_model", "Model"):
        from . import api
        return getattr(api, name)
    # The checkpoint errors live with the model layer, which imports numpy: also only when asked for.
    if name in ("CheckpointError", "UnsupportedModelError"):
        from . import model
        return getattr(model, name)
    if name in ("Token", "TokenStream"):
        from . import api
        return getattr(api, name)
    if name == "ChatTemplateError":
        from . import chat
        return chat.ChatTemplateError
    raise AttributeError(f"module 'vmmstream' has no attribute {name!r}")


__all__ = ["load_model", "Model", "parse_budget", "BudgetError", "CapacityError", "CaptureError", "CheckpointError",
           "ChatTemplateError", "ConfigError", "ContextLengthError", "DriverError", "Token", "TokenStream",
           "UnsupportedModelError", "VmmstreamError", "WorkspaceShortfall"]
