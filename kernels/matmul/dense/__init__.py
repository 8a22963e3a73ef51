"""bf16 weights: ``gemv`` (decode; fused gate/up + SiLU and several outputs per launch) and ``gemm`` (prefill)."""
