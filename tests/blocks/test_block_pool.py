import pytest

from servelab.blocks import BlockPool, FreeBlockQueue, KVCacheBlock
from servelab.blocks.hashing import hash_block_tokens, none_hash


def h(i: int) -> bytes:
    return hash_block_tokens(none_hash(), [i])


def test_null_block_is_never_handed_out_or_freed():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 3
    ids = [b.block_id for b in pool.get_new_blocks(3)]
    assert ids == [1, 2, 3]
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="num_blocks=1 exceeds the 0 free blocks"):
        pool.get_new_blocks(1)


def test_unhashed_blocks_return_to_the_head_hashed_to_the_tail():
    pool = BlockPool(6)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_full_blocks([a, b], [h(0), h(1)], 0, 2)
    pool.free_blocks([b, a, c])  # tail-first, as the manager frees
    # c (no content) is reused first; hashed blocks wait in LRU order behind block 5.
    assert pool.free_block_ids() == [c.block_id, 5, b.block_id, a.block_id]
    assert pool.usage == pytest.approx(1 / 5)


def test_eviction_drops_the_hash_and_a_prefix_hit_revives_from_the_middle():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a, b, c], [h(0), h(1), h(2)], 0, 3)
    pool.free_blocks([a, b, c])
    assert pool.free_block_ids() == [1, 2, 3]
    hit = pool.get_cached_block(h(1))
    pool.touch([hit])  # O(1) removal from the middle of the queue
    assert hit.ref_cnt == 1 and pool.free_block_ids() == [1, 3]
    (new,) = pool.get_new_blocks(1)  # evicts the LRU cached block
    assert new.block_id == 1 and new.block_hash is None
    assert pool.get_cached_block(h(0)) is None and pool.num_evictions == 1
    assert pool.get_cached_block(h(2)).block_id == 3


def test_duplicate_content_is_indexed_once():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h(7)], 0, 1)
    pool.cache_full_blocks([b], [h(7)], 0, 1)
    assert pool.get_cached_block(h(7)) is a and b.block_hash is None
    pool.free_blocks([b, a])
    assert pool.free_block_ids() == [b.block_id, 3, a.block_id]  # the duplicate is reused first


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [h(0)], 0, 1)
    assert pool.reset_prefix_cache() is False and pool.get_cached_block(h(0)) is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(0)) is None and a.block_hash is None


def test_caching_disabled_never_hashes():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [h(0)], 0, 1)
    assert pool.get_cached_block(h(0)) is None


def test_bad_input():
    with pytest.raises(ValueError, match="num_blocks=1 must be >= 2"):
        BlockPool(1)
    with pytest.raises(TypeError, match="num_blocks"):
        BlockPool(3.0)
    with pytest.raises(TypeError, match="enable_caching"):
        BlockPool(3, enable_caching="yes")
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="num_blocks=-1"):
        pool.get_new_blocks(-1)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="already free"):
        pool.free_blocks([a])
    (b,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="num_cached_blocks=1 must be <= num_full_blocks=0"):
        pool.cache_full_blocks([b], [h(0)], 1, 0)
    with pytest.raises(ValueError, match="num_full_blocks=2 exceeds"):
        pool.cache_full_blocks([b], [h(0)], 0, 2)


def test_free_queue_links_and_errors():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 0, 1, 3, 4]
    assert [b.block_id for b in q.popleft_n(2)] == [2, 0]
    assert q.popleft().block_id == 1 and len(q) == 2
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[3])
    with pytest.raises(ValueError, match="n=3 exceeds"):
        q.popleft_n(3)
    q.popleft_n(2)
    with pytest.raises(ValueError, match="empty"):
        q.popleft()


def test_foreign_or_wrong_blocks_are_rejected_before_any_change():
    pool, other = BlockPool(4), BlockPool(8)
    (a,) = pool.get_new_blocks(1)
    (stranger,) = other.get_new_blocks(1)
    before = (pool.free_block_ids(), pool.ref_counts())
    with pytest.raises(ValueError, match="another pool"):
        pool.free_blocks([a, stranger])
    with pytest.raises(TypeError, match="KVCacheBlock"):
        pool.touch([a, 3])
    with pytest.raises(TypeError, match="KVCacheBlock"):
        pool.free_blocks([KVCacheBlock(99)])
    with pytest.raises(TypeError, match="block_hash must be bytes"):
        pool.get_cached_block([1, 2, 3])
    assert (pool.free_block_ids(), pool.ref_counts()) == before
