"""HybridKVCacheManager: the hybrid scenarios of vLLM v1's prefix-caching tests
(inputs and expected hits, adapted to servelab's API: commit after compute
means ``cache_blocks`` is called after each allocation), plus the grouping and
page-size rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from servelab.blocks import (
    FullAttentionSpec,
    HybridKVCacheManager,
    KVCacheGroup,
    KVCacheManagerProtocol,
    MambaSpec,
    SlidingWindowSpec,
    TokenSequence,
    make_kv_cache_groups,
    unify_page_sizes,
)
from servelab.blocks.specs import blocks_needed_alone, request_blocks_cap
from servelab.reference import HybridKVCacheManager as RefHybrid

BS = 16


def full(bs=BS, heads=1):
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=1, dtype=torch.float32)


def sw(window_blocks, bs=BS):
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=window_blocks * bs)


def mamba(bs=BS):
    return MambaSpec(block_size=bs, shapes=((1,), (1,)), dtypes=(torch.float32, torch.float32))


SPECS = {"full": full, "sliding_window": lambda: sw(2), "sliding_window_large": lambda: sw(4), "mamba": mamba}


def req(rid, tokens, bs=BS):
    return TokenSequence(rid, tokens, bs)


def admit(manager, r):
    """Admission as the scheduler does it, then the step's KV is written."""
    blocks, n_hit = manager.get_computed_blocks(r)
    new = manager.allocate_slots(r, r.num_tokens - n_hit, n_hit, blocks)
    assert new is not None
    r.num_computed_tokens = r.num_tokens
    manager.cache_blocks(r, r.num_computed_tokens)
    return blocks, n_hit, new


def partial_hit(manager, tokens, evict, expect_blocks):
    """vLLM's _test_partial_request_hit: drop index entries (group, block
    position), look up, restore."""
    r = req("probe", tokens)
    index = manager.block_pool.cached_block_hash_to_block
    keys = [manager.group_hashes(r, g)[i] for g, i in evict]
    saved = {k: index.pop(k) for k in keys}
    blocks, n_hit = manager.get_computed_blocks(r)
    index.update(saved)
    assert n_hit == expect_blocks * BS
    assert all(len(b) == expect_blocks for b in blocks)


def test_prefill_hybrid_model():
    manager = HybridKVCacheManager([full(), sw(2), sw(2)], 21, max_model_len=8192)
    assert isinstance(manager, KVCacheManagerProtocol)
    common = [i for i in range(3) for _ in range(BS)]
    r0 = req("0", common + [3] * 7)
    blocks, n_hit, new = admit(manager, r0)
    assert n_hit == 0 and not any(blocks)
    assert manager.get_block_ids(r0) == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    pool = manager.block_pool
    for block_id in (4, 8, 12):  # partial blocks are never indexed
        assert pool.blocks[block_id].block_hash is None and pool.blocks[block_id].ref_cnt == 1
    for g, ids in enumerate(([1, 2, 3], [5, 6, 7], [9, 10, 11])):
        assert [pool.blocks[i].block_hash for i in ids] == list(manager.group_hashes(r0, g))

    tokens = common + [3] * 5
    r1 = req("1", tokens)
    blocks, n_hit = manager.get_computed_blocks(r1)
    assert tuple([b.block_id for b in g] for g in blocks) == ([1, 2, 3], [0, 6, 7], [0, 10, 11])
    assert n_hit == 3 * BS
    new = manager.allocate_slots(r1, 53 - n_hit, n_hit, blocks)
    assert tuple([b.block_id for b in g] for g in new) == ([13], [14], [15])
    for group in blocks:
        for b in group:
            assert b.is_null or b.ref_cnt == 2
    manager.free(r0)
    manager.free(r1)

    partial_hit(manager, tokens, [(1, 0), (2, 0)], 3)  # outside the window: no effect
    partial_hit(manager, tokens, [(0, 0)], 0)  # first full-attention block: total miss
    partial_hit(manager, tokens, [(0, 2), (1, 2), (2, 2)], 2)  # last block of all layers
    partial_hit(manager, tokens, [(0, 2)], 2)  # last full-attention block
    partial_hit(manager, tokens, [(1, 2)], 2)  # last sliding-window block
    partial_hit(manager, tokens, [(2, 2)], 2)
    # Full attention serves 2 blocks, sliding window serves 3 but not 2: a miss.
    partial_hit(manager, tokens, [(0, 2), (1, 0), (2, 0)], 0)


HYBRID_CASES = [
    ["full", "sliding_window"], ["full", "mamba"], ["sliding_window", "mamba"],
    ["sliding_window", "sliding_window_large"], ["full", "sliding_window", "sliding_window"],
    ["full", "mamba", "mamba"], ["full", "sliding_window", "mamba"],
    ["full", "sliding_window", "sliding_window_large"], ["full", "full", "sliding_window"],
    ["full", "full", "mamba"], ["full", "sliding_window", "full", "sliding_window_large"],
    ["full", "mamba", "full", "mamba"], ["sliding_window", "mamba", "sliding_window_large", "mamba"],
    ["full", "full", "sliding_window", "mamba"],
]


@pytest.mark.parametrize("kinds", HYBRID_CASES, ids=["+".join(c) for c in HYBRID_CASES])
def test_prefill_hybrid_model_combinations(kinds):
    specs = [SPECS[k]() for k in kinds]
    for manager in (HybridKVCacheManager(specs, 10 * len(specs), max_model_len=8192),
                    RefHybrid(specs, 10 * len(specs), max_model_len=8192)):
        common = [i for i in range(3) for _ in range(BS)]
        r0 = req("0", common + [3] * 7)
        _, n_hit, new = admit(manager, r0)
        assert n_hit == 0 and len(new) == len(specs)
        r1 = req("1", common + [4] * 5)
        blocks, n_hit = manager.get_computed_blocks(r1)
        assert n_hit == 3 * BS and len(blocks) == len(specs)
        assert manager.allocate_slots(r1, 5, n_hit, blocks) is not None
        manager.free(r0)
        manager.free(r1)
        assert manager.num_free_blocks == 10 * len(specs) - 1


def test_sliding_window_frees_blocks_outside_the_window():
    manager = HybridKVCacheManager([full(), sw(2)], 40)
    r = req("r", list(range(6 * BS)))
    admit(manager, r)
    r.append_token_ids([1])
    assert manager.allocate_slots(r, 1) is not None
    ids = manager.get_block_ids(r)
    assert len(ids[0]) == 7 and all(ids[0])
    # Next token (position 96) sees back to 65: blocks 0..3 are dead.
    assert ids[1][:4] == [0, 0, 0, 0] and all(ids[1][4:])
    manager.free(r)
    assert manager.num_free_blocks == 39


def test_mixed_block_sizes_align_hits_to_the_lcm():
    # Full attention pages of 2 heads x 16 tokens == sliding pages of 1 head x 32 tokens.
    specs = unify_page_sizes([full(heads=2), sw(2)])
    assert [s.block_size for s in specs] == [16, 32]
    manager = HybridKVCacheManager(specs, 40)
    ref = RefHybrid(specs, 40)
    assert manager.block_size == 16 and manager.hit_alignment == 32
    tokens = list(range(5 * 16 + 3))
    for m in (manager, ref):
        admit(m, req("a", tokens))
        blocks, n_hit = m.get_computed_blocks(req("b", tokens))
        assert n_hit == 64  # 5 blocks of 16 -> 2 blocks of 32
        assert [len(b) for b in blocks] == [4, 2]


def test_page_size_rule_refusals():
    with pytest.raises(ValueError, match="pages must be equal"):
        HybridKVCacheManager([full(heads=2), sw(2)], 10)
    with pytest.raises(ValueError, match="does not divide"):
        unify_page_sizes([full(heads=3), full(heads=2)])
    big = MambaSpec(block_size=BS, shapes=((1000,),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="Mamba state"):
        HybridKVCacheManager([full(), big], 10, enable_caching=False)
    with pytest.raises(ValueError, match="multiple"):
        HybridKVCacheManager([full(bs=16), mamba(bs=24)], 10, enable_caching=False)


def test_make_kv_cache_groups_splits_kinds_to_equal_sizes():
    specs = [sw(2), full()] * 3 + [full()] * 3  # 3 sliding, 6 full layers
    groups = make_kv_cache_groups(specs)
    assert [g.layer_indices for g in groups] == [(0, 2, 4), (1, 3, 5), (6, 7, 8)]
    assert all(isinstance(g, KVCacheGroup) for g in groups)


def test_mamba_without_caching_holds_one_block():
    manager = HybridKVCacheManager([full(), mamba()], 20, enable_caching=False)
    r = req("r", list(range(50)))
    admit(manager, r)
    assert [len(b) for b in manager.get_block_ids(r)] == [4, 1]


def test_allocation_is_all_or_nothing_across_groups():
    manager = HybridKVCacheManager([full(), sw(2)], 8)  # 7 usable blocks
    r = req("r", list(range(4 * BS)))
    assert manager.allocate_slots(r, 4 * BS) is None  # needs 8
    assert manager.num_free_blocks == 7 and not manager.req_to_blocks
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        manager.allocate_slots(r, 1, 16, ([], []))
    assert manager.num_free_blocks == 7


def test_commit_after_compute_indexes_nothing_at_allocation():
    manager = HybridKVCacheManager([full(), sw(2)], 20)
    r = req("r", list(range(3 * BS)))
    assert manager.allocate_slots(r, 3 * BS) is not None
    assert not manager.block_pool.cached_block_hash_to_block
    manager.cache_blocks(r, 2 * BS)
    assert len(manager.block_pool.cached_block_hash_to_block) == 4
    with pytest.raises(ValueError, match="exceeds"):
        manager.cache_blocks(r, 3 * BS + 1)


def test_hit_iterates_to_a_fixed_point_between_two_windows():
    # sw2 (needs 2 blocks) answers 6 blocks, then sw4 (needs 4) lowers it to 5:
    # sw2 must be asked again, its 6-block hit truncated would miss block 3.
    specs = [sw(2), sw(4)]
    manager, ref = HybridKVCacheManager(specs, 40), RefHybrid(specs, 40)
    tokens = list(range(8 * BS + 1))
    for m in (manager, ref):
        admit(m, req("a", tokens))
        m.free("a")
        r = req("b", tokens)
        index = m.block_pool.cached_block_hash_to_block if m is manager else m.block_pool.block_of_hash
        for g, i in ((0, 6), (1, 5)):
            index.pop(m.group_hashes(r, g)[i])
        blocks, n_hit = m.get_computed_blocks(r)
        assert n_hit == 5 * BS
        block_ids = [[getattr(b, "block_id", b) for b in g] for g in blocks]
        assert all(block_ids[0][3:5]) and all(block_ids[1][1:5])


def test_scheduler_drives_the_hybrid_manager():
    """The scheduler treats hits and block ids as opaque: with the hybrid
    manager it admits with cross-group hits, preempts when the shared pool is
    full, commits after compute and leaks nothing; block ids come per group."""
    from servelab.samplers.params import SamplingParams
    from servelab.scheduling import ModelRunnerOutput, Request, Scheduler, SchedulerConfig

    specs = [full(bs=4), sw(2, bs=4), full(bs=4)]
    kv = HybridKVCacheManager(specs, 24, True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64), kv, "fcfs")
    system = list(range(100, 116))
    for i in range(6):
        sched.add_request(Request(f"r{i}", system + [200 + i] * (3 + i), SamplingParams(max_tokens=12),
                                  eos_token_id=2))
    seen_tuple = False
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            assert isinstance(new.block_ids, tuple) and len(new.block_ids) == 3
            seen_tuple = True
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
                   for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(ids, sampled))
    assert not sched.has_unfinished_requests() and seen_tuple
    assert sched.num_preemptions > 0 and kv.prefix_cache_stats.hit_tokens > 0
    assert kv.num_free_blocks == 23 and not kv.req_to_blocks


def test_hybrid_memory_benchmark_counts_the_window():
    """bench/hybrid_memory.py: Gemma-2-like, 8k context: the sliding half holds
    one window (256 blocks) instead of 512, so uniform / hybrid = 4/3."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "hybrid_memory.py"
    spec = importlib.util.spec_from_file_location("servelab_bench_hybrid_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.measure(bench.gemma2_9b_like_specs(torch.bfloat16), 8192, 512, 4 * 2**30)
    assert res["hybrid"]["blocks"] == 512 + 256
    assert res["uniform"]["bytes_per_request"] * 3 == res["hybrid"]["bytes_per_request"] * 4
    assert res["hybrid"]["max_batch"] >= res["uniform"]["max_batch"]
    # Gemma 3 270M's shape (5 local layers of window 512 per global one): the global group holds 8k
    # tokens, each local group one window (32 blocks), so a request holds 18 / (3 + 15 * 32 / 512) of it.
    common = dict(block_size=16, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    gemma3 = [FullAttentionSpec(**common) if i % 6 == 5 else SlidingWindowSpec(sliding_window=512, **common)
              for i in range(18)]
    res = bench.measure(gemma3, 8192, 512, 1 * 2**30)
    assert res["hybrid"]["blocks"] == 512 + 5 * 32
    assert res["uniform"]["bytes_per_request"] == 18 * 8192 * 2 * 256 * 2


# ---- admission: what chunked prefill can serve (vLLM's sliding-window cap) -------------------

def test_request_blocks_cap_is_vllms_rule():
    window = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8)
    assert request_blocks_cap(window, 40, 16) == -(-(8 - 1 + 16) // 4) + 1 == 7
    assert request_blocks_cap(window, 40, 512) == 10  # never more than the blocks of the tokens
    assert request_blocks_cap(full(4), 40, 1) == 10 and request_blocks_cap(mamba(4), 40, 1) == 1


def test_max_chunk_alone_admits_the_issue_case():
    """Gemma 2 shape: window 8, 4-token blocks, 19 usable blocks, a 40-token prompt."""
    window = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8)
    manager = HybridKVCacheManager([window, full(4)], 20, enable_caching=False)
    r = req("a", list(range(40)), 4)
    assert manager.allocate_slots(r, 40) is None  # one 40-token step needs 20 blocks
    chunk = manager.max_chunk_alone(r, 40)
    assert chunk == 25  # cdiv(7 + 25, 4) + 1 + 10 = 19 usable blocks; 26 would need 20
    assert manager.allocate_slots(r, chunk) is not None
    assert manager.max_chunk_alone(req("b", list(range(77)), 4), 77) == 0  # 20 full-attention blocks alone


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 20), bs=st.sampled_from([1, 2, 4, 8]), prompt=st.integers(1, 90),
       usable=st.integers(2, 40), in_flight=st.integers(1, 64))
def test_chunked_prefill_never_holds_more_than_the_cap(window, bs, prompt, usable, in_flight):
    """Alone in the pool, a prompt prefilled in chunks of ``max_chunk_alone``
    tokens (at most ``in_flight``) always finds room, and never holds more
    blocks than ``blocks_needed_alone`` says."""
    spec = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=window)
    manager = HybridKVCacheManager([spec, full(bs)], usable + 1, enable_caching=False)
    r = req("a", list(range(prompt)), bs)
    chunk = manager.max_chunk_alone(r, min(in_flight, prompt))
    if chunk == 0:
        assert blocks_needed_alone([spec, full(bs)], prompt, 1) > usable
        return
    cap = blocks_needed_alone([spec, full(bs)], prompt, chunk)
    assert cap <= usable
    while r.num_computed_tokens < prompt:
        n = min(chunk, prompt - r.num_computed_tokens)
        assert manager.allocate_slots(r, n) is not None, (r.num_computed_tokens, n)
        held = usable - manager.num_free_blocks
        assert held <= cap
        r.num_computed_tokens += n
    manager.free(r)
    assert manager.num_free_blocks == usable
