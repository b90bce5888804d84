"""``TierStore`` against a plain reference (an LRU dict), on random operation sequences;
the disk medium round-trips and a vanished file is a miss, not an exception."""

from __future__ import annotations

from collections import OrderedDict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.connectors.tiers import TierStore


class ReferenceLRUTier:
    """The plain reference: an ordered dict, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.data = capacity, OrderedDict()

    def put(self, key, value):
        if key in self.data:
            return []
        evicted = []
        if len(self.data) == self.capacity:
            evicted.append(self.data.popitem(last=False))
        self.data[key] = value
        return evicted

    def get(self, key):
        if key not in self.data:
            return None
        self.data.move_to_end(key)
        return self.data[key]


_OPS = st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(0, 9)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 5), ops=_OPS)
def test_lru_tier_matches_the_reference(capacity, ops):
    tier, ref = TierStore("host", capacity, "lru"), ReferenceLRUTier(capacity)
    for op, k in ops:
        key = bytes([k]) * 4
        if op == "put":
            value = [torch.full((2,), float(k), dtype=torch.float64)]
            got = [(ek, ev[0].tolist()) for ek, ev in tier.put(key, value)]
            want = [(ek, ev[0].tolist()) for ek, ev in ref.put(key, value)]
            assert got == want
        else:
            got, want = tier.get(key), ref.get(key)
            assert (got is None) == (want is None)
            if got is not None:
                assert torch.equal(got[0], want[0])
        assert len(tier) == len(ref.data) <= capacity
        assert sorted(ref.data) == sorted(k for k in ref.data if k in tier)


def test_disk_tier_round_trip_and_vanished_file(tmp_path):
    tier = TierStore("disk", 2, "lru", directory=tmp_path)
    a, b, c = b"a" * 8, b"b" * 8, b"c" * 8
    tier.put(a, [torch.arange(4.0)])
    tier.put(b, [torch.ones(3)])
    assert torch.equal(tier.get(a)[0], torch.arange(4.0))
    evicted = tier.put(c, [torch.zeros(1)])  # b is least recently used
    assert [k for k, _ in evicted] == [b] and torch.equal(evicted[0][1][0], torch.ones(3))
    assert len(list(tmp_path.iterdir())) == 2
    (tmp_path / f"{a.hex()}.pt").unlink()  # the file went away behind the tier's back
    assert tier.get(a) is None and a not in tier and tier.stats.failed_reads == 1


def test_other_policies_hold_capacity():
    for policy in ("lfu", "fewest_descendants"):
        tier = TierStore("host", 3, policy)
        for k in range(10):
            tier.put(bytes([k]), [torch.zeros(1)])
            tier.get(bytes([0]))
        assert len(tier) == 3 and tier.stats.evicted == 7
