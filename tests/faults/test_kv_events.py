"""KV-cache events under injected faults: the event stream stays equal to the prefix cache.

The fault machine of ``test_fault_machine.py`` (a real pipeline on a tiny
model, faults at every stage: scheduler, user policy, block allocation, the
forward before or after it wrote the KV, samplers, drafters, detokenizer)
runs with KV events on. After every step, the batches published so far plus
the events not yet published (a step interrupted before its end publishes
them with the next one) are replayed into an independent index, which must
equal the pool's index: a block whose step failed was never announced, and
every eviction was.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from test_fault_machine import TorchAttentionMachine

from servelab.blocks.events import KVEventIndex


class EventsUnderFaults(TorchAttentionMachine):
    @initialize(pool_slack=st.integers(0, 6), max_num_seqs=st.integers(1, 4), budget=st.integers(4, 24),
                spec=st.sampled_from([0, 0, 1, 2]))
    def build(self, pool_slack, max_num_seqs, budget, spec):
        super().build(pool_slack, max_num_seqs, budget, spec)
        self.index = KVEventIndex()
        self.driver.pipe.scheduler.kv_cache_manager.subscribe_kv_events(self.index)

    @invariant()
    def events_replay_to_the_index(self):
        if self.driver is None:
            return
        kv = self.driver.pipe.scheduler.kv_cache_manager
        replay = KVEventIndex(set(self.index.hashes))
        replay.apply(kv.kv_event_publisher.pending)
        assert replay.hashes == set(kv.block_pool.cached_block_hash_to_block)
        assert kv.kv_event_publisher.num_subscriber_errors == 0


TestKVEventsUnderFaults = EventsUnderFaults.TestCase
TestKVEventsUnderFaults.settings = settings(max_examples=12, deadline=None, stateful_step_count=15,
                                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
