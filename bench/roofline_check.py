"""Does the roofline predict the real pipeline's step times on this CPU? And what does it say for GPUs?

1. Measure this machine (1 thread), ``bench/gemm_limit.py``-style: SmolLM2-135M's own GEMMs alone
   (every weight once) at 1 token give the weight-streaming bandwidth and at 256 tokens the fp32
   FLOP rate; the pipeline's fixed host time per step and per sequence comes from ``calibrate`` on a
   30-layer, 64-wide model (same layer count, negligible GEMMs). These are the ``cpu-measured``
   entry of ``hardware.json``.
2. Serve SmolLM2-135M (the real checkpoint when fetched, else random weights of its shape) through
   the ``Pipeline`` at 1 thread: decode steps at batch 1, 4 and 16 and prefill steps of 64 and 256
   tokens, median step time of each; predict each with the roofline built from step 1's numbers.
   Target: within 25%.
3. The roofline's Llama-3.1-8B decode throughput (batch 1 and 64, 1k context) on every GPU of the
   table, for the record.

Every time is the CPU time of this one-thread process (``time.thread_time``), not wall time: on a shared
machine the wall clock also counts other processes. Rows go to ``bench/results/results.csv`` (component
``roofline``; params say ``clock: thread_time``). Usage::

    python bench/roofline_check.py [--no-record]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


# CPU time of this (1-thread) process: on a machine shared with others, wall time also counts the
# time other processes held the core; CPU time is what the step itself cost.
CLOCK = time.thread_time


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = CLOCK()
        fn()
        best = min(best, CLOCK() - t)
    return best


def smollm2_weights():
    """Random fp32 weight matrices with SmolLM2-135M's linear shapes (30 layers + the LM head)."""
    import torch

    h, kv, inter = 576, 192, 1536
    layer = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    return [torch.randn(*shape) for _ in range(30) for shape in layer] + [torch.randn(h, 49152)]


def gemm_only_step(weights, tokens: int) -> float:
    """CPU seconds of one step's GEMMs alone (every weight once, ``tokens`` rows; median of 5)."""
    import torch

    xs = {w.shape[0]: torch.randn(tokens, w.shape[0]) for w in weights}
    times = []
    for _ in range(5):
        t = CLOCK()
        for w in weights:
            torch.mm(xs[w.shape[0]], w)
        times.append(CLOCK() - t)
    return statistics.median(times)


def measure_machine(tmp: Path) -> dict:
    """The ``cpu-measured`` numbers, gemm_limit-style: the model's own GEMMs alone give the achievable
    weight-streaming bandwidth (1 token) and FLOP rate (256 tokens); a 30-layer, 64-wide model (the
    same number of layers, negligible GEMMs) gives the pipeline's host time per step and sequence."""
    from servelab import Pipeline
    from servelab.models import build_tiny_model
    from servelab.scheduling.simulator import calibrate

    weights = smollm2_weights()
    num_bytes = sum(w.numel() for w in weights) * 4
    num_params = sum(w.numel() for w in weights)
    bw = num_bytes / gemm_only_step(weights, 1)
    flops = 2 * num_params * 256 / gemm_only_step(weights, 256)
    del weights
    path = build_tiny_model(tmp / "probe", arch="llama", seed=0, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=30, num_attention_heads=4, num_key_value_heads=2)
    pipe = Pipeline.from_pretrained(path, attention_backend="auto", max_num_seqs=16, max_num_batched_tokens=512,
                                    max_model_len=512)
    cost = calibrate(pipe, batch_sizes=(1, 4, 16), prompt_lens=(8, 32), max_tokens=8, clock=CLOCK)
    return dict(peak_flops=flops, mem_bw=bw, step_overhead_s=cost.base_s, seq_overhead_s=cost.per_seq_s)


def measure_smollm2(tmp: Path) -> tuple[list[dict], str]:
    import random

    from e2e import checkpoint

    from servelab import Pipeline
    from servelab.scheduling.simulator import measure_steps

    path, what = checkpoint("smollm2", tmp)
    pipe = Pipeline.from_pretrained(path, attention_backend="auto", max_num_seqs=16, max_num_batched_tokens=512,
                                    max_model_len=1024)
    rng = random.Random(0)

    def prompts(n, k):
        return [[rng.randrange(3, 30000) for _ in range(k)] for _ in range(n)]

    measure_steps(pipe, prompts(2, 32), 4, clock=CLOCK)  # warm-up
    cases = []
    for b in (1, 4, 16):
        rows = [r for r in measure_steps(pipe, prompts(b, 64), 12, clock=CLOCK) if r[3] == 0 and r[2] == b]
        cases.append(dict(kind="decode", size=b, rows=rows))
    for n in (64, 256):
        rows = [r for _ in range(3) for r in measure_steps(pipe, prompts(1, n), 1, clock=CLOCK) if r[3] > 0]
        cases.append(dict(kind="prefill", size=n, rows=rows))
    return cases, what


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    import torch

    from servelab.scheduling.simulator import MODEL_PRESETS, RooflineCostModel, hardware_table

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        machine = measure_machine(Path(tmp))
        print("measured:", {k: f"{v:.4g}" for k, v in machine.items()})
        cases, what = measure_smollm2(Path(tmp))
    cpu = dataclasses.replace(hardware_table()["cpu-measured"], **machine)
    model = RooflineCostModel(cpu, MODEL_PRESETS["smollm2-135m"])
    out, worst = [], 0.0
    for case in cases:
        real = statistics.median(r[-1] for r in case["rows"])
        feats = case["rows"][len(case["rows"]) // 2][:-1]
        pred = model.step_time(*feats)
        err = (pred - real) / real
        worst = max(worst, abs(err))
        print(f"{case['kind']:<8}{case['size']:>5}  real {1e3 * real:8.2f} ms  roofline {1e3 * pred:8.2f} ms  "
              f"({100 * err:+.0f}%)  {model.breakdown(*feats)}")
        out.append((case, real, pred, err))
    print(f"worst |error| {100 * worst:.0f}% (target 25%)")
    gpus = []
    for name, hw in hardware_table().items():
        if name == "cpu-measured":
            continue
        m = RooflineCostModel(hw, MODEL_PRESETS["llama-3.1-8b"])
        gpus.append((name, m.decode_throughput(1, 1024), m.decode_throughput(64, 1024)))
        print(f"{name:<10} Llama-3.1-8B decode: batch 1 {gpus[-1][1]:7.0f} tok/s, batch 64 {gpus[-1][2]:7.0f} tok/s")
    if not args.no_record:
        record(machine, out, worst, gpus, what)
    return 0


def record(machine, out, worst, gpus, what) -> None:
    from results_io import append_rows, make_row

    rows = [make_row("roofline", "cpu-measured", k, "FLOP/s" if k == "peak_flops" else "B/s" if k == "mem_bw" else "s",
                     v, params={"threads": 1, "clock": "thread_time"}) for k, v in machine.items()]
    for case, real, pred, err in out:
        params = {"model": what, "step": case["kind"], "size": case["size"], "threads": 1, "clock": "thread_time"}
        rows.append(make_row("roofline", "real", "step_time", "s", real, params=params))
        rows.append(make_row("roofline", "cpu-measured", "step_time", "s", pred, params=params))
        rows.append(make_row("roofline", "error", "step_time", "%", 100 * err, params=params))
    rows.append(make_row("roofline", "error", "worst_abs_error", "%", 100 * worst, params={"threads": 1}))
    for name, b1, b64 in gpus:
        params = {"model": "llama-3.1-8b bf16", "context": 1024, "hardware": name}
        rows.append(make_row("roofline", name, "decode_tok_s_batch1", "tok/s", b1, params=params, device=name))
        rows.append(make_row("roofline", name, "decode_tok_s_batch64", "tok/s", b64, params=params, device=name))
    print(f"rows appended to {append_rows(rows)}")


if __name__ == "__main__":
    sys.exit(main())
