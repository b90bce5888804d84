"""Stateful tests: the fast block pool and manager against their references.

Hypothesis drives random sequences of operations on both implementations at
once, under every eviction policy, and compares every observable after every
step: return values, free counts, reference counts, the free blocks in
hand-out (eviction) order, the prefix-cache index, each request's block table
and the prefix-cache stats. Invariants are checked on the fast implementation
directly, so a bug shared by both still fails: among them *commit after
compute* (no block is findable before the step that computes it succeeded)
and atomicity (a call that raises changes nothing).
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

import pytest

from servelab.blocks import (
    BlockPool,
    FullAttentionSpec,
    KVCacheManager,
    SlidingWindowSpec,
    TokenSequence,
    available_eviction_policies,
)
from servelab.blocks.hashing import hash_block_tokens, none_hash
from servelab.reference import BlockPool as RefBlockPool
from servelab.reference import KVCacheManager as RefKVCacheManager

POLICIES = st.sampled_from(["lru", "lfu", "fewest_descendants"])
STATEFUL = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def check_pool_invariants(pool: BlockPool) -> None:
    free_ids = pool.free_block_ids()
    assert len(free_ids) == pool.num_free_blocks == len(set(free_ids))
    assert 0 not in free_ids, "the null block is never free"
    refs = pool.ref_counts()
    for block_id in free_ids:
        assert refs[block_id] == 0, f"block {block_id} is both free and referenced"
    held = [b for b in range(1, pool.num_blocks) if refs[b] > 0]
    assert len(held) + len(free_ids) == pool.num_blocks - 1, "a block is neither free nor held"
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    # Empty free blocks are handed out before any cached one.
    empty = [b.block_id for b in pool.free_queue]
    assert free_ids[: len(empty)] == empty
    assert all(pool.blocks[i].block_hash is None for i in empty)
    assert all(pool.blocks[i].block_hash is not None for i in free_ids[len(empty):])


def pool_state(pool: BlockPool) -> tuple:
    return (pool.free_block_ids(), pool.ref_counts(), dict(pool.cached_block_hash_to_block), pool.num_evictions)


def assert_pools_equal(fast: BlockPool, ref: RefBlockPool) -> None:
    assert fast.free_block_ids() == ref.free_block_ids(), "free queue / eviction order differs"
    assert fast.ref_counts() == ref.ref_counts()
    assert {h: b.block_id for h, b in fast.cached_block_hash_to_block.items()} == ref.block_of_hash
    assert fast.num_evictions == ref.num_evictions


class BlockPoolMachine(RuleBasedStateMachine):
    """Pool-level operations: allocate, cache, prefix-hit (touch), free, reset."""

    owned = Bundle("owned")  # lists of block ids held by one "request"

    @initialize(num_blocks=st.integers(2, 12), enable_caching=st.booleans(), policy=POLICIES)
    def setup(self, num_blocks: int, enable_caching: bool, policy: str) -> None:
        self.fast = BlockPool(num_blocks, enable_caching, eviction_policy=policy)
        self.ref = RefBlockPool(num_blocks, enable_caching, eviction_policy=policy)
        self.hash_counter = 0

    def _fast_blocks(self, ids):
        return [self.fast.blocks[i] for i in ids]

    @rule(target=owned, n=st.integers(0, 5))
    def allocate(self, n):
        if n > self.ref.num_free_blocks:
            return []
        fast_ids = [b.block_id for b in self.fast.get_new_blocks(n)]
        assert fast_ids == self.ref.get_new_blocks(n)
        return fast_ids

    @rule(ids=owned, data=st.data())
    def cache(self, ids, data):
        """Index a random range of a held block list under fresh or reused hashes."""
        if not ids or any(self.ref.ref_cnt[b] == 0 for b in ids):
            return
        hashes = []
        for _ in ids:
            # Reuse a small hash space so duplicate content happens.
            self.hash_counter = data.draw(st.integers(0, 8))
            hashes.append(hash_block_tokens(none_hash(), [self.hash_counter]))
        lo = data.draw(st.integers(0, len(ids)))
        hi = data.draw(st.integers(lo, len(ids)))
        self.fast.cache_full_blocks(self._fast_blocks(ids), hashes, lo, hi)
        self.ref.cache_full_blocks(ids, hashes, lo, hi)

    @rule(target=owned, key=st.integers(0, 8))
    def prefix_hit(self, key):
        block_hash = hash_block_tokens(none_hash(), [key])
        fast_block = self.fast.get_cached_block(block_hash)
        ref_block = self.ref.get_cached_block(block_hash)
        assert (fast_block.block_id if fast_block else None) == ref_block
        if ref_block is None:
            return []
        self.fast.touch([fast_block])
        self.ref.touch([ref_block])
        return [ref_block]

    @rule(ids=consumes(owned), reverse=st.booleans())
    def free(self, ids, reverse):
        if any(self.ref.ref_cnt[b] == 0 for b in ids):
            return  # already released through a reset path; nothing to free
        order = list(reversed(ids)) if reverse else list(ids)
        self.fast.free_blocks(self._fast_blocks(order))
        self.ref.free_blocks(order)

    @rule(ids=owned, data=st.data())
    def free_too_much(self, ids, data):
        """Free a list that holds one reference too many: both pools refuse and
        nothing changes (atomic), whatever came before the bad entry."""
        if not ids:
            return
        extra = data.draw(st.sampled_from(ids))
        times = self.ref.ref_cnt[extra] + 1  # one more than it is referenced
        order = data.draw(st.permutations(list(ids) + [extra] * (times - ids.count(extra))))
        before = pool_state(self.fast)
        with pytest.raises(ValueError):
            self.fast.free_blocks(self._fast_blocks(order))
        with pytest.raises(ValueError):
            self.ref.free_blocks(order)
        assert pool_state(self.fast) == before

    @rule()
    def reset(self):
        assert self.fast.reset_prefix_cache() == self.ref.reset_prefix_cache()

    @invariant()
    def same_state(self):
        check_pool_invariants(self.fast)
        assert_pools_equal(self.fast, self.ref)


TestBlockPoolStateful = BlockPoolMachine.TestCase
TestBlockPoolStateful.settings = STATEFUL


# Three long "system prompts"; requests start with a slice of one of them so
# prefix hits, shared blocks and evictions of shared content all happen.
_rng = random.Random(0)
SYSTEM_PROMPTS = [[_rng.randrange(50) for _ in range(40)] for _ in range(3)]
MAX_MODEL_LEN = 48


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Scheduler-like use of the manager: admit with prefix hits, compute in
    chunks, decode with lookahead, preempt on failure, finish, reset."""

    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.integers(2, 24),
        window=st.one_of(st.none(), st.integers(1, 12)),
        watermark=st.sampled_from([0.0, 0.1, 0.3]),
        policy=POLICIES,
    )
    def setup(self, block_size, num_blocks, window, watermark, policy):
        common = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")
        spec = FullAttentionSpec(**common) if window is None else SlidingWindowSpec(**common, sliding_window=window)
        kwargs = dict(max_model_len=MAX_MODEL_LEN, watermark=watermark, eviction_policy=policy)
        self.fast = KVCacheManager(spec, num_blocks, True, **kwargs)
        self.ref = RefKVCacheManager(spec, num_blocks, True, **kwargs)
        self.block_size = block_size
        self.waiting: list[TokenSequence] = []
        self.running: list[TokenSequence] = []
        self.next_id = 0

    @rule(prompt=st.integers(0, 2), prefix_len=st.integers(0, 40), suffix=st.lists(st.integers(0, 49), max_size=6))
    def add_request(self, prompt, prefix_len, suffix):
        tokens = (SYSTEM_PROMPTS[prompt][:prefix_len] + suffix)[: MAX_MODEL_LEN - 4]
        if not tokens:
            return
        self.waiting.append(TokenSequence(f"r{self.next_id}", tokens, self.block_size))
        self.next_id += 1

    def _allocate(self, req, num_new, hit_ids=(), lookahead=0):
        fast_hit = [self.fast.block_pool.blocks[i] for i in hit_ids]
        n_hit = len(hit_ids) * self.block_size
        fast = self.fast.allocate_slots(req, num_new, n_hit, (fast_hit,) if hit_ids else None, lookahead)
        ref = self.ref.allocate_slots(req, num_new, n_hit, (list(hit_ids),) if hit_ids else None, lookahead)
        assert (None if fast is None else tuple([b.block_id for b in g] for g in fast)) == ref  # one list per group
        return ref is not None

    def _commit(self, req, num_computed):
        """The step that computed ``req``'s tokens up to ``num_computed`` succeeded."""
        self.fast.cache_blocks(req, num_computed)
        self.ref.cache_blocks(req, num_computed)

    def _preempt(self, req):
        self.fast.free(req)
        self.ref.free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 16), fails=st.booleans())
    def admit(self, data, chunk, fails):
        req = data.draw(st.sampled_from(self.waiting))
        fast_blocks, fast_hit = self.fast.get_computed_blocks(req)
        ref_blocks, ref_hit = self.ref.get_computed_blocks(req)
        assert type(fast_blocks) is tuple and len(fast_blocks) == 1 and type(ref_blocks) is tuple
        assert [b.block_id for b in fast_blocks[0]] == ref_blocks[0] and fast_hit == ref_hit
        assert fast_hit <= req.num_tokens - 1, "the last token is always recomputed"
        num_new = min(chunk, req.num_tokens - fast_hit)
        if self._allocate(req, num_new, ref_blocks[0]):
            req.num_computed_tokens = fast_hit + num_new
            self.waiting.remove(req)
            self.running.append(req)
            if fails:  # the step failed: rolled back like Scheduler.rollback_step
                self._preempt(req)
            else:
                self._commit(req, req.num_computed_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 16), lookahead=st.integers(0, 3), token=st.integers(0, 49),
          outcome=st.sampled_from(["ok", "ok", "ok", "fails", "late_commit"]))
    def step(self, data, chunk, lookahead, token, outcome):
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens >= MAX_MODEL_LEN:
                return self._finish(req)
            req.append_token_ids([token])  # the token sampled by the previous step
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if not self._allocate(req, num_new, lookahead=lookahead):
            return self._preempt(req)  # drop everything, recompute later
        if outcome == "fails":  # model execution failed: nothing computed is committed
            return self._preempt(req)
        req.num_computed_tokens += num_new
        if outcome == "ok":
            self._commit(req, req.num_computed_tokens)
        # "late_commit": the commit comes with a later step (commit_some)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def commit_some(self, data):
        """cache_blocks is incremental and idempotent: any computed length, any time."""
        req = data.draw(st.sampled_from(self.running))
        self._commit(req, data.draw(st.integers(0, req.num_computed_tokens)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), extra=st.integers(1, 8))
    def bad_calls_change_nothing(self, data, extra):
        req = data.draw(st.sampled_from(self.running))
        before = (pool_state(self.fast.block_pool), self.fast.get_block_ids(req))
        with pytest.raises(ValueError):  # more than the request has
            self.fast.cache_blocks(req, req.num_tokens + extra)
        with pytest.raises(ValueError):
            self.ref.cache_blocks(req, req.num_tokens + extra)
        with pytest.raises(ValueError):  # past max_model_len
            self.fast.allocate_slots(req, MAX_MODEL_LEN + extra)
        assert (pool_state(self.fast.block_pool), self.fast.get_block_ids(req)) == before

    def _finish(self, req):
        self.fast.free(req)
        self.ref.free(req)
        self.running.remove(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._finish(data.draw(st.sampled_from(self.running)))

    @rule()
    def reset_prefix_cache(self):
        assert self.fast.reset_prefix_cache() == self.ref.reset_prefix_cache()

    @invariant()
    def same_state(self):
        if not hasattr(self, "fast"):
            return
        check_pool_invariants(self.fast.block_pool)
        assert_pools_equal(self.fast.block_pool, self.ref.block_pool)
        for req in self.running:
            ids = self.fast.get_block_ids(req)
            assert ids == self.ref.get_block_ids(req)
            assert type(ids) is tuple and len(ids) == 1 and type(ids[0]) is list  # one KV-cache group
            (ids,) = ids
            # Every computed token has a slot (null only where out of window).
            assert len(ids) * self.block_size >= req.num_computed_tokens
        assert set(self.fast.req_to_blocks) == {r.request_id for r in self.running}
        refs = self.fast.block_pool.ref_counts()
        held = sum(1 for r in self.running for i in self.fast.get_block_ids(r)[0] if i != 0)
        assert sum(refs) == held, "reference counts must equal the blocks requests hold"
        assert self.fast.prefix_cache_stats == self.ref.prefix_cache_stats
        # Commit after compute: a request's indexed blocks hold computed tokens only.
        for req in self.running:
            for i, block in enumerate(self.fast.get_blocks(req.request_id)):
                if block.block_hash is not None:
                    assert (i + 1) * self.block_size <= req.num_computed_tokens, (
                        f"block {block.block_id} at position {i} of {req!r} is findable before it was computed")

    def teardown(self):
        if not hasattr(self, "fast"):
            return
        for req in list(self.running):
            self._finish(req)
        pool = self.fast.block_pool
        assert pool.num_free_blocks == pool.num_blocks - 1, "a block leaked"
        assert self.ref.block_pool.num_free_blocks == pool.num_blocks - 1


TestKVCacheManagerStateful = KVCacheManagerMachine.TestCase
TestKVCacheManagerStateful.settings = STATEFUL


def test_every_registered_builtin_policy_is_modelled_by_the_reference():
    assert {"lru", "lfu", "fewest_descendants"} <= set(available_eviction_policies())


def _both_pools(num_blocks: int):
    return (BlockPool(num_blocks, True, eviction_policy="fewest_descendants"),
            RefBlockPool(num_blocks, True, eviction_policy="fewest_descendants"))


@pytest.mark.parametrize("hashes, lo", [
    ([0, 1, 0, 2], 1),  # position 2 reuses position 0's hash: block 2 is indexed before block 3 holds it
    ([5, 5, 6], 1),     # a block whose previous position has its own (unindexed) hash: no self-link
])
def test_parents_are_recorded_as_each_block_is_indexed(hashes, lo):
    """Found by the stateful test (small hash space): a parent is the block the index held for
    the previous position right after this block was indexed, never a block indexed later in
    the same call, and never the block itself (the reference's descendant walk then looped)."""
    fast, ref = _both_pools(8)
    ids = [b.block_id for b in fast.get_new_blocks(len(hashes))]
    assert ref.get_new_blocks(len(hashes)) == ids
    block_hashes = [hash_block_tokens(none_hash(), [h]) for h in hashes]
    fast.cache_full_blocks([fast.blocks[i] for i in ids], block_hashes, lo, len(hashes))
    ref.cache_full_blocks(ids, block_hashes, lo, len(hashes))
    fast.free_blocks([fast.blocks[i] for i in ids])
    ref.free_blocks(ids)
    assert fast.free_block_ids() == ref.free_block_ids()
