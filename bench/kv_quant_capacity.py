"""What quantized KV pages buy: capacity at equal bytes, a pool-bound workload, and the CPU decode
kernel at long context. Rows ``component=kv_quant_capacity`` / ``kv_quant_workload`` /
``kv_quant_kernel`` in ``bench/results/results.csv``, each timed row with the 1-minute load
average (``loadavg``): the machine may be shared, so compare ratios taken within one run.

- ``--part capacity``: SmolLM2-135M's spec (30 layers, 3 KV heads of 64, blocks of 16): bytes
  per block (data and scales), blocks held by a 256 MiB budget per ``kv_cache_dtype`` (a real
  pool built by the Pipeline's sizing) and the ratio to float32.
- ``--part workload``: SmolLM2 on a pool-bound workload (``--requests`` prompts of ``--prompt``
  tokens, ``--output`` greedy tokens each, ``--budget`` bytes of KV pool, the same for every
  dtype): preemptions, output tokens per second (wall, and per CPU second of this process: a shared
  machine inflates wall time), TTFT p50.
- ``--part kernel``: decode attention at ``--context`` tokens, SmolLM2's heads (9 query / 3 KV
  heads of 64): the float32 C kernel over its dense K/V (what a float32 decode step runs) against
  the C kernel over int8 / fp8 pages (per layer, median of ``--repeats``), each with its own K/V
  read floor (its bytes over the read bandwidth measured in the same run), for each
  ``--kernel-shapes`` BATCHxLAYERS: the calls cycle over LAYERS layers' K/V, so ``1x1`` / ``16x1``
  keep the K/V in the last-level cache between calls (compute-bound) and ``16x12`` (1.2 GB of
  float32 K/V per sweep) reads it from DRAM each call (the memory-bound regime a quantized read
  is for).

Usage: ``python bench/kv_quant_capacity.py --part capacity,workload,kernel [--threads 1,2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from options import comma_separated  # noqa: E402
from results_io import append_rows, make_row  # noqa: E402

from servelab.blocks import allocate_kv_cache  # noqa: E402
from servelab.blocks.kv_quant import get_kv_cache_dtype, kv_cache_storage, quantize_rows  # noqa: E402
from servelab.blocks.specs import FullAttentionSpec  # noqa: E402

DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
SMOLLM2 = dict(num_layers=30, num_q_heads=9, num_kv_heads=3, head_size=64)


def capacity(budget: int = 256 << 20) -> list[dict]:
    from servelab.pipeline.sizing import blocks_for_budget

    rows, base = [], None
    for dtype in DTYPES:
        storage, scale = kv_cache_storage(dtype, None, torch.float32)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=SMOLLM2["num_kv_heads"], head_size=SMOLLM2["head_size"],
                                 dtype=storage, kv_scale=scale)
        block_bytes = spec.page_size_bytes * SMOLLM2["num_layers"]
        blocks = blocks_for_budget(budget, block_bytes, given=True)
        base = base or blocks
        params = dict(model="smollm2", budget_bytes=budget, kv_cache_dtype=dtype, kv_cache_scale=scale or "none")
        rows += [make_row("kv_quant_capacity", dtype, "block_bytes", "B", block_bytes, params=params),
                 make_row("kv_quant_capacity", dtype, "blocks_at_budget", "blocks", blocks, params=params),
                 make_row("kv_quant_capacity", dtype, "blocks_over_float32", "ratio", blocks / base, params=params)]
        print(f"{dtype:9s} block {block_bytes:7d} B  blocks in {budget >> 20} MiB: {blocks:6d}  ({blocks / base:.2f}x)")
    return rows


def workload(args) -> list[dict]:
    from servelab import Pipeline, SamplingParams
    from servelab.models import hub

    path = hub.fetch_smollm2()
    rows = []
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (args.prompt,), generator=gen).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    for dtype in ("auto", "int8", "fp8_e4m3"):
        pipe = Pipeline.from_pretrained(path, kv_cache_memory_bytes=args.budget, kv_cache_dtype=dtype,
                                        max_num_seqs=args.requests, enable_prefix_caching=False)
        load = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), time.process_time()
        outs = pipe.generate(prompts, params)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        preemptions = sum(o.metrics.num_preemptions for o in outs)
        ttft = statistics.median(o.metrics.ttft for o in outs)
        tokens = sum(len(o.token_ids) for o in outs)
        p = dict(model="smollm2", kv_cache_dtype=dtype, budget_bytes=args.budget, num_blocks=pipe.num_blocks,
                 requests=args.requests, prompt=args.prompt, output=args.output, loadavg=load,
                 threads=torch.get_num_threads())
        rows += [make_row("kv_quant_workload", dtype, "preemptions", "count", preemptions, params=p),
                 make_row("kv_quant_workload", dtype, "throughput", "tok/s", tokens / wall, params=p),
                 make_row("kv_quant_workload", dtype, "throughput_per_cpu_second", "tok/cpu-s", tokens / cpu,
                          params=p),
                 make_row("kv_quant_workload", dtype, "ttft_p50", "s", ttft, params=p)]
        print(f"{dtype:9s} blocks {pipe.num_blocks:5d} preemptions {preemptions:4d} throughput {tokens / wall:7.1f} "
              f"tok/s ({tokens / cpu:.1f} per CPU second) TTFT p50 {ttft:.2f} s (load {load:.1f})", flush=True)
    return rows


def read_bandwidth(num_bytes: int = 256 << 20) -> float:
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = min(_timed(buffer.sum) for _ in range(3))
    return num_bytes / best


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _timed(fn) -> float:
    """Seconds of ``fn()`` on the chosen clock (``--clock cpu``: this process's CPU time, which a
    machine shared with other jobs inflates far less than wall time; with one thread)."""
    start = _clock()
    fn()
    return _clock() - start


def _layer_data(batch: int, context: int, gen: torch.Generator) -> tuple:
    """One layer's float32 K (tiled, as the float32 decode step carries it) and V ``[batch * Hk,
    context, D]``, and its int8 / fp8 pages (the same K/V quantized; token-head scales)."""
    from servelab.attention import cpu_decode

    hk, d = SMOLLM2["num_kv_heads"], SMOLLM2["head_size"]
    keys, values = (torch.randn((batch * hk, context, d), generator=gen) for _ in range(2))
    blocks = batch * context // 16
    pages = {}
    for dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
        storage, granularity = kv_cache_storage(dtype, None, torch.float32)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=hk, head_size=d, dtype=storage, kv_scale=granularity)
        k, v, ks, vs = allocate_kv_cache(spec, 1, blocks + 1).views[0]
        fmt = get_kv_cache_dtype(dtype)
        for cache, scales, dense in ((k, ks, keys), (v, vs, values)):
            rows = dense.view(batch, hk, context, d).transpose(1, 2).reshape(-1, hk, d)
            data, row_scales = quantize_rows(rows, fmt)
            cache[1:].view(torch.uint8).copy_(data.view(torch.uint8).view(blocks, 16, hk, d))
            scales[1:].copy_(row_scales.view(blocks, 16, hk))
        pages[dtype] = (k, v, ks, vs, batch * context * spec.page_size_bytes // 16)
    return cpu_decode.tile_keys(keys), values, pages


def kernel(args, threads: int, batch: int, layers: int) -> list[dict]:
    """The float32 kernel against the quantized one at ``batch`` sequences of ``--context`` tokens,
    each call on the next of ``layers`` layers' K/V: with one layer the K/V stays in the last-level
    cache between calls (SmolLM2 at 4k x 16: 100 MB float32), with enough layers every call reads
    from DRAM (float32 bytes per sweep > the L3). Per-call time: a sweep over the layers / layers."""
    from servelab.attention import cpu_decode, cpu_decode_quant

    torch.set_num_threads(threads)
    context, hk, d = args.context, SMOLLM2["num_kv_heads"], SMOLLM2["head_size"]
    group = SMOLLM2["num_q_heads"] // hk
    gen = torch.Generator().manual_seed(0)
    query = torch.randn((batch, hk * group, d), generator=gen)
    scale = d ** -0.5
    bandwidth = read_bandwidth()
    lens = torch.full((batch,), context, dtype=torch.int64)
    data = [_layer_data(batch, context, gen) for _ in range(layers)]
    table = (torch.arange(batch * context // 16, dtype=torch.int32) + 1).view(batch, context // 16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)

    def sweep(name: str) -> None:
        for tiles, values, pages in data:
            if name == "float32":
                cpu_decode.attend(query, tiles, values, lens, hk, context, scale)
            else:
                k, v, ks, vs, _ = pages[name]
                cpu_decode_quant.paged_decode(query, k, v, ks, vs, table, seq_lens, scale)

    f32_bytes = 2 * batch * hk * context * d * 4
    results = {}
    for name in ("float32", "int8", "fp8_e4m3", "fp8_e5m2"):
        sweep(name)  # warm: first-touch page faults, and the L3 state each regime means
        seconds = statistics.median(_timed(lambda: sweep(name)) for _ in range(args.repeats)) / layers
        results[name] = (seconds, f32_bytes if name == "float32" else data[0][2][name][4])
    rows, load = [], os.getloadavg()[0]
    regime = f"{layers} layers, float32 K/V {layers * f32_bytes / 1e6:.0f} MB per sweep"
    for name, (seconds, num_bytes) in results.items():
        floor = num_bytes / bandwidth
        p = dict(model_shape="smollm2", batch=batch, context=context, layers=layers, threads=threads, loadavg=load,
                 clock=args.clock, kv_cache_dtype=name, read_bandwidth_gbs=round(bandwidth / 1e9, 2),
                 float32_sweep_mb=round(layers * f32_bytes / 1e6))
        ratio = seconds / results["float32"][0]
        rows += [make_row("kv_quant_kernel", name, "decode_attention_layer", "ms", 1e3 * seconds, params=p),
                 make_row("kv_quant_kernel", name, "kv_read_floor", "ms", 1e3 * floor, params=p),
                 make_row("kv_quant_kernel", name, "over_floor", "ratio", seconds / floor, params=p),
                 make_row("kv_quant_kernel", name, "over_float32", "ratio", ratio, params=p)]
        print(f"threads {threads} batch {batch:3d} ({regime}) {name:9s} {1e3 * seconds:7.2f} ms/layer  floor "
              f"{1e3 * floor:6.2f} ms ({seconds / floor:.2f}x)  vs float32 {ratio:.3f}  (load {load:.1f})", flush=True)
    return rows


def _shapes(text: str) -> list[tuple[int, int]]:
    """``"1x1,16x1,16x12"`` -> [(batch, layers), ...]."""
    try:
        return [(int(b), int(n)) for b, n in (item.split("x") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kernel-shapes {text!r}: expected BATCHxLAYERS,... (e.g. 1x1,16x12)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="capacity,workload,kernel", type=lambda text: text.split(","))
    parser.add_argument("--threads", default="1", type=comma_separated(int))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--kernel-shapes", type=_shapes, default=_shapes("1x1,16x1,16x12"),
                        help="kernel part: BATCHxLAYERS,... (calls cycle over LAYERS layers' K/V; 16x12 at 4k "
                             "context: 1.2 GB of float32 K/V per sweep, beyond a 480 MB L3)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clock", default="wall", choices=sorted(CLOCK),
                        help="kernel timing clock: wall, or cpu (process CPU time; use with --threads 1)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--budget", type=int, default=18 << 20, help="KV pool bytes of the workload")
    args = parser.parse_args()
    global _clock
    _clock = CLOCK[args.clock]
    rows = []
    if "capacity" in args.part:
        rows += capacity()
    if "kernel" in args.part:
        for t in args.threads:
            for batch, layers in args.kernel_shapes:
                rows += kernel(args, t, batch, layers)
    if "workload" in args.part:
        torch.set_num_threads(args.threads[0])
        rows += workload(args)
    append_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
