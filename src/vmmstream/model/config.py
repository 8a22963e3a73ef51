"""A decoder's shape, parsed from a Hugging Face ``config.json``: dense (Llama, Mistral, Qwen2, Qwen3, Phi-3) or
mixture of experts (Mixtral; Qwen2-MoE with its shared expert; Qwen3-MoE).

``ModelConfig`` also names the model's tensors and the order a decode step reads them, because that
is architecture knowledge: the checkpoint reader validates against ``checkpoint_shapes()`` (Phi-3's fused
tensors whole), hands out ``tensor_shapes()`` (their parts as tensors of their own) and the
planner streams in ``decode_schedule()`` order (it calls the method, so planning never imports this
layer; DESIGN §2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import VmmstreamError
from . import rope


class UnsupportedModelError(VmmstreamError, ValueError):
    """A ``config.json`` this package cannot run: unknown architecture, missing field, unsupported feature."""


# architecture -> (model_type, HF default max_position_embeddings)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", 2048),
    "MistralForCausalLM": ("mistral", 4096 * 32),
    "Qwen2ForCausalLM": ("qwen2", 32768),
    "MixtralForCausalLM": ("mixtral", 4096 * 32),
    "Qwen2MoeForCausalLM": ("qwen2_moe", 32768),
    "Qwen3ForCausalLM": ("qwen3", 40960),
    "Qwen3MoeForCausalLM": ("qwen3_moe", 40960),
    "Phi3ForCausalLM": ("phi3", 4096),        # Phi-3 and Phi-3.5 mini / medium, Phi-4, Phi-4-mini
}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_QKV_BIAS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")   # an RMSNorm over each head of q and k, before RoPE
_FUSED = ("Phi3ForCausalLM",)   # checkpoints hold q|k|v as one qkv_proj and gate|up as one gate_up_proj (by rows)
_BY_MODEL_TYPE = {mt: arch for arch, (mt, _) in ARCHITECTURES.items()}
_LIMITS = {"num_hidden_layers": 1024, "num_experts": 4096, "num_experts_per_tok": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 4096}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)   # llama3 or longrope (Phi-3); None: plain RoPE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # q/k/v biases (Qwen2); no o_proj bias
    torch_dtype: str | None = "bfloat16"
    sliding_window: int | None = None  # recorded; attention here is full causal (see check_context)
    # mixture of experts (0 experts: a dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0     # each routed expert's intermediate size
    norm_topk_prob: bool = False       # renormalise the top-k routing weights to sum to 1 (Mixtral: always)
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE's always-on expert (with a sigmoid gate); 0: none
    partial_rotary_factor: float = 1.0   # RoPE on the first int(head_dim * this) dims of a head (Phi-4-mini: 0.75)

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedModelError(_unsupported_arch(self.architecture))
        for name in _REQUIRED + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise UnsupportedModelError(f"config field {name}={v!r} must be a positive integer")
            # far past any real model: a hostile config must not make the reader build millions of entries
            if v > _LIMITS.get(name, 1 << 24):
                raise UnsupportedModelError(f"config field {name}={v} is larger than any model this reads "
                                            f"(at most {_LIMITS.get(name, 1 << 24)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; grouped-query attention needs it")
        if self.attention_bias != (self.architecture in _QKV_BIAS):
            raise UnsupportedModelError(
                f"attention_bias={self.attention_bias} does not match {self.architecture}: Qwen2 always has q/k/v "
                "biases, Llama and Mistral (as supported here) never do")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} is odd; RoPE rotates pairs, it must be even")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise UnsupportedModelError(
                f"rms_norm_eps={self.rms_norm_eps!r} and rope_theta={self.rope_theta!r} must be positive")
        if self.torch_dtype is not None and self.torch_dtype not in DTYPES:
            raise UnsupportedModelError(
                f"torch_dtype={self.torch_dtype!r} is not supported; checkpoints must be one of {', '.join(DTYPES)}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise UnsupportedModelError(f"sliding_window={self.sliding_window!r} must be a positive integer or null")
        try:
            rope.check(self.rope_scaling, longrope_ok=self.architecture in _FUSED, head_dim=self.head_dim,
                       partial_rotary_factor=self.partial_rotary_factor,
                       max_position_embeddings=self.max_position_embeddings)
        except rope.RopeConfigError as exc:
            raise UnsupportedModelError(str(exc)) from None
        if self.is_moe:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise UnsupportedModelError(f"{self.architecture}: config field {name}={v!r} must be a positive "
                                                "integer")
                if v > _LIMITS.get(name, 1 << 24):
                    raise UnsupportedModelError(f"config field {name}={v} is larger than any model this reads "
                                                f"(at most {_LIMITS.get(name, 1 << 24)})")
            if self.num_experts_per_tok > self.num_experts:
                raise UnsupportedModelError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                                            f"num_experts={self.num_experts}")
        elif self.num_experts:
            raise UnsupportedModelError(f"{self.architecture} is dense; num_experts={self.num_experts} is not used")

    # -- derived sizes --
    @property
    def is_moe(self) -> bool:
        return self.architecture in MOE_ARCHITECTURES

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture][0]

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k (weights ``self_attn.q_norm`` / ``k_norm``, [head_dim]) before RoPE."""
        return self.architecture in _QK_NORM

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """K and V of every layer for one position of one sequence."""
        return 2 * self.num_hidden_layers * self.kv_dim * itemsize

    @property
    def rotary_dim(self) -> int:
        """Dims of a head that RoPE rotates (the first ones); the rest pass unrotated."""
        return rope.rotary_dim(self.head_dim, self.partial_rotary_factor)

    @property
    def rope_attention_factor(self) -> float:
        """The factor on cos and sin (transformers' ``attention_scaling``): 1 except for longrope."""
        return rope.attention_factor(self.rope_scaling, self.max_position_embeddings)

    def rope_factor_set(self, max_context: int | None = None) -> str | None:
        """longrope: "short" or "long", the factor list a model loaded for ``max_context`` uses (see
        ``vmmstream.model.rope``); None for other RoPE."""
        return rope.factor_set(self.rope_scaling, max_context)

    def rope_inv_freq(self, max_context: int | None = None):
        """RoPE inverse frequencies [rotary_dim / 2] (fp32, computed as transformers does), scaling applied;
        longrope's factor list is the one for ``max_context``."""
        return rope.inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, self.partial_rotary_factor,
                             max_context)

    def n_params(self) -> int:
        return sum(_prod(s) for s in self.tensor_shapes().values())

    # -- tensors --
    def layer_tensor_shapes(self, i: int) -> dict[str, tuple[int, ...]]:
        """One decoder layer's tensors, in the order its decode step reads them."""
        h, p = self.hidden_size, f"model.layers.{i}."
        out = {p + "input_layernorm.weight": (h,)}
        for proj, rows in (("q", self.q_dim), ("k", self.kv_dim), ("v", self.kv_dim)):
            out[p + f"self_attn.{proj}_proj.weight"] = (rows, h)
            if self.attention_bias:
                out[p + f"self_attn.{proj}_proj.bias"] = (rows,)
        if self.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (self.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (self.head_dim,)
        out[p + "self_attn.o_proj.weight"] = (h, self.q_dim)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if not self.is_moe:
            out[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            out[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            out[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
            return out
        i_moe = self.moe_intermediate_size
        out[self.router_name(i)] = (self.num_experts, h)
        for e in range(self.num_experts):
            g, u, d = self.expert_names(i, e)
            out[g], out[u], out[d] = (i_moe, h), (i_moe, h), (h, i_moe)
        if self.shared_expert_intermediate_size:
            g, u, d, gate = self.shared_expert_names(i)
            si = self.shared_expert_intermediate_size
            out[g], out[u], out[d], out[gate] = (si, h), (si, h), (h, si), (1, h)
        return out

    # -- mixture of experts: tensor names --
    def router_name(self, i: int) -> str:
        return f"model.layers.{i}." + ("block_sparse_moe.gate.weight" if self.model_type == "mixtral"
                                       else "mlp.gate.weight")

    def expert_names(self, i: int, e: int) -> tuple[str, str, str]:
        """(gate, up, down) weights of routed expert ``e`` in layer ``i``."""
        p = f"model.layers.{i}."
        if self.model_type == "mixtral":
            return tuple(p + f"block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
        return tuple(p + f"mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))

    def shared_expert_names(self, i: int) -> tuple[str, str, str, str]:
        """(gate, up, down, sigmoid gate) of Qwen2-MoE's shared expert in layer ``i``."""
        p = f"model.layers.{i}.mlp."
        return (p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight",
                p + "shared_expert.down_proj.weight", p + "shared_expert_gate.weight")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its shape: embedding, layers in read order, norm, head."""
        out = {"model.embed_tokens.weight": (self.vocab_size, self.hidden_size)}
        for i in range(self.num_hidden_layers):
            out.update(self.layer_tensor_shapes(i))
        out["model.norm.weight"] = (self.hidden_size,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return out

    def fused_tensors(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Checkpoint tensors that hold several of ``tensor_shapes()``'s weights stacked by rows: fused name ->
        ((part name, rows), ...) in row order. Phi-3: ``self_attn.qkv_proj`` = q | k | v and
        ``mlp.gate_up_proj`` = gate | up. The rows of a row-major [out, in] tensor are contiguous, so each part
        is a contiguous byte range of the fused tensor and is read as a tensor of its own."""
        if self.architecture not in _FUSED:
            return {}
        out = {}
        for i in range(self.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            out[a + "qkv_proj.weight"] = ((a + "q_proj.weight", self.q_dim), (a + "k_proj.weight", self.kv_dim),
                                          (a + "v_proj.weight", self.kv_dim))
            out[m + "gate_up_proj.weight"] = ((m + "gate_proj.weight", self.intermediate_size),
                                              (m + "up_proj.weight", self.intermediate_size))
        return out

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors as the checkpoint stores them: ``tensor_shapes()`` with fused parts replaced by their fused
        tensor (where its first part was)."""
        shapes = self.tensor_shapes()
        fused = self.fused_tensors()
        if not fused:
            return shapes
        first = {parts[0][0]: name for name, parts in fused.items()}
        rest = {p for parts in fused.values() for p, _ in parts[1:]}
        out = {}
        for name, shape in shapes.items():
            if name in first:
                parts = fused[first[name]]
                out[first[name]] = (sum(rows for _, rows in parts), shape[1])
            elif name not in rest:
                out[name] = shape
        return out

    def decode_schedule(self) -> tuple[str, ...]:
        """Names of the tensors a decode step reads on the device, in the order it reads them.

        The embedding table is gathered row by row from host memory (DESIGN §4), so it is not here —
        unless it is tied to the output head, which reads all of it: then it is the last entry.
        """
        names = [n for n in self.tensor_shapes() if n != "model.embed_tokens.weight" and n != "lm_head.weight"]
        names.append("model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight")
        return tuple(names)

    def host_tensors(self) -> tuple[str, ...]:
        """Tensors that stay in (pinned) host memory: the embedding table, when it is not also the head."""
        return () if self.tie_word_embeddings else ("model.embed_tokens.weight",)

    def default_context(self, cap: int = 4096) -> int:
        """The KV cache's positions when none is asked for: ``cap``, at most max_position_embeddings, and at most
        the sliding window (past which full attention differs from the model's)."""
        return min(cap, self.max_position_embeddings, self.sliding_window or cap)

    def check_context(self, max_context: int) -> None:
        """Refuse a context our full causal attention would compute differently from the model's."""
        if self.sliding_window is not None and max_context > self.sliding_window:
            raise UnsupportedModelError(
                f"{self.architecture} uses sliding-window attention (window {self.sliding_window}); vmmstream "
                f"attends over the full context, which differs beyond the window. Use max_context <= "
                f"{self.sliding_window}")

    # -- (de)serialization --
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise UnsupportedModelError(f"config must be a JSON object, got {type(d).__name__}")
        arch = _architecture(d)
        _, default_max_pos = ARCHITECTURES[arch]
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise UnsupportedModelError(
                f"config.json for {arch} lacks required field(s) {', '.join(missing)}; is it a complete "
                "Hugging Face config?")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported; the MLP kernel is SiLU-gated")
        if arch == "LlamaForCausalLM" and (d.get("attention_bias") or d.get("mlp_bias")):
            raise UnsupportedModelError("Llama with attention_bias/mlp_bias (biases on o_proj and the MLP) is not "
                                        "supported; only Qwen2-style q/k/v biases are")
        if arch in _QK_NORM and d.get("attention_bias"):
            raise UnsupportedModelError("Qwen3 with attention_bias (biases on q/k/v and o_proj) is not supported")
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim")
        if head_dim is None:
            if not isinstance(d["hidden_size"], int) or not isinstance(heads, int) or heads <= 0 \
                    or d["hidden_size"] % heads:
                raise UnsupportedModelError(
                    f"hidden_size={d['hidden_size']!r} is not a multiple of num_attention_heads={heads!r} and "
                    "the config gives no head_dim")
            head_dim = d["hidden_size"] // heads
        rope_theta, rope_scaling, partial_rotary = rope.parse(d)
        if arch in _FUSED:
            if head_dim * heads != d["hidden_size"]:
                raise UnsupportedModelError(
                    f"Phi-3 with head_dim={head_dim} != hidden_size / num_attention_heads is not supported "
                    "(transformers' Phi3 sizes its longrope factors by hidden_size / num_attention_heads)")
            try:
                rope_scaling = rope.phi3_scaling(d, rope_scaling)
            except rope.RopeConfigError as exc:
                raise UnsupportedModelError(str(exc)) from None
        sliding = d.get("sliding_window")
        moe = {}
        if arch == "MixtralForCausalLM":
            moe = dict(num_experts=d.get("num_local_experts"), num_experts_per_tok=d.get("num_experts_per_tok"),
                       moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
        elif arch == "Qwen2MoeForCausalLM":
            if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers"):
                raise UnsupportedModelError(
                    "Qwen2-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported; "
                    "every layer must be sparse")
            if d.get("qkv_bias", True) is not True:
                raise UnsupportedModelError("Qwen2-MoE without q/k/v biases (qkv_bias false) is not supported")
            moe = dict(num_experts=d.get("num_experts"), num_experts_per_tok=d.get("num_experts_per_tok"),
                       moe_intermediate_size=d.get("moe_intermediate_size"),
                       norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                       shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0)
        elif arch == "Qwen3MoeForCausalLM":
            if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers"):
                raise UnsupportedModelError(
                    "Qwen3-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported; "
                    "every layer must be sparse")
            moe = dict(num_experts=d.get("num_experts", d.get("num_local_experts")),   # newer transformers
                       num_experts_per_tok=d.get("num_experts_per_tok"),                 # write the second name
                       moe_intermediate_size=d.get("moe_intermediate_size"),
                       norm_topk_prob=bool(d.get("norm_topk_prob", False)))   # transformers' default
        if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") \
                and not d.get("use_sliding_window", False):
            sliding = None      # Qwen2 and Qwen3 record a window but only use it with use_sliding_window
        if arch == "LlamaForCausalLM":
            sliding = None
        try:
            return cls(
                architecture=arch,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=rope_scaling,
                max_position_embeddings=d.get("max_position_embeddings") or default_max_pos,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=arch in _QKV_BIAS,
                torch_dtype=d.get("torch_dtype", d.get("dtype")),
                sliding_window=sliding,
                partial_rotary_factor=partial_rotary,
                **moe,
            )
        except UnsupportedModelError:
            raise
        except (TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"config.json for {arch} has a malformed field: {exc}") from None

    def to_hf_dict(self) -> dict:
        """A ``config.json`` Hugging Face transformers reads back as this model."""
        d = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype or "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "use_cache": True,
        }
        if self.model_type == "llama":
            d.update(attention_bias=False, mlp_bias=False)
        elif self.model_type in ("mistral", "mixtral"):
            d["sliding_window"] = self.sliding_window
            if self.model_type == "mixtral":
                d.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                         intermediate_size=self.moe_intermediate_size)
        elif self.model_type == "qwen3":
            d.update(attention_bias=False, use_sliding_window=self.sliding_window is not None,
                     sliding_window=self.sliding_window, max_window_layers=self.num_hidden_layers)
        elif self.model_type == "qwen3_moe":
            d.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                     max_window_layers=self.num_hidden_layers, num_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
        elif self.model_type == "phi3":
            d.update(sliding_window=self.sliding_window, partial_rotary_factor=self.partial_rotary_factor,
                     pad_token_id=None)   # Phi3Config's default pad id 32000 is past a small vocabulary
            if self.rope_scaling is not None:
                d["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        elif self.model_type == "qwen2_moe":
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers,
                     num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                     decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True)
        else:
            d.update(use_sliding_window=self.sliding_window is not None,
                     sliding_window=self.sliding_window, max_window_layers=self.num_hidden_layers)
        return d


def load_config(path) -> ModelConfig:
    """Parse ``config.json`` (a checkpoint directory or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UnsupportedModelError(f"no config.json at {p}; a Hugging Face checkpoint directory has one") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{p} is not valid JSON: {exc}") from None
    return ModelConfig.from_dict(d)


def _unsupported_arch(arch) -> str:
    return (f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)} "
            "(dense Llama, Mistral, Qwen2, Qwen3 and Phi-3 decoders; Mixtral, Qwen2-MoE and Qwen3-MoE)")


def _architecture(d: dict) -> str:
    archs = d.get("architectures")
    if archs:
        if not isinstance(archs, list):
            raise UnsupportedModelError(f"config 'architectures' must be a list, got {archs!r}")
        arch = archs[0]
    elif isinstance(d.get("model_type"), str) and d["model_type"] in _BY_MODEL_TYPE:
        arch = _BY_MODEL_TYPE[d["model_type"]]
    else:
        raise UnsupportedModelError(
            f"config names no architecture (architectures missing, model_type={d.get('model_type')!r}); "
            f"supported: {', '.join(ARCHITECTURES)}")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:     # a list there is unhashable
        raise UnsupportedModelError(_unsupported_arch(arch))
    return arch


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n

