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
- ``--part kernel``: decode attention at ``--context`` tokens x ``--batch`` sequences, SmolLM2's
  heads (9 query / 3 KV heads of 64): the float32 C kernel over its dense K/V (what a float32
  decode step runs) against the C kernel over int8 / fp8 pages (per layer, median of
  ``--repeats``), each with its own K/V read floor (its bytes over the read bandwidth measured
  in the same run).

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


def kernel(args, threads: int) -> list[dict]:
    from servelab.attention import cpu_decode, cpu_decode_quant
    from servelab.attention.decode_kv import DecodeKV  # noqa: F401 - the float32 path's layout owner

    torch.set_num_threads(threads)
    batch, context, hk, d = args.batch, args.context, SMOLLM2["num_kv_heads"], SMOLLM2["head_size"]
    group = SMOLLM2["num_q_heads"] // hk
    gen = torch.Generator().manual_seed(0)
    query = torch.randn((batch, hk * group, d), generator=gen)
    scale = d ** -0.5
    bandwidth = read_bandwidth()
    lens = torch.full((batch,), context, dtype=torch.int64)
    # float32: the dense carried K/V the float32 decode step's kernel reads (tiles of K, rows of V)
    keys = torch.randn((batch * hk, context, d), generator=gen)
    tiles, values = cpu_decode.tile_keys(keys), torch.randn((batch * hk, context, d), generator=gen)
    f32 = [_timed(lambda: cpu_decode.attend(query, tiles, values, lens, hk, context, scale))
           for _ in range(args.repeats)]
    results = {"float32": (statistics.median(f32), 2 * batch * hk * context * d * 4)}
    blocks = batch * context // 16
    for dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
        storage, granularity = kv_cache_storage(dtype, None, torch.float32)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=hk, head_size=d, dtype=storage, kv_scale=granularity)
        buffers = allocate_kv_cache(spec, 1, blocks + 1)
        k, v, ks, vs = buffers.views[0]
        fmt = get_kv_cache_dtype(dtype)
        for cache, scales, dense in ((k, ks, keys), (v, vs, values)):  # the float32 run's K/V, quantized
            rows = dense.view(batch, hk, context, d).transpose(1, 2).reshape(-1, hk, d)
            data, row_scales = quantize_rows(rows, fmt)
            cache[1:].view(torch.uint8).copy_(data.view(torch.uint8).view(blocks, 16, hk, d))
            scales[1:].copy_(row_scales.view(blocks, 16, hk))
        table = (torch.arange(blocks, dtype=torch.int32) + 1).view(batch, context // 16)
        seq_lens = torch.full((batch,), context, dtype=torch.int32)
        times = [_timed(lambda: cpu_decode_quant.paged_decode(query, k, v, ks, vs, table, seq_lens, scale))
                 for _ in range(args.repeats)]
        results[dtype] = (statistics.median(times), batch * context * spec.page_size_bytes // 16)
    rows, load = [], os.getloadavg()[0]
    for name, (seconds, num_bytes) in results.items():
        floor = num_bytes / bandwidth
        p = dict(model_shape="smollm2", batch=batch, context=context, threads=threads, loadavg=load, clock=args.clock,
                 kv_cache_dtype=name, read_bandwidth_gbs=round(bandwidth / 1e9, 2))
        ratio = seconds / results["float32"][0]
        rows += [make_row("kv_quant_kernel", name, "decode_attention_layer", "ms", 1e3 * seconds, params=p),
                 make_row("kv_quant_kernel", name, "kv_read_floor", "ms", 1e3 * floor, params=p),
                 make_row("kv_quant_kernel", name, "over_floor", "ratio", seconds / floor, params=p),
                 make_row("kv_quant_kernel", name, "over_float32", "ratio", ratio, params=p)]
        print(f"threads {threads} {name:9s} {1e3 * seconds:7.2f} ms/layer  floor {1e3 * floor:6.2f} ms "
              f"({seconds / floor:.2f}x)  vs float32 {ratio:.3f}  (load {load:.1f})", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="capacity,workload,kernel", type=lambda text: text.split(","))
    parser.add_argument("--threads", default="1", type=comma_separated(int))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16)
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
            rows += kernel(args, t)
    if "workload" in args.part:
        torch.set_num_threads(args.threads[0])
        rows += workload(args)
    append_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
