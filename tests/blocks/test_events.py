"""KV-cache events: replaying them rebuilds exactly the pool's prefix-cache index.

The state machines of ``test_stateful.py`` run with events on; after every
step the events published so far are replayed into an independent index
(:class:`~servelab.blocks.events.KVEventIndex`, a set of hashes built from the
events alone) and compared with the pool's ``cached_block_hash_to_block``.
Failed steps in the manager machine commit nothing, so they must publish no
``BlockStored``. The fault-injection version (a real pipeline, faults at every
stage) is ``tests/faults/test_kv_events.py``.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant

from servelab.blocks import BlockPool, FullAttentionSpec, KVCacheManager, TokenSequence
from servelab.blocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventIndex,
    KVEventPublisher,
)
from servelab.blocks.hybrid import HybridKVCacheManager
from servelab.blocks.specs import SlidingWindowSpec

sys.path.insert(0, os.path.dirname(__file__))
from test_stateful import POLICIES, STATEFUL, BlockPoolMachine, KVCacheManagerMachine  # noqa: E402

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")


def replayed(index: KVEventIndex, pending) -> set:
    """The index after also applying the not-yet-published events."""
    copy = KVEventIndex(set(index.hashes))
    copy.apply(pending)
    return copy.hashes


class PoolWithEvents(BlockPoolMachine):
    @initialize(num_blocks=st.integers(2, 12), enable_caching=st.booleans(), policy=POLICIES)
    def setup(self, num_blocks, enable_caching, policy):
        super().setup(num_blocks, enable_caching, policy)
        self.index = KVEventIndex()
        self.fast.kv_event_publisher = KVEventPublisher(subscribers=[self.index])
        self.ts = 0.0

    @invariant()
    def events_rebuild_the_index(self):
        if not hasattr(self, "index"):
            return
        self.ts += 1.0
        self.fast.kv_event_publisher.publish(self.ts)
        assert self.index.hashes == set(self.fast.cached_block_hash_to_block)


class ManagerWithEvents(KVCacheManagerMachine):
    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(2, 24),
                window=st.one_of(st.none(), st.integers(1, 12)), watermark=st.sampled_from([0.0, 0.1, 0.3]),
                policy=POLICIES)
    def setup(self, block_size, num_blocks, window, watermark, policy):
        super().setup(block_size, num_blocks, window, watermark, policy)
        self.index = KVEventIndex()
        self.fast.subscribe_kv_events(self.index)
        self.batches: list[KVEventBatch] = []
        self.fast.subscribe_kv_events(self.batches.append)
        self.ts = 0.0

    @invariant()
    def events_rebuild_the_index(self):
        if not hasattr(self, "index"):
            return
        self.ts += 1.0
        self.fast.publish_kv_events(self.ts)
        assert self.index.hashes == set(self.fast.block_pool.cached_block_hash_to_block)
        for batch in self.batches:  # vLLM's field meanings: a chain, with its tokens
            for event in batch.events:
                if isinstance(event, BlockStored):
                    assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                    assert event.medium == "GPU"
        self.batches.clear()


TestPoolEvents = PoolWithEvents.TestCase
TestPoolEvents.settings = settings(STATEFUL, max_examples=100)
TestManagerEvents = ManagerWithEvents.TestCase
TestManagerEvents.settings = settings(STATEFUL, max_examples=100)


def test_stored_event_has_vllm_field_meanings():
    batches = []
    kv = KVCacheManager(SPEC, 8, kv_event_subscribers=batches.append)
    req = TokenSequence("a", list(range(10)), 4)
    kv.allocate_slots(req, 10)
    kv.cache_blocks(req, 4)
    kv.cache_blocks(req, 10)
    batch = kv.publish_kv_events(1.5)
    assert batches == [batch] and batch.ts == 1.5
    first, second = batch.events
    assert first == BlockStored([req.block_hashes[0]], None, [0, 1, 2, 3], 4, None, "GPU")
    assert second.block_hashes == [req.block_hashes[1]]
    assert second.parent_block_hash == req.block_hashes[0]
    assert second.token_ids == [4, 5, 6, 7]
    assert kv.publish_kv_events(2.0) is None, "nothing changed: no batch"


def test_eviction_and_reset_publish_removed_and_cleared():
    kv = KVCacheManager(SPEC, 3, kv_events=True)
    a = TokenSequence("a", list(range(8)), 4)
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    kv.free(a)
    b = TokenSequence("b", list(range(100, 104)), 4)
    kv.allocate_slots(b, 4)  # evicts a's tail block (LRU: freed first)
    events = kv.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert events[1].block_hashes == [a.block_hashes[1]]
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_duplicate_content_is_not_announced():
    kv = KVCacheManager(SPEC, 8, kv_events=True)
    a, b = TokenSequence("a", list(range(4)), 4), TokenSequence("b", list(range(4)), 4)
    kv.allocate_slots(a, 4)
    kv.allocate_slots(b, 4)
    kv.cache_blocks(a, 4)
    kv.cache_blocks(b, 4)  # same hash: not indexed (the first block keeps it)
    assert len(kv.take_events()) == 1


def test_events_off_by_default_and_enabled_later():
    kv = KVCacheManager(SPEC, 8)
    assert kv.kv_event_publisher is None and kv.block_pool.kv_event_publisher is None
    assert kv.take_events() == [] and kv.publish_kv_events(0.0) is None
    index = KVEventIndex()
    kv.subscribe_kv_events(index)
    a = TokenSequence("a", list(range(8)), 4)
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    kv.publish_kv_events(0.0)
    assert index.hashes == set(a.block_hashes) and index.prefix_hit_blocks(a.block_hashes) == 2


def test_events_follow_the_manager_to_a_new_pool():
    kv = KVCacheManager(SPEC, 8, kv_events=True)
    publisher = kv.kv_event_publisher
    kv.block_pool = BlockPool(8)
    assert kv.kv_event_publisher is publisher


def test_a_raising_subscriber_does_not_stop_the_others():
    index = KVEventIndex()

    def broken(batch):
        raise RuntimeError("boom")

    kv = KVCacheManager(SPEC, 8, kv_event_subscribers=[broken, index])
    a = TokenSequence("a", list(range(4)), 4)
    kv.allocate_slots(a, 4)
    kv.cache_blocks(a, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kv.publish_kv_events(0.0)
    assert index.hashes == set(a.block_hashes)
    assert kv.kv_event_publisher.num_subscriber_errors == 1 and "boom" in str(caught[0].message)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="kv_events"):
        KVCacheManager(SPEC, 8, kv_events="yes")
    with pytest.raises(TypeError, match="callable"):
        KVCacheManager(SPEC, 8, kv_event_subscribers=[42])
    with pytest.raises(ValueError, match="medium"):
        KVEventPublisher(medium="")


def test_hybrid_manager_publishes_group_events():
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    window = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=4)
    index = KVEventIndex()
    kv = HybridKVCacheManager([full, window], 16, kv_event_subscribers=index)
    a = TokenSequence("a", list(range(12)), 4)
    kv.allocate_slots(a, 12)
    kv.cache_blocks(a, 12)
    batch = kv.publish_kv_events(0.0)
    assert {e.group_idx for e in batch.events} == {0, 1}
    assert index.hashes == set(kv.block_pool.cached_block_hash_to_block)


def test_scheduler_publishes_one_batch_per_step():
    from servelab.samplers.params import SamplingParams
    from servelab.scheduling import Request, Scheduler, SchedulerConfig
    from servelab.scheduling.output import ModelRunnerOutput

    batches = []
    kv = KVCacheManager(SPEC, 32, kv_event_subscribers=batches.append)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64), kv)
    sched.add_request(Request("r", list(range(9)), SamplingParams(max_tokens=3, ignore_eos=True)))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["r"], [[5]]))
    assert len(batches) == 1 and sum(len(e.block_hashes) for e in batches[0].events) == 2
