"""Where a prompt's prefill spends its device time, kernel by kernel (CUPTI through torch.profiler).

    python3 bench/tools/profile_prefill.py [MODEL] [BUDGET] [LENGTHS]     # defaults: qwen2-7b-12l, resident, 1024,4096

Prints, per prompt length, the wall clock of ``generate(prompt, 1)`` and the device time of every kernel and copy,
summed by name, largest first.
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import vmmstream
    from vmmstream.model import make_checkpoint

    name = sys.argv[1] if len(sys.argv) > 1 else "qwen2-7b-12l"
    budget = sys.argv[2] if len(sys.argv) > 2 else "80%"
    lengths = [int(n) for n in (sys.argv[3] if len(sys.argv) > 3 else "1024,4096").split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(name, tmp, seed=0)
        with vmmstream.load_model(path, budget=budget, backend="cuda", max_context=max(lengths) + 64,
                                  progress=False) as m:
            print(name, budget, m.plan.strategy, "streamed per step", m.plan.streamed_bytes_per_token)
            for n in lengths:
                ids = np.random.default_rng(n).integers(3, m.config.vocab_size, n).tolist()
                m.generate(ids, 1, eos_token_id=[])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                m.generate(ids, 1, eos_token_id=[])
                wall = time.perf_counter() - t0
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    m.generate(ids, 1, eos_token_id=[])
                    torch.cuda.synchronize()
                print_kernels(prof, f"{name} {budget} prompt {n}: wall {wall * 1e3:.1f} ms")


def print_kernels(prof, title: str, top: int = 25) -> None:
    """The device time of every kernel and copy a torch.profiler run saw, summed by name, largest first."""
    rows = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        k = e.name[:90]
        t, c = rows.get(k, (0.0, 0))
        rows[k] = (t + e.device_time_total if hasattr(e, "device_time_total") else t + e.cuda_time, c + 1)
    total = sum(t for t, _ in rows.values())
    print(f"\n== {title}, device sum {total / 1e3:.1f} ms")
    for k, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / 1e3:9.2f} ms {c:6d}x  {k}")


if __name__ == "__main__":
    main()
