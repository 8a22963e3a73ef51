"""ModelConfig parsing: the three supported architectures, their tensor sets and schedules, and every refusal."""

import json

import numpy as np
import pytest

from vmmstream.errors import VmmstreamError
from vmmstream.model import PRESETS, ModelConfig, UnsupportedModelError, load_config

LLAMA = {  # shaped like Llama-3.2-1B's config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "attention_bias": False, "mlp_bias": False,
}
MISTRAL = {  # Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "max_position_embeddings": 32768,
    "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
QWEN2 = {  # Qwen2-0.5B
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 24,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}


def test_llama_with_llama3_rope_scaling():
    c = ModelConfig.from_dict(LLAMA)
    assert (c.architecture, c.model_type, c.head_dim, c.num_key_value_heads) == ("LlamaForCausalLM", "llama", 64, 8)
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_theta == 500000.0
    assert c.tie_word_embeddings and not c.attention_bias and c.sliding_window is None
    assert c.kv_bytes_per_token() == 2 * 16 * 8 * 64 * 2
    shapes = c.tensor_shapes()
    assert "lm_head.weight" not in shapes and shapes["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)
    assert c.decode_schedule()[-1] == "model.embed_tokens.weight" and c.host_tensors() == ()


def test_mistral_records_its_sliding_window_and_refuses_contexts_past_it():
    c = ModelConfig.from_dict(MISTRAL)
    assert c.head_dim == 128 and c.sliding_window == 4096 and not c.tie_word_embeddings
    c.check_context(4096)
    with pytest.raises(UnsupportedModelError, match="sliding-window.*max_context <= 4096"):
        c.check_context(4097)
    assert c.decode_schedule()[-1] == "lm_head.weight" and c.host_tensors() == ("model.embed_tokens.weight",)


def test_mistral_explicit_head_dim_wins():
    c = ModelConfig.from_dict({**MISTRAL, "hidden_size": 5120, "head_dim": 128, "sliding_window": None})
    assert c.head_dim == 128 and c.q_dim == 4096
    assert c.tensor_shapes()["model.layers.0.self_attn.o_proj.weight"] == (5120, 4096)


def test_qwen2_has_qkv_biases_and_ignores_an_unused_window():
    c = ModelConfig.from_dict(QWEN2)
    assert c.attention_bias and c.sliding_window is None and c.head_dim == 64
    shapes = c.tensor_shapes()
    assert shapes["model.layers.3.self_attn.q_proj.bias"] == (896,)
    assert shapes["model.layers.3.self_attn.k_proj.bias"] == (128,)
    assert "model.layers.3.self_attn.o_proj.bias" not in shapes
    assert ModelConfig.from_dict({**QWEN2, "use_sliding_window": True}).sliding_window == 131072


QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
         "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
         "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
         "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
         "sliding_window": None, "torch_dtype": "bfloat16", "hidden_act": "silu"}


def test_qwen3_has_per_head_qk_norms_read_before_o_proj():
    c = ModelConfig.from_dict(QWEN3)                 # Qwen3-0.6B's shape: head_dim 128 over hidden 1024
    assert c.qk_norm and not c.attention_bias and c.head_dim == 128 and c.q_dim == 2048
    names = [n.split("layers.2.")[1] for n in c.decode_schedule() if ".layers.2." in n]
    assert names[:7] == ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                         "self_attn.v_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                         "self_attn.o_proj.weight"]
    assert c.tensor_shapes()["model.layers.2.self_attn.k_norm.weight"] == (128,)
    assert not ModelConfig.from_dict(MISTRAL).qk_norm
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        ModelConfig.from_dict({**QWEN3, "attention_bias": True})
    assert ModelConfig.from_dict(c.to_hf_dict()) == c


def test_defaults_kv_heads_and_head_dim():
    d = {k: v for k, v in MISTRAL.items() if k not in ("num_key_value_heads", "sliding_window")}
    c = ModelConfig.from_dict(d)
    assert c.num_key_value_heads == 32 and c.head_dim == 4096 // 32


def test_layer_schedule_order():
    c = PRESETS["tiny"].config
    names = [n.split("layers.1.")[1] for n in c.decode_schedule() if ".layers.1." in n]
    assert names == ["input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                     "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    sched = c.decode_schedule()
    assert sched[0] == "model.layers.0.input_layernorm.weight" and sched[-2:] == ("model.norm.weight",
                                                                                  "lm_head.weight")
    assert "model.embed_tokens.weight" not in sched


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_hf_config(name):
    c = PRESETS[name].config
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_hf_dict()))) == c


def test_llama_3b_preset_matches_gpu_md():
    c = PRESETS["llama-3b"].config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.vocab_size) == (3072, 28, 24, 8, 8192, 32000)
    assert abs(PRESETS["llama-3b"].weight_bytes / 2**30 - 5.62) < 0.01


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_dict({**LLAMA, "architectures": ["DeepseekV3ForCausalLM"]})
    msg = str(e.value)
    assert "DeepseekV3ForCausalLM" in msg and "LlamaForCausalLM" in msg and "MixtralForCausalLM" in msg
    assert isinstance(e.value, ValueError) and isinstance(e.value, VmmstreamError)
    with pytest.raises(UnsupportedModelError, match="num_experts=None"):     # Mixtral without its expert count
        ModelConfig.from_dict({**LLAMA, "architectures": ["MixtralForCausalLM"]})


def test_architecture_from_model_type_when_architectures_is_missing():
    d = {k: v for k, v in QWEN2.items() if k != "architectures"}
    assert ModelConfig.from_dict(d).architecture == "Qwen2ForCausalLM"
    with pytest.raises(UnsupportedModelError, match="names no architecture"):
        ModelConfig.from_dict({k: v for k, v in d.items() if k != "model_type"})


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads"])
def test_missing_required_field(field):
    with pytest.raises(UnsupportedModelError, match=field):
        ModelConfig.from_dict({k: v for k, v in LLAMA.items() if k != field})


@pytest.mark.parametrize("patch,match", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 5}, "not a multiple"),
    ({"mlp_bias": True}, "not supported"),
    ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
    ({"hidden_size": 2048.0, "head_dim": 64}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"head_dim": 63}, "odd"),
])
def test_refusals_say_what_is_wrong(patch, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dict({**LLAMA, **patch})


def test_default_rope_scaling_and_transformers5_rope_parameters():
    c = ModelConfig.from_dict({**LLAMA, "rope_scaling": {"rope_type": "default"}})
    assert c.rope_scaling is None
    d = {k: v for k, v in LLAMA.items() if k not in ("rope_scaling", "rope_theta")}
    d["rope_parameters"] = {**LLAMA["rope_scaling"], "rope_theta": 500000.0}
    c = ModelConfig.from_dict(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert "rope_theta" not in c.rope_scaling


def test_rope_inv_freq_plain_and_llama3():
    plain = ModelConfig.from_dict({**LLAMA, "rope_scaling": None})
    inv = plain.rope_inv_freq()
    np.testing.assert_allclose(inv, 500000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)
    scaled = ModelConfig.from_dict(LLAMA).rope_inv_freq()
    wavelen = 2 * np.pi / inv
    high = wavelen < 8192 / 4.0          # high frequencies: untouched
    low = wavelen > 8192 / 1.0           # low frequencies: divided by the factor
    assert high.any() and low.any()
    np.testing.assert_array_equal(scaled[high], inv[high])
    np.testing.assert_allclose(scaled[low], inv[low] / 32.0, rtol=1e-6)
    mid = ~high & ~low
    assert np.all(scaled[mid] <= inv[mid]) and np.all(scaled[mid] >= inv[mid] / 32.0)


def test_load_config_from_directory_and_its_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    assert load_config(tmp_path).architecture == "Qwen2ForCausalLM"
    assert load_config(tmp_path / "config.json").vocab_size == 151936
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        load_config(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        load_config(tmp_path)
