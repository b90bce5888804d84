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
           ratios: dict[str, list[float]] | None = None, rounds: int = 1, clock: str = "wall") -> None:
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
                                         "rounds": rounds, "repeats": REPEATS, "threads": 1, "clock": clock},
                                 **q, extra_versions=vllm_versions if impl == "vllm" else None))
    for cycle, rs in (ratios or {}).items():
        q = percentiles(rs)
        rows.append(make_row("block_pool", "servelab_vs_vllm", "ratio", "x", q["p50"],
                             params={"cycle": cycle, "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
                                     "rounds": rounds, "repeats": REPEATS, "threads": 1, "clock": clock,
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
    parser.add_argument("--no-record", action="store_true", help="do not append rows to results.csv")
    parser.add_argument("--only", choices=["servelab", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or not args.scale > 0 or args.rounds < 1:
        parser.error(f"--repeats must be >= 1 and --scale > 0, got {args.repeats} and {args.scale}")
    REPEATS, SCALE = args.repeats, args.scale
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.only:
        print(json.dumps(bench_servelab() if args.only == "servelab" else bench_vllm()))
        return 0

    rounds = []  # interleaved: servelab, then vLLM, per round (the machine's load drifts between rounds)
    note = ""
    for _ in range(args.rounds):
        ours = bench_servelab()
        theirs = None
        try:
            import vllm  # noqa: F401

            theirs = bench_vllm()
        except ImportError:
            if args.vllm_python:
                cmd = [args.vllm_python, __file__, "--only", "vllm", "--repeats", str(REPEATS), "--scale", str(SCALE),
                       "--clock", args.clock]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stderr[-2000:], file=sys.stderr)
                    return 1
                theirs = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                note = "vLLM is not importable here; pass --vllm-python (an environment with vLLM). Skipped."
        rounds.append((ours, theirs))

    merged = {impl: {c: [x for r in rounds if r[k] for x in r[k][c]] for c in rounds[0][0]}
              for k, impl in ((0, "servelab"), (1, "vllm")) if rounds[0][k]}
    print(f"{'cycle (median ops/s)':<24}{'servelab ops/s':>16}{'vLLM ops/s':>14}"
          f"{'ratio p50 [min-max over rounds]':>34}")
    ratios: dict[str, list[float]] = {}
    for name, rates in merged["servelab"].items():
        value = statistics.median(rates)
        if "vllm" in merged:
            ratios[name] = [statistics.median(o[name]) / statistics.median(t[name]) for o, t in rounds]
            other = statistics.median(merged["vllm"][name])
            r = ratios[name]
            print(f"{name:<24}{value:>16,.0f}{other:>14,.0f}{statistics.median(r):>14.2f} "
                  f"[{min(r):.2f}-{max(r):.2f}]")
        else:
            print(f"{name:<24}{value:>16,.0f}{'-':>14}{'-':>8}")
    if note:
        print(note)
    if not args.no_record:
        record(merged, args.vllm_python, ratios, args.rounds, args.clock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
