"""KV memory per request: hybrid KV groups vs one uniform full-attention group.

``--model gemma3-270m`` (the default) takes the layers of the real Gemma 3
270M checkpoint's config (fetched and converted by
:func:`servelab.models.hub.fetch_gemma3_270m`): 18 layers, 15 local with a
512-token window and 3 global (5:1), 1 KV head of 256, at 8k and 32k
tokens, bf16 (its native dtype). ``--model gemma2-9b-like`` is Gemma 2 9B's
shape: 42 layers alternating sliding-window (4096 tokens) and
full attention, 8 KV heads of 256, bf16, 16-token blocks. For one request
grown to each context (chunked prefill of ``--chunk`` tokens, then decode), the
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
``ratio`` (uniform / hybrid), ``max_batch`` for each, per context. Run:
``python bench/hybrid_memory.py`` (seconds; needs the converted Gemma 3 270M
folder, or ``--model gemma2-9b-like``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

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

BLOCK = 16


def gemma2_9b_like_specs(dtype: torch.dtype) -> list:
    """Gemma 2 9B's KV layers: 42, alternating window 4096 / full, 8 KV heads of 256."""
    common = dict(block_size=BLOCK, num_kv_heads=8, head_size=256, dtype=dtype)
    return [SlidingWindowSpec(sliding_window=4096, **common) if i % 2 == 0 else FullAttentionSpec(**common)
            for i in range(42)]


def gemma3_270m_specs(dtype: torch.dtype) -> list:
    """The real Gemma 3 270M's KV layers, from its converted checkpoint's config."""
    from servelab.models import hub, load_config
    from servelab.pipeline.hybrid import layer_kv_cache_specs

    if not hub.is_gemma3_fetched():
        raise SystemExit(f"the Gemma 3 270M folder is not in {hub.gemma3_path()}: run `python -c 'from "
                         "servelab.models.hub import fetch_gemma3_270m; fetch_gemma3_270m()'` first")
    config = load_config(hub.gemma3_path())
    return layer_kv_cache_specs(SimpleNamespace(config=config), BLOCK, dtype)


MODELS = {"gemma3-270m": gemma3_270m_specs, "gemma2-9b-like": gemma2_9b_like_specs}


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


def measure(specs: list, context: int, chunk: int, budget_bytes: int) -> dict:
    """Blocks one request of ``context`` tokens holds, and the largest batch in
    ``budget_bytes``, for one uniform full-attention group and for hybrid groups."""
    page, first = specs[0].page_size_bytes, specs[0]
    groups = make_kv_cache_groups(specs)
    group_size = len(groups[0].layer_indices)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=first.num_kv_heads, head_size=first.head_size,
                             dtype=first.dtype)
    out = {}
    for name, block_bytes, build in (
        ("uniform", page * len(specs), lambda n: KVCacheManager(full, n, False)),
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
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma3-270m")
    parser.add_argument("--context", type=int, nargs="+", default=None,
                        help="contexts in tokens (default: 8192 32768 for gemma3-270m, 8192 otherwise)")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    contexts = args.context or ([8192, 32768] if args.model == "gemma3-270m" else [8192])
    specs = MODELS[args.model](getattr(torch, args.dtype))
    windows = sorted({getattr(s, "sliding_window", 0) for s in specs} - {0})
    rows = []
    for context in contexts:
        res = measure(specs, context, args.chunk, int(args.budget_gib * 2**30))
        params = dict(model=args.model, layers=len(specs), kv_heads=specs[0].num_kv_heads,
                      head_dim=specs[0].head_size, windows=windows, local_layers=sum(
                          isinstance(s, SlidingWindowSpec) for s in specs), block_size=BLOCK, dtype=args.dtype,
                      context=context, chunk=args.chunk, budget_gib=args.budget_gib)
        ratio = res["uniform"]["bytes_per_request"] / res["hybrid"]["bytes_per_request"]
        for name, r in res.items():
            print(f"{args.model} {context:6d} tokens {name:8s} {r['bytes_per_request'] / 2**20:9.1f} MiB/request "
                  f"({r['blocks']} blocks of {r['block_bytes'] / 2**20:.3f} MiB)  max batch in "
                  f"{args.budget_gib:g} GiB: {r['max_batch']}")
            rows.append(make_row("hybrid_kv", name, "bytes_per_request", "bytes", r["bytes_per_request"],
                                 params=params))
            rows.append(make_row("hybrid_kv", name, "max_batch", "requests", r["max_batch"], params=params))
        print(f"{args.model} {context:6d} tokens uniform / hybrid = {ratio:.3f}")
        rows.append(make_row("hybrid_kv", "hybrid", "ratio_uniform_over_hybrid", "x", ratio, params=params))
    append_rows(rows)


if __name__ == "__main__":
    main()
