"""Oracle at the attention shapes real families use, against transformers on the host backend: head_dim 80, 96
and 256, multi-query (8 query heads on one KV head) and a 16-wide query group — resident and streamed. The
recipe, tolerance and reference are test_oracle.py's (Llama architecture, tiny random weights saved in bf16);
seeds chosen on the reference for a smallest top-2 margin near or above 1 % of the step's max |logit|."""

from __future__ import annotations

import pytest
from test_oracle import ATOL_FRAC, COMMON, NEW, PROMPT, _budgets, _run

from hf_oracle import build_reference, check_against_reference

pytestmark = pytest.mark.unit

SHAPES = {  # name: (config overrides, seed; smallest reference margin)
    "d80": (dict(head_dim=80), 11),                                     # 0.91 %
    "d96": (dict(head_dim=96), 8),                                      # 0.97 %
    "d256": (dict(head_dim=256), 11),                                   # 3.1 %
    "mqa": (dict(num_attention_heads=8, num_key_value_heads=1), 3),     # 1.1 %
    "g16": (dict(num_attention_heads=16, num_key_value_heads=1), 1),    # 1.8 %
}


@pytest.fixture(scope="module", params=list(SHAPES))
def reference(request, tmp_path_factory):
    over, seed = SHAPES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    tokens, logits = build_reference("llama", seed, out, {**COMMON, **over}, PROMPT, NEW)
    return request.param, out, tokens, logits


@pytest.mark.parametrize("where", ["resident", "streamed"])
def test_oracle_attention_shapes_match_transformers(reference, where):
    name, path, hf_tokens, hf_logits = reference
    resident, half = _budgets(path)
    strategy, tokens, logits = _run(path, resident if where == "resident" else half)
    assert strategy == where
    check_against_reference(name, tokens, logits, hf_tokens, hf_logits, ATOL_FRAC)
