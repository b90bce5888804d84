"""The block layer's shapes and its pool seam.

- Block ids are one list per KV-cache group everywhere (vLLM's shape): a
  single-group manager, fast or reference, answers 1-tuples from
  ``get_block_ids`` and ``allocate_slots``; the hybrid one a list per group.
- ``KVCacheManager(block_pool=...)`` takes any object conforming to
  ``BlockPoolProtocol`` (here a user class wrapping a ``BlockPool``, not a
  subclass) and behaves exactly as with the plain pool; a non-conforming
  object is refused with every missing member named, nothing changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from servelab import reference
from servelab.blocks import BlockPool, FullAttentionSpec, HybridKVCacheManager, KVCacheManager, TokenSequence
from servelab.blocks.hashing import BlockHash
from servelab.blocks.interfaces import BlockPoolProtocol
from servelab.blocks.specs import SlidingWindowSpec

BS = 4
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16")
SLIDING = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8)


class CountingPool:
    """A user's pool: delegates to a ``BlockPool`` and counts the blocks handed out
    (not a ``BlockPool`` subclass; it only conforms to ``BlockPoolProtocol``)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.inner = BlockPool(num_blocks, enable_caching)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block = self.inner.null_block
        self.handed_out = 0

    @property
    def num_evictions(self) -> int:
        return self.inner.num_evictions

    @property
    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks

    @property
    def usage(self) -> float:
        return self.inner.usage

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        blocks = self.inner.get_new_blocks(num_blocks)
        self.handed_out += len(blocks)
        return blocks

    def free_blocks(self, blocks: Sequence[Any]) -> None:
        self.inner.free_blocks(blocks)

    def touch(self, blocks: Sequence[Any]) -> None:
        self.inner.touch(blocks)

    def get_cached_block(self, block_hash: BlockHash) -> Any | None:
        return self.inner.get_cached_block(block_hash)

    def cache_full_blocks(self, blocks: Sequence[Any], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        self.inner.cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks)

    def reset_prefix_cache(self) -> bool:
        return self.inner.reset_prefix_cache()

    def ref_counts(self) -> list[int]:
        return self.inner.ref_counts()

    def free_block_ids(self) -> list[int]:
        return self.inner.free_block_ids()


def _serve(mgr: Any) -> list[Any]:
    """Admit three requests sharing a prefix, decode, free one; every answer, in order."""
    seen = []
    reqs = [TokenSequence(f"r{i}", list(range(10)) + [100 + i] * (3 + i), BS) for i in range(3)]
    for req in reqs:
        blocks, hit = mgr.get_computed_blocks(req)
        new = mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        req.num_computed_tokens = req.num_tokens
        mgr.cache_blocks(req, req.num_computed_tokens)
        seen.append((hit, None if new is None else tuple([b.block_id for b in g] for g in new)))
    for req in reqs:
        req.append_token_ids([7])
        seen.append(tuple([b.block_id for b in g] for g in mgr.allocate_slots(req, 1)))
        seen.append(mgr.get_block_ids(req))
    mgr.free(reqs[0])
    seen += [mgr.num_free_blocks, mgr.usage, mgr.block_pool.free_block_ids(), mgr.prefix_cache_stats]
    return seen


def test_a_single_group_manager_answers_one_list_per_group():
    for mgr in (KVCacheManager(FULL, 16), reference.KVCacheManager(FULL, 16)):
        req = TokenSequence("a", list(range(9)), BS)
        assert mgr.get_block_ids(req) == ([],)
        new = mgr.allocate_slots(req, 9)
        assert type(new) is tuple and len(new) == 1 and type(new[0]) is list and len(new[0]) == 3
        ids = mgr.get_block_ids(req)
        assert type(ids) is tuple and len(ids) == 1 and ids == ([getattr(b, "block_id", b) for b in new[0]],)
        ids[0].append(99)  # fresh lists: the caller's to keep
        assert len(mgr.get_block_ids("a")[0]) == 3
        req.num_computed_tokens = 9
        assert mgr.allocate_slots(req, 1) == ([],)  # nothing new, still one list per group
    hybrid = HybridKVCacheManager([FULL, SLIDING], 16)
    req = TokenSequence("a", list(range(9)), BS)
    assert len(hybrid.allocate_slots(req, 9)) == 2 and len(hybrid.get_block_ids(req)) == 2


def test_a_user_pool_that_conforms_is_taken_and_behaves_as_the_plain_pool():
    assert not issubclass(CountingPool, BlockPool)
    pool = CountingPool(12)
    mgr = KVCacheManager(FULL, 12, block_pool=pool)
    assert mgr.block_pool is pool
    assert _serve(mgr) == _serve(KVCacheManager(FULL, 12, block_pool=BlockPool(12)))
    assert pool.handed_out > 0 and mgr.get_computed_blocks(TokenSequence("x", list(range(10)), BS))[1] == 8
    with pytest.raises(ValueError, match="another KVCacheManager"):
        KVCacheManager(FULL, 12, block_pool=pool)

    other = KVCacheManager(FULL, 12)  # the setter takes one too, and the old checks still apply
    with pytest.raises(ValueError, match="num_blocks=8, the manager needs 12"):
        other.block_pool = CountingPool(8)
    with pytest.raises(ValueError, match="enable_caching"):
        other.block_pool = CountingPool(12, enable_caching=False)
    fresh = CountingPool(12)
    other.block_pool = fresh
    (new,) = other.allocate_slots(TokenSequence("a", [1, 2, 3], BS), 3)
    assert other.block_pool is fresh and fresh.handed_out == 1 and fresh.ref_counts()[new[0].block_id] == 1


def test_kv_events_need_a_pool_that_can_publish_them():
    with pytest.raises(ValueError, match="CountingPool.*no kv_event_publisher"):
        KVCacheManager(FULL, 12, block_pool=CountingPool(12), kv_events=True)
    mgr = KVCacheManager(FULL, 12, block_pool=CountingPool(12))
    assert mgr.kv_event_publisher is None and mgr.take_events() == [] and mgr.publish_kv_events(0.0) is None
    with pytest.raises(ValueError, match="no kv_event_publisher"):
        mgr.subscribe_kv_events(lambda batch: None)
    with_events = KVCacheManager(FULL, 12, kv_events=True)
    with pytest.raises(ValueError, match="cannot publish this manager's KV events"):
        with_events.block_pool = CountingPool(12)
    assert isinstance(with_events.block_pool, BlockPool) and with_events.kv_event_publisher is not None


class HalfAPool:
    """Sizes and a hand-out method, nothing else."""

    num_blocks = 12
    enable_caching = True

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        return []


def test_a_pool_that_does_not_conform_is_refused_naming_every_missing_member():
    missing = ("cache_full_blocks()", "free_block_ids()", "free_blocks()", "get_cached_block()", "null_block",
               "num_evictions", "num_free_blocks", "ref_counts()", "reset_prefix_cache()", "touch()", "usage")
    with pytest.raises(TypeError) as err:
        KVCacheManager(FULL, 12, block_pool=HalfAPool())
    message = str(err.value)
    assert message.startswith("block_pool (HalfAPool) does not implement servelab.blocks.interfaces.BlockPoolProtocol")
    assert message.endswith("it lacks " + ", ".join(missing))
    mgr = KVCacheManager(FULL, 12)
    pool = mgr.block_pool
    with pytest.raises(TypeError, match=r"block_pool \(HalfAPool\) .* it lacks cache_full_blocks\(\), "):
        mgr.block_pool = HalfAPool()
    assert mgr.block_pool is pool and mgr.allocate_slots(TokenSequence("a", [1], BS), 1) is not None
    with pytest.raises(TypeError, match="reference pool pairs with"):  # conforms, but its blocks are ints
        KVCacheManager(FULL, 12, block_pool=reference.BlockPool(12))
    assert isinstance(CountingPool(12), BlockPoolProtocol)


def test_the_hybrid_manager_takes_the_same_pool_seam():
    pool = CountingPool(24)
    hybrid = HybridKVCacheManager([FULL, SLIDING], 24, block_pool=pool)
    req = TokenSequence("a", list(range(9)), BS)
    new = hybrid.allocate_slots(req, 9)
    assert len(new) == 2 and pool.handed_out == sum(len(g) for g in new) > 0
    with pytest.raises(TypeError, match=r"block_pool \(HalfAPool\) does not implement .*BlockPoolProtocol"):
        HybridKVCacheManager([FULL, SLIDING], 12, block_pool=HalfAPool())
    with pytest.raises(TypeError, match="needs KVCacheBlock objects"):
        HybridKVCacheManager([FULL, SLIDING], 12, block_pool=reference.BlockPool(12))
