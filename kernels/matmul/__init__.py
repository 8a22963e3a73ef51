"""Matrix products: ``dense`` (bf16 weights: GEMV for decode, GEMM for prefill) and ``quant`` (int4 and MXFP4
weights: their formats, the GEMV dispatcher and its routes, the GEMM)."""
