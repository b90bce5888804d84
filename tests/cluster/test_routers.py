"""The router seam: registry, the four built-ins' choices, a user router."""

from __future__ import annotations

import hashlib

import pytest

from servelab.blocks.events import BlockStored, KVEventIndex
from servelab.blocks.hashing import RequestBlockHasher
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
    assert choose(r, request(), states([10, 500, 20], hits=[2, 3, 0])) == 0  # 1 is over the cap
    assert choose(r, request(), states([40, 20, 20], hits=[3, 3, 0])) == 1  # equal hits: the less loaded


def tokens_request(tokens, block_size=4, max_tokens=8):
    hasher = RequestBlockHasher(block_size)
    hasher.update(tokens)
    return RouteRequest("r", tokens, hasher.block_hashes, block_size, max_tokens)


def cached(loads, reqs_blocks, block_size=4):
    """States of replicas with ``loads``; replica i has the first n blocks of each (req, n) in reqs_blocks[i]."""
    out = []
    for i, load in enumerate(loads):
        index = KVEventIndex()
        for req, n in reqs_blocks[i] if reqs_blocks else ():
            index.apply([BlockStored(list(req.block_hashes[:n]), None, [], block_size, None, "GPU")])
        out.append(ReplicaState(i, 0, 0, load, 0.0, (), index, None))
    return out


def test_prefix_affinity_spreads_misses_by_prefix_not_to_replica_zero():
    # idle replicas, nothing cached, distinct prefixes: a miss goes to its prefix's ring owner (as an unbounded
    # consistent_hash would), so they spread; the old fallback (least loaded, ties to 0) sent every one to 0
    r = get_router("prefix_affinity")
    ring = get_router("consistent_hash", load_factor=None)
    reqs = [tokens_request([1000 + i] * 24) for i in range(32)]
    picks = [choose(r, q, states([0] * 4)) for q in reqs]
    assert picks == [choose(ring, q, states([0] * 4)) for q in reqs]
    assert set(picks) == {0, 1, 2, 3}


def test_prefix_affinity_keeps_a_shared_leading_prefix_together_before_it_is_cached():
    r = get_router("prefix_affinity", prefix_blocks=2)
    lead = [7] * 8  # the first 2 blocks
    picks = {choose(r, tokens_request(lead + [100 + i] * 16), states([0] * 4)) for i in range(16)}
    assert len(picks) == 1, "requests with the same first prefix_blocks blocks must land together"


def test_prefix_affinity_ignores_a_short_shared_hit_unless_asked():
    # every request starts with the same block (a system prompt) cached on replica 0: 1 of 6 blocks is
    # under min_hit_fraction, so the requests spread by prefix instead of all following that block
    system = [5] * 4
    reqs = [tokens_request(system + [200 + i] * 20) for i in range(32)]
    picks = {choose(get_router("prefix_affinity"), q, cached([0] * 4, [[(q, 1)], [], [], []])) for q in reqs}
    assert len(picks) > 1
    greedy = get_router("prefix_affinity", min_hit_fraction=0.0)
    assert {choose(greedy, q, cached([0] * 4, [[(q, 1)], [], [], []])) for q in reqs} == {0}
    # a hit of half the request's blocks or more is followed
    assert {choose(get_router("prefix_affinity"), q, cached([0] * 4, [[], [], [(q, 3)], []])) for q in reqs} == {2}


def test_prefix_affinity_keys_misses_past_the_prefix_every_replica_holds():
    # 32 requests share their first 4 blocks and differ after: while no replica holds the shared part
    # they land together (one key); once every replica holds block 1, the key starts past it and spreads them
    r = get_router("prefix_affinity")
    reqs = [tokens_request([5] * 16 + [300 + i] * 16) for i in range(32)]
    assert len({choose(r, q, states([0] * 4)) for q in reqs}) == 1
    assert len({choose(r, q, cached([0] * 4, [[(q, 1)]] * 4)) for q in reqs}) > 1


def test_prefix_affinity_breaks_ties_by_prefix_and_passes_over_busy_owners():
    r = get_router("prefix_affinity", balance_abs_tokens=100)
    ring = get_router("consistent_hash", load_factor=None)
    reqs = [tokens_request([3000 + i] * 24) for i in range(32)]
    # both replicas 1 and 3 hold the whole prompt at equal load: the request's ring order decides
    both = {choose(r, q, cached([0] * 4, [[], [(q, 6)], [], [(q, 6)]])) for q in reqs}
    assert both == {1, 3}
    # a miss whose ring owner is over the cap goes to the next replica on the ring
    for q in reqs:
        owner = choose(ring, q, states([0] * 4))
        loads = [0] * 4
        loads[owner] = 1000
        assert choose(r, q, states(loads)) not in (owner,)


def test_consistent_hash_is_stable_per_prefix_and_spreads_prefixes():
    r = get_router("consistent_hash", prefix_blocks=2)
    reps = states([0] * 4)
    hot_request = tokens_request([1] * 8)
    hot = choose(r, hot_request, reps)
    loads = [0] * 4
    loads[hot] = 10_000
    assert choose(r, hot_request, states(loads)) != hot, "bounded load"
    unbounded = get_router("consistent_hash", prefix_blocks=2, load_factor=None)
    assert choose(unbounded, hot_request, states(loads)) == hot
    same = {choose(r, tokens_request([1] * 8 + [i] * 4), reps) for i in range(20)}
    assert same == {hot}, "the same first two blocks must map to the same replica"
    spread = {choose(r, tokens_request([1] * 4 + [i] * 4), reps) for i in range(64)}
    assert len(spread) == 4


def test_ring_keys_are_the_tokens_not_the_engine_hashes():
    # the simulator hashes blocks with a per-process seed, real engines with sha256: the same prompt must
    # land on the same replica whatever the block hashes are
    r = get_router("consistent_hash", load_factor=None)
    tokens = list(range(16))
    picks = {choose(r, RouteRequest("r", tokens, [hashlib.sha256(bytes([i, b])).digest() for b in range(4)], 4, 1),
                    states([0] * 4)) for i in range(16)}
    assert len(picks) == 1
    short = {choose(r, RouteRequest("r", [i, i + 1], [], 4, 1), states([0] * 4)) for i in range(64)}
    assert len(short) == 4, "prompts shorter than one block are keyed by their tokens too"


def test_replica_state_is_lazy_and_reads_the_event_index():
    s = states([0], hits=[2])[0]
    s._request = request()
    assert s.prefix_hit_tokens == 8 and s.running_tokens == 0


def test_router_options_are_validated():
    with pytest.raises(ValueError, match="balance_factor"):
        get_router("prefix_affinity", balance_factor=0.5)
    with pytest.raises(ValueError, match="prefix_blocks"):
        get_router("consistent_hash", prefix_blocks=0)
    with pytest.raises(ValueError, match="min_hit_fraction"):
        get_router("prefix_affinity", min_hit_fraction=1.5)
    with pytest.raises(ValueError, match="virtual_nodes"):
        get_router("prefix_affinity", virtual_nodes=0)
