"""The router seam: registry, the four built-ins' choices, a user router."""

from __future__ import annotations

import hashlib

import pytest

from servelab.blocks.events import BlockStored, KVEventIndex
from servelab.cluster import (
    ReplicaState,
    RouteRequest,
    Router,
    available_routers,
    get_router,
    register_router,
)


def states(loads, hits=None, block_size=4):
    out = []
    for i, load in enumerate(loads):
        index = KVEventIndex()
        if hits:
            index.apply([BlockStored([bytes([b]) for b in range(hits[i])], None, [], block_size, None, "GPU")])
        out.append(ReplicaState(i, 0, 0, load, 0.0, (), index, None))
    return out


def request(num_blocks=4, block_size=4, first=0):
    return RouteRequest("r", list(range(num_blocks * block_size)), [bytes([first + b]) for b in range(num_blocks)],
                        block_size, 8)


def choose(router, req, reps):
    for s in reps:
        s._request = req
    return router.choose(req, reps)


def test_registry_lists_the_builtins_and_refuses_bad_names():
    assert available_routers() == ["consistent_hash", "least_loaded", "prefix_affinity", "round_robin"]
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        get_router("nope")
    with pytest.raises(TypeError, match="choose"):
        get_router(object())
    with pytest.raises(ValueError, match="already registered"):
        register_router("round_robin", "servelab.cluster.routers:RoundRobinRouter")
    assert all(isinstance(get_router(n), Router) for n in available_routers())


def test_round_robin_cycles():
    r = get_router("round_robin")
    assert [choose(r, request(), states([0, 0, 0])) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_loaded_takes_the_fewest_outstanding_tokens():
    assert choose(get_router("least_loaded"), request(), states([30, 10, 20])) == 1


def test_prefix_affinity_prefers_the_longest_cached_prefix_within_the_load_cap():
    r = get_router("prefix_affinity", balance_abs_tokens=100)
    assert choose(r, request(), states([10, 50, 20], hits=[1, 3, 0])) == 1  # longest hit
    assert choose(r, request(), states([10, 500, 20], hits=[1, 3, 0])) == 0  # 1 is over the cap
    assert choose(r, request(first=100), states([30, 50, 20], hits=[1, 3, 0])) == 2  # a miss: least loaded


def test_consistent_hash_is_stable_per_prefix_and_spreads_prefixes():
    r = get_router("consistent_hash", prefix_blocks=2)
    reps = states([0] * 4)
    hot = choose(r, RouteRequest("x", [0] * 16, [b"a", b"b"], 4, 1), reps)
    loads = [0] * 4
    loads[hot] = 10_000
    assert choose(r, RouteRequest("x", [0] * 16, [b"a", b"b"], 4, 1), states(loads)) != hot, "bounded load"
    unbounded = get_router("consistent_hash", prefix_blocks=2, load_factor=None)
    assert choose(unbounded, RouteRequest("x", [0] * 16, [b"a", b"b"], 4, 1), states(loads)) == hot
    same = {choose(r, RouteRequest("x", [0] * 16, [b"a", b"b", bytes([i])], 4, 1), reps) for i in range(20)}
    assert len(same) == 1, "the same first two blocks must map to the same replica"
    spread = {choose(r, RouteRequest("x", [0] * 8, [b"a", hashlib.sha256(bytes([i])).digest()], 4, 1), reps)
              for i in range(64)}
    assert len(spread) == 4


def test_replica_state_is_lazy_and_reads_the_event_index():
    s = states([0], hits=[2])[0]
    s._request = request()
    assert s.prefix_hit_tokens == 8 and s.running_tokens == 0


def test_router_options_are_validated():
    with pytest.raises(ValueError, match="balance_factor"):
        get_router("prefix_affinity", balance_factor=0.5)
    with pytest.raises(ValueError, match="prefix_blocks"):
        get_router("consistent_hash", prefix_blocks=0)
