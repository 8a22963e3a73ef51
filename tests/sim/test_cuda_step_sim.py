"""The CUDA step — the launch adapter's kernels in the order ``Step`` issues them, with the views, strides and
workspaces of a real load — run in the simulator over the host driver (``simops.SimCudaOps``), against the host
backend's NumPy references on the same checkpoint and plan: equal greedy tokens, close logits.

Covers what the unit tier cannot: the fused decode launches (q/k/v ``gemv_multi`` with Qwen2 biases,
``gemv_gate_up_silu``, RoPE + KV append), the capture of the decode graph and its replays, decode attention
reading the length from device memory, the quantized GEMV / GEMM wiring, and the MoE path (router, grouping,
expert FFN over the pool stack or the gathered slots, combine). Models are tiny (one layer, head_dim 64: the
CUDA decode attention's smallest) so the simulator's thread per CUDA thread stays affordable.
"""

from __future__ import annotations

import numpy as np
import pytest

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.execution import engine as engine_module, ops as ops_module
from vmmstream.memory import DeviceMemory
from vmmstream.model import ModelConfig, make_checkpoint

from simops import SimCudaOps

# Whole model steps through the simulated CUDA adapter: half a minute to six minutes each on a CI core, so the
# file is left to `scripts/test.sh full`; the gpu tier runs the same models through the real adapter
# (tests/gpu/test_load_model_gpu.py oracles: dense, Phi-3, quantized, MoE).
pytestmark = [pytest.mark.sim, pytest.mark.slow]

G = 16 << 10
MC = 32
PROMPT = [3, 1, 4, 1, 5]
NEW = 3


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """One-warp blocks (4 rows per GEMV block) for the GEMVs, quantized GEMVs and MoE kernels — their other
    shapes are tested in their own sim tests: a few hundred simulated threads per launch, not thousands."""
    import functools

    from vmmstream.kernels.matmul.dense import gemv
    from vmmstream.kernels import moe
    from vmmstream.kernels.moe import experts as moe_ffn
    from vmmstream.kernels.matmul.quant import gemv as qgemv
    monkeypatch.setattr(gemv, "_auto", lambda n, b, cfg: (32, 4 if n % 4 == 0 else 1,
                                                          1 if b == 1 else 2 if b == 2 else 4))
    monkeypatch.setattr(qgemv, "QgemvConfig", functools.partial(qgemv.QgemvConfig, threads=32))
    monkeypatch.setattr(moe_ffn, "MoeConfig", functools.partial(moe_ffn.MoeConfig, threads=32))
    for name in ("group_by_expert", "combine"):
        monkeypatch.setattr(moe, name, functools.partial(getattr(moe, name), threads=32))


def config(arch="LlamaForCausalLM", **kw):
    base = dict(architecture=arch, vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=64,
                rms_norm_eps=1e-5, attention_bias=arch.startswith("Qwen2"))
    base.update(kw)
    return ModelConfig(**base)


def run(path, budget_fn, cuda_ops, monkeypatch, prompt=PROMPT, **load):
    make = (lambda driver: SimCudaOps(driver)) if cuda_ops else (lambda driver: ops_module.HostOps(driver))
    monkeypatch.setattr(ops_module, "make_ops", make)
    monkeypatch.setattr(engine_module, "make_ops", make)      # the engine holds its own reference
    mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), budget_fn(path))
    try:
        with vmmstream.load_model(path, memory=mem, max_context=MC, **load) as m:
            assert isinstance(m.engine.ops, SimCudaOps) == cuda_ops
            tokens, logits = m.generate(prompt, NEW, return_logits=True, eos_token_id=[])
            return tokens, logits, m.plan, m.stats()
    finally:
        mem.close()


def budgets(path, quantize=None):
    from vmmstream.api import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    full = make_plan(ck.config, ck.tensors, 1 << 40, granularity=G, max_context=MC,
                     workspace=workspace_peaks(ck.config, MC, MC), quantize=quantize)
    return full


def compare(a, b):
    (t1, l1), (t2, l2) = a[:2], b[:2]
    scale = np.abs(l1).max(axis=1, keepdims=True)
    assert np.all(np.abs(l1 - l2) <= 0.02 * scale), f"max logit difference {np.abs(l1 - l2).max():.4f}"
    assert t1 == t2


@pytest.mark.parametrize("arch,where", [
    ("Qwen2ForCausalLM", "resident"),    # fused q/k/v with biases, fused gate/up/SiLU
    ("LlamaForCausalLM", "streamed"),    # streamed groups larger than the 2 slots: unfused, through the slots
])
def test_dense_cuda_step_matches_host(tmp_path, monkeypatch, arch, where):
    path = make_checkpoint(config(arch), tmp_path, seed=5)
    full = budgets(path)

    def budget(_):
        return full.floor + full.weight_bytes if where == "resident" else full.floor + full.weight_bytes // 2
    host = run(path, budget, False, monkeypatch)
    sim = run(path, budget, True, monkeypatch)
    assert sim[2].strategy == where
    compare(host, sim)
    # stats() names the prefill attention route that ran: the host's reference, the CUDA step's chosen kernel
    from vmmstream.kernels.attention import prefill as ap
    assert set(host[3]["prefill_attention_routes"]) == {"reference"}
    assert set(sim[3]["prefill_attention_routes"]) == {ap.choose_route(len(PROMPT), 1, 1, 64)}
    assert sum(sim[3]["prefill_attention_routes"].values()) == host[3]["prefill_attention_routes"]["reference"] >= 1


def test_phi3_cuda_step_matches_host(tmp_path, monkeypatch):
    """Phi-3 through the CUDA adapter: q/k/v and gate/up read as row ranges of the fused checkpoint tensors (fused
    decode launches over them), longrope with its attention factor, RoPE on 48 of head_dim 64 (the 8-wide path
    with an unrotated tail copied to the cache), streamed."""
    n = 24
    cfg = config("Phi3ForCausalLM", partial_rotary_factor=0.75, sliding_window=2047,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(n)],
                               "long_factor": [1.0 + 0.3 * i for i in range(n)],
                               "original_max_position_embeddings": 16})
    path = make_checkpoint(cfg, tmp_path, seed=8)
    full = budgets(path)
    host = run(path, lambda _: full.floor + full.weight_bytes // 2, False, monkeypatch)
    sim = run(path, lambda _: full.floor + full.weight_bytes // 2, True, monkeypatch)
    assert sim[2].strategy == "streamed" and any("long_factor" in note for note in sim[2].notes)
    compare(host, sim)


@pytest.mark.parametrize("kind", ["mxfp4", "int4"])
def test_quantized_cuda_step_matches_host(tmp_path, monkeypatch, kind):
    """quantize= through the CUDA adapter: qgemv in decode, qgemm (in-register route) in prefill."""
    hidden = 128 if kind == "int4" else 64            # int4 groups are 128 wide
    path = make_checkpoint(config(hidden_size=hidden, intermediate_size=128, num_attention_heads=hidden // 64),
                           tmp_path, seed=6)
    full = budgets(path, kind)
    host = run(path, lambda _: full.floor + full.weight_bytes // 2, False, monkeypatch, quantize=kind)
    sim = run(path, lambda _: full.floor + full.weight_bytes // 2, True, monkeypatch, quantize=kind)
    assert sim[2].quantization == kind and sim[3]["quantization"]["tensors"] == 7
    compare(host, sim)


@pytest.mark.parametrize("where,quantize", [("resident", None), ("on demand", None), ("on demand", "mxfp4")])
def test_moe_cuda_step_matches_host(tmp_path, monkeypatch, where, quantize):
    """Mixtral through the CUDA adapter: every expert resident (the layer's pool stack), or the dense part
    and some experts resident with the routed others gathered into the slots by the device-side gather inside
    the decode graph (prefill: host-driven rounds); and with MXFP4 experts (quantized strided stacks)."""
    cfg = config("MixtralForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True)
    path = make_checkpoint(cfg, tmp_path, seed=7)
    full = budgets(path, quantize)
    ep = full.experts
    dense = full.weight_bytes - ep.total * ep.unit_bytes
    budget = (full.floor + full.weight_bytes if where == "resident"
              else full.floor + dense + (ep.top_k + 1) * ep.unit_bytes)
    host = run(path, lambda _: budget, False, monkeypatch, quantize=quantize)
    sim = run(path, lambda _: budget, True, monkeypatch, quantize=quantize)
    assert sim[2].quantization == quantize
    assert (sim[2].experts.slots == 0) == (where == "resident")
    compare(host, sim)
    for k in ("expert_hits", "expert_misses", "expert_bytes_per_token"):
        assert host[3][k] == sim[3][k], k                 # the gather's device counters count as the host does


def test_moe_prefill_through_the_tensor_core_experts(tmp_path, monkeypatch):
    """``moe.experts_mma.MMA``: a prefill of 9 tokens with every expert resident runs the experts' tensor-core kernels
    (tiles of 8 rows, K in chunks of 64) inside the model; tokens and logits as the host backend's."""
    from vmmstream.kernels.moe import experts_mma as experts
    monkeypatch.setattr(experts, "MMA", True)
    made = []
    real = experts._make_gate_up_mma
    monkeypatch.setattr(experts, "_make_gate_up_mma", lambda: made.append(1) or real())
    cfg = config("MixtralForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True)
    path = make_checkpoint(cfg, tmp_path, seed=7)
    full = budgets(path)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    host = run(path, lambda _: full.floor + full.weight_bytes, False, monkeypatch, prompt=prompt)
    assert not made
    sim = run(path, lambda _: full.floor + full.weight_bytes, True, monkeypatch, prompt=prompt)
    assert made                                     # the prefill's experts went through the tensor cores
    compare(host, sim)
