"""Tree attention masks (token trees verified in one step) on every backend.

The oracle builds each sequence's mask independently: causal rows, except the
last ``N`` query rows (the tree nodes), whose visibility over the tree slots
is :meth:`DraftTree.attention_mask` (root and ancestors only). The torch
reference and SDPA are held to it in float64; the Triton kernel (interpreter,
small shapes) to the reference in float32.
"""

import math

import pytest
import torch
from attention_cases import build_case
from hypothesis import given, note, settings
from hypothesis import strategies as st

from servelab.attention import TreeMask, get_attention_backend
from servelab.reference import paged_attention as reference_attention
from servelab.samplers.draft_tree import DraftTree


@st.composite
def tree_batches(draw, max_seqs=3, max_nodes=9, block_size=4):
    """(query_lens, seq_lens, trees): each sequence = context, root (+ maybe known tokens), then its tree."""
    query_lens, seq_lens, trees = [], [], []
    for _ in range(draw(st.integers(1, max_seqs))):
        num_nodes = draw(st.integers(0, max_nodes))
        parents = [draw(st.integers(-1, n - 1)) for n in range(num_nodes)]
        tree = DraftTree(tuple(range(num_nodes)), tuple(parents))
        extra = draw(st.integers(0, 3))  # known tokens computed in the same step (a chunk, or a resume)
        context = draw(st.integers(0, 3 * block_size))
        query_lens.append(1 + extra + num_nodes)
        seq_lens.append(context + 1 + extra + num_nodes)
        trees.append(tree)
    return query_lens, seq_lens, trees


def tree_mask_of(query_lens, trees) -> TreeMask:
    ancestors = []
    for q_len, tree in zip(query_lens, trees):
        ancestors += [0] * (q_len - tree.num_nodes) + tree.ancestor_bits()
    return TreeMask(torch.tensor(ancestors, dtype=torch.int64),
                    torch.tensor([t.num_nodes for t in trees], dtype=torch.int32))


def oracle(case, trees):
    """float64 attention with each sequence's mask built from :meth:`DraftTree.attention_mask`."""
    query = case.query.double()
    _, num_q_heads, head_size = query.shape
    out = torch.zeros_like(query)
    starts = case.query_start_loc.tolist()
    for i, (k, v, tree) in enumerate(zip(case.keys, case.values, trees)):
        q = query[starts[i]: starts[i + 1]]
        q_len, seq_len = q.shape[0], k.shape[0]
        allow = torch.tril(torch.ones(q_len, seq_len, dtype=torch.bool), diagonal=seq_len - q_len)
        if tree.num_nodes:
            context = seq_len - tree.num_nodes - 1  # everything before the root
            allow[q_len - tree.num_nodes:] = tree.attention_mask(context)[1:]
        group = num_q_heads // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q, k.double().repeat_interleave(group, 1)) / math.sqrt(head_size)
        s = s.masked_fill(~allow, -math.inf)
        out[starts[i]: starts[i + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1),
                                                     v.double().repeat_interleave(group, 1))
    return out


@settings(max_examples=40, deadline=None)
@given(tree_batches(), st.sampled_from([(2, 1), (4, 2)]), st.integers(0, 2 ** 16))
def test_reference_and_sdpa_match_the_oracle(shape, heads, seed):
    query_lens, seq_lens, trees = shape
    note(f"query_lens={query_lens} seq_lens={seq_lens} parents={[t.parents for t in trees]}")
    case = build_case(query_lens, seq_lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_size=8,
                      block_size=4, dtype=torch.float64, seed=seed)
    mask = tree_mask_of(query_lens, trees)
    want = oracle(case, trees)
    torch.testing.assert_close(reference_attention(*case.args(), tree_mask=mask), want)
    sdpa = get_attention_backend("sdpa")
    plan = sdpa.plan(case.block_table, case.seq_lens, case.query_start_loc, block_size=4, tree_mask=mask)
    torch.testing.assert_close(sdpa.paged_attention(*case.args(), plan=plan, tree_mask=mask), want)


def test_tree_mask_changes_the_result():
    """A tree that is not a chain must attend differently from the causal chain layout."""
    tree = DraftTree((0, 1, 2), (-1, -1, -1))  # three siblings
    case = build_case([4], [10], num_q_heads=2, num_kv_heads=1, head_size=8, block_size=4, dtype=torch.float64)
    masked = reference_attention(*case.args(), tree_mask=tree_mask_of([4], [tree]))
    causal = reference_attention(*case.args())
    assert torch.allclose(masked[:2], causal[:2]) and not torch.allclose(masked[2:], causal[2:])


def test_tree_mask_is_validated():
    case = build_case([3], [6], num_q_heads=2, num_kv_heads=1, head_size=8, block_size=4, dtype=torch.float32)
    bad = TreeMask(torch.zeros(3, dtype=torch.int64), torch.tensor([7], dtype=torch.int32))  # 7 nodes > 6 keys
    with pytest.raises(ValueError, match="tree_lens"):
        reference_attention(*case.args(), tree_mask=bad)
    with pytest.raises(ValueError, match="sliding_window"):
        reference_attention(*case.args(), sliding_window=4, tree_mask=TreeMask(bad.ancestors, bad.tree_lens * 0))
    with pytest.raises(ValueError, match="does not implement tree"):
        from servelab.attention import AttentionCapabilities

        class NoTree(type(get_attention_backend("sdpa"))):
            capabilities = AttentionCapabilities()
        NoTree().paged_attention(*case.args(), tree_mask=bad)


@pytest.mark.interpreter
@settings(max_examples=6, deadline=None)
@given(tree_batches(max_seqs=2, max_nodes=7), st.integers(0, 2 ** 16))
def test_triton_matches_the_reference(shape, seed):
    query_lens, seq_lens, trees = shape
    case = build_case(query_lens, seq_lens, num_q_heads=2, num_kv_heads=1, head_size=16, block_size=4,
                      dtype=torch.float32, seed=seed)
    mask = tree_mask_of(query_lens, trees)
    want = reference_attention(*case.args(), tree_mask=mask)
    got = get_attention_backend("triton").paged_attention(*case.args(), tree_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
