"""Microbenchmarks of the block layer, fast vs reference (pytest-benchmark).

    pytest bench/bench_blocks.py --benchmark-columns=mean,ops

Cycles mirror ``block_pool_vs_vllm.py``: single-block alloc+free, 16-block
alloc+free, a 16-block prefix hit (lookup, touch, free), and one manager
request life cycle (prefix lookup, allocate a 512-token prompt, 64 decode
steps, each committed with ``cache_blocks``, free).
"""

import pytest

from servelab import reference
from servelab.blocks import BlockPool, FullAttentionSpec, KVCacheManager, TokenSequence

# Rows appended to bench/results/results.csv by bench/conftest.py (implementation = impl).
RESULTS_COMPONENT = "blocks"
IMPLS = {"fast": (BlockPool, KVCacheManager), "reference": (reference.BlockPool, reference.KVCacheManager)}
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 16])
def test_alloc_free(benchmark, impl, n):
    pool = IMPLS[impl][0](4096)
    benchmark(lambda: pool.free_blocks(list(reversed(pool.get_new_blocks(n)))))


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_hit(benchmark, impl):
    pool = IMPLS[impl][0](4096)
    seq = TokenSequence("r", list(range(256)), 16)
    blocks = pool.get_new_blocks(16)
    pool.cache_full_blocks(blocks, seq.block_hashes, 0, 16)
    pool.free_blocks(list(reversed(blocks)))
    pool.get_new_blocks(2000)  # cached blocks now sit in the middle of a long free queue

    def hit():
        got = [pool.get_cached_block(h) for h in seq.block_hashes]
        pool.touch(got)
        pool.free_blocks(list(reversed(got)))

    benchmark(hit)


@pytest.mark.parametrize("impl", IMPLS)
def test_manager_request_lifecycle(benchmark, impl):
    manager = IMPLS[impl][1](SPEC, 4096)
    prompt = list(range(512))
    counter = iter(range(10**9))

    def lifecycle():
        req = TokenSequence(f"r{next(counter)}", prompt, 16)
        blocks, hit = manager.get_computed_blocks(req)
        manager.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        req.num_computed_tokens = req.num_tokens
        manager.cache_blocks(req, req.num_computed_tokens)  # commit after compute
        for t in range(64):
            req.append_token_ids([t])
            manager.allocate_slots(req, 1)
            req.num_computed_tokens += 1
            manager.cache_blocks(req, req.num_computed_tokens)
        manager.free(req)

    benchmark(lifecycle)
