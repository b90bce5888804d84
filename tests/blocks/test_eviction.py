"""Eviction policies, the block layer's protocols, pool injection and atomicity."""

from __future__ import annotations

import random

import pytest

from servelab import reference
from servelab.blocks import (
    BlockPool,
    BlockPoolProtocol,
    EvictionPolicy,
    FullAttentionSpec,
    KVCacheManager,
    KVCacheManagerProtocol,
    LRUEvictionPolicy,
    TokenSequence,
    available_eviction_policies,
    get_eviction_policy,
    register_eviction_policy,
)
from servelab.blocks.hashing import hash_block_tokens, none_hash

BS = 4
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")


def h(i: int) -> bytes:
    return hash_block_tokens(none_hash(), [i])


def cached_free_pool(policy, n=3, num_blocks=8):
    """A pool whose blocks 1..n are free, indexed under h(1)..h(n), freed in id order."""
    pool = BlockPool(num_blocks, eviction_policy=policy)
    blocks = pool.get_new_blocks(n)
    for b in blocks:
        pool.cache_full_blocks([b], [h(b.block_id)], 0, 1)
    pool.free_blocks(blocks)
    return pool, blocks


# ---- a user-written policy through the public API (<= 30 lines) -----------------------------

class MostRecentlyFreedFirst:
    """Evict the most recently freed cached block first (MRU)."""

    name = "mru"

    def __init__(self):
        self.stack = {}  # insertion-ordered: block id -> block

    def __len__(self):
        return len(self.stack)

    def __iter__(self):
        return iter(list(self.stack.values())[::-1])

    def push(self, block):
        self.stack[block.block_id] = block

    def remove(self, block):
        del self.stack[block.block_id]

    def evict(self, n):
        return [self.stack.pop(next(reversed(self.stack))) for _ in range(n)]

    def clear(self):
        self.stack.clear()


def test_a_user_policy_plugs_in_by_object_and_by_name():
    assert isinstance(MostRecentlyFreedFirst(), EvictionPolicy)
    pool, (a, b, c) = cached_free_pool(MostRecentlyFreedFirst())
    assert pool.free_block_ids() == [4, 5, 6, 7, c.block_id, b.block_id, a.block_id]
    assert [x.block_id for x in pool.get_new_blocks(5)] == [4, 5, 6, 7, c.block_id]
    assert pool.get_cached_block(h(3)) is None and pool.get_cached_block(h(1)) is a

    register_eviction_policy("test-mru", MostRecentlyFreedFirst)
    try:
        assert "test-mru" in available_eviction_policies()
        mgr = KVCacheManager(FULL, 8, eviction_policy="test-mru")
        assert mgr.block_pool.eviction_policy.name == "mru"
        with pytest.raises(ValueError, match="already registered"):
            register_eviction_policy("test-mru", MostRecentlyFreedFirst)
    finally:
        register_eviction_policy("test-mru", LRUEvictionPolicy, override=True)


def test_registry_errors_name_the_choices():
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'.*'lfu'.*'lru'"):
        BlockPool(4, eviction_policy="nope")
    with pytest.raises(TypeError, match="pass LRUEvictionPolicy"):
        BlockPool(4, eviction_policy=LRUEvictionPolicy)
    with pytest.raises(TypeError, match="missing"):
        BlockPool(4, eviction_policy=object())
    used, _ = cached_free_pool("lru")
    with pytest.raises(ValueError, match="one policy object serves one pool"):
        BlockPool(4, eviction_policy=used.eviction_policy)
    assert get_eviction_policy("lfu") is not get_eviction_policy("lfu")  # a new instance per pool


# ---- the built-in policies -------------------------------------------------------------------

def test_lru_evicts_least_recently_freed_and_empty_blocks_go_first():
    pool, (a, b, c) = cached_free_pool("lru")
    assert pool.free_block_ids() == [4, 5, 6, 7, 1, 2, 3]
    pool.touch([a])
    pool.free_blocks([a])  # a is now the most recently freed
    assert pool.free_block_ids() == [4, 5, 6, 7, 2, 3, 1]


def test_lfu_keeps_frequently_hit_blocks_and_ages():
    pool, (a, b, c) = cached_free_pool("lfu")
    for _ in range(2):  # two prefix hits on a
        pool.touch([a])
        pool.free_blocks([a])
    assert pool.free_block_ids()[4:] == [2, 3, 1]  # a: frequency 3
    (x, y, z, w, v) = pool.get_new_blocks(5)  # evicts b (priority 1): age becomes 1
    assert v is b and pool.eviction_policy.age == 1
    pool.touch([c])  # c: frequency 2
    pool.free_blocks([c])  # priority 2 + age 1 = 3, same as a (3 + 0): a was freed earlier
    assert pool.free_block_ids() == [1, 3]


def test_fewest_descendants_evicts_leaves_first():
    pool = BlockPool(8, eviction_policy="fewest_descendants")
    seq = TokenSequence("r", list(range(12)), BS)
    chain = pool.get_new_blocks(3)
    pool.cache_full_blocks(chain, seq.block_hashes, 0, 3)
    pool.free_blocks(chain)  # head first: LRU would evict the shared start first
    assert pool.free_block_ids()[4:] == [3, 2, 1]
    lru, lru_chain = BlockPool(8), None
    lru_chain = lru.get_new_blocks(3)
    lru.cache_full_blocks(lru_chain, seq.block_hashes, 0, 3)
    lru.free_blocks(lru_chain)
    assert lru.free_block_ids()[4:] == [1, 2, 3]


# ---- protocols and drop-in references ----------------------------------------------------------

@pytest.mark.parametrize("policy", ["lru", "lfu", "fewest_descendants"])
def test_protocol_conformance(policy):
    assert isinstance(get_eviction_policy(policy), EvictionPolicy)
    assert isinstance(BlockPool(4, eviction_policy=policy), BlockPoolProtocol)
    assert isinstance(reference.BlockPool(4, eviction_policy=policy), BlockPoolProtocol)
    for cls in (KVCacheManager, reference.KVCacheManager):
        mgr = cls(FULL, 8, True, max_model_len=64, watermark=0.1, eviction_policy=policy)
        assert isinstance(mgr, KVCacheManagerProtocol)
        assert mgr.num_blocks == 8 and mgr.usage == 0.0 and mgr.num_free_blocks == 7


def test_reference_pool_models_registered_names_only():
    with pytest.raises(ValueError, match="reference pool models"):
        reference.BlockPool(4, eviction_policy=MostRecentlyFreedFirst())


# ---- one owner for the pool ------------------------------------------------------------------------

def test_injected_pool_is_used_and_owned_once():
    pool = BlockPool(8, eviction_policy="lfu")
    mgr = KVCacheManager(FULL, 8, block_pool=pool)
    assert mgr.block_pool is pool
    with pytest.raises(ValueError, match="another KVCacheManager"):
        KVCacheManager(FULL, 8, block_pool=pool)
    with pytest.raises(ValueError, match="num_blocks=8, the manager needs 9"):
        KVCacheManager(FULL, 9, block_pool=BlockPool(8))
    with pytest.raises(ValueError, match="enable_caching"):
        KVCacheManager(FULL, 8, block_pool=BlockPool(8, enable_caching=False))
    with pytest.raises(ValueError, match="give the policy to that BlockPool"):
        KVCacheManager(FULL, 8, block_pool=BlockPool(8), eviction_policy="lfu")
    with pytest.raises(TypeError, match="reference pool pairs with"):
        KVCacheManager(FULL, 8, block_pool=reference.BlockPool(8))


def test_assigning_a_pool_works_fully_or_raises():
    mgr = KVCacheManager(FULL, 8)
    a = TokenSequence("a", list(range(9)), BS)
    mgr.allocate_slots(a, 9)
    new_pool = BlockPool(8, eviction_policy="lfu")
    with pytest.raises(ValueError, match="requests hold blocks"):
        mgr.block_pool = new_pool
    mgr.free(a)
    mgr.block_pool = new_pool  # works: lookups and allocations use the new pool
    a2 = TokenSequence("a2", list(range(9)), BS)
    mgr.allocate_slots(a2, 9)
    a2.num_computed_tokens = 9
    mgr.cache_blocks(a2, 9)
    assert new_pool.num_free_blocks == 4 and len(new_pool.cached_block_hash_to_block) == 2
    b = TokenSequence("b", list(range(9)), BS)
    assert mgr.get_computed_blocks(b)[1] == 8  # the hit comes from the new pool
    with pytest.raises(ValueError, match="another KVCacheManager"):
        KVCacheManager(FULL, 8, block_pool=new_pool)


# ---- atomic operations -------------------------------------------------------------------------------

def state(pool):
    return pool.free_block_ids(), pool.ref_counts(), dict(pool.cached_block_hash_to_block), pool.num_evictions


@pytest.mark.parametrize("policy", ["lru", "lfu", "fewest_descendants"])
def test_free_blocks_is_all_or_nothing(policy):
    pool = BlockPool(6, eviction_policy=policy)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(0)], 0, 1)
    pool.free_blocks([b])
    before = state(pool)
    with pytest.raises(ValueError, match=f"block {b.block_id} is already free"):
        pool.free_blocks([a, b])
    with pytest.raises(ValueError, match="listed more times"):
        pool.free_blocks([a, a])
    assert state(pool) == before and a.ref_cnt == 1
    ref = reference.BlockPool(6, eviction_policy=policy)
    ra, rb = ref.get_new_blocks(2)
    ref.free_blocks([rb])
    with pytest.raises(ValueError):
        ref.free_blocks([ra, rb])
    assert ref.ref_counts() == pool.ref_counts()


def test_cache_full_blocks_refuses_free_blocks_and_bad_hashes_without_change():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    before = state(pool)
    with pytest.raises(ValueError, match=r"blocks\[1\].*is free"):
        pool.cache_full_blocks([a, b], [h(0), h(1)], 0, 2)
    with pytest.raises(TypeError, match="block_hashes must hold bytes"):
        pool.cache_full_blocks([a], [[1, 2]], 0, 1)
    assert state(pool) == before and a.block_hash is None


def test_allocate_slots_validates_everything_first():
    mgr = KVCacheManager(FULL, 8, max_model_len=16)
    a = TokenSequence("a", list(range(8)), BS)
    mgr.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    mgr.cache_blocks(a, 8)
    b = TokenSequence("b", list(range(9)), BS)
    hit, n = mgr.get_computed_blocks(b)
    before = state(mgr.block_pool), dict(mgr.req_to_blocks), mgr.prefix_cache_stats.requests
    other = BlockPool(8)
    with pytest.raises(ValueError, match="another pool"):
        mgr.allocate_slots(b, 1, n, (other.get_new_blocks(2),))
    with pytest.raises(ValueError, match="over max_model_len=16"):
        mgr.allocate_slots(b, 17 - n, n, hit)
    with pytest.raises(TypeError, match="num_lookahead_tokens"):
        mgr.allocate_slots(b, 1, n, hit, 0.5)
    assert (state(mgr.block_pool), dict(mgr.req_to_blocks), mgr.prefix_cache_stats.requests) == before
    assert mgr.allocate_slots(b, 1, n, hit) is not None


def test_a_raising_policy_leaves_the_pool_and_manager_unchanged():
    class Broken(LRUEvictionPolicy):
        def evict(self, n):
            raise RuntimeError("policy bug")

    mgr = KVCacheManager(FULL, 6, block_pool=BlockPool(6, eviction_policy=Broken()))
    a = TokenSequence("a", list(range(12)), BS)
    mgr.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    mgr.cache_blocks(a, 12)
    mgr.free(a)  # 3 cached free blocks, 2 empty ones
    b = TokenSequence("b", list(range(13)), BS)
    hit, n = mgr.get_computed_blocks(b)
    assert n == 12
    c = TokenSequence("c", list(range(100, 120)), BS)
    before = state(mgr.block_pool)
    with pytest.raises(RuntimeError, match="policy bug"):
        mgr.allocate_slots(c, 20)  # needs evictions
    assert state(mgr.block_pool) == before and mgr.get_block_ids(c) == ([],)
    assert mgr.allocate_slots(b, 1, n, hit) is not None  # the cache still works


# ---- commit after compute and stats ----------------------------------------------------------------

def test_nothing_is_findable_until_cache_blocks():
    for cls in (KVCacheManager, reference.KVCacheManager):
        mgr = cls(FULL, 16)
        a = TokenSequence("a", list(range(12)), BS)
        mgr.allocate_slots(a, 12)
        b = TokenSequence("b", list(range(13)), BS)
        assert mgr.get_computed_blocks(b)[1] == 0  # allocated, not computed: not findable
        mgr.free(a)  # e.g. the step failed and the request was rolled back
        assert mgr.get_computed_blocks(b)[1] == 0
        a = TokenSequence("a", list(range(12)), BS)
        mgr.allocate_slots(a, 12)
        a.num_computed_tokens = 6
        mgr.cache_blocks(a, 6)
        assert mgr.get_computed_blocks(b)[1] == 4
        mgr.cache_blocks(a, 6)  # idempotent
        a.num_computed_tokens = 12
        mgr.cache_blocks(a, 12)
        assert mgr.get_computed_blocks(b)[1] == 12
        with pytest.raises(ValueError, match="exceeds"):
            mgr.cache_blocks(a, 13)
        mgr.cache_blocks(TokenSequence("z", [1], BS), 1)  # holds nothing: no-op


def test_stats_count_once_per_admission():
    mgr = KVCacheManager(FULL, 4)  # 3 usable blocks
    a = TokenSequence("a", list(range(12)), BS)
    mgr.allocate_slots(a, 12)
    b = TokenSequence("b", list(range(100, 108)), BS)
    for _ in range(3):  # waits for memory: looked up every step, admitted never
        blocks, n = mgr.get_computed_blocks(b)
        assert mgr.allocate_slots(b, 8 - n, n, blocks) is None
    assert mgr.prefix_cache_stats.requests == 1  # a only
    mgr.free(a)
    blocks, n = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 8 - n, n, blocks) is not None
    assert mgr.prefix_cache_stats.requests == 2 and mgr.prefix_cache_stats.queried_tokens == 20


# ---- the simulator with each policy -------------------------------------------------------------------

def hot_prefix_trace(n=120, seed=0):
    """Every other request starts with one of two hot 256-token system prompts;
    the others are one-off 400-800-token documents that flood an LRU cache."""
    from servelab.scheduling.simulator import TraceRequest

    rng = random.Random(seed)
    hot = [[rng.randrange(32000) for _ in range(256)] for _ in range(2)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(4.0)
        if i % 2 == 0:
            prompt = hot[rng.randrange(2)] + [rng.randrange(32000) for _ in range(48)]
        else:
            prompt = [rng.randrange(32000) for _ in range(rng.randrange(400, 800))]
        out.append(TraceRequest(f"r{i}", t, prompt, 16))
    return out


def test_simulator_hit_rates_per_policy():
    from servelab.scheduling import SchedulerConfig
    from servelab.scheduling.simulator import simulate

    trace = hot_prefix_trace()
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32, max_model_len=4096)
    hit = {p: simulate(trace, "fcfs", scheduler_config=cfg, num_blocks=100, block_size=16,
                       eviction_policy=p).prefix_hit_rate for p in ("lru", "lfu", "fewest_descendants")}
    # LFU keeps the hot prompts through the scans; LRU loses them.
    assert hit["lfu"] > hit["lru"] + 0.03, hit
    # Tail-first frees make LRU leaf-first already: with full attention a parent
    # is always freed after its children, so the two policies coincide exactly.
    assert hit["fewest_descendants"] == hit["lru"], hit
