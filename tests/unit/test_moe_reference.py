"""The NumPy MoE reference (``kernels/moe/reference.py``: router + experts + combine) against transformers' sparse MoE
blocks (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE) and against a plain torch loop.

transformers runs in fp32 from bf16-valued weights and inputs; the reference rounds gate, up and h to bf16
where the kernels store them (and the shared expert's output), so the two agree to a few bf16 roundings of
the output's scale, while a wrong weighting (renormalised or not) is off by far more. The torch loop makes
the same roundings in the same places, so it must agree to fp32 precision. No simulator, no GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from vmmstream.kernels.matmul.dense import gemv
from vmmstream.kernels import moe
from vmmstream.kernels.base.dtypes import bf16_to_f32, f32_to_bf16

pytestmark = pytest.mark.unit

T, H, I, E, K, IS = 5, 16, 24, 6, 2, 20   # tokens, hidden, expert intermediate, experts, top-k, shared intermediate


def bits(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def t32(b):
    return torch.from_numpy(bf16_to_f32(b).copy())


def make_weights(seed):
    rng = np.random.default_rng(seed)
    return {"x": bits(rng, (T, H)), "router": bits(rng, (E, H)), "gate": bits(rng, (E, I, H), 0.3),
            "up": bits(rng, (E, I, H), 0.3), "down": bits(rng, (E, H, I), 0.3),
            "shared": (bits(rng, (IS, H), 0.3), bits(rng, (IS, H), 0.3), bits(rng, (H, IS), 0.3)),
            "shared_gate": bits(rng, (1, H), 0.5)}


def hf_block(arch, w):
    # the eager experts loop (a standalone block has no dispatched implementation)
    common = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=K,
                  experts_implementation="eager")
    if arch == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(intermediate_size=I, num_local_experts=E, **common))
    elif arch == "qwen2_moe":
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(moe_intermediate_size=I, shared_expert_intermediate_size=IS,
                                                      num_experts=E, norm_topk_prob=False, **common))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(moe_intermediate_size=I, num_experts=E, norm_topk_prob=True,
                                                      **common))
    with torch.no_grad():
        block.gate.weight.copy_(t32(w["router"]))
        block.experts.gate_up_proj.copy_(torch.cat([t32(w["gate"]), t32(w["up"])], dim=1))   # [gate; up]
        block.experts.down_proj.copy_(t32(w["down"]))
        if arch == "qwen2_moe":
            sg, su, sd = w["shared"]
            block.shared_expert.gate_proj.weight.copy_(t32(sg))
            block.shared_expert.up_proj.weight.copy_(t32(su))
            block.shared_expert.down_proj.weight.copy_(t32(sd))
            block.shared_expert_gate.weight.copy_(t32(w["shared_gate"]))
    return block.eval()


ARCHS = {"mixtral": None, "qwen2_moe": False, "qwen3_moe": True}   # arch -> norm_topk_prob


def ours(arch, w, norm=None):
    norm = ARCHS[arch] if norm is None else norm
    shared = arch == "qwen2_moe"
    return moe.reference_moe(w["x"], w["router"], w["gate"], w["up"], w["down"], K, scoring=arch,
                             norm_topk_prob=norm, shared_mlp=w["shared"] if shared else None,
                             w_shared_gate=w["shared_gate"] if shared else None)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_moe_matches_transformers_block(arch, seed):
    w = make_weights(seed)
    block = hf_block(arch, w)
    with torch.no_grad():
        want = block(t32(w["x"])[None])[0].double().numpy()
        logits, scores, idx = block.gate(t32(w["x"]))
    # the router alone: same experts in the same order, same weights
    rid, rw = moe.reference_router(gemv.reference(w["router"], w["x"]), K, scoring=arch, norm_topk_prob=ARCHS[arch])
    np.testing.assert_array_equal(rid, idx.numpy())
    np.testing.assert_allclose(rw, scores.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gemv.reference(w["router"], w["x"]), logits.numpy(), rtol=1e-5, atol=1e-5)
    # the whole block: a few bf16 roundings (gate, up, h, the shared output) of the output's scale
    got = ours(arch, w).astype(np.float64)
    tol = 2.0 ** -6 * np.max(np.abs(want))
    err = np.max(np.abs(got - want))
    assert err <= tol, f"{arch}: max error {err:.3g} > {tol:.3g}"
    # ... and the test can tell the renormalisations apart: the other one is far outside the tolerance
    other = "qwen2_moe" if arch == "mixtral" else arch
    wrong = ours(other, w, norm=not ARCHS[arch] if arch != "mixtral" else False)
    assert np.max(np.abs(wrong - want)) > 4 * tol


def torch_loop(w, renorm, shared):
    """Sparse MoE as a plain loop in fp64 with the kernels' roundings: router logits fp32, softmax over all,
    top-k (torch.topk), renormalised or not; gate/up rounded fp32 -> bf16, h = bf16(silu(g)·u), y fp32."""
    def bf(v):
        return v.float().to(torch.bfloat16).double()

    x = t32(w["x"]).double()
    logits = (x @ t32(w["router"]).double().T).float().double()
    probs = torch.softmax(logits, dim=-1)
    top_v, top_i = torch.topk(probs, K, dim=-1)
    if renorm:
        top_v = top_v / top_v.sum(-1, keepdim=True)
    top_v = top_v.float().double()
    wg, wu, wd = (t32(w[n]).double() for n in ("gate", "up", "down"))
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for s in range(K):
            e = int(top_i[t, s])
            g, u = bf(x[t] @ wg[e].T), bf(x[t] @ wu[e].T)
            h = bf(g * torch.sigmoid(g) * u)
            out[t] += top_v[t, s] * (h @ wd[e].T).float().double()
    if shared:
        sg, su, sd = (t32(a).double() for a in w["shared"])
        h = bf(bf(x @ sg.T) * torch.sigmoid(bf(x @ sg.T)) * bf(x @ su.T))
        sh = bf(h @ sd.T)
        gate = (x @ t32(w["shared_gate"]).double().T).float().double()
        out += torch.sigmoid(gate) * sh
    return out.numpy()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_reference_moe_matches_a_torch_loop_with_the_same_roundings(arch):
    w = make_weights(7)
    want = torch_loop(w, renorm=ARCHS[arch] is not False, shared=arch == "qwen2_moe")
    np.testing.assert_allclose(ours(arch, w), want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


def test_reference_router_ties_and_renormalisation():
    x = np.array([[1, 3, 3, 0, 3, 2], [0, 0, 0, 0, 0, 0]], np.float32)
    ids, w = moe.reference_router(x, 2)
    np.testing.assert_array_equal(ids, [[1, 2], [0, 1]])          # ties: the lower expert index
    np.testing.assert_allclose(w, 0.5)
    ids_q, w_q = moe.reference_router(x, 2, scoring="qwen2_moe", norm_topk_prob=False)
    np.testing.assert_array_equal(ids_q, ids)
    np.testing.assert_allclose(w_q[1], 1 / 6)
    np.testing.assert_allclose(moe.reference_router(x, 2, scoring="qwen3_moe", norm_topk_prob=True)[1], w, rtol=1e-7)
