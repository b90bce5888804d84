"""Block pool throughput: servelab vs vLLM's ``BlockPool`` on the same workload.

Three cycles, each timed as operations per second over ``--repeats`` repeats,
in ``--rounds`` interleaved rounds (servelab, then vLLM, then servelab ...: a
load change on a shared machine hits both). The table shows the medians and
the servelab / vLLM ratio per round (median and range); rows with p20/p50/p80
over all repeats, one per cycle and implementation, are appended to
``bench/results/results.csv`` (component ``block_pool``, implementations
``servelab`` and ``vllm``), plus the ratio over rounds (``servelab_vs_vllm``):

- ``alloc1+free``:  get_new_blocks(1), free_blocks(it)
- ``alloc16+free``: get_new_blocks(16), free_blocks(them, tail first)
- ``prefix hit``:   16 x get_cached_block, touch(16 blocks), free_blocks(16)
                    on a pool whose cached blocks sit in the free queue (each
                    hit pulls blocks out of the middle of the queue)

Usage::

    python bench/block_pool_vs_vllm.py                      # vLLM too if importable
    python bench/block_pool_vs_vllm.py --vllm-python /path/to/anchors-venv/bin/python
    python bench/block_pool_vs_vllm.py --repeats 2 --scale 0.01 --no-record  # smoke run

vLLM needs a CPU install (any environment where ``import vllm`` works); when
it cannot be imported here and no ``--vllm-python`` is given, its rows are
skipped with a message. The vLLM side runs in its own process through this same file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from options import comma_separated  # bench/ is sys.path[0] when run as a script

NUM_BLOCKS = 4096
BLOCK_SIZE = 16
HIT_BLOCKS = 16


REPEATS, SCALE = 5, 1.0  # set from the command line (also in the vLLM subprocess)
CLOCK = time.perf_counter  # --clock cpu: time.process_time (this process's CPU time: robust on a shared machine)


def ops_per_s(cycle: Callable[[], None], iters: int) -> list[float]:
    """Ops/s of each of ``REPEATS`` timed runs of ``iters * SCALE`` cycles."""
    iters = max(1, int(iters * SCALE))
    rates = []
    for _ in range(REPEATS):
        start = CLOCK()
        for _ in range(iters):
            cycle()
        rates.append(iters / (CLOCK() - start))
    return rates


def bench_alloc_free(pool) -> dict[str, list[float]]:
    """The two allocation cycles; both pools share these method names."""

    def alloc1():
        pool.free_blocks(pool.get_new_blocks(1))

    def alloc16():
        pool.free_blocks(reversed(pool.get_new_blocks(16)))

    return {"alloc1+free": ops_per_s(alloc1, 20000), "alloc16+free": ops_per_s(alloc16, 5000)}


def bench_servelab() -> dict[str, list[float]]:
    from servelab.blocks import BlockPool, TokenSequence

    pool = BlockPool(NUM_BLOCKS)
    out = bench_alloc_free(pool)

    req = TokenSequence("r", list(range(HIT_BLOCKS * BLOCK_SIZE)), BLOCK_SIZE)
    blocks = pool.get_new_blocks(HIT_BLOCKS)
    pool.cache_full_blocks(blocks, req.block_hashes, 0, HIT_BLOCKS)
    pool.free_blocks(reversed(blocks))
    hashes = req.block_hashes

    def hit():
        got = [pool.get_cached_block(h) for h in hashes]
        pool.touch(got)
        pool.free_blocks(reversed(got))

    out["prefix hit (16 blocks)"] = ops_per_s(hit, 5000)
    return out


def bench_vllm() -> dict[str, list[float]]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    pool = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE)
    out = bench_alloc_free(pool)

    req = Request("r", list(range(HIT_BLOCKS * BLOCK_SIZE)), SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    blocks = pool.get_new_blocks(HIT_BLOCKS)
    pool.cache_full_blocks(req, blocks, 0, HIT_BLOCKS, BLOCK_SIZE, 0)
    pool.free_blocks(reversed(blocks))
    hashes = req.block_hashes

    def hit():
        got = [pool.get_cached_block(h, [0])[0] for h in hashes]
        pool.touch(got)
        pool.free_blocks(reversed(got))

    out["prefix hit (16 blocks)"] = ops_per_s(hit, 5000)
    return out


def record(results: dict[str, dict[str, list[float]]], vllm_python: str | None,
           ratios: dict[str, list[float]] | None = None, rounds: int = 1, clock: str = "wall",
           threads: int = 1) -> None:
    """Rows for ``results[implementation][cycle]`` into bench/results/results.csv
    (vLLM rows carry the versions of the interpreter that ran them), and one
    ``servelab_vs_vllm`` ratio row per cycle (p20/p50/p80 over the rounds)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_io import append_rows, make_row, percentiles, versions_of_python

    vllm_versions = versions_of_python(vllm_python or sys.executable) if "vllm" in results else {}
    rows = []
    for impl, cycles in results.items():
        for cycle, rates in cycles.items():
            q = percentiles(rates)
            rows.append(make_row("block_pool", impl, "ops_per_s", "ops/s", q["p50"],
                                 params={"cycle": cycle, "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
                                         "rounds": rounds, "repeats": REPEATS, "threads": threads, "clock": clock},
                                 **q, extra_versions=vllm_versions if impl == "vllm" else None))
    for cycle, rs in (ratios or {}).items():
        q = percentiles(rs)
        rows.append(make_row("block_pool", "servelab_vs_vllm", "ratio", "x", q["p50"],
                             params={"cycle": cycle, "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
                                     "rounds": rounds, "repeats": REPEATS, "threads": threads, "clock": clock,
                                     "load_avg_1m": round(os.getloadavg()[0], 2)},
                             **q, extra_versions=vllm_versions))
    print(f"results: {append_rows(rows)}")


def main() -> int:
    global REPEATS, SCALE, CLOCK
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of an environment where vllm imports")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per cycle (default 5)")
    parser.add_argument("--scale", type=float, default=SCALE, help="multiply iteration counts (smoke runs)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or the process's CPU time (a shared, loaded machine)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (servelab, then vLLM; default 3)")
    parser.add_argument("--threads", default="1", type=comma_separated(int),
                        help="torch thread counts, comma-separated (e.g. 1,2); each round runs both pools at "
                             "each count")
    parser.add_argument("--no-record", action="store_true", help="do not append rows to results.csv")
    parser.add_argument("--only", choices=["servelab", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or not args.scale > 0 or args.rounds < 1:
        parser.error(f"--repeats must be >= 1 and --scale > 0, got {args.repeats} and {args.scale}")
    REPEATS, SCALE = args.repeats, args.scale
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.only:
        set_threads(args.threads[0])
        print(json.dumps(bench_servelab() if args.only == "servelab" else bench_vllm()))
        return 0

    threads = args.threads
    rounds: dict[int, list] = {t: [] for t in threads}  # per count: (servelab, vLLM) of each round
    note = ""
    for _ in range(args.rounds):  # interleaved: servelab, then vLLM, each count (the machine's load drifts)
        for t in threads:
            set_threads(t)
            ours, (theirs, note) = bench_servelab(), vllm_round(args, t)
            if theirs is None and note.startswith("vLLM failed"):
                print(note, file=sys.stderr)
                return 1
            rounds[t].append((ours, theirs))
    for t in threads:
        merged, ratios = summarize(rounds[t], t)
        if note:
            print(note)
        if not args.no_record:
            record(merged, args.vllm_python, ratios, args.rounds, args.clock, t)
    return 0


def set_threads(count: int) -> None:
    """``torch.set_num_threads(count)`` where torch is loaded (neither pool calls it: the count is
    set, as in every other benchmark of the thread-scaling work, so that each row states it)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(count)


def vllm_round(args, threads: int) -> tuple[dict | None, str]:
    """One round of vLLM's pool, here or in ``--vllm-python``'s process: (its rates or None, a note)."""
    try:
        import vllm  # noqa: F401

        return bench_vllm(), ""
    except ImportError:
        if not args.vllm_python:
            return None, "vLLM is not importable here; pass --vllm-python (an environment with vLLM). Skipped."
    cmd = [args.vllm_python, __file__, "--only", "vllm", "--repeats", str(REPEATS), "--scale", str(SCALE),
           "--clock", args.clock, "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"vLLM failed in {args.vllm_python}:\n{proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def summarize(rounds: list, threads: int) -> tuple[dict, dict[str, list[float]]]:
    """Print one thread count's table; return (every repeat's rates per implementation and cycle,
    the servelab / vLLM ratio of each round's medians per cycle)."""
    merged = {impl: {c: [x for r in rounds if r[k] for x in r[k][c]] for c in rounds[0][0]}
              for k, impl in ((0, "servelab"), (1, "vllm")) if rounds[0][k]}
    print(f"\n{threads} thread(s)\n{'cycle (median ops/s)':<24}{'servelab ops/s':>16}{'vLLM ops/s':>14}"
          f"{'ratio p50 [min-max over rounds]':>34}")
    ratios: dict[str, list[float]] = {}
    for name, rates in merged["servelab"].items():
        value = statistics.median(rates)
        if "vllm" in merged:
            ratios[name] = r = [statistics.median(o[name]) / statistics.median(t[name]) for o, t in rounds]
            other = statistics.median(merged["vllm"][name])
            print(f"{name:<24}{value:>16,.0f}{other:>14,.0f}{statistics.median(r):>14.2f} "
                  f"[{min(r):.2f}-{max(r):.2f}]")
        else:
            print(f"{name:<24}{value:>16,.0f}{'-':>14}{'-':>8}")
    return merged, ratios


if __name__ == "__main__":
    sys.exit(main())
