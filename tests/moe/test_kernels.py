"""Routing, token permutation and the experts kernels held to their references on random shapes:
experts 4-64, top-k 1-8, uneven token counts (a skewed router), empty experts, zero tokens;
float64 for the torch paths, float32 for the Triton kernel (under the interpreter, tiny shapes).
Plus: every registry name resolves, and bad input is a ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.moe import (
    available_experts_kernels,
    available_moe_routers,
    fused_experts_cpu,
    get_experts_kernel,
    get_moe_router,
    grouped_topk,
    moe_align_block_size,
    register_experts_kernel,
    topk_softmax,
)
from servelab.reference import fused_moe as ref


@st.composite
def routing_cases(draw, max_tokens=40, max_experts=64):
    """(topk_ids [T, k], num_experts): distinct experts per token, drawn from a skewed subset
    (so some experts get many pairs, some none)."""
    num_experts = draw(st.integers(4, max_experts))
    top_k = draw(st.integers(1, min(8, num_experts)))
    num_tokens = draw(st.integers(0, max_tokens))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    hot = draw(st.integers(top_k, num_experts))  # only `hot` experts receive pairs: the others are empty
    subset = torch.randperm(num_experts, generator=gen)[:hot]
    skew = torch.rand(hot, generator=gen) ** 3 + 1e-3
    rows = [subset[torch.multinomial(skew, top_k, replacement=False, generator=gen)] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    if draw(st.booleans()):  # expert parallelism: pairs of experts on other ranks are -1 (add nothing)
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.4, -1, ids)
    return ids, num_experts, gen


@settings(max_examples=60, deadline=None)
@given(routing_cases(), st.sampled_from([1, 4, 16]))
def test_moe_align_block_size_matches_reference(case, block_size):
    ids, num_experts, _ = case
    got = moe_align_block_size(ids, block_size, num_experts)
    want = ref.moe_align_block_size(ids, block_size, num_experts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2]
    assert got[2] % block_size == 0
    real = got[0][got[0] < ids.numel()]
    assert sorted(real.tolist()) == (ids.reshape(-1) >= 0).nonzero().reshape(-1).tolist()  # each real pair once


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 30), st.integers(4, 64), st.integers(1, 8), st.booleans(), st.integers(0, 2**31 - 1))
def test_topk_softmax_matches_reference(num_tokens, num_experts, top_k, renormalize, seed):
    top_k = min(top_k, num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w, i = topk_softmax(logits, top_k, renormalize=renormalize)
    rw, ri = ref.topk_softmax(logits, top_k, renormalize=renormalize)
    assert torch.equal(i, ri) and torch.equal(w, rw) and w.dtype == torch.float32
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(num_tokens))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 20), st.sampled_from([(8, 2), (16, 4), (32, 8), (64, 8), (12, 3)]), st.integers(1, 8),
       st.data(), st.booleans(), st.integers(0, 2**31 - 1))
def test_grouped_topk_matches_reference(num_tokens, experts_groups, top_k, data, renormalize, seed):
    num_experts, groups = experts_groups
    per_group = num_experts // groups
    topk_group = data.draw(st.integers(max(1, -(-min(top_k, num_experts) // per_group)), groups))
    top_k = min(top_k, topk_group * per_group)
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    logits[0, :] = 0.0  # all groups tie on the first token: the lower group wins in both
    got = grouped_topk(logits, top_k, renormalize=renormalize, num_expert_group=groups, topk_group=topk_group)
    want = ref.grouped_topk(logits, top_k, renormalize=renormalize, num_expert_group=groups, topk_group=topk_group)
    assert torch.equal(got[1].sort(-1).values, want[1].sort(-1).values)
    torch.testing.assert_close(got[0].sort(-1).values, want[0].sort(-1).values)
    kept_groups = (got[1] // per_group)
    assert all(len(set(row.tolist())) <= topk_group for row in kept_groups)


def _weights(num_experts, hidden, inter, gen, dtype):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, dtype=torch.float64) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


@settings(max_examples=40, deadline=None)
@given(routing_cases(max_tokens=24), st.integers(1, 40), st.integers(1, 40), st.sampled_from(["silu", "gelu"]))
def test_cpu_experts_match_the_per_expert_loop_float64(case, hidden, inter, activation):
    ids, num_experts, gen = case
    x = torch.randn(ids.shape[0], hidden, generator=gen, dtype=torch.float64)
    w13, w2 = _weights(num_experts, hidden, inter, gen, torch.float64)
    weights = torch.rand(ids.shape, generator=gen, dtype=torch.float64)
    got = fused_experts_cpu(x, w13, w2, weights, ids, activation=activation)
    want = ref.fused_experts(x, w13, w2, weights, ids, activation=activation)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@settings(max_examples=12, deadline=None)
@given(routing_cases(max_tokens=12, max_experts=24), st.integers(1, 24), st.integers(1, 24),
       st.sampled_from(["silu", "gelu"]))
def test_triton_experts_match_the_per_expert_loop(case, hidden, inter, activation):
    from servelab.kernels.fused_moe import fused_experts

    ids, num_experts, gen = case
    x = torch.randn(ids.shape[0], hidden, generator=gen, dtype=torch.float64)
    w13, w2 = _weights(num_experts, hidden, inter, gen, torch.float64)
    weights = torch.rand(ids.shape, generator=gen, dtype=torch.float64)
    got = fused_experts(x.float(), w13.float(), w2.float(), weights.float(), ids, activation=activation)
    want = ref.fused_experts(x, w13, w2, weights, ids, activation=activation)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


def test_registries_resolve_and_swap():
    assert {"cpu", "triton", "reference"} <= set(available_experts_kernels())
    assert {"softmax", "reference"} <= set(available_moe_routers())
    assert get_experts_kernel("cpu") is fused_experts_cpu and get_experts_kernel("reference") is ref.fused_experts
    assert get_moe_router("reference") is ref.route
    with pytest.raises(ValueError, match="unknown experts kernel 'nope'; known: .*'cpu'"):
        get_experts_kernel("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_experts_kernel("cpu", fused_experts_cpu)
    with pytest.raises(TypeError, match="callable"):
        get_experts_kernel(42)  # type: ignore[arg-type]


def test_bad_input_names_the_argument():
    x, ids = torch.randn(3, 8), torch.tensor([[0, 1], [1, 2], [3, 0]])
    w13, w2, w = torch.randn(4, 12, 8), torch.randn(4, 8, 6), torch.rand(3, 2)
    with pytest.raises(ValueError, match="topk_ids holds expert 4, outside \\[0, 4\\)"):
        fused_experts_cpu(x, w13, w2, w, ids + 1)
    with pytest.raises(ValueError, match="topk_ids holds expert -2"):
        fused_experts_cpu(x, w13, w2, w, ids - 2)
    with pytest.raises(ValueError, match="w2 must be \\[E=4, H=8, I=6\\]"):
        fused_experts_cpu(x, w13, w2[:, :, :5], w, ids)
    with pytest.raises(ValueError, match="activation='relu'"):
        fused_experts_cpu(x, w13, w2, w, ids, activation="relu")
    with pytest.raises(ValueError, match="top_k=5 must be an int in \\[1, num_experts=4\\]"):
        topk_softmax(torch.randn(2, 4), 5, renormalize=True)
    with pytest.raises(ValueError, match="num_expert_group=3 must be a positive divisor"):
        grouped_topk(torch.randn(2, 8), 2, renormalize=True, num_expert_group=3, topk_group=1)
    with pytest.raises(ValueError, match="block_size=0"):
        moe_align_block_size(ids, 0, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["cpu", "triton"])
def test_half_precision_experts_stay_near_the_float64_loop(kernel, dtype):
    """Half-precision weights and activations: within the half type's rounding of the float64 loop
    (the Triton kernel accumulates in float32; under the interpreter its bf16 dots run in float32)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32, generator=gen, dtype=torch.float64)
    w13, w2 = _weights(6, 32, 16, gen, torch.float64)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen, dtype=torch.float64)
    want = ref.fused_experts(x, w13, w2, weights, ids)
    fn = get_experts_kernel(kernel)
    got = fn(x.to(dtype), w13.to(dtype), w2.to(dtype), weights.float(), ids)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)
