"""The reference side of the oracle tests (unit tier on the host backend, gpu tier on CUDA).

A tiny random Llama / Mistral / Qwen2 / Qwen3 / Phi-3 is built with ``transformers``, saved in bf16 with
``save_pretrained``, and decoded greedily by transformers in float32 from those same bf16 weights. The output
head is scaled up so greedy margins are mostly well above rounding, and Qwen2's q/k/v biases are random
(transformers initialises them to zero, which would test nothing).

Phi-3 (fused qkv_proj / gate_up_proj) with longrope: "phi3" has an original context of 128, longer than any
sequence here, so transformers uses short_factor throughout, as does a load with max_context <= 128; "phi3-partial"
(Phi-4-mini's partial_rotary_factor 0.75) has an original context of 4, shorter than the prompt, so transformers
uses long_factor at every call, as does a load with max_context > 4; "phi3-tied" is Phi-4-mini's form (partial
rotary, tied embeddings) with short factors. All have longrope's attention factor (from max_position_embeddings /
original_max_position_embeddings).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)


def _phi3(partial: float, original: int, tied: bool, window):
    """Phi-3 extras for ``common`` (factor lists sized by its head_dim): longrope with short factors near 1 and
    long ones up to ~8, as Phi-3's are."""
    def extra(common):
        n = int(common["head_dim"] * partial) // 2
        scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(n)],
                   "long_factor": [1.0 + 7.0 * i / max(1, n - 1) for i in range(n)]}
        return {"rope_scaling": scaling, "original_max_position_embeddings": original,
                "partial_rotary_factor": partial, "tie_word_embeddings": tied, "sliding_window": window,
                "pad_token_id": None}
    return extra

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM, {}),
         "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 4096}),
         "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}),
         "qwen2-tied": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
         "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": False}),
         "phi3": (Phi3Config, Phi3ForCausalLM, _phi3(1.0, 128, False, 2047)),
         "phi3-partial": (Phi3Config, Phi3ForCausalLM, _phi3(0.75, 4, False, None)),
         "phi3-tied": (Phi3Config, Phi3ForCausalLM, _phi3(0.75, 128, True, None)),
         # mixtures of experts: 6 experts, top-2; the expert size is Mixtral's intermediate_size
         "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 6, "num_experts_per_tok": 2}),
         "qwen2-moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                       {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                        "shared_expert_intermediate_size": 96, "norm_topk_prob": False,
                        "tie_word_embeddings": False}),
         "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                       {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
                        "norm_topk_prob": True, "tie_word_embeddings": False}),
         # Qwen3-MoE's real routing shape: 128 experts, top-8 (tiny experts)
         "qwen3-moe-128": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                           {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 16,
                            "norm_topk_prob": True, "tie_word_embeddings": False}),
         "qwen2-moe-norm": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                            {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                             "shared_expert_intermediate_size": 96, "norm_topk_prob": True,
                             "tie_word_embeddings": False})}


def build_reference(arch: str, seed: int, out, common: dict, prompt: list[int], new: int, quantize=None,
                    dtype: str = "bfloat16"):
    """Write the checkpoint to ``out`` (in ``dtype``: bf16, or float16 / float32, which load_model rounds to bf16
    as it reads); return (greedy tokens, fp32 logits [new, vocab]) of transformers on the saved weights.
    ``quantize`` ("int4" | "mxfp4"): transformers runs on the weights vmmstream's ``quantize`` stores —
    each quantizable linear weight replaced by its exact fp32 dequantization."""
    cfg_cls, model_cls, extra = ARCHS[arch]
    extra = extra(common) if callable(extra) else extra
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**common, **extra))
    with torch.no_grad():   # spread the logits so greedy margins are not all rounding-sized
        model.lm_head.weight.mul_(10.0 if extra.get("tie_word_embeddings") else 40.0)
        if arch.startswith("qwen2"):
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
        if arch.startswith("qwen3"):      # q/k norm weights: random around 1 (transformers sets them to ones)
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
        for layer in model.model.layers:   # routers: decisive top-k choices, not near-uniform softmaxes
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.mul_(20.0)
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    ref = model_cls.from_pretrained(out, dtype=torch.float32).eval()
    if quantize is not None:
        from vmmstream.kernels.matmul.quant.formats import dequantize, quantize as quantize_weight
        from vmmstream.quantization import quantizable
        with torch.no_grad():
            for name, param in ref.named_parameters():
                # Phi-3's fused q|k|v and gate|up: groups run along each row, so quantizing the stacked rows
                # is quantizing each part, as vmmstream does once it has split them
                unfused = name.replace(".qkv_proj.", ".q_proj.").replace(".gate_up_proj.", ".gate_proj.")
                if quantizable(unfused, tuple(param.shape), quantize):
                    w = param.detach().numpy()
                    param.copy_(torch.from_numpy(dequantize(quantize_weight(w, quantize), quantize)))
                elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                    # transformers keeps the experts stacked ([E, 2I, H] gate|up, [E, H, I] down); quantization
                    # groups run along each row's input dim, so quantizing expert e's stacked rows is quantizing
                    # its gate, up and down weights one by one, as vmmstream does per checkpoint tensor
                    for e in range(param.shape[0]):
                        w = param[e].detach().numpy()
                        param[e].copy_(torch.from_numpy(dequantize(quantize_weight(w, quantize), quantize)))
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            lg = ref(torch.tensor([ids])).logits[0, -1].float().numpy()
            logits.append(lg)
            ids.append(int(lg.argmax()))
    return ids[len(prompt):], np.stack(logits)


def check_against_reference(label: str, tokens, logits, hf_tokens, hf_logits, atol_frac: float = 0.02) -> None:
    """The oracle's bar: every step's logits within ``atol_frac`` of that step's max |logit| up to the first
    differing token (after it the contexts differ), and all greedy tokens equal. A failure says where the
    tokens part and the reference's top-2 margin there (a near-tie is not a kernel error)."""
    import pytest
    n = len(hf_tokens)
    k = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), n)
    tol = atol_frac * np.abs(hf_logits).max(axis=1, keepdims=True)
    err = np.abs(np.asarray(logits) - hf_logits)[:k + 1]
    assert np.all(err <= tol[:k + 1]), f"{label}: worst step error {err.max():.4f} > tolerance {tol.min():.4f}"
    if k < n:
        top2 = np.sort(hf_logits[k])[-2:]
        pytest.fail(f"{label}: greedy tokens differ first at new token {k} (reference top-2 margin "
                    f"{top2[1] - top2[0]:.4f}, our logit error there {err[k].max():.4f})")
