"""A batch through the CUDA adapter in the simulator: a packed prefill of three joining prompts and the batched
decode steps after it, and a mixture of experts' batch (resident experts, experts gathered on demand), against the
host backend (``test_cuda_step_sim.py`` has the one-sequence steps). Tiny models, but whole steps in the simulator:
``slow`` (``scripts/test.sh full``)."""

from __future__ import annotations

import pytest
from simops import SimCudaOps
from test_cuda_step_sim import G, MC, NEW, PROMPT, _small_blocks, compare, config  # noqa: F401  (fixture)

import vmmstream
from vmmstream.driver.host import HostDriver
from vmmstream.execution import engine as engine_module, ops as ops_module
from vmmstream.memory import DeviceMemory
from vmmstream.model import make_checkpoint

pytestmark = pytest.mark.sim


@pytest.mark.slow          # about 35 s on a CI core: `scripts/test.sh full`
def test_batched_cuda_steps_with_a_packed_prefill_match_host(tmp_path, monkeypatch):
    """Three prompts joining a max_batch=3 model together: one packed prefill (RoPE + KV append by cache row, each
    prompt's attention over its own slot, the last rows gathered for the logits), then batched decode steps (per
    sequence lengths and rows, a captured graph per batch size) — the CUDA adapter in the simulator against the
    host backend: equal tokens, close logits."""
    path = make_checkpoint(config("LlamaForCausalLM"), tmp_path, seed=5)
    host, sim, stats = both(path, monkeypatch, 64 << 20)
    assert stats["packed_prefills"] == 1
    for h, s in zip(host, sim):
        compare(h, s)


PROMPTS = [PROMPT, [7, 2], [9, 9, 8, 1, 6, 2]]


def both(path, monkeypatch, budget):
    """``generate(PROMPTS)`` on a max_batch=3 model: host backend, then the CUDA adapter in the simulator."""
    prompts = PROMPTS

    def go(cuda_ops):
        make = (lambda driver: SimCudaOps(driver)) if cuda_ops else (lambda driver: ops_module.HostOps(driver))
        monkeypatch.setattr(ops_module, "make_ops", make)
        monkeypatch.setattr(engine_module, "make_ops", make)
        mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), budget)
        try:
            with vmmstream.load_model(path, memory=mem, max_context=MC, max_batch=3) as m:
                out = m.generate(prompts, NEW, return_logits=True, eos_token_id=[])
                return out, m.stats(), m.plan
        finally:
            mem.close()
    host, _, _ = go(False)
    sim, stats, plan = go(True)
    stats["plan"] = plan
    return host, sim, stats


@pytest.mark.slow          # about a minute each on a CI core: `scripts/test.sh full`
@pytest.mark.parametrize("where", ["resident", "on_demand", "on_demand-graph"])
def test_a_mixture_of_experts_batch_through_the_cuda_adapter(tmp_path, monkeypatch, where):
    """Mixtral, three sequences a step: every expert resident (the pool stack inside the step's graph, the session
    workspace sized for the batch), or experts gathered on demand (a batch's steps: host-driven rounds over the
    slots, eagerly; ``-graph``: rounds decided on the device, the steps captured and replayed): equal tokens and
    close logits to the host backend."""
    from vmmstream.execution import experts as experts_mod
    from vmmstream.loading import plan_walked
    monkeypatch.setattr(experts_mod, "BATCH_GATHER_IN_GRAPH", where == "on_demand-graph")
    from vmmstream.model import open_checkpoint
    cfg = config("MixtralForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True)
    path = make_checkpoint(cfg, tmp_path, seed=7)
    ck = open_checkpoint(path)
    full = plan_walked(ck.config, ck.tensors, 1 << 40, backend="host", granularity=G, max_context=MC, batch=3)
    ep = full.experts
    dense = full.weight_bytes - ep.total * ep.unit_bytes
    budget = (full.floor + full.weight_bytes if where == "resident"
              else full.floor + dense + (ep.top_k + 1) * ep.unit_bytes)
    host, sim, stats = both(path, monkeypatch, budget)
    assert (stats["plan"].experts.slots > 0) == (where != "resident")
    assert (stats["batch_graph_replays"] > 0) == (where != "on_demand")
    for h, s in zip(host, sim):
        compare(h, s)
