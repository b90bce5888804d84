"""EPLB: the default policy's properties on random loads (every logical expert keeps a replica,
counts add up, the three maps agree, never a heavier rank than the reference packing nor, on one
node without redundancy, than the identity placement); bad input named; applied while serving
(weights moved, maps committed) with greedy outputs identical to the model without EPLB."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_harness import random_prompts

from servelab import Pipeline, SamplingParams
from servelab.moe import moe_blocks
from servelab.moe.eplb import check_placement, enable_eplb, rank_load_balance
from servelab.moe.eplb_policy import available_eplb_policies, get_eplb_policy, rebalance_experts
from servelab.reference.eplb import rebalance_experts as reference_policy


@st.composite
def placements(draw):
    """(weight [L, E], num_replicas, num_groups, num_nodes, num_ranks) that fit together."""
    num_nodes = draw(st.sampled_from([1, 1, 2, 4]))
    ranks_per_node = draw(st.integers(1, 4))
    num_ranks = num_nodes * ranks_per_node
    num_groups = draw(st.sampled_from([1, num_nodes, 2 * num_nodes, 3]))
    group_size = draw(st.integers(1, max(1, 64 // (num_groups * 4))))
    experts = num_groups * group_size * draw(st.integers(1, 4))
    if experts < 4:
        experts *= 4
    experts = min(experts, 64)
    while experts % num_groups:
        experts -= 1
    slots_per_rank = -(-experts // num_ranks) + draw(st.integers(0, 3))
    num_replicas = slots_per_rank * num_ranks
    layers = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    shape = draw(st.sampled_from(["zipf", "uniform", "one-hot", "zeros", "ties"]))
    if shape == "zipf":
        weight = (torch.rand(layers, experts, generator=gen) ** 6 * 1000).round()
    elif shape == "uniform":
        weight = torch.randint(0, 100, (layers, experts), generator=gen).float()
    elif shape == "one-hot":
        weight = torch.zeros(layers, experts)
        weight[:, 0] = 500
    elif shape == "zeros":
        weight = torch.zeros(layers, experts)
    else:
        weight = torch.full((layers, experts), 7.0)
    return weight, num_replicas, num_groups, num_nodes, num_ranks


@settings(max_examples=80, deadline=None)
@given(placements())
def test_default_policy_properties(args):
    weight, num_replicas, num_groups, num_nodes, num_ranks = args
    phy2log, log2phy, logcnt = rebalance_experts(*args)
    experts = weight.shape[1]
    assert phy2log.shape == (weight.shape[0], num_replicas) and log2phy.shape == (weight.shape[0], experts,
                                                                                 num_replicas - experts + 1)
    check_placement(phy2log, log2phy, logcnt, experts)  # every expert a replica, counts add up, maps agree
    assert bool((logcnt >= 1).all()) and bool((logcnt.sum(1) == num_replicas).all())
    ref = reference_policy(*args)
    check_placement(*ref, experts)
    ours = rank_load_balance(weight, phy2log, logcnt, num_ranks)
    theirs = rank_load_balance(weight, ref[0], ref[2], num_ranks)
    assert bool((ours <= theirs * (1 + 1e-6)).all()), (ours, theirs)
    assert torch.equal(logcnt, ref[2])  # the same replication
    if num_nodes == 1 and num_replicas == experts:
        identity = torch.arange(experts).expand(weight.shape[0], experts)
        base = rank_load_balance(weight, identity, torch.ones_like(logcnt), num_ranks)
        assert bool((ours <= base * (1 + 1e-6)).all()), (ours, base)


def test_the_policy_beats_the_identity_on_a_skewed_load():
    weight = torch.tensor([[100.0, 90, 5, 5, 1, 1, 1, 1]])
    phy2log, _, logcnt = rebalance_experts(weight, 8, 1, 1, 2)
    assert float(rank_load_balance(weight, phy2log, logcnt, 2)) < float(
        rank_load_balance(weight, torch.arange(8)[None], torch.ones(1, 8, dtype=torch.int64), 2))
    phy2log, _, logcnt = rebalance_experts(weight, 12, 1, 1, 4)  # 4 redundant slots go to the heavy two
    assert logcnt[0, :2].tolist() == [3, 3]


def test_registry_and_bad_input():
    assert {"default", "reference"} <= set(available_eplb_policies())
    assert get_eplb_policy("default") is rebalance_experts
    w = torch.rand(2, 8)
    with pytest.raises(ValueError, match="num_replicas=6 is smaller than the 8 logical experts"):
        rebalance_experts(w, 6, 1, 1, 2)
    with pytest.raises(ValueError, match="num_replicas=10 must be divisible by num_ranks=4"):
        rebalance_experts(w, 10, 1, 1, 4)
    with pytest.raises(ValueError, match="num_groups=3 must divide the 8 logical experts"):
        rebalance_experts(w, 8, 3, 1, 2)
    with pytest.raises(ValueError, match="finite, non-negative"):
        rebalance_experts(-w, 8, 1, 1, 2)
    phy2log, log2phy, logcnt = rebalance_experts(w, 8, 1, 1, 2)
    lost = phy2log.clone()
    lost[0, lost[0] == 5] = 4
    with pytest.raises(ValueError, match="loses logical expert 5 in layer 0"):
        check_placement(lost, log2phy, logcnt, 8)
    bad = log2phy.clone()
    bad[1, 3, 0] = int(log2phy[1, 4, 0])
    with pytest.raises(ValueError, match=r"logical_to_physical_map\[1, 3\]"):
        check_placement(phy2log, bad, logcnt, 8)


@pytest.fixture(scope="module")
def qwen3_moe(moe_checkpoint):
    return moe_checkpoint("qwen3_moe")


def test_enable_eplb_refuses_bad_settings(qwen3_moe):
    from servelab.models import load_model

    model, _ = load_model(qwen3_moe)
    with pytest.raises(ValueError, match="num_replicas=10 must be divisible by num_ranks=4"):  # EP size must divide
        enable_eplb(model, num_redundant_experts=2, num_ranks=4)
    with pytest.raises(ValueError, match="num_redundant_experts=-1"):
        enable_eplb(model, num_redundant_experts=-1)
    with pytest.raises(ValueError, match="skip_threshold=1.5"):
        enable_eplb(model, skip_threshold=1.5)
    with pytest.raises(ValueError, match="unknown EPLB policy 'best'"):
        enable_eplb(model, policy="best")
    assert getattr(model, "eplb_state", None) is None  # nothing changed by a refusal
    assert moe_blocks(model)[0][1].experts.gate_up_proj.shape[0] == 8


def test_rearranging_while_serving_keeps_greedy_outputs(qwen3_moe):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = Pipeline.from_pretrained(qwen3_moe, enable_prefix_caching=True, drafter="ngram", num_speculative_tokens=2)
    prompts = random_prompts([9, 14, 6, 11], plain.model.config.vocab_size, seed=11)
    expected = [list(o.token_ids) for o in plain.generate(prompts, params)]
    pipe = Pipeline.from_pretrained(qwen3_moe, enable_prefix_caching=True, drafter="ngram", num_speculative_tokens=2)
    state = enable_eplb(pipe.model, num_redundant_experts=4, num_ranks=4, window_size=4, rearrange_interval=3,
                        skip_threshold=0.0)
    initial = state.physical_to_logical_map.clone()
    assert moe_blocks(pipe.model)[0][1].experts.gate_up_proj.shape[0] == 12
    got = [list(o.token_ids) for o in pipe.generate(prompts, params)]
    assert got == expected
    applied = [h for h in state.history if h["applied"]]
    assert applied and not torch.equal(state.physical_to_logical_map, initial)
    assert all(h["balance_after"] <= h["balance_before"] + 1e-9 for h in applied)
    check_placement(state.physical_to_logical_map, state.logical_to_physical_map, state.logical_replica_count, 8)
    # Every slot holds its logical expert's weights (moved before the maps were committed).
    plain_blocks = moe_blocks(plain.model)
    for layer, (_, block) in enumerate(moe_blocks(pipe.model)):
        logical = plain_blocks[layer][1].experts.gate_up_proj
        assert torch.equal(block.experts.gate_up_proj, logical[state.physical_to_logical_map[layer]])
    # A high threshold skips a rearrangement whose gain is smaller.
    state.skip_threshold = 0.99
    assert state.rearrange() is False and state.history[-1]["applied"] is False
