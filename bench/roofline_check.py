"""Does the roofline predict the real pipeline's step times on this CPU? And what does it say for GPUs?

1. Measure this machine (1 thread) by microbenchmarks, never from SmolLM2's own step times:
   SmolLM2-135M's decoder GEMMs alone (every fused weight once, through the pipeline's own call:
   oneDNN on weights packed once, :mod:`servelab.models.linear`) at 1, 2, 4, ... 256 rows give the achievable rate per shape class (the best is
   ``peak_flops``, each class's share the ``gemm_efficiency_curve``; a few rows reach far less than
   their weight-streaming time says) and the fastest weight streaming the bandwidth; the pipeline's
   fixed host time per step and per sequence comes from carried decode steps at batch 1 and 16 of
   a 30-layer model 64 wide (SmolLM2's layer count: the per-layer launches; negligible GEMMs).
   These are the ``cpu-measured`` entry of ``hardware.json``.
2. Serve SmolLM2-135M (the real checkpoint when fetched, else random weights of its shape) through
   the ``Pipeline`` at 1 thread: decode steps at batch 1, 4 and 16 and prefill steps of 64 and 256
   tokens, median step time of each; predict each with the roofline built from step 1's numbers.
   Target: within 25%.
3. The roofline's Llama-3.1-8B decode throughput (batch 1 and 64, 1k context) on every GPU of the
   table, for the record, and its prediction for each published serving measurement the table
   lists (``hardware.json``'s ``_published``, each with its source): predicted vs published rows.

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


GEMM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""The shape classes the GEMM microbenchmark measures (rows of the activation)."""


def smollm2_weights():
    """Random fp32 weights ``[out, in]`` with the pipeline's SmolLM2-135M linear shapes: per layer
    the fused QKV, O, fused gate-up and down projections (30 layers), then the LM head."""
    import torch

    h, kv, inter = 576, 192, 1536
    layer = [(h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)]
    return [torch.randn(*shape) for _ in range(30) for shape in layer], torch.randn(49152, h)


def gemm_only_step(weights, tokens: int, repeats: int = 5) -> float:
    """CPU seconds of the pipeline's GEMM call (``servelab.models.linear.linear``: oneDNN on a
    weight packed once where that applies, else ``F.linear``) over every weight once on
    ``tokens`` rows (median of ``repeats``)."""
    import torch

    from servelab.models.linear import PackedWeight, linear

    xs = {w.shape[1]: torch.randn(tokens, w.shape[1]) for w in weights}
    packs = [PackedWeight() for _ in weights]
    times = []
    with torch.inference_mode():
        for w, pack in zip(weights, packs):  # pack outside the timing, as the model does once
            linear(xs[w.shape[1]], w, None, pack)
        for _ in range(repeats):
            t = CLOCK()
            for w, pack in zip(weights, packs):
                linear(xs[w.shape[1]], w, None, pack)
            times.append(CLOCK() - t)
    return statistics.median(times)


def measure_gemms() -> dict:
    """Achievable GEMM rate per shape class: the decoder layers' GEMMs alone at each of
    :data:`GEMM_ROWS` rows. The best rate is ``peak_flops``, each class's share of it the
    ``gemm_efficiency_curve``; the fastest weight streaming over the row counts, the bandwidth."""
    layers, _ = smollm2_weights()
    params = sum(w.numel() for w in layers)
    gemm_only_step(layers, 1, repeats=2)  # warm-up
    rates = {m: 2 * params * m / gemm_only_step(layers, m) for m in GEMM_ROWS}
    peak = max(rates.values())
    # Every GEMM reads every weight once, so fp32 weight bytes / time bounds the bandwidth from below
    # at any row count; the tightest bound is the best one (with packed weights one row runs a GEMM
    # kernel, not a matrix-vector one, and streams slower than 2-8 rows do).
    mem_bw = max(4 * params * rate / (2 * params * m) for m, rate in rates.items())
    return dict(peak_flops=peak, mem_bw=mem_bw,
                gemm_efficiency_curve=tuple((m, r / peak) for m, r in rates.items()))


def measure_overheads(tmp: Path) -> dict:
    """The pipeline's host time per step and per sequence, on a 30-layer model 64 wide with a
    512-token vocabulary (SmolLM2's layer count, negligible GEMMs and attention): carried decode steps
    at batch 1 and 16 (median of each), a straight line through the two."""
    from servelab import Pipeline
    from servelab.models import build_tiny_model

    path = build_tiny_model(tmp / "probe", arch="llama", seed=0, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=30, num_attention_heads=4, num_key_value_heads=2)
    pipe = Pipeline.from_pretrained(path, attention_backend="auto", max_num_seqs=16, max_num_batched_tokens=512,
                                    max_model_len=512)
    t1, t16 = (statistics.median(r[-1] for r in decode_rows(pipe, b, 32, 24)) for b in (1, 16))
    return dict(step_overhead_s=t1, seq_overhead_s=max(t16 - t1, 0.0) / 15)


def decode_rows(pipe, batch: int, prompt_len: int, max_tokens: int) -> list[tuple]:
    """Carried pure decode steps of ``batch`` sequences (the first decode after the prompts left out)."""
    import random

    from servelab.scheduling.simulator import measure_steps

    rng = random.Random(batch)
    vocab = pipe.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    measure_steps(pipe, prompts[:1], 2, clock=CLOCK)  # warm-up
    rows = measure_steps(pipe, prompts, max_tokens, clock=CLOCK)
    return [r for r in rows if r[3] == 0 and r[2] == batch and r[6] == 0]


def measure_machine(tmp: Path) -> dict:
    """The ``cpu-measured`` numbers: :func:`measure_gemms` and :func:`measure_overheads`."""
    return {**measure_gemms(), **measure_overheads(tmp)}


def measure_smollm2(tmp: Path) -> tuple[list[dict], str]:
    import random

    from e2e import checkpoint

    from servelab import Pipeline
    from servelab.scheduling.simulator import measure_steps

    path, what = checkpoint("smollm2", tmp)
    pipe = Pipeline.from_pretrained(path, attention_backend="auto", max_num_seqs=16, max_num_batched_tokens=512,
                                    max_model_len=1024)
    rng = random.Random(0)
    cases = [dict(kind="decode", size=b, rows=decode_rows(pipe, b, 64, 10)) for b in (1, 4, 16)]
    for n in (64, 256):
        prompts = [[rng.randrange(3, 30000) for _ in range(n)] for _ in range(3)]
        rows = [r for p in prompts for r in measure_steps(pipe, [p], 1, clock=CLOCK) if r[3] > 0]
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
        print("measured:", {k: v if isinstance(v, tuple) else f"{v:.4g}" for k, v in machine.items()})
        cases, what = measure_smollm2(Path(tmp))
    cpu = dataclasses.replace(hardware_table()["cpu-measured"], **machine)
    model = RooflineCostModel(cpu, MODEL_PRESETS["smollm2-135m"])
    out, worst = [], 0.0
    for case in cases:
        real = statistics.median(r[-1] for r in case["rows"])
        feats = case["rows"][len(case["rows"]) // 2][:5]
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
    published = compare_published()
    if not args.no_record:
        record(machine, out, worst, gpus, what, published)
    return 0


def compare_published() -> list[tuple[dict, float, float]]:
    """``(figure, predicted, relative error)`` for each published GPU figure of the table."""
    from servelab.scheduling.simulator import roofline_cost_model
    from servelab.scheduling.simulator.hardware import published_figures

    out = []
    for fig in published_figures():
        model = roofline_cost_model(fig["hardware"], fig["model"], dtype=fig["dtype"])
        b, ctx = fig["batch"], fig["context"]
        tok_s = model.decode_throughput(b, ctx)
        pred = b / tok_s if fig["metric"] == "tpot_p50_s" else tok_s
        out.append((fig, pred, (pred - fig["value"]) / fig["value"]))
        print(f"{fig['hardware']:<10} {fig['model']} batch {b} ctx {ctx}: {fig['metric']} roofline {pred:.4g}, "
              f"published {fig['value']:.4g} ({100 * out[-1][2]:+.1f}%)")
    return out


def record(machine, out, worst, gpus, what, published) -> None:
    from results_io import append_rows, make_row

    units = {"peak_flops": "FLOP/s", "mem_bw": "B/s", "step_overhead_s": "s", "seq_overhead_s": "s"}
    rows = [make_row("roofline", "cpu-measured", k, unit, machine[k], params={"threads": 1, "clock": "thread_time"})
            for k, unit in units.items()]
    rows += [make_row("roofline", "cpu-measured", "gemm_efficiency", "fraction", eff,
                      params={"rows": m, "threads": 1, "clock": "thread_time"})
             for m, eff in machine["gemm_efficiency_curve"]]
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
    for fig, pred, err in published:
        params = {k: fig[k] for k in ("model", "dtype", "batch", "context", "source")}
        unit = "s" if fig["metric"] == "tpot_p50_s" else "tok/s"
        dev = fig["hardware"]
        rows.append(make_row("roofline", "published", fig["metric"], unit, fig["value"], params=params, device=dev))
        rows.append(make_row("roofline", dev, fig["metric"], unit, pred, params=params, device=dev))
        rows.append(make_row("roofline", "error", fig["metric"], "%", 100 * err, params=params, device=dev))
    print(f"rows appended to {append_rows(rows)}")


if __name__ == "__main__":
    sys.exit(main())
