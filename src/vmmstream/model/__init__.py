"""The model layer: a checkpoint's config and tensors, the order a step reads them, presets (DESIGN §2)."""

from .checkpoint import (  # noqa: F401
    DTYPES,
    Checkpoint,
    CheckpointError,
    TensorInfo,
    iter_load,
    load_all,
    read_header,
    read_headers,
    read_tensor,
    synthetic_tensors,
    validate_tensors,
)
from .companions import load_tokenizer  # noqa: F401
from .opening import open_checkpoint  # noqa: F401
from .config import ARCHITECTURES, ModelConfig, UnsupportedModelError, load_config  # noqa: F401
from .presets import PRESETS, Preset, get_preset, make_checkpoint  # noqa: F401
