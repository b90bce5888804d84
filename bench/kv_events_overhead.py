"""What KV-cache events cost the block pool: off (the default) vs a pool without the hooks vs on.

Three pools, timed in interleaved rounds in one process:

- ``no_hooks``: ``servelab/blocks/block_pool.py`` with the event hook lines
  removed (loaded from its source under another module name; the script
  checks the expected lines were removed);
- ``off``: today's pool, events off (the default);
- ``on``: today's pool with a publisher (batches drained every cycle).

Cycles: the three of ``bench/block_pool_vs_vllm.py`` (alloc 1 + free, alloc
16 + free, 16-block prefix hit: no event code on their path) and ``cache16 +
evict``: allocate 16 blocks from a full cache (evicting 16 cached ones), index
them under new hashes, free them — the paths the hooks sit on. Rows (component
``kv_events``, metric ``ops_per_s``; ratio rows ``off_vs_no_hooks`` and
``on_vs_no_hooks``, p20/p50/p80 over rounds) go to ``bench/results/results.csv``.

Usage::

    python bench/kv_events_overhead.py --rounds 7
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import append_rows, make_row, percentiles  # noqa: E402

from servelab.blocks import BlockPool, TokenSequence  # noqa: E402
from servelab.blocks import block_pool as pool_module  # noqa: E402
from servelab.blocks.events import KVEventPublisher  # noqa: E402

HOOK_LINES = ("publisher = self.kv_event_publisher", "if publisher is not None", "publisher.removed(",
              "publisher.stored(", "if self.kv_event_publisher is not None:", "self.kv_event_publisher.cleared()")
NUM_BLOCKS, BLOCK_SIZE = 4096, 16


def pool_without_hooks() -> type:
    """``BlockPool`` compiled from today's source minus the event hook lines."""
    source = Path(pool_module.__file__).read_text().splitlines(keepends=True)
    kept = [line for line in source if not line.strip().startswith(HOOK_LINES)]
    if len(source) - len(kept) != 8:
        raise RuntimeError(f"expected to remove 8 hook lines, removed {len(source) - len(kept)}: update HOOK_LINES")
    spec = importlib.util.spec_from_loader("_block_pool_without_hooks", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile("".join(kept), "<block_pool without hooks>", "exec"), module.__dict__)
    return module.BlockPool


def cycles(pool_cls: type, events: bool, iters: float) -> dict[str, float]:
    """Ops/s of each cycle on a fresh pool of ``pool_cls``."""
    out = {}
    pool = pool_cls(NUM_BLOCKS)
    publisher = None
    if events:
        publisher = pool.kv_event_publisher = KVEventPublisher()

    def timed(name, fn, n):
        n = max(1, int(n * iters))
        start = time.process_time()  # this process's CPU time: the machine is shared
        for _ in range(n):
            fn()
        out[name] = n / (time.process_time() - start)

    timed("alloc1+free", lambda: pool.free_blocks(pool.get_new_blocks(1)), 20000)
    timed("alloc16+free", lambda: pool.free_blocks(reversed(pool.get_new_blocks(16))), 5000)
    req = TokenSequence("r", list(range(16 * BLOCK_SIZE)), BLOCK_SIZE)
    blocks = pool.get_new_blocks(16)
    pool.cache_full_blocks(blocks, req.block_hashes, 0, 16)
    pool.free_blocks(reversed(blocks))
    hashes = req.block_hashes

    def hit():
        got = [pool.get_cached_block(h) for h in hashes]
        pool.touch(got)
        pool.free_blocks(reversed(got))

    timed("prefix hit (16 blocks)", hit, 5000)
    # A full cache of cached blocks: every allocation of 16 evicts 16.
    small = pool_cls(65)
    if events:
        small.kv_event_publisher = publisher
    seqs = [TokenSequence(f"s{i}", [i] * 16 * BLOCK_SIZE + list(range(16 * BLOCK_SIZE)), BLOCK_SIZE)
            for i in range(64)]
    tokens = [s.token_ids for s in seqs]
    state = {"i": 0}

    def cache_evict():
        i = state["i"] = (state["i"] + 1) % 64
        got = small.get_new_blocks(16)
        small.cache_full_blocks(got, seqs[i].block_hashes, 0, 16, tokens[i], BLOCK_SIZE)
        small.free_blocks(reversed(got))
        if publisher is not None:
            publisher.take_events()

    timed("cache16+evict", cache_evict, 3000)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    bare = pool_without_hooks()
    variants = {"no_hooks": (bare, False), "off": (BlockPool, False), "on": (BlockPool, True)}
    samples: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    for _ in range(args.rounds):
        for name, (cls, events) in variants.items():
            for cycle, rate in cycles(cls, events, args.scale).items():
                samples[name].setdefault(cycle, []).append(rate)
    rows = []
    print(f"{'cycle':<24}{'no hooks':>12}{'off':>12}{'on':>12}{'off/no_hooks p50 [p20-p80]':>30}{'on/no_hooks':>13}")
    for cycle in samples["off"]:
        base = samples["no_hooks"][cycle]
        off = [o / b for o, b in zip(samples["off"][cycle], base)]
        on = [o / b for o, b in zip(samples["on"][cycle], base)]
        qo, qn = percentiles(off), percentiles(on)
        print(f"{cycle:<24}" + "".join(f"{statistics.median(samples[v][cycle]):>12,.0f}" for v in variants)
              + f"{qo['p50']:>14.3f} [{qo['p20']:.3f}-{qo['p80']:.3f}]{qn['p50']:>13.3f}")
        params = {"cycle": cycle, "rounds": args.rounds, "threads": 1, "clock": "cpu",
                  "load_avg_1m": round(os.getloadavg()[0], 2)}
        for v in variants:
            q = percentiles(samples[v][cycle])
            rows.append(make_row("kv_events", v, "ops_per_s", "ops/s", q["p50"], params=params, **q))
        rows.append(make_row("kv_events", "off_vs_no_hooks", "ratio", "x", qo["p50"], params=params, **qo))
        rows.append(make_row("kv_events", "on_vs_no_hooks", "ratio", "x", qn["p50"], params=params, **qn))
    if not args.no_record:
        print(f"results: {append_rows(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
