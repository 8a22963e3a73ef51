"""The attention shapes of tests/unit/test_oracle_shapes.py on CUDA, at test_load_model_gpu.py's recipe
(hidden 256): head_dim 80 / 96 (decode lanes padded to 16, tensor-core prefill with partial load rounds), 256
(one lane group per warp, materialized prefill), multi-query and a 16-wide query group (head groups of 8) —
resident and streamed, against transformers. Seeds chosen on the reference for a smallest top-2 margin of at
least 1.3 % of the step's max |logit|."""

from __future__ import annotations

import pytest
from test_load_model_gpu import ATOL_FRAC, COMMON, NEW, PROMPT, _budgets, _run

from hf_oracle import build_reference, check_against_reference

pytestmark = pytest.mark.gpu

SHAPES = {  # name: (config overrides, seed; smallest reference margin)
    "d80": (dict(head_dim=80), 1),                                      # 2.7 %
    "d96": (dict(head_dim=96), 32),                                     # 3.2 %
    "d256": (dict(head_dim=256), 22),                                   # 5.2 %
    "mqa": (dict(num_attention_heads=8, num_key_value_heads=1), 14),    # 2.1 %
    "g16": (dict(num_attention_heads=16, num_key_value_heads=1), 8),    # 1.3 %
}


@pytest.fixture(scope="module")
def driver():
    from vmmstream.driver.cuda import CudaDriver
    return CudaDriver(0)


@pytest.mark.parametrize("name", list(SHAPES))
def test_oracle_attention_shapes_on_cuda_resident_and_streamed(driver, tmp_path, name):
    over, seed = SHAPES[name]
    hf_tokens, hf_logits = build_reference("llama", seed, tmp_path, {**COMMON, **over}, PROMPT, NEW)
    fits, half, _ = _budgets(tmp_path, driver.granularity())
    for budget, strategy in ((fits, "resident"), (half, "streamed")):
        (tokens, logits), plan, _ = _run(driver, tmp_path, budget)
        assert plan.strategy == strategy
        check_against_reference(f"{name}/{strategy}", tokens, logits, hf_tokens, hf_logits, ATOL_FRAC)
