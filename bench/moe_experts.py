"""The CPU experts kernel against the per-expert loop (the reference), on one thread.

    python bench/moe_experts.py [--repeats 15]

Shapes: hidden 1024, expert width 512 (float32), tokens 1 (a decode step), 32 and 512 (a prefill
chunk), experts 8 top-2 (Mixtral-like) and 64 top-8 (OLMoE / Qwen3-MoE-like), routing uniform at
random. Both kernels run interleaved in one process, so their ratio is taken under the same load;
``os.getloadavg()`` goes into every row (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, INTER = 1024, 512
CASES = [(tokens, experts, top_k) for tokens in (1, 32, 512) for experts, top_k in ((8, 2), (64, 8))]


def main(argv: list[str] | None = None) -> int:
    from results_io import append_rows, make_row, percentiles

    from servelab.moe import get_experts_kernel

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kernels = {name: get_experts_kernel(name) for name in ("cpu", "reference")}
    rows = []
    for tokens, experts, top_k in CASES:
        gen = torch.Generator().manual_seed(tokens * 131 + experts)
        x = torch.randn(tokens, HIDDEN, generator=gen)
        w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5
        w2 = torch.randn(experts, HIDDEN, INTER, generator=gen) / INTER ** 0.5
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=gen)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.repeats):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                kernel(x, w13, w2, weights, ids)
                times[name].append((time.perf_counter() - start) * 1e3)
        params = {"tokens": tokens, "experts": experts, "top_k": top_k, "hidden": HIDDEN, "inter": INTER,
                  "threads": 1, "loadavg": [round(v, 2) for v in os.getloadavg()]}
        for name, samples in times.items():
            pct = percentiles(samples)
            rows.append(make_row("moe_experts", name, "time", "ms", pct["p50"], params=params, **pct))
        ratio = percentiles(times["reference"])["p50"] / percentiles(times["cpu"])["p50"]
        rows.append(make_row("moe_experts", "cpu", "speedup_vs_reference", "x", ratio, params=params))
        print(f"T={tokens:4d} E={experts:2d} k={top_k}: cpu {percentiles(times['cpu'])['p50']:.2f} ms, "
              f"reference {percentiles(times['reference'])['p50']:.2f} ms ({ratio:.2f}x)")
    append_rows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
