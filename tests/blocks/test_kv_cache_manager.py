import pytest
import torch

from servelab.blocks import FullAttentionSpec, KVCacheManager, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
from servelab.blocks import TokenSequence

BS = 4
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype="float16")


def seq(rid, n, start=0):
    return TokenSequence(rid, list(range(start, start + n)), BS)


def admit(mgr, req, num_new=None):
    blocks, hit = mgr.get_computed_blocks(req)
    num_new = req.num_tokens - hit if num_new is None else num_new
    new = mgr.allocate_slots(req, num_new, hit, blocks)
    if new is not None:
        req.num_computed_tokens = hit + num_new
        mgr.cache_blocks(req, req.num_computed_tokens)  # the step wrote their KV: commit
    return hit, new


def test_prefix_hit_is_capped_at_num_tokens_minus_one():
    mgr = KVCacheManager(FULL, 16)
    a = seq("a", 8)
    admit(mgr, a)
    # Same 8 tokens: both blocks are cached, but the last token must be recomputed,
    # so only the first block (4 tokens) is a hit.
    b = seq("b", 8)
    hit, _ = admit(mgr, b)
    assert hit == 4
    c = seq("c", 9)
    hit, _ = admit(mgr, c)
    assert hit == 8
    assert mgr.get_block_ids(c)[0][:2] == mgr.get_block_ids(a)[0]
    assert mgr.prefix_cache_stats.hit_tokens == 12
    assert mgr.prefix_cache_stats.hit_rate == pytest.approx(12 / 25)


def test_allocation_is_all_or_nothing():
    mgr = KVCacheManager(FULL, 5)  # 4 usable blocks
    a = seq("a", 12)
    admit(mgr, a)
    before = (mgr.num_free_blocks, mgr.block_pool.ref_counts())
    b = seq("b", 8, start=100)
    assert mgr.allocate_slots(b, 8) is None
    assert (mgr.num_free_blocks, mgr.block_pool.ref_counts()) == before
    assert mgr.get_block_ids(b) == ([],)


def test_lookahead_slots_are_allocated_but_never_hashed():
    mgr = KVCacheManager(FULL, 8)
    a = seq("a", 4)
    (new,) = mgr.allocate_slots(a, 4, num_lookahead_tokens=5)  # one KV-cache group
    assert len(new) == 3  # 4 + 5 slots -> 3 blocks
    assert [b.block_hash is not None for b in new] == [False, False, False]  # nothing before compute
    a.num_computed_tokens = 4
    mgr.cache_blocks(a, 4)
    assert [b.block_hash is not None for b in new] == [True, False, False]


def test_watermark_holds_back_admissions_but_not_running_requests():
    mgr = KVCacheManager(FULL, 11, watermark=0.2)  # 10 usable, 2 held back
    a = seq("a", 16, start=100)
    admit(mgr, a)  # first request: no one to protect, no watermark
    b = seq("b", 20, start=200)
    assert mgr.allocate_slots(b, 20) is None  # 6 free - 2 watermark < 5 needed
    c = seq("c", 8, start=300)
    assert mgr.allocate_slots(c, 8) is not None  # 6 free - 2 watermark >= 2 needed
    # A running request may use the reserve: 16 more tokens, 4 more blocks.
    a.append_token_ids(list(range(16)))
    assert mgr.allocate_slots(a, 16) is not None and mgr.num_free_blocks == 0


def test_sliding_window_returns_out_of_window_blocks():
    spec = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=4)
    mgr = KVCacheManager(spec, 8)
    a = seq("a", 12)
    admit(mgr, a)
    assert mgr.get_block_ids(a) == ([1, 2, 3],)
    # Next token (position 12) sees 9..12: blocks 0 and 1 (tokens 0..7) are dead.
    a.append_token_ids([99])
    mgr.allocate_slots(a, 1)
    a.num_computed_tokens = 13
    mgr.cache_blocks(a, 13)
    assert mgr.get_block_ids(a) == ([0, 0, 3, 4],)
    # Their content stays cached for others: a request with the same prefix hits,
    # needing only the last window-1 tokens' blocks.
    b = seq("b", 13)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 12 and [x.block_id for x in blocks[0]] == [0, 0, 3]


def test_mla_and_mamba():
    mla = KVCacheManager(MLAAttentionSpec(block_size=BS, head_size=16, dtype=torch.bfloat16), 8)
    r = seq("r", 9)
    admit(mla, r)
    assert len(mla.get_block_ids(r)[0]) == 3
    mamba = KVCacheManager(MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,)), 3,
                           enable_caching=False)
    r = seq("r", 100)
    assert len(mamba.allocate_slots(r, 100)[0]) == 1
    r.num_computed_tokens = 100
    r.append_token_ids([1])
    assert mamba.allocate_slots(r, 1) == ([],) and mamba.get_block_ids(r) == ([1],)


def test_free_is_tail_first_and_idempotent():
    mgr = KVCacheManager(FULL, 6)
    a = seq("a", 13)
    admit(mgr, a)
    (ids,) = mgr.get_block_ids(a)
    mgr.free(a)
    mgr.free(a)
    mgr.free("never-seen")
    # The partial last block (unhashed) goes to the head; the full ones to the
    # tail, end of the chain first so the shared prefix is evicted last.
    assert mgr.block_pool.free_block_ids() == [ids[3], 5, ids[2], ids[1], ids[0]]
    assert mgr.num_free_blocks == 5 and mgr.usage == 0.0


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(FULL, 8, watermark=1.0)
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager(FULL, 8, max_model_len=0)
    with pytest.raises(TypeError, match="spec"):
        KVCacheManager("full", 8)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(FULL, 1)
    mgr = KVCacheManager(FULL, 8, max_model_len=8)
    a = seq("a", 8)
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        mgr.allocate_slots(a, -1)
    with pytest.raises(TypeError, match="num_lookahead_tokens"):
        mgr.allocate_slots(a, 1, num_lookahead_tokens=1.5)
    with pytest.raises(ValueError, match="num_new_computed_tokens=3"):
        mgr.allocate_slots(a, 1, 3, ([],))
    with pytest.raises(TypeError, match=r"new_computed_blocks must be None or a per-group tuple .* got a list"):
        mgr.allocate_slots(a, 1, 0, [])  # a bare list: the hit of one group goes in a 1-tuple
    with pytest.raises(ValueError, match="over max_model_len=8"):
        mgr.allocate_slots(a, 9)
    mgr.allocate_slots(a, 8, num_lookahead_tokens=4)  # lookahead is clipped at max_model_len
    assert len(mgr.get_block_ids(a)[0]) == 2
    a.num_computed_tokens = 8
    mgr.cache_blocks(a, 8)
    b = seq("b", 8)
    blocks, hit = mgr.get_computed_blocks(b)
    mgr.allocate_slots(b, 8 - hit, hit, blocks)
    with pytest.raises(ValueError, match="admission only"):
        mgr.allocate_slots(b, 1, hit, blocks)


def test_objects_that_are_not_requests_are_rejected():
    mgr = KVCacheManager(FULL, 8)
    with pytest.raises(TypeError, match="request must have request_id"):
        mgr.get_computed_blocks([1, 2, 3])
    with pytest.raises(TypeError, match="request must have request_id"):
        mgr.allocate_slots("req-1", 4)
