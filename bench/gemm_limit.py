"""The CPU's own limit as the yardstick: a pipeline decode step vs the same step's GEMMs alone.

For batch sizes 1, 16, 64 (``--batches``): ``B`` requests with ``--context``-token
prompts are admitted and prefilled, then every following ``Pipeline.step()``
is a pure decode step of ``B`` tokens, timed one by one (median of
``--rounds`` x ``--steps``, in rounds alternating with the GEMM-only timing).
Beside it, the *GEMM-only* time of that step, two ways, on the model's own
weight matrices (fused QKV, O, fused gate-up, down per layer, plus the LM head
on the ``B`` sampled rows), a ``[B, in]`` activation in a loop, nothing else:

- ``gemm_only_step``: the kernel the model itself runs, each layer's own
  ``forward`` (on a CPU in float32, oneDNN on weights packed once:
  :mod:`servelab.models.linear`). ``step / GEMM`` (``step_over_gemm``) is the
  pipeline's "fraction of the physical limit": 1.0 would mean attention,
  norms, RoPE, scheduling, sampling and bookkeeping cost nothing.
- ``c_gemm_only_step``: the model's kernel (the panel GEMM, where it runs) called straight from
  C-call arguments prepared once (:func:`c_gemm_only`): the GEMMs with no Python between them,
  the tighter yardstick. ``gemm_only_step`` calls each layer's ``forward`` in a Python loop, so it
  includes ~120 module calls whose Python, like the step's, runs right after a weight stream evicted
  it; ``step_over_c_gemm`` is the step against the GEMMs alone;
- ``matmul_only_step``: ``torch.matmul`` on the dense weights, the GEMM a
  plain PyTorch model runs (and this benchmark's yardstick before weights
  were packed); ``step_over_matmul`` is the step against it.

Where the rest of the step goes, per row:

- ``attention_in_step``: the time inside the model's attention ops, every
  layer's cache write and paged attention (plans, gathers, the kernel),
  measured on the timed steps with those two methods wrapped in a clock
  (:class:`AttentionClock`);
- ``kv_read_floor``: the K/V bytes that step must read (every running
  request's context, every layer, float32) over the read bandwidth measured
  in the same round (``read_bandwidth``: ``torch.sum`` over >= 256 MiB): what
  attention would cost if it only streamed its data once at the machine's
  rate. ``(GEMM + kv_read_floor) / GEMM`` (``gemm_plus_floor_over_gemm``) is
  the lowest ``step_over_gemm`` any engine could reach on this step without
  shrinking its K/V or keeping it in cache across the weights' stream;
- ``attention_kernel_cold`` / ``_warm``: the C attention kernel's own time per
  step, as the step runs it (cold: the layer's weights streamed through the
  caches since its K/V was last read) and the same calls repeated at once
  (warm: that K/V in L2/L3), on :data:`KERNEL_STEPS` extra decode steps after each round
  (:func:`kernel_cold_and_warm`). Warm is the kernel's arithmetic at this
  thread count: where it is near the read floor, attention is compute-bound
  too, and prefetching alone cannot bring cold below it. Float32 pages only
  (``nan`` over quantized pages, whose kernel runs inside the prepared layers'
  one C call: ``attention_in_step`` is its time there, write included);
- ``rest_of_step``: step - GEMM - attention: norms, RoPE, SiLU, residual
  adds, the embedding, argmax, scheduling, input preparation and bookkeeping.

    python bench/gemm_limit.py --batches 16 --threads 1,2     # rows into bench/results/results.csv
    python bench/gemm_limit.py --model tiny --batches 1,16

The KV pool is touched once before timing (steady state: a serving process
has faulted its pool's pages in long ago; a fresh pool would add a page
fault to the first write of every page, about 4 ms of a 110 ms batch-16
step on SmolLM2).

Threads: ``--threads 1,2`` (default 1) times every batch at each count
(``torch.set_num_threads``, which the C decode kernel follows too), the
counts alternating within each round so that they share the same stretch of
a shared machine's time; each row's ``params`` holds its count and the
OpenMP wait policy (``OMP_WAIT_POLICY=PASSIVE`` on a machine shared with
other jobs: see ``bench/e2e.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from options import comma_separated  # noqa: E402 (bench/ is sys.path[0] when run as a script)
from profile_step import build, workload  # noqa: E402


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
    return q[1], statistics.median(samples), q[7]


def gemm_only(model, batch: int, steps: int, kernel: str) -> list[float]:
    """Seconds per step of the model's GEMMs alone on a ``[batch, in]`` activation:
    ``kernel="model"`` each layer's own forward (and ``lm_head_gemm``), ``"matmul"``
    ``torch.matmul`` on the dense weights."""
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    if kernel == "c":
        return c_gemm_only(model, layers, batch, steps)
    if kernel == "model":
        calls = [(layer.in_features, layer) for layer in layers]
        calls.append((model.lm_head_weight.shape[1], model.lm_head_gemm))
    else:
        weights = [layer.weight.t() for layer in layers] + [model.lm_head_weight.t()]  # [in, out] views
        calls = [(w.shape[0], lambda x, w=w: torch.matmul(x, w)) for w in weights]
    dtype = model.lm_head_weight.dtype
    inputs = {width: torch.randn(batch, width, dtype=dtype) for width, _ in calls}
    times = []
    with torch.inference_mode():
        for _ in range(steps + 2):
            start = time.perf_counter()
            for width, call in calls:
                call(inputs[width])
            times.append(time.perf_counter() - start)
    return times[2:]


def c_gemm_only(model, layers: list, batch: int, steps: int) -> list[float]:
    """Seconds per step of the same GEMMs as ``gemm_only(kernel="model")`` made straight from C
    calls with prepared arguments (the panel kernel on each layer's packed panels and the LM
    head's): the GEMMs with no Python between them, as the glued layers make them. Empty when the
    panel kernel does not run on this machine (then the model's GEMMs are oneDNN's)."""
    from servelab.models import cpu_gemm, decode_glue
    from servelab.models.linear import PackedWeight, weight_panels

    lib = decode_glue._library()
    if lib is None or not cpu_gemm.preferred():
        return []
    threads = torch.get_num_threads()
    head = PackedWeight()
    weights = [(layer.weight, layer.bias, layer._packed_weight()) for layer in layers]
    weights.append((model.lm_head_weight, None, head))
    held, calls = [], []
    for weight, bias, cache in weights:
        panels = weight_panels(weight, bias, cache)
        if panels is None:
            return []
        out_features, in_features = weight.shape
        x, out = torch.randn(batch, in_features), torch.empty(batch, out_features)
        held += [panels, x, out]
        calls.append((x.data_ptr(), in_features, panels.data_ptr(), None if bias is None else bias.data_ptr(),
                      out.data_ptr(), batch, in_features, out_features, threads))
    gemm = lib.servelab_panel_gemm
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        for args in calls:
            gemm(*args)
        times.append(time.perf_counter() - start)
    return times[2:]


class AttentionClock:
    """Seconds spent inside the model's attention ops during ``Pipeline.step()``s: every
    layer's ``reshape_and_cache`` and ``paged_attention``, or its ``carried_attend`` /
    ``quantized_attend`` (the two in direct calls, on decode steps) — plans, gathers and the kernel
    included —, timed by wrapping those methods of the model's per-step attention view
    (:class:`servelab.models.step_attention.StepAttention`), plus the int8 write-and-attention calls
    that int8 pages' prepared layers make from C (:mod:`servelab.models.quantized_decode_layers`,
    timed in C by its ``timed_attention``) while the clock is on; a call made inside another
    (``carried_attend`` falling back to ``paged_attention``) counts once. It runs on the timed steps
    themselves: two clock reads per op, ~10 us of a 50-80 ms step. Set :attr:`spent` to 0 to restart."""

    def __init__(self) -> None:
        self.python_spent = 0.0
        self.depth = 0

    @property
    def spent(self) -> float:
        return self.python_spent + self.c_spent[0]

    @spent.setter
    def spent(self, value: float) -> None:
        self.python_spent, self.c_spent[0] = value, 0.0

    def __enter__(self) -> "AttentionClock":
        from servelab.models import llama, quantized_decode_layers

        self.owner, self.originals = llama.StepAttention, {}
        for name in ("reshape_and_cache", "paged_attention", "carried_attend", "quantized_attend"):
            original = self.originals[name] = getattr(self.owner, name)

            def timed(*args, _original=original, **kwargs):
                start = time.perf_counter()
                self.depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.depth -= 1
                    if not self.depth:
                        self.python_spent += time.perf_counter() - start

            setattr(self.owner, name, timed)
        self.c_timing = quantized_decode_layers.timed_attention()
        self.c_spent = self.c_timing.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.c_timing.__exit__(*exc)
        for name, original in self.originals.items():
            setattr(self.owner, name, original)


#: extra decode steps per round and thread count timing the attention kernel cold and warm (few: each
#: makes every context one token longer, and the rows' contexts are ``--context`` plus the steps run)
KERNEL_STEPS = 3


def kernel_cold_and_warm(pipe, steps: int) -> tuple[list[float], list[float]]:
    """Seconds per decode step inside the C attention kernel (``cpu_decode._decode_attention``, every
    layer's one call) as the step runs it, cold (its K/V streamed from memory: the layer's weights
    evicted them), and the same calls made again at once, warm (the layer's few MB of K/V then in
    L2/L3): the warm time is the kernel's arithmetic at this thread count, a floor under the cold
    one that no prefetching reaches. Over ``steps`` extra decode steps (the second call repeats the
    first's copy of the new row: the same bytes). Empty lists when the kernel does not run."""
    from servelab.attention import cpu_decode

    original, spent = cpu_decode._decode_attention, [0.0, 0.0]

    def twice(*args):
        start = time.perf_counter()
        out = original(*args)
        middle = time.perf_counter()
        original(*args)
        spent[0] += middle - start
        spent[1] += time.perf_counter() - middle
        return out

    cold, warm = [], []
    cpu_decode._decode_attention = twice
    try:
        for _ in range(steps):
            spent[:] = [0.0, 0.0]
            pipe.step()
            if spent[0]:
                cold.append(spent[0])
                warm.append(spent[1])
    finally:
        cpu_decode._decode_attention = original
    return cold, warm


def read_bandwidth(num_bytes: int, repeats: int = 3) -> float:
    """Bytes per second of the fastest of ``repeats`` ``torch.sum`` passes over a fresh
    float32 buffer of ``num_bytes`` (at least 256 MiB, so it streams from memory):
    the rate at which this machine, at the current thread count, reads data it must
    fetch from DRAM, as a decode step reads every layer's K/V once."""
    buffer = torch.ones(max(num_bytes, 256 << 20) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def kv_bytes_per_step(pipe, model) -> int:
    """K and V bytes one decode step must read: every running request's context (this
    step's token included), every layer, at the cache's dtype."""
    config = model.config
    tokens = sum(r.num_computed_tokens + 1 for r in pipe.scheduler.running)
    spec = getattr(pipe.kv_cache_manager, "spec", None)
    if getattr(spec, "kv_scale", None) is not None:  # quantized pages: data and scales, as the page counts them
        return tokens * spec.page_size_bytes // spec.block_size * config.num_hidden_layers
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return 2 * tokens * config.num_key_value_heads * config.head_dim * itemsize * config.num_hidden_layers


def decode_and_gemm(pipe, model, prompts: list[list[int]], steps: int, rounds: int,
                    threads: list[int]) -> dict[int, tuple[list[float], ...]]:
    """Per thread count: seconds per ``Pipeline.step()`` once every request is decoding, and
    per GEMM-only step, measured in alternating rounds of ``steps`` each (a shared machine's
    speed drifts over seconds; interleaving gives both, and every thread count, the same
    conditions); with them, per round, the attention clock's share, the K/V read floor and
    bandwidth, the kernel's cold and warm times (:func:`kernel_cold_and_warm`), and the C-only GEMM
    times (:func:`c_gemm_only`): nine lists."""
    from servelab.samplers import SamplingParams

    max_tokens = rounds * (steps + KERNEL_STEPS) * len(threads) + 8
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = [pipe.add_request(p, params, detokenize=False) for p in prompts]
    scheduler = pipe.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) or scheduler.waiting:
        pipe.step()
    pipe.step()  # first step with every request decoding (warm caches)
    out: dict[int, tuple[list[float], ...]] = {t: ([], [], [], [], [], [], [], [], []) for t in threads}
    for _ in range(rounds):
        for t in threads:
            torch.set_num_threads(t)
            times, gemms, matmuls, attention, floors, bandwidths, cold, warm, c_gemms = out[t]
            with AttentionClock() as clock:
                for _ in range(steps):
                    clock.spent = 0.0
                    start = time.perf_counter()
                    pipe.step()
                    times.append(time.perf_counter() - start)
                    attention.append(clock.spent)
            gemms += gemm_only(model, len(prompts), steps, "model")
            matmuls += gemm_only(model, len(prompts), steps, "matmul")
            c_gemms += gemm_only(model, len(prompts), steps, "c")
            kv_bytes = kv_bytes_per_step(pipe, model)
            bandwidths.append(read_bandwidth(kv_bytes))
            floors.append(kv_bytes / bandwidths[-1])
            kernel = kernel_cold_and_warm(pipe, KERNEL_STEPS)
            cold += kernel[0]
            warm += kernel[1]
    for rid in rids:
        pipe.abort_request(rid)
    while pipe.has_unfinished_requests():
        pipe.step()
    return out


def report_row(batch: int, threads: int, timed: tuple[list[float], ...]) -> list[tuple]:
    """Print one (batch, thread count)'s table row; return its (metric, unit, value, p20/p50/p80) items."""
    step, gemm, matmul, attention = (percentiles(samples) for samples in timed[:4])
    floor, bandwidth = statistics.median(timed[4]), statistics.median(timed[5])
    cold, warm = (statistics.median(v) if v else float("nan") for v in timed[6:8])
    ratio, matmul_ratio, floor_ratio = step[1] / gemm[1], step[1] / matmul[1], (gemm[1] + floor) / gemm[1]
    rest = step[1] - gemm[1] - attention[1]
    c_gemm = percentiles(timed[8]) if timed[8] else (float("nan"),) * 3
    print(f"| {batch} | {threads} | {'/'.join(f'{1e3 * x:.1f}' for x in step)} | "
          f"{'/'.join(f'{1e3 * x:.1f}' for x in gemm)} | {ratio:.2f} | "
          f"{'/'.join(f'{1e3 * x:.1f}' for x in c_gemm)} | {step[1] / c_gemm[1]:.2f} | "
          f"{'/'.join(f'{1e3 * x:.1f}' for x in matmul)} | {matmul_ratio:.2f} | {1e3 * attention[1]:.1f} | "
          f"{1e3 * floor:.1f} ({bandwidth / 1e9:.1f} GB/s) | {floor_ratio:.3f} | {1e3 * cold:.1f} / {1e3 * warm:.1f} | "
          f"{1e3 * rest:.1f} |", flush=True)
    kernel = [("attention_kernel_cold", "ms", 1e3 * cold, None),
              ("attention_kernel_warm", "ms", 1e3 * warm, None)] if timed[6] else []
    if timed[8]:
        kernel += [("c_gemm_only_step", "ms", 1e3 * c_gemm[1], [1e3 * g for g in c_gemm]),
                   ("step_over_c_gemm", "ratio", step[1] / c_gemm[1], None)]
    return kernel + [
        ("decode_step", "ms", 1e3 * step[1], [1e3 * s for s in step]),
        ("gemm_only_step", "ms", 1e3 * gemm[1], [1e3 * g for g in gemm]),
        ("step_over_gemm", "ratio", ratio, None),
        ("matmul_only_step", "ms", 1e3 * matmul[1], [1e3 * m for m in matmul]),
        ("step_over_matmul", "ratio", matmul_ratio, None),
        ("attention_in_step", "ms", 1e3 * attention[1], [1e3 * a for a in attention]),
        ("kv_read_floor", "ms", 1e3 * floor, None),
        ("gemm_plus_floor_over_gemm", "ratio", floor_ratio, None),
        ("read_bandwidth", "GB/s", bandwidth / 1e9, None),
        ("rest_of_step", "ms", 1e3 * rest, None),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (the real SmolLM2-135M-Instruct when fetched, else random weights of "
                             "its shapes), tiny, smollm2-shape, or a checkpoint folder")
    parser.add_argument("--batches", default="1,16,64", type=comma_separated(int))
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=10, help="decode steps (and GEMM-only steps) per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of decode and GEMM-only timing")
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--threads", default="1", type=comma_separated(int),
                        help="torch thread counts, comma-separated (e.g. 1,2)")
    parser.add_argument("--no-record", action="store_true", help="print only; no rows in results.csv")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the pages' kv_cache_dtype (auto, int8, fp8...)")
    args = parser.parse_args()
    threads = args.threads
    torch.set_num_threads(threads[0])
    from servelab import Pipeline
    from servelab.models import load_model

    batches = args.batches
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "smollm2":
            from e2e import checkpoint

            path, model_name = checkpoint("smollm2", Path(tmp))
        else:
            path, model_name = build(args.model, Path(tmp)), args.model
        model, config = load_model(path)
    max_model_len = args.context + args.rounds * (args.steps + KERNEL_STEPS) * len(threads) + 64
    # A pool that holds the largest batch whole (the default, sized from the
    # weights, would preempt at batch 64 and time a smaller batch).
    num_blocks = max(batches) * -(-max_model_len // 16) + 1
    pipe = Pipeline(model, attention_backend=args.backend, max_num_seqs=max(batches),
                    max_num_batched_tokens=max(4096, args.context * 8), max_model_len=max_model_len,
                    enable_prefix_caching=False, block_size=16, num_blocks=num_blocks,
                    kv_cache_dtype=args.kv_cache_dtype)
    # Steady state: a serving process has long since touched every page of its
    # pool. A fresh pool is allocated without zero-fill, so without this every
    # first write to a page is a page fault inside the timed decode step.
    pipe.kv_caches.buffer.zero_()
    lines = []
    print(f"model {model_name}, backend {args.backend}, threads {threads}, context {args.context}\n")
    print("| batch | threads | decode step ms (p20/p50/p80) | GEMM-only ms, model's kernel (p20/p50/p80) | "
          "step / GEMM | C-only GEMM ms (p20/p50/p80) | step / C GEMM | torch.matmul-only ms | step / matmul | attention in step ms | its K/V read floor ms "
          "| (GEMM + floor) / GEMM | attention kernel ms, cold / warm | rest of step ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in batches:
        prompts = workload(batch, args.context, args.context, min(config.vocab_size, 500), seed=batch)
        timed = decode_and_gemm(pipe, model, prompts, args.steps, args.rounds, threads)
        for t in threads:
            params = dict(model=model_name, batch=batch, context=args.context, backend=args.backend, threads=t,
                          steps=args.steps * args.rounds, packed_weights=model.pack_weights,
                          omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),
                          **({} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}))
            lines.append((params, report_row(batch, t, timed[t])))
    if not args.no_record:
        from results_io import append_rows, make_row

        out = []
        for params, items in lines:
            for metric, unit, value, pct in items:
                extra = {} if pct is None else dict(p20=pct[0], p50=pct[1], p80=pct[2])
                out.append(make_row("e2e", "servelab", metric, unit, value, params=params, **extra))
        append_rows(out)
        print(f"\n{len(out)} rows appended to results.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
