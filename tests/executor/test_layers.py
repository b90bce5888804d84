"""Sharded layers vs their references (the unsharded layers), ranks simulated in one process.

Column shards must be exactly the full layer's rows of their ranges (per fused slice); row
partials summed over the ranks, plus the bias once, must equal the full layer; the
vocab-parallel embedding's partials sum to the full lookup and the LM head's concatenate to
the full logits. float64, so the only differences are summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from servelab.executor.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                      VocabParallelEmbedding, qkv_shard_plan, slice_shard_plan, vocab_range)
from servelab.executor.parallel_state import ParallelState, rank_layout
from servelab.executor.sharding import stage_layers
from servelab.models.layer_api import gate_up_slices, output_slices, qkv_slices, set_output_slices
from servelab.models.linear import Linear

DT = torch.float64


def _linear(in_f: int, out_f: int, bias: bool, gen: torch.Generator) -> Linear:
    layer = Linear(in_f, out_f, bias=bias, dtype=DT)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=gen, dtype=DT))
        if bias:
            layer.bias.copy_(torch.randn(out_f, generator=gen, dtype=DT))
    return layer.requires_grad_(False)


# (heads, kv heads, tp): split, replicated (tp > kv), MHA, one KV head (Gemma 3 270M), SmolLM2-like 9/3 at tp 3
GRIDS = [(4, 2, 1), (4, 2, 2), (4, 2, 4), (8, 8, 4), (4, 1, 2), (8, 1, 4), (9, 3, 3), (6, 2, 6)]


@settings(max_examples=12)
@given(grid=st.sampled_from(GRIDS), head_dim=st.sampled_from([2, 4]), tokens=st.integers(0, 5),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_projections_sharded_equal_the_full_layers(grid, head_dim, tokens, bias, seed):
    heads, kv_heads, tp = grid
    gen = torch.Generator().manual_seed(seed)
    hidden, q_size, kv_size = 6, heads * head_dim, kv_heads * head_dim
    qkv = _linear(hidden, q_size + 2 * kv_size, bias, gen)
    set_output_slices(qkv, qkv_slices(q_size, kv_size))
    o_proj = _linear(q_size, hidden, bias, gen)
    x = torch.randn(tokens, hidden, generator=gen, dtype=DT)
    full = qkv(x)
    attn_out = torch.randn(tokens, q_size, generator=gen, dtype=DT)
    partials = []
    for rank in range(tp):
        ranges, local_heads, local_kv = qkv_shard_plan(heads, kv_heads, head_dim, tp, rank)
        col = ColumnParallelLinear(qkv, ranges, tp_rank=rank, tp_size=tp)
        expected = torch.cat([full[:, r.start:r.start + r.size] for r in ranges], dim=1)
        torch.testing.assert_close(col(x), expected, rtol=1e-12, atol=1e-12)
        # the local output is again [q | k | v] of the local heads, each named as its HF module
        assert [s.name for s in output_slices(col, "qkv_proj")] == ["q_proj", "k_proj", "v_proj"]
        assert [s.size for s in output_slices(col, "qkv_proj")] == [local_heads * head_dim, local_kv * head_dim,
                                                                     local_kv * head_dim]
        # vLLM's rule: the KV head a rank holds is the one its query heads read
        q_first = ranges[0].start // head_dim
        kv_head = (ranges[1].start - q_size) // head_dim
        assert kv_head == q_first // (heads // kv_heads)
        row = RowParallelLinear(o_proj, tp=ParallelState.simulated(rank, tp).tp, in_start=ranges[0].start,
                                in_size=ranges[0].size)
        partials.append(row.partial(attn_out[:, ranges[0].start:ranges[0].start + ranges[0].size]))
    total = torch.stack(partials).sum(0) + (o_proj.bias if bias else 0)
    torch.testing.assert_close(total, o_proj(attn_out), rtol=1e-10, atol=1e-10)


@settings(max_examples=10)
@given(tp=st.sampled_from([1, 2, 3, 4]), per_rank=st.integers(1, 4), tokens=st.integers(0, 5),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_mlp_sharded_sums_to_the_full_mlp(tp, per_rank, tokens, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 5, tp * per_rank
    gate_up, down = _linear(hidden, 2 * inter, bias, gen), _linear(inter, hidden, bias, gen)
    set_output_slices(gate_up, gate_up_slices(inter))
    x = torch.randn(tokens, hidden, generator=gen, dtype=DT)
    gate, up = gate_up(x).split(inter, dim=-1)
    reference = down(F.silu(gate) * up)
    total = torch.zeros_like(reference)
    for rank in range(tp):
        col = ColumnParallelLinear(gate_up, slice_shard_plan(gate_up, "gate_up_proj", tp, rank), tp_rank=rank,
                                   tp_size=tp)
        row = RowParallelLinear(down, tp=ParallelState.simulated(rank, tp).tp, in_start=rank * per_rank,
                                in_size=per_rank)
        g, u = col(x).split(per_rank, dim=-1)
        total += row.partial(F.silu(g) * u)
    if bias:
        total += down.bias
    torch.testing.assert_close(total, reference, rtol=1e-10, atol=1e-10)


@settings(max_examples=10)
@given(tp=st.integers(1, 4), vocab=st.integers(4, 23), tokens=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_vocab_parallel_embedding_and_head_equal_the_full_ones(tp, vocab, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = 3
    embed = nn.Embedding(vocab, hidden, dtype=DT)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(vocab, hidden, generator=gen, dtype=DT))
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    h = torch.randn(tokens, hidden, generator=gen, dtype=DT)
    assume(-(-vocab // tp) * (tp - 1) < vocab)  # else the last rank has no rows (refused: tested below)
    lookups, logits = [], []
    for rank in range(tp):
        group = ParallelState.simulated(rank, tp).tp
        lookups.append(VocabParallelEmbedding(embed, tp=group).partial(ids))
        head = ParallelLMHead(embed.weight, tp=group)
        logits.append(head.partial(h))
        assert head.start + head.size <= vocab
    torch.testing.assert_close(torch.stack(lookups).sum(0), embed(ids), rtol=0, atol=0)  # exact: one rank each
    torch.testing.assert_close(torch.cat(logits, dim=-1), h @ embed.weight.T, rtol=1e-12, atol=1e-12)


def test_vocab_range_tiles_the_vocabulary_and_refuses_empty_ranks():
    for vocab in (5, 8, 13):
        for tp in (1, 2, 3, 4):
            if -(-vocab // tp) * (tp - 1) >= vocab:
                continue  # the last rank would be empty (refused below)
            starts = [vocab_range(vocab, tp, r) for r in range(tp)]
            assert starts[0][0] == 0 and sum(size for _, size in starts) == vocab
    with pytest.raises(ValueError, match="no vocabulary rows"):
        vocab_range(4, 3, 2)  # ceil(4/3) = 2 rows each: rank 2 would start at 4


def test_qkv_plan_refuses_a_tp_size_that_cannot_split_or_replicate():
    with pytest.raises(ValueError, match="does not divide num_attention_heads=4"):
        qkv_shard_plan(4, 2, 8, 3, 0)
    with pytest.raises(ValueError, match="neither divides num_key_value_heads=3"):
        qkv_shard_plan(12, 3, 8, 2, 0)  # 2 does not divide 3 and is not a multiple of it
    with pytest.raises(ValueError, match="does not divide"):
        slice_shard_plan(_linear(2, 6, False, torch.Generator()), "down_proj", 4, 0)


@given(layers=st.integers(1, 30), pp=st.integers(1, 8))
def test_stages_tile_the_layers_in_order(layers, pp):
    assume(pp <= layers)
    bounds = [stage_layers(layers, pp, r) for r in range(pp)]
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [end - first for first, end in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_rank_layout_is_tp_innermost():
    assert [rank_layout(r, 2, 2) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    state = ParallelState.simulated(3, 2, 2)
    assert state.tp.ranks == (2, 3) and state.pp.ranks == (1, 3) and state.is_last_rank
    assert state.ep is state.tp
    with pytest.raises(ValueError, match="outside the world"):
        rank_layout(4, 2, 2)
