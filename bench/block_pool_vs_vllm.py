"""Block pool throughput: servelab vs vLLM's ``BlockPool`` on the same workload.

Three cycles, each timed as operations per second (best of several repeats):

- ``alloc1+free``:  get_new_blocks(1), free_blocks(it)
- ``alloc16+free``: get_new_blocks(16), free_blocks(them, tail first)
- ``prefix hit``:   16 x get_cached_block, touch(16 blocks), free_blocks(16)
                    on a pool whose cached blocks sit in the free queue (each
                    hit pulls blocks out of the middle of the queue)

Usage::

    python bench/block_pool_vs_vllm.py                      # vLLM too if importable
    python bench/block_pool_vs_vllm.py --vllm-python /path/to/anchors-venv/bin/python

vLLM needs a CPU install (``../shared/anchors/README.md``); when it cannot be
imported here and no ``--vllm-python`` is given, its rows are skipped with a
message. The vLLM side runs in its own process through this same file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable

NUM_BLOCKS = 4096
BLOCK_SIZE = 16
HIT_BLOCKS = 16


def best_ops_per_s(cycle: Callable[[], None], iters: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            cycle()
        best = min(best, time.perf_counter() - start)
    return iters / best


def bench_alloc_free(pool) -> dict[str, float]:
    """The two allocation cycles; both pools share these method names."""

    def alloc1():
        pool.free_blocks(pool.get_new_blocks(1))

    def alloc16():
        pool.free_blocks(reversed(pool.get_new_blocks(16)))

    return {"alloc1+free": best_ops_per_s(alloc1, 20000), "alloc16+free": best_ops_per_s(alloc16, 5000)}


def bench_servelab() -> dict[str, float]:
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

    out["prefix hit (16 blocks)"] = best_ops_per_s(hit, 5000)
    return out


def bench_vllm() -> dict[str, float]:
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

    out["prefix hit (16 blocks)"] = best_ops_per_s(hit, 5000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of an environment where vllm imports")
    parser.add_argument("--only", choices=["servelab", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        print(json.dumps(bench_servelab() if args.only == "servelab" else bench_vllm()))
        return 0

    ours = bench_servelab()
    theirs, note = None, ""
    try:
        import vllm  # noqa: F401

        theirs = bench_vllm()
    except ImportError:
        if args.vllm_python:
            proc = subprocess.run([args.vllm_python, __file__, "--only", "vllm"], capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
            theirs = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            note = "vLLM is not importable here; pass --vllm-python (see ../shared/anchors/README.md). Skipped."

    print(f"{'cycle':<24}{'servelab ops/s':>16}{'vLLM ops/s':>14}{'ratio':>8}")
    for name, value in ours.items():
        if theirs:
            print(f"{name:<24}{value:>16,.0f}{theirs[name]:>14,.0f}{value / theirs[name]:>8.2f}")
        else:
            print(f"{name:<24}{value:>16,.0f}{'-':>14}{'-':>8}")
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
