"""A batch through the CUDA adapter in the simulator: a packed prefill of three joining prompts and the batched
decode steps after it, against the host backend (``test_cuda_step_sim.py`` has the one-sequence steps). One tiny
model, about 40 s on a CI core."""

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


def test_batched_cuda_steps_with_a_packed_prefill_match_host(tmp_path, monkeypatch):
    """Three prompts joining a max_batch=3 model together: one packed prefill (RoPE + KV append by cache row, each
    prompt's attention over its own slot, the last rows gathered for the logits), then batched decode steps (per
    sequence lengths and rows, a captured graph per batch size) — the CUDA adapter in the simulator against the
    host backend: equal tokens, close logits."""
    path = make_checkpoint(config("LlamaForCausalLM"), tmp_path, seed=5)
    prompts = [PROMPT, [7, 2], [9, 9, 8, 1, 6, 2]]

    def go(cuda_ops):
        make = (lambda driver: SimCudaOps(driver)) if cuda_ops else (lambda driver: ops_module.HostOps(driver))
        monkeypatch.setattr(ops_module, "make_ops", make)
        monkeypatch.setattr(engine_module, "make_ops", make)
        mem = DeviceMemory(HostDriver(granularity=G, total_bytes=1 << 30), 64 << 20)
        try:
            with vmmstream.load_model(path, memory=mem, max_context=MC, max_batch=3) as m:
                out = m.generate(prompts, NEW, return_logits=True, eos_token_id=[])
                return out, m.stats()
        finally:
            mem.close()
    host, _ = go(False)
    sim, stats = go(True)
    assert stats["packed_prefills"] == 1
    for h, s in zip(host, sim):
        compare(h, s)
