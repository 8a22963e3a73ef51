"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): config parsing (longrope, partial rotary, sliding window, fused tensor
names), the RoPE table against transformers' own functions, the fused checkpoint tensors read as their parts, and
the refusals. The model's numbers against transformers are in test_oracle.py (phi3*)."""

import json
import math

import numpy as np
import pytest

from vmmstream.model import (PRESETS, CheckpointError, ModelConfig, UnsupportedModelError, make_checkpoint,
                             open_checkpoint, read_tensor, synthetic_tensors)
from vmmstream.model.presets import tensor_values

pytestmark = pytest.mark.unit


def _factors(n, lo, hi):
    return [round(lo + (hi - lo) * i / (n - 1), 4) for i in range(n)]


PHI3_MINI_128K = {  # Phi-3-mini-128k-instruct's config.json (factor values made up, lengths real)
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "sliding_window": 262144, "tie_word_embeddings": False,
    "rope_scaling": {"type": "longrope", "short_factor": _factors(48, 1.0, 1.2), "long_factor": _factors(48, 1.0, 30.0)},
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 32000, "pad_token_id": 32000,
    "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attention_dropout": 0.0,
}
PHI4_MINI = {  # Phi-4-mini-instruct: GQA, RoPE on 96 of head_dim 128, tied embeddings
    **PHI3_MINI_128K, "vocab_size": 200064, "num_attention_heads": 24, "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75, "tie_word_embeddings": True,
    "rope_scaling": {"type": "longrope", "short_factor": _factors(48, 1.0, 1.1), "long_factor": _factors(48, 1.0, 20.0)},
}
PHI3_MINI_4K = {**PHI3_MINI_128K, "max_position_embeddings": 4096, "rope_scaling": None, "sliding_window": 2047}
PHI4 = {  # Phi-4 (14B): no rope scaling, no window
    **PHI3_MINI_128K, "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40,
    "num_attention_heads": 40, "num_key_value_heads": 10, "max_position_embeddings": 16384,
    "original_max_position_embeddings": 16384, "rope_theta": 250000.0, "rope_scaling": None, "sliding_window": None,
}


def test_phi3_mini_128k_longrope_and_fused_tensor_names():
    c = ModelConfig.from_dict(PHI3_MINI_128K)
    assert (c.architecture, c.model_type, c.head_dim, c.rotary_dim) == ("Phi3ForCausalLM", "phi3", 96, 96)
    assert c.rope_scaling["rope_type"] == "longrope" and c.rope_scaling["original_max_position_embeddings"] == 4096
    assert not c.attention_bias and not c.qk_norm and c.sliding_window == 262144
    # the step reads separate q/k/v and gate/up weights; the checkpoint holds them fused, by rows
    shapes, stored = c.tensor_shapes(), c.checkpoint_shapes()
    p = "model.layers.3."
    assert shapes[p + "self_attn.q_proj.weight"] == (3072, 3072) and p + "self_attn.qkv_proj.weight" not in shapes
    assert stored[p + "self_attn.qkv_proj.weight"] == (3 * 3072, 3072)
    assert stored[p + "mlp.gate_up_proj.weight"] == (2 * 8192, 3072)
    assert not any(n.endswith(tuple(f".{w}_proj.weight" for w in ("q", "k", "v", "gate", "up"))) for n in stored)
    assert list(stored)[:4] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    assert c.fused_tensors()[p + "mlp.gate_up_proj.weight"] == ((p + "mlp.gate_proj.weight", 8192),
                                                                 (p + "mlp.up_proj.weight", 8192))
    assert sum(math.prod(s) for s in stored.values()) == sum(math.prod(s) for s in shapes.values())
    # longrope: attention factor from max_position_embeddings / original; the factor list by max_context
    assert c.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-15)
    assert (c.rope_factor_set(4096), c.rope_factor_set(4097), c.rope_factor_set()) == ("short", "long", "short")
    base = 10000.0 ** (np.arange(0, 96, 2) / 96)
    np.testing.assert_allclose(c.rope_inv_freq(4096), 1 / (np.array(PHI3_MINI_128K["rope_scaling"]["short_factor"])
                                                           * base), rtol=1e-6)
    np.testing.assert_allclose(c.rope_inv_freq(8192), 1 / (np.array(PHI3_MINI_128K["rope_scaling"]["long_factor"])
                                                           * base), rtol=1e-6)
    # older configs call it "su" (and some "yarn"): transformers' Phi3Config reads both as longrope
    for alias in ("su", "yarn"):
        assert ModelConfig.from_dict({**PHI3_MINI_128K, "rope_scaling": {**PHI3_MINI_128K["rope_scaling"],
                                                                         "type": alias}}) == c
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_hf_dict()))) == c


def test_phi4_mini_partial_rotary_and_tied_head():
    c = ModelConfig.from_dict(PHI4_MINI)
    assert (c.head_dim, c.partial_rotary_factor, c.rotary_dim, c.kv_dim) == (128, 0.75, 96, 1024)
    assert c.rope_inv_freq(4096).shape == (48,) and c.rope_inv_freq(4096).dtype == np.float32
    assert c.checkpoint_shapes()["model.layers.0.self_attn.qkv_proj.weight"] == (3072 + 2 * 1024, 3072)
    assert "lm_head.weight" not in c.tensor_shapes() and c.decode_schedule()[-1] == "model.embed_tokens.weight"
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_hf_dict()))) == c


def test_transformers5_rope_parameters_form_reads_the_same():
    """A config saved by transformers 5: the rope dict under rope_parameters, with rope_theta, the partial factor
    and the original context inside it."""
    d = {k: v for k, v in PHI4_MINI.items() if k not in ("rope_scaling", "rope_theta", "partial_rotary_factor")}
    d["rope_parameters"] = {**PHI4_MINI["rope_scaling"], "rope_type": "longrope", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.75, "original_max_position_embeddings": 4096}
    assert ModelConfig.from_dict(d) == ModelConfig.from_dict(PHI4_MINI)
    plain = {k: v for k, v in PHI4.items() if k not in ("rope_scaling", "rope_theta")}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 250000.0, "partial_rotary_factor": 1.0}
    assert ModelConfig.from_dict(plain) == ModelConfig.from_dict(PHI4)


def test_phi3_sliding_window_is_applied_by_refusing_longer_contexts():
    """transformers' Phi3 masks to the window whenever sliding_window is set (no use_sliding_window switch)."""
    c = ModelConfig.from_dict(PHI3_MINI_4K)
    assert c.sliding_window == 2047 and c.rope_scaling is None and c.rope_attention_factor == 1.0
    c.check_context(2047)
    with pytest.raises(UnsupportedModelError, match="sliding-window.*max_context <= 2047"):
        c.check_context(2048)
    assert c.default_context() == 2047                  # with no max_context asked for: the window, not refused
    phi4 = ModelConfig.from_dict(PHI4)
    assert phi4.sliding_window is None and phi4.rope_factor_set(16384) is None
    phi4.check_context(16384)
    assert phi4.default_context() == 4096


def test_a_sliding_window_model_loads_with_the_default_context(tmp_path):
    """Phi-3-mini-4k's shape (window 2047 < max_position_embeddings 4096): load_model without max_context plans
    the window's 2047 positions instead of refusing the default 4096."""
    import dataclasses

    import vmmstream
    from vmmstream.model import get_preset, make_checkpoint
    cfg = dataclasses.replace(get_preset("phi3-tiny").config, sliding_window=100, max_position_embeddings=256,
                              rope_scaling=None)
    path = make_checkpoint(cfg, tmp_path, seed=0)
    with vmmstream.load_model(path, budget="256MiB", backend="host", progress=False) as m:
        assert m.plan.max_context == 100 and len(m.generate([1, 2, 3], 4, eos_token_id=[])) == 4


def test_rope_tables_match_transformers():
    """inv_freq and the attention factor against transformers' own functions: longrope (both factor lists,
    partial rotary, given factor / attention_factor) and Phi-3's default RoPE with a partial rotary factor."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import _compute_longrope_parameters
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    small = dict(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, pad_token_id=None, bos_token_id=1,
                 eos_token_id=2)
    cases = [dict(partial_rotary_factor=1.0, original_max_position_embeddings=64),
             dict(partial_rotary_factor=0.75, original_max_position_embeddings=128),
             dict(partial_rotary_factor=0.5, original_max_position_embeddings=64, factor=3.0),
             dict(partial_rotary_factor=1.0, original_max_position_embeddings=64, attention_factor=1.7)]
    for case in cases:
        extra = {k: case.pop(k) for k in ("factor", "attention_factor") if k in case}
        n = int(64 * case["partial_rotary_factor"]) // 2
        scaling = {"rope_type": "longrope", "short_factor": _factors(n, 1.0, 1.3), "long_factor": _factors(n, 1.0, 9.0),
                   **extra}
        hf = Phi3Config(**small, **case, rope_scaling=dict(scaling))
        ours = ModelConfig.from_dict({**hf.to_dict(), "architectures": ["Phi3ForCausalLM"]})
        orig = case["original_max_position_embeddings"]
        for seq_len, max_context in ((None, orig), (orig + 1, orig + 1)):
            inv, factor = _compute_longrope_parameters(hf, "cpu", seq_len=seq_len)
            np.testing.assert_allclose(ours.rope_inv_freq(max_context), inv.numpy(), rtol=5e-7, atol=0)   # float32 pow: numpy and torch may differ by an ulp
            assert ours.rope_attention_factor == factor
    hf = Phi3Config(**small, partial_rotary_factor=0.75)
    inv, factor = Phi3RotaryEmbedding.compute_default_rope_parameters(hf)
    ours = ModelConfig.from_dict({**hf.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert ours.rope_scaling is None and factor == ours.rope_attention_factor == 1.0
    np.testing.assert_allclose(ours.rope_inv_freq(), inv.numpy(), rtol=5e-7, atol=0)   # float32 pow: numpy and torch may differ by an ulp


def test_config_rope_table_for_plain_and_llama3_rope_matches_transformers():
    """The engine uploads ``ModelConfig.rope_inv_freq``: for plain and Llama-3 RoPE against transformers' own
    functions, and bit for bit the kernel module's ``rope_inv_freq`` (one table for both)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from vmmstream.kernels.ops.rope import rope_inv_freq
    llama3 = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
              "original_max_position_embeddings": 8192}
    for head_dim in (16, 64, 96, 128, 256):
        for theta in (10000.0, 500000.0, 1e6):
            for scaling in (None, llama3):
                c = ModelConfig(**{**PRESETS["tiny"].config.__dict__, "head_dim": head_dim, "rope_theta": theta,
                                   "rope_scaling": scaling})
                ours = c.rope_inv_freq(4096)
                np.testing.assert_array_equal(ours, rope_inv_freq(head_dim, theta, scaling))
                params = {"rope_type": "default", "rope_theta": theta} if scaling is None else \
                    {**scaling, "rope_theta": theta}
                hf = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                 max_position_embeddings=131072, rope_parameters=params)
                if scaling is None:
                    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
                    ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
                else:
                    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
                np.testing.assert_allclose(ours, ref.numpy(), rtol=2e-6, atol=0)   # an fp32 ulp or two


@pytest.mark.parametrize("patch,match", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47, "long_factor": [1.0] * 48}},
     "short_factor has 47 entries; it needs rotary_dim / 2 = 48"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 64}},
     "long_factor has 64 entries"),     # sized for the whole head, not the 96 rotated dims
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}}, "long_factor must be a list"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47 + [-1.0], "long_factor": [1.0] * 48}},
     "positive numbers"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47 + ["x"], "long_factor": [1.0] * 48}},
     "positive numbers"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported for Phi-3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'llama3' is not supported for Phi-3"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48,
                       "original_max_position_embeddings": 8192}}, "differs from the top-level value 4096"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48,
                       "attention_factor": -1.0}}, "attention_factor=-1.0 must be a positive number"),
    ({"original_max_position_embeddings": 1, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                                                             "long_factor": [1.0] * 48}}, "no attention factor"),
    ({"partial_rotary_factor": 0.0}, r"partial_rotary_factor=0.0 must be a number in \(0, 1\]"),
    ({"partial_rotary_factor": 1.5}, "must be a number in"),
    ({"partial_rotary_factor": "half"}, "must be a number in"),
    ({"partial_rotary_factor": 0.2578125, "rope_scaling": None}, "rotates 33 of head_dim 128 dims"),
    ({"head_dim": 64}, "head_dim=64 != hidden_size / num_attention_heads"),
    ({"hidden_act": "gelu_new"}, "hidden_act"),
])
def test_phi3_refusals_say_what_is_wrong(patch, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dict({**PHI4_MINI, **patch})


def test_longrope_and_partial_rotary_are_phi3_only():
    llama = {**PHI3_MINI_4K, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    ModelConfig.from_dict(llama)
    with pytest.raises(UnsupportedModelError, match="'longrope' is not supported"):
        ModelConfig.from_dict({**llama, "rope_scaling": PHI3_MINI_128K["rope_scaling"]})
    with pytest.raises(UnsupportedModelError, match="only Phi-3 rotates part of each head"):
        ModelConfig.from_dict({**llama, "partial_rotary_factor": 0.5})


def test_fused_tensors_are_read_as_their_row_ranges(tmp_path):
    """The checkpoint holds qkv_proj and gate_up_proj; ``open_checkpoint`` gives their parts as tensors of their
    own, each a contiguous byte range of the fused tensor in the same file (so loading, streaming and quantizing
    read the parts directly), in the order the step reads them."""
    path = make_checkpoint("phi3-tiny", tmp_path / "ck", seed=3)
    raw = open_checkpoint(path, validate=False).tensors
    assert "model.layers.1.self_attn.qkv_proj.weight" in raw and "model.layers.1.self_attn.q_proj.weight" not in raw
    ck = open_checkpoint(path)
    c = ck.config
    assert list(ck.tensors) == list(c.tensor_shapes())
    for fused, parts in c.fused_tensors().items():
        whole = raw[fused]
        want = tensor_values(fused, whole.shape, seed=3)
        start, row = 0, 0
        for name, rows in parts:
            t = ck.tensors[name]
            assert (t.file, t.dtype, t.shape) == (whole.file, whole.dtype, (rows, whole.shape[1]))
            assert t.offset == whole.offset + start and t.nbytes == rows * whole.shape[1] * 2
            np.testing.assert_array_equal(read_tensor(t), want[row:row + rows])
            start, row = start + t.nbytes, row + rows
        assert start == whole.nbytes
    # planning sees the parts: the same bytes as the checkpoint, per tensor as synthetic planning counts them
    synth = synthetic_tensors(c)
    assert {n: (t.shape, t.nbytes) for n, t in synth.items()} == {n: (t.shape, t.nbytes) for n, t in ck.tensors.items()}
    assert ck.total_bytes == sum(t.nbytes for t in raw.values())


def test_a_phi3_checkpoint_with_wrong_fused_tensors_is_refused(tmp_path):
    """Problems are named in the checkpoint's own terms: a fused tensor's shape, or split names where the
    checkpoint should hold fused ones."""
    from vmmstream.model.presets import _write_safetensors
    c = PRESETS["phi3-tiny"].config
    shapes = dict(c.checkpoint_shapes())
    shapes["model.layers.0.self_attn.qkv_proj.weight"] = (c.q_dim + c.kv_dim, c.hidden_size)   # lacks v
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(c.to_hf_dict()))
    _write_safetensors(bad / "model.safetensors", shapes, 0, lambda n: None)
    with pytest.raises(CheckpointError, match=r"qkv_proj.weight: expected shape \[128, 64\], got \[96, 64\]"):
        open_checkpoint(bad)
    split = tmp_path / "split"
    split.mkdir()
    (split / "config.json").write_text(json.dumps(c.to_hf_dict()))
    _write_safetensors(split / "model.safetensors", c.tensor_shapes(), 0, lambda n: None)
    with pytest.raises(CheckpointError, match="missing tensor model.layers.0.self_attn.qkv_proj.weight") as e:
        open_checkpoint(split)
    assert "unexpected tensor model.layers.0.self_attn.q_proj.weight" in e.value.problems


def test_plan_says_which_longrope_factors_it_uses():
    from vmmstream.planning import make_plan
    c = PRESETS["phi3-tiny"].config             # original context 64
    notes = " ".join(make_plan(c, synthetic_tensors(c), 1 << 30, max_context=64).notes)
    assert "longrope: short_factor (max_context 64 <= original_max_position_embeddings 64)" in notes
    notes = " ".join(make_plan(c, synthetic_tensors(c), 1 << 30, max_context=65).notes)
    assert "longrope: long_factor at every position" in notes and "sequences of at most 64 tokens" in notes
    assert not any("longrope" in n for n in make_plan(PRESETS["tiny"].config, synthetic_tensors(
        PRESETS["tiny"].config), 1 << 30).notes)
