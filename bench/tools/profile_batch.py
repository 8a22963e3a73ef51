"""Where a batch's time goes: the prefills of the joining prompts apart from the decode steps, by the wall clock,
the step counters (graph replays, eager steps, packed prefills) and the device time of every kernel.

    python3 bench/tools/profile_batch.py [MODEL] [BUDGET] [BATCHES]     # defaults: llama-3b, resident, 1,16

For each B: ``generate([B prompts of 16], 1)`` (the prefills) and ``generate([B prompts of 16], 64)`` timed after a
warm-up call, then the second one again under torch.profiler.
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np
from profile_prefill import print_kernels


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import vmmstream
    from vmmstream.model import make_checkpoint

    name = sys.argv[1] if len(sys.argv) > 1 else "llama-3b"
    budget = sys.argv[2] if len(sys.argv) > 2 else "80%"
    batches = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,16").split(",")]
    keys = ("batch_graph_replays", "eager_steps", "packed_prefills", "page_ins")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(name, tmp, seed=0)
        with vmmstream.load_model(path, budget=budget, backend="cuda", max_context=96, max_batch=max(batches),
                                  progress=False) as m:
            print(name, budget, m.plan.strategy, "streamed per step", m.plan.streamed_bytes_per_token)
            for b in batches:
                prompts = [np.random.default_rng(i).integers(3, m.config.vocab_size, 16).tolist() for i in range(b)]
                m.generate(prompts, 4, eos_token_id=[])
                t0 = time.perf_counter()
                m.generate(prompts, 1, eos_token_id=[])
                joins = time.perf_counter() - t0
                before = m.stats()
                t0 = time.perf_counter()
                m.generate(prompts, 64, eos_token_id=[])
                wall = time.perf_counter() - t0
                after = m.stats()
                print(f"\nB={b}: prefills {joins * 1e3:.1f} ms, whole call {wall * 1e3:.1f} ms, "
                      f"decode steps {(wall - joins) / 63 * 1e3:.2f} ms each; "
                      + ", ".join(f"{k} {after[k] - before[k]}" for k in keys))
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    m.generate(prompts, 64, eos_token_id=[])
                    torch.cuda.synchronize()
                print_kernels(prof, f"B={b}: generate(64)")


if __name__ == "__main__":
    main()
