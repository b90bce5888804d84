"""KV memory of a Gemma-2-like model: hybrid KV groups vs one uniform full-attention group.

Gemma 2 9B's shape: 42 layers alternating sliding-window (4096 tokens) and
full attention, 8 KV heads of 256, bf16, 16-token blocks. For one request
grown to 8k tokens (chunked prefill of ``--chunk`` tokens, then decode), the
blocks each manager holds are *counted by running the managers*, not derived
from a formula:

- ``uniform``: :class:`servelab.blocks.KVCacheManager` with one
  ``FullAttentionSpec`` for every layer (what a single-group engine does; the
  window is then only a mask), a block = one page in each of the 42 layers;
- ``hybrid``: :class:`servelab.blocks.HybridKVCacheManager` with the layers
  grouped by :func:`~servelab.blocks.make_kv_cache_groups` (21 sliding + 21
  full), a block = one page in each of the 21 shared tensors; the sliding
  group releases blocks that left its window.

Then, for a fixed KV budget (``--budget-gib``), the pool each manager gets and
the largest batch of 8k-token requests that fits (requests are admitted and
grown to 8k one after another until the pool is full).

Rows (component ``hybrid_kv``): ``bytes_per_request`` for each implementation,
``ratio`` (uniform / hybrid), ``max_batch`` for each. Run:
``python bench/hybrid_memory.py`` (a few seconds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import append_rows, make_row  # noqa: E402

from servelab.blocks import (  # noqa: E402
    FullAttentionSpec,
    HybridKVCacheManager,
    KVCacheManager,
    SlidingWindowSpec,
    TokenSequence,
    make_kv_cache_groups,
)

LAYERS, KV_HEADS, HEAD_DIM, WINDOW, BLOCK = 42, 8, 256, 4096, 16


def layer_specs() -> list:
    common = dict(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    return [SlidingWindowSpec(sliding_window=WINDOW, **common) if i % 2 == 0 else FullAttentionSpec(**common)
            for i in range(LAYERS)]


def grow(manager, rid: str, context: int, chunk: int) -> bool:
    """Admit one request and grow it to ``context`` tokens (prefill chunks, then
    decode one token at a time over the last chunk); False when it no longer fits."""
    req = TokenSequence(rid, [7] * (context - chunk), BLOCK, hash_fn="xxhash")
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        if manager.allocate_slots(req, n) is None:
            return False
        req.num_computed_tokens += n
    for _ in range(chunk):
        req.append_token_ids([7])
        if manager.allocate_slots(req, 1) is None:
            return False
        req.num_computed_tokens += 1
    return True


def measure(context: int, chunk: int, budget_bytes: int) -> dict:
    specs = layer_specs()
    page = specs[0].page_size_bytes
    groups = make_kv_cache_groups(specs)
    group_size = len(groups[0].layer_indices)
    out = {}
    for name, block_bytes, build in (
        ("uniform", page * LAYERS,
         lambda n: KVCacheManager(FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                                    dtype=torch.bfloat16), n, False)),
        ("hybrid", page * group_size, lambda n: HybridKVCacheManager(groups, n, False)),
    ):
        one = build(context // BLOCK * 4)
        assert grow(one, "probe", context, chunk)
        held = one.num_blocks - 1 - one.num_free_blocks
        pool = build(budget_bytes // block_bytes)
        batch = 0
        while grow(pool, f"r{batch}", context, chunk):
            batch += 1
        out[name] = dict(bytes_per_request=held * block_bytes, blocks=held, block_bytes=block_bytes,
                         max_batch=batch, pool_blocks=pool.num_blocks)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    args = parser.parse_args(argv)
    budget = int(args.budget_gib * 2**30)
    res = measure(args.context, args.chunk, budget)
    params = dict(model="gemma-2-9b-like", layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, window=WINDOW,
                  block_size=BLOCK, dtype="bfloat16", context=args.context, chunk=args.chunk,
                  budget_gib=args.budget_gib)
    ratio = res["uniform"]["bytes_per_request"] / res["hybrid"]["bytes_per_request"]
    rows = []
    for name, r in res.items():
        print(f"{name:8s} {r['bytes_per_request'] / 2**20:9.1f} MiB/request ({r['blocks']} blocks of "
              f"{r['block_bytes'] / 2**20:.3f} MiB)  max batch in {args.budget_gib:g} GiB: {r['max_batch']}")
        rows.append(make_row("hybrid_kv", name, "bytes_per_request", "bytes", r["bytes_per_request"], params=params))
        rows.append(make_row("hybrid_kv", name, "max_batch", "requests", r["max_batch"], params=params))
    print(f"uniform / hybrid = {ratio:.3f}")
    rows.append(make_row("hybrid_kv", "hybrid", "ratio_uniform_over_hybrid", "x", ratio, params=params))
    append_rows(rows)


if __name__ == "__main__":
    main()
