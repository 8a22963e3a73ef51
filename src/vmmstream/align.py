"""The alignment every tensor of a packed region (weights, their host staging, activations, quantized
layouts) starts on: 256 bytes, enough for any vector load a kernel makes and for a 16-byte ``cp.async``."""

TENSOR_ALIGN = 256


def align_up(n: int, to: int = TENSOR_ALIGN) -> int:
    """The smallest multiple of ``to`` that is at least ``n``."""
    return -(-n // to) * to
