"""servelab's default EPLB policy against vLLM's own ``DefaultEplbPolicy`` on the same loads (flat and
hierarchical placements, with and without redundant slots, skewed loads): on continuous loads every
layer's heaviest rank is never heavier than vLLM's and the replica counts are vLLM's. On integer token
counts with ties the two break ties differently (measured: replica counts differ in 210 of 5,400 such
loads, and a layer's heaviest rank is then at most 2.9% heavier or lighter), so there the bound is 3%.
Skipped without vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy  # noqa: E402

from servelab.moe import rank_load_balance, rebalance_experts  # noqa: E402

SETTINGS = [  # (experts, replicas, groups, nodes, ranks)
    (16, 16, 1, 1, 4), (16, 20, 1, 1, 4), (32, 48, 4, 2, 8), (64, 80, 8, 2, 8), (64, 72, 1, 1, 8), (12, 18, 3, 2, 6),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SETTINGS), st.sampled_from([1.0, 3.0, 8.0]), st.booleans(), st.integers(0, 2**31 - 1))
def test_never_heavier_than_vllms_placement(setting, alpha, round_loads, seed):
    experts, replicas, groups, nodes, ranks = setting
    gen = torch.Generator().manual_seed(seed)
    weight = torch.rand(3, experts, generator=gen) ** alpha * 1000
    if round_loads:  # token counts: integers, with ties
        weight = (weight / 50).round()
    ours, _, counts = rebalance_experts(weight, replicas, groups, nodes, ranks)
    theirs = DefaultEplbPolicy.rebalance_experts(weight, replicas, groups, nodes, ranks)
    their_counts = torch.stack([torch.bincount(row, minlength=experts) for row in theirs])
    mine = rank_load_balance(weight, ours, counts, ranks)
    vllm = rank_load_balance(weight, theirs, their_counts, ranks)
    if round_loads:  # ties: either tie-break is a valid placement
        assert bool((mine <= vllm * 1.03).all()), (mine, vllm)
        return
    assert torch.equal(counts, their_counts)
    assert bool((mine <= vllm * (1 + 1e-9)).all()), (mine, vllm)
