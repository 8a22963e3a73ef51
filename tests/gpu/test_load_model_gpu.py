"""load_model on a real GPU: the transformers oracle, I10 across budgets, I1 cross-checked with cuMemGetInfo,
the counters (streamed bytes per token, graph replays, zero VMM calls per decode token), legacy, context
exhaustion. Fails (never skips) without a GPU (root conftest).

The CUDA decode attention takes head_dim 64 or 128, so the oracle models here are the unit tier's recipe
(tests/unit/test_oracle.py) at head_dim 64. Tolerance as there: logits within 2 % of the step's max |logit|
(bf16 activations, fp32 accumulation in a different order than the host references: same bound).
"""

from __future__ import annotations

import numpy as np
import pytest

from hf_oracle import check_against_reference

import vmmstream
from vmmstream.errors import CapacityError, ContextLengthError

pytestmark = pytest.mark.gpu

MiB = 1 << 20
NEW = 32
PROMPT = [1, 5, 9, 33, 7, 2]
MC = 128
ATOL_FRAC = 0.02
COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
              initializer_range=0.02, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def driver():
    from vmmstream.driver.cuda import CudaDriver
    return CudaDriver(0)


def memory(driver, budget):
    from vmmstream.memory import DeviceMemory
    return DeviceMemory(driver, budget)


def _hf(arch, seed, out):
    from hf_oracle import build_reference
    return build_reference(arch, seed, out, COMMON, PROMPT, NEW)


def _budgets(path, gran, mc=MC, quantize=None):
    from vmmstream.api import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(path)
    ws = workspace_peaks(ck.config, mc, mc, "cuda")
    full = make_plan(ck.config, ck.tensors, 1 << 40, granularity=gran, max_context=mc, workspace=ws,
                     quantize=quantize)
    with pytest.raises(CapacityError) as e:
        make_plan(ck.config, ck.tensors, 1, granularity=gran, max_context=mc, workspace=ws, quantize=quantize)
    return full.floor + full.weight_bytes, full.floor + full.weight_bytes // 2, e.value.requested


def _run(driver, path, budget, new=NEW, quantize=None, **kw):
    mem = memory(driver, budget)
    try:
        with vmmstream.load_model(path, memory=mem, max_context=MC, quantize=quantize) as m:
            out = m.generate(PROMPT, new, return_logits=True, eos_token_id=[], **kw)
            return out, m.plan, m.stats()
    finally:
        mem.close()


# Greedy equality over 32 tokens is only decidable where the reference's top-2 margin exceeds the numerical
# difference between bf16-activation kernels and HF in fp32. Random tiny models have near-ties: qwen2 seed 1 had
# a 0.004 margin at step 6 (0.01 x the logit tolerance) and flipped on the H200 while its logits stayed within
# tolerance. qwen2 seed 9 was chosen on the CPU reference for a smallest margin of 1.0 x the tolerance; the
# logit check below is the numerical test either way. The Phi-3 seeds were chosen on the CPU reference for a
# smallest top-2 margin of at least 1 % of the step's max |logit| over all 32 steps (phi3 116: 1.13 %; phi3-partial
# 17: 1.41 %, partial rotary over 48 of 64 dims with longrope's long factors).
@pytest.mark.parametrize("arch,seed", [("llama", 0), ("mistral", 3), ("qwen2", 9), ("qwen3", 2), ("phi3", 116),
                                       ("phi3-partial", 17)])
def test_oracle_on_cuda_resident_and_streamed(driver, tmp_path, arch, seed):
    hf_tokens, hf_logits = _hf(arch, seed, tmp_path)
    fits, half, _ = _budgets(tmp_path, driver.granularity())
    for budget, strategy in ((fits, "resident"), (half, "streamed")):
        (tokens, logits), plan, _ = _run(driver, tmp_path, budget)
        assert plan.strategy == strategy
        check_against_reference(f"{arch}/{strategy}", tokens, logits, hf_tokens, hf_logits, ATOL_FRAC)


@pytest.mark.parametrize("kind", ["int4", "mxfp4"])
def test_quantized_oracle_on_cuda_resident_and_streamed(driver, tmp_path, kind):
    """quantize= on CUDA (qgemv decode, qgemm prefill) against transformers on the dequantized weights
    (tests/unit/test_quantized_load.py's recipe at head_dim 64): same logits bound, same tokens."""
    from hf_oracle import build_reference
    hf_tokens, hf_logits = build_reference("llama", 0, tmp_path, COMMON, PROMPT, NEW, quantize=kind)
    fits, half, _ = _budgets(tmp_path, driver.granularity(), quantize=kind)
    for budget, strategy in ((fits, "resident"), (half, "streamed")):
        (tokens, logits), plan, stats = _run(driver, tmp_path, budget, quantize=kind)
        assert plan.strategy == strategy and plan.quantization == kind
        assert stats["quantization"]["tensors"] == 7 * COMMON["num_hidden_layers"]
        check_against_reference(f"{kind}/{strategy}", tokens, logits, hf_tokens, hf_logits, ATOL_FRAC)


@pytest.mark.parametrize("arch,seed,quantize", [("llama", 0, None), ("qwen2", 9, None), ("llama", 0, "int4"),
                                                ("llama", 0, "mxfp4")])
def test_tensor_core_prefill_and_prefill_graphs_on_cuda(driver, tmp_path, monkeypatch, arch, seed, quantize):
    """With the tensor-core GEMM routes as the default and short prompts replayed as prefill graphs (both off by
    default until this passes): the oracle, resident and streamed, for prompts that take the eager padded
    prefill, its capture and its replay; the first logits equal those of the plain eager prefill."""
    from hf_oracle import build_reference
    from vmmstream.kernels.matmul.dense import gemm_mma
    hf_tokens, hf_logits = build_reference(arch, seed, tmp_path, COMMON, PROMPT, NEW, quantize=quantize)
    fits, half, _ = _budgets(tmp_path, driver.granularity(), quantize=quantize)
    prompts = [PROMPT, [3, 4], PROMPT, list(range(5, 25))]
    for budget, strategy in ((fits, "resident"), (half, "streamed")):
        monkeypatch.setattr(gemm_mma, "DEFAULT", False)
        monkeypatch.setattr("vmmstream.execution.engine.Engine.PREFILL_GRAPH_MAX", 0)
        mem = memory(driver, budget)
        try:
            with vmmstream.load_model(tmp_path, memory=mem, max_context=MC, quantize=quantize) as m:
                plain = [m.generate(p, 1, return_logits=True, eos_token_id=[])[1][0] for p in prompts]
        finally:
            mem.close()
        monkeypatch.setattr(gemm_mma, "DEFAULT", True)
        monkeypatch.setattr("vmmstream.execution.engine.Engine.PREFILL_GRAPH_MAX", 256)
        mem = memory(driver, budget)
        try:
            with vmmstream.load_model(tmp_path, memory=mem, max_context=MC, quantize=quantize) as m:
                assert m.plan.strategy == strategy
                firsts = [m.generate(p, 1, return_logits=True, eos_token_id=[])[1][0] for p in prompts]
                tokens, logits = m.generate(PROMPT, NEW, return_logits=True, eos_token_id=[])
                s = m.stats()
        finally:
            mem.close()
        assert s["prefill_graph_captures"] == 1 and s["prefill_graph_replays"] == 3
        for a, b in zip(firsts, plain):     # tensor cores and fp32 FMA sum in other orders: within the oracle's bound
            assert np.max(np.abs(a - b)) <= ATOL_FRAC * np.max(np.abs(b))
        check_against_reference(f"{arch}/{quantize}/{strategy}/tensor cores + prefill graphs", tokens, logits,
                                hf_tokens, hf_logits, ATOL_FRAC)


# llama seed 0 had a near-tie on this prompt (top-2 margin 0.058 at new token 2, within our bf16 error): seed 5's
# smallest margin is 0.66
@pytest.mark.parametrize("arch,seed", [("llama", 5), ("qwen2", 9)])
def test_prefill_walk_and_cublaslt_gemms_on_cuda(driver, tmp_path, monkeypatch, arch, seed):
    """A 100-token prompt, streamed, walked 64 tokens at a time with the MLP's up projection in parts of 16: the
    oracle with the prefill GEMMs on cuBLASLt and on our tensor-core kernel, each streamed weight copied once
    per walk."""
    from hf_oracle import build_reference

    from vmmstream import loading
    from vmmstream.kernels.matmul.dense import cublaslt, gemm
    from vmmstream.planning import floor
    prompt = [3 + (7 * i) % 500 for i in range(100)]
    hf_tokens, hf_logits = build_reference(arch, seed, tmp_path, COMMON, prompt, NEW)
    _, half, _ = _budgets(tmp_path, driver.granularity(), mc=160)
    monkeypatch.setattr(floor, "PREFILL_SUB", 16)
    monkeypatch.setattr(loading, "PREFILL_SUB", 16)
    assert cublaslt.available(), cublaslt.unavailable_reason()
    for prefer in (False, True):
        monkeypatch.setattr(gemm, "PREFER_CUBLASLT", prefer)
        mem = memory(driver, half)
        try:
            with vmmstream.load_model(tmp_path, memory=mem, max_context=160, prefill_chunk=64) as m:
                assert m.plan.strategy == "streamed" and m.acts.sub == 16
                before = m.stats()["page_ins"]
                m.generate(prompt, 1, eos_token_id=[])
                assert m.stats()["page_ins"] - before == len(m.plan.streamed) * 2
                tokens, logits = m.generate(prompt, NEW, return_logits=True, eos_token_id=[])
        finally:
            mem.close()
        check_against_reference(f"{arch} walk cublaslt={prefer}", tokens, logits, hf_tokens, hf_logits, ATOL_FRAC)


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_batched_decode_on_cuda_gives_each_sequence_its_own_tokens(driver, tmp_path, quantize):
    """max_batch 3, five prompts of different lengths and lengths of answer (two join as slots free): every
    sequence's tokens equal its tokens alone, resident and streamed; its KV pages are unmapped when it leaves."""
    from hf_oracle import build_reference
    build_reference("llama", 0, tmp_path, COMMON, [1, 2], 1)
    prompts = [PROMPT, [3, 4], list(range(10, 31)), [7] * 9, [100, 17, 5]]
    news = [12, 5, 9, 12, 7]
    fits, half, _ = _budgets(tmp_path, driver.granularity(), quantize=quantize)
    for budget, strategy in ((fits * 2, "resident"), (half, "streamed")):
        mem = memory(driver, budget)
        try:
            with vmmstream.load_model(tmp_path, memory=mem, max_context=MC, quantize=quantize, max_batch=3) as m:
                assert m.plan.strategy == strategy
                alone = [m.generate(p, k, eos_token_id=[]) for p, k in zip(prompts, news)]
                before = m.placement.batch_kv.committed()
                together = [m.generate(prompts, k, eos_token_id=[]) for k in (12,)][0]
                assert m.placement.batch_kv.committed() <= before
        finally:
            mem.close()
        for got, want, k in zip(together, alone, news):
            assert got[:k] == want, (strategy, quantize)


def test_batched_decode_of_eight_or_more_on_tensor_cores(driver, tmp_path):
    """max_batch 12, fourteen prompts: steps of 8 to 12 sequences take the tensor-core GEMV (``gemv_mma``), whose
    sums are ordered differently from one sequence's SIMT GEMV; every sequence's tokens still equal its own alone,
    resident and streamed."""
    from hf_oracle import build_reference
    from vmmstream.kernels.matmul.dense import gemv_mma
    from vmmstream.loading import plan_walked
    from vmmstream.model import open_checkpoint
    build_reference("llama", 0, tmp_path, COMMON, [1, 2], 1)
    assert COMMON["hidden_size"] % gemv_mma.KC == 0 and COMMON["intermediate_size"] % gemv_mma.KC == 0
    prompts = [[3 + i, 40 + 7 * i, 9, 100 + i][: 2 + i % 3] for i in range(14)]
    news = [6 + i % 5 for i in range(14)]
    ck = open_checkpoint(tmp_path)       # twelve KV ranges of whole granules: budgets planned for the batch
    full = plan_walked(ck.config, ck.tensors, 1 << 40, backend="cuda", granularity=driver.granularity(),
                       max_context=MC, batch=12)
    for budget, strategy in ((full.floor + full.weight_bytes, "resident"),
                             (full.floor + full.weight_bytes // 2, "streamed")):
        mem = memory(driver, budget)
        try:
            with vmmstream.load_model(tmp_path, memory=mem, max_context=MC, max_batch=12) as m:
                assert m.plan.strategy == strategy
                alone = [m.generate(p, k, eos_token_id=[]) for p, k in zip(prompts, news)]
                together = m.generate(prompts, max(news), eos_token_id=[])
                assert m.stats()["packed_prefills"] > 0        # the joining prompts prefilled together
        finally:
            mem.close()
        for got, want, k in zip(together, alone, news):
            assert got[:k] == want, strategy


@pytest.mark.parametrize("in_graph", [False, True], ids=["host_rounds", "rounds_in_graph"])
@pytest.mark.parametrize("arch,seed", [("mixtral", 8), ("qwen2-moe", 7)])
def test_batched_decode_of_a_mixture_of_experts_on_cuda(driver, tmp_path, monkeypatch, arch, seed, in_graph):
    """max_batch 3, five prompts: resident experts (the pool stack, steps as graphs) and at half the weights (experts
    gathered on demand; a batch's steps run host-driven rounds over the slots, eagerly, or with
    ``BATCH_GATHER_IN_GRAPH`` rounds decided on the device, as graphs): each sequence's tokens equal its own alone."""
    from vmmstream.execution import experts as experts_mod
    from vmmstream.loading import plan_walked
    from vmmstream.model import open_checkpoint
    monkeypatch.setattr(experts_mod, "BATCH_GATHER_IN_GRAPH", in_graph)
    _hf(arch, seed, tmp_path)
    prompts = [PROMPT, [3, 4], list(range(10, 31)), [7] * 9, [100, 17, 5]]
    news = [12, 5, 9, 12, 7]
    ck = open_checkpoint(tmp_path)
    full = plan_walked(ck.config, ck.tensors, 1 << 40, backend="cuda", granularity=driver.granularity(),
                       max_context=MC, batch=3)
    for budget, on_demand in ((full.floor + full.weight_bytes, False), (full.floor + full.weight_bytes // 2, True)):
        mem = memory(driver, budget)
        try:
            with vmmstream.load_model(tmp_path, memory=mem, max_context=MC, max_batch=3) as m:
                assert (m.plan.experts.slots > 0) == on_demand
                alone = [m.generate(p, k, eos_token_id=[]) for p, k in zip(prompts, news)]
                together = m.generate(prompts, max(news), eos_token_id=[])
                assert (m.stats()["batch_graph_replays"] > 0) == (not on_demand or in_graph)
        finally:
            mem.close()
        for got, want, k in zip(together, alone, news):
            assert got[:k] == want, (arch, on_demand)


def test_batched_decode_of_a_mixture_through_the_tensor_core_experts(driver, tmp_path, monkeypatch):
    """``moe.experts_mma.MMA``, every expert resident, 9 sequences a step (tiles of 8 rows in the step's graph) and a
    9-token prompt (the prefill's tiles): each sequence's tokens equal its own alone."""
    from vmmstream.kernels.moe import experts_mma as experts
    monkeypatch.setattr(experts, "MMA", True)
    made, real = [], experts._make_gate_up_mma
    monkeypatch.setattr(experts, "_make_gate_up_mma", lambda: made.append(1) or real())
    _hf("mixtral", 8, tmp_path)
    prompts = [PROMPT, list(range(10, 19))] + [[3 + j, 4, 5 + 2 * j] for j in range(7)]
    news = [10, 6, 8, 10, 4, 9, 7, 10, 5]
    mem = memory(driver, 1 << 30)
    try:
        with vmmstream.load_model(tmp_path, memory=mem, max_context=MC, max_batch=9) as m:
            assert m.plan.experts.slots == 0
            alone = [m.generate(p, k, eos_token_id=[]) for p, k in zip(prompts, news)]
            together = m.generate(prompts, max(news), eos_token_id=[])
            assert m.stats()["batch_graph_replays"] > 0 and made      # the tensor-core experts ran
    finally:
        mem.close()
    for got, want, k in zip(together, alone, news):
        assert got[:k] == want


# Seeds chosen on the host backend for the widest greedy margins over the 32 steps (smallest top-2 margin /
# tolerance: mixtral 8 0.64, qwen2-moe 7 1.92; of seeds 0-39 and 0-7). mixtral 3 / qwen2-moe 0 had margins of
# 0.06 / 0.12 of the tolerance and parted from transformers at a near-tie on the H200 (mixtral 3 on the host too).
@pytest.mark.parametrize("arch,seed", [("mixtral", 8), ("qwen2-moe", 7), ("qwen3-moe", 16),
                                       ("qwen3-moe-128", 7)])   # 128 experts, top-8: smallest margin 1.7 %
def test_moe_oracle_on_cuda_resident_and_experts_on_demand(driver, tmp_path, arch, seed):
    """Mixtral / Qwen2-MoE on CUDA: the pool stack when every expert is resident; at a budget holding the
    dense part and half the experts, the routed others gathered into the slots inside the decode graph.
    Same logits bound as the dense oracle; counters: misses, bytes per token, no VMM call per token."""
    hf_tokens, hf_logits = _hf(arch, seed, tmp_path)
    from vmmstream.api import workspace_peaks
    from vmmstream.model import open_checkpoint
    from vmmstream.planning import make_plan
    ck = open_checkpoint(tmp_path)
    full = make_plan(ck.config, ck.tensors, 1 << 40, granularity=driver.granularity(), max_context=MC,
                     workspace=workspace_peaks(ck.config, MC, MC, "cuda"))
    ep = full.experts
    dense = full.weight_bytes - ep.total * ep.unit_bytes
    for budget, where in ((full.floor + full.weight_bytes, "resident"),
                          (full.floor + dense + (ep.top_k + ep.total // 2) * ep.unit_bytes, "on demand")):
        (tokens, logits), plan, stats = _run(driver, tmp_path, budget)
        assert (plan.experts.slots == 0) == (where == "resident")
        assert stats["vmm_calls_per_decode_token"] == 0 and stats["peak_committed"] <= budget
        if where == "on demand":
            assert stats["expert_misses"] > 0
            assert stats["expert_bytes_per_token"] == pytest.approx(stats["experts_streamed_per_token"] * ep.unit_payload)
        check_against_reference(f"{arch}/{where}", tokens, logits, hf_tokens, hf_logits, ATOL_FRAC)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from vmmstream.model import make_checkpoint
    return make_checkpoint("small", tmp_path_factory.mktemp("small"), seed=1)


def test_i10_greedy_tokens_identical_fitting_half_floor_on_cuda(driver, small):
    fits, half, floor = _budgets(small, driver.granularity())
    got = {}
    for name, b in (("fits", fits), ("half", half), ("floor", floor)):
        (tokens, _), plan, stats = _run(driver, small, b, new=24)
        got[name] = tokens
        assert stats["peak_committed"] <= b
    assert got["fits"] == got["half"] == got["floor"]


def test_i1_committed_never_exceeds_budget_cross_checked_with_cumemgetinfo(driver, small):
    _, half, _ = _budgets(small, driver.granularity())
    _run(driver, small, half, new=4)                # compile and load every module first (not budget memory)
    driver.synchronize()
    free0, _ = driver.mem_get_info()
    mem = memory(driver, half)
    try:
        with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
            assert m.plan.strategy == "streamed"
            for n in (8, 32, MC - len(PROMPT)):
                m.generate(PROMPT, n)
                driver.synchronize()
                used = free0 - driver.mem_get_info()[0]
                a = mem.authority
                assert a.committed <= a.budget and a.peak_committed <= a.budget
                # what the device lost is what the ledger charged, plus the graph's and the driver's own
                # few MiB, never more than the budget plus that
                assert a.committed - 4 * MiB <= used <= a.budget + 32 * MiB, (used, a.committed, a.budget)
    finally:
        mem.close()
    driver.synchronize()
    assert free0 - driver.mem_get_info()[0] <= 8 * MiB


def test_counters_on_cuda(driver, small):
    _, half, _ = _budgets(small, driver.granularity())
    mem = memory(driver, half)
    try:
        with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
            vmm0 = driver.vmm_call_count()
            m.generate(PROMPT, 24, eos_token_id=[])     # all 24, in one block: counted below
            vmm_gen = driver.vmm_call_count() - vmm0
            m.generate(PROMPT, 24, eos_token_id=[])    # the KV cache is already committed: no VMM call at all
            s = m.stats()
            assert driver.vmm_call_count() - vmm0 == vmm_gen
            assert s["graph_replays"] == s["decode_tokens"] == 46 and s["graph_captures"] == 1
            assert s["vmm_calls_decode"] == 0 and s["vmm_calls_per_decode_token"] == 0
            assert s["measured_streamed_bytes_per_step"] == m.plan.streamed_bytes_per_token > 0
            assert s["page_in_bytes"] == (1 + 2 + 46) * m.plan.streamed_bytes_per_token
            assert s["h2d_gbps"] > 1.0 and s["decode_tokens_per_s"] > 0      # device time, CUDA events (I11)
            assert s["graph_nodes"]["None"] > 0
    finally:
        mem.close()


def test_sampling_on_cuda_is_seeded(driver, small):
    mem = memory(driver, 512 * MiB)
    try:
        with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
            a = m.generate(PROMPT, 16, temperature=0.9, top_k=40, top_p=0.9, seed=7)
            b = m.generate(PROMPT, 16, temperature=0.9, top_k=40, top_p=0.9, seed=7)
            assert a == b and all(0 <= t < m.config.vocab_size for t in a)
    finally:
        mem.close()


def test_legacy_on_cuda(driver, small, monkeypatch):
    from vmmstream.memory import DeviceMemory
    (ref, _), _, _ = _run(driver, small, 512 * MiB, new=12)
    mem = DeviceMemory(driver, 512 * MiB, legacy=True)
    vmm0 = driver.vmm_call_count()
    try:
        with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
            assert m.plan.strategy == "legacy"
            assert m.generate(PROMPT, 12) == ref
    finally:
        mem.close()
    assert driver.vmm_call_count() == vmm0
    mem = DeviceMemory(driver, 16 * MiB, legacy=True)
    with pytest.raises(CapacityError, match="VMMSTREAM_LEGACY_ALLOCATOR"):
        vmmstream.load_model(small, memory=mem, max_context=MC)
    mem.close()


def test_max_context_exhaustion_on_cuda_is_an_error_not_a_crash(driver, small):
    mem = memory(driver, 512 * MiB)
    try:
        with vmmstream.load_model(small, memory=mem, max_context=MC) as m:
            with pytest.raises(ContextLengthError):
                m.generate(PROMPT, MC)
            assert len(m.generate(PROMPT, MC - len(PROMPT), eos_token_id=[])) == MC - len(PROMPT)
    finally:
        mem.close()


_FRESH_PROCESS = """
import json, sys, time
t0 = time.perf_counter()
import vmmstream
from vmmstream.kernels.base import jit
with vmmstream.load_model(sys.argv[1], budget=sys.argv[2], backend="cuda", max_context=128) as m:
    t1 = time.perf_counter()
    ids = m.generate([1, 5, 9, 33, 7, 2], 8, eos_token_id=[])
print(json.dumps(dict(jit.stats(), ids=ids, load_s=t1 - t0, total_s=time.perf_counter() - t0)))
"""


def test_a_second_process_loads_every_kernel_from_the_disk_cache(small, tmp_path, driver):
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, VMMSTREAM_CACHE_DIR=str(tmp_path), VMMSTREAM_KERNEL_CACHE="1")

    def fresh(budget):
        r = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(small), budget], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-4000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    cold, warm = fresh("1GiB"), fresh("1GiB")
    streamed = fresh(str(_budgets(small, driver.granularity())[1]))
    print(f"\nkernel cache: cold {cold['load_s']:.1f} s to load ({cold['misses']} compiled), warm "
          f"{warm['load_s']:.1f} s ({warm['hits']} from disk); streamed {streamed['load_s']:.1f} s")
    assert cold["uncached"] == [] and cold["misses"] > 0 and cold["hits"] == 0
    assert warm["misses"] == 0 and warm["hits"] == cold["misses"]
    assert warm["ids"] == cold["ids"] == streamed["ids"]


def test_long_prompts_replayed_as_padded_graphs_on_cuda(driver, tmp_path, monkeypatch):
    """Prompts above PREFILL_GRAPH_STEP tokens pad (under 1/8 more rows) and replay as captured graphs (the walk
    longer than the MLP's sub-chunks, cuBLASLt or our GEMMs inside the capture): first logits as the unpadded
    eager prefill's, within the oracle's bound, and the same greedy tokens."""
    from vmmstream.execution import engine as eng
    from vmmstream.model import make_checkpoint
    path = make_checkpoint("small", tmp_path / "small", seed=5)
    mc = 1100
    fits, _ = _budgets(path, driver.granularity(), mc=mc)[:2]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 200, n).tolist() for n in (600, 610, 600)]     # all padded to 640

    def answers(graph_max):
        monkeypatch.setattr(eng.Engine, "PREFILL_GRAPH_MAX", graph_max)
        mem = memory(driver, fits * 4)
        try:
            with vmmstream.load_model(path, memory=mem, max_context=mc) as m:
                assert m.acts.tmax >= 640 and m.acts.sub < 600         # one walk, the MLP in sub-chunks
                out = [m.generate(p, 4, return_logits=True, eos_token_id=[]) for p in prompts]
                return out, m.stats()
        finally:
            mem.close()
    graphed, s = answers(4096)
    assert s["prefill_graph_captures"] == 1 and s["prefill_graph_replays"] == 2
    eager, _ = answers(0)
    for (a, la), (b, lb) in zip(graphed, eager):
        assert np.max(np.abs(la[0] - lb[0])) <= ATOL_FRAC * np.max(np.abs(lb[0]))
        assert a == b
