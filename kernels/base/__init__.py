"""What every kernel family shares: the launch adapter and its device primitives (``launch``), bf16 bit
conversions (``dtypes``), the workspace contract (``workspace``) and the tensor-core PTX helpers (``mma``).
It imports no family."""
