"""int4 and MXFP4 weights.

``formats`` the layouts (quantize / dequantize). ``gemv`` the decode GEMV's public functions and its dispatcher,
which picks one route: ``gemv_simt`` (any K), ``gemv_mma`` (bf16 tensor cores; its device steps in
``gemv_mma_steps``), ``gemv_imma`` (MXFP4 at batch 1 on int8 tensor cores), ``gemv_mx16`` (MXFP4 on f16 tensor
cores, opt-in). A route imports its format and the shared base, never the dispatcher. ``gemm`` the prefill GEMM.
"""
