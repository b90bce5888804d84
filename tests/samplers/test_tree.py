"""Token trees: structure, attention mask, greedy and stochastic verification."""

import pytest
import torch
from sampling_stats import assert_distributed_as

from servelab.samplers import (
    TokenTree,
    rejection_sample,
    tree_attention_mask,
    verify_tree_greedy,
    verify_tree_stochastic,
)

# paths [[1, 2, 3], [1, 4], [5]] -> nodes: 0:'1'(root) 1:'2'(0) 2:'3'(1) 3:'4'(0) 4:'5'(root)
TREE = TokenTree.from_paths([[1, 2, 3], [1, 4], [5]])


def test_from_paths_builds_a_trie_in_first_appearance_order():
    assert TREE.token_ids == (1, 2, 3, 4, 5)
    assert TREE.parents == (-1, 0, 1, 0, -1)
    assert TREE.depths == (1, 2, 3, 2, 1) and TREE.max_depth == 3
    assert TREE.children(-1) == [0, 4] and TREE.children(0) == [1, 3]
    assert TREE.path_to(2) == [1, 2, 3] and TREE.path_to(3) == [1, 4]
    assert TREE.positions(10).tolist() == [10, 11, 12, 13, 12, 11]


def test_attention_mask_layout_root_context_and_ancestors():
    mask = TREE.attention_mask(context_len=2)
    assert mask.dtype == torch.bool and mask.shape == (6, 8)
    expected_tree = torch.tensor([
        # root n0 n1 n2 n3 n4   (columns after the 2 context columns)
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # node 0 ('1')
        [1, 1, 1, 0, 0, 0],  # node 1 ('2'), child of 0
        [1, 1, 1, 1, 0, 0],  # node 2 ('3'), child of 1
        [1, 1, 0, 0, 1, 0],  # node 3 ('4'), child of 0: does not see its sibling
        [1, 0, 0, 0, 0, 1],  # node 4 ('5'), child of the root
    ], dtype=torch.bool)
    assert torch.equal(mask[:, 2:], expected_tree)
    assert mask[:, :2].all()
    # A chain's mask is the causal mask.
    chain = tree_attention_mask([-1, 0, 1])
    assert torch.equal(chain, torch.ones(4, 4, dtype=torch.bool).tril())


def test_masked_attention_over_the_tree_equals_causal_attention_along_each_path():
    """One pass with the tree mask gives every node what a plain causal pass over its own path gives."""
    gen = torch.Generator().manual_seed(0)
    context_len, dim = 3, 8
    num_slots = TREE.num_nodes + 1
    query, key, value = (torch.randn(context_len + num_slots, dim, generator=gen, dtype=torch.float64)
                         for _ in range(3))
    mask = TREE.attention_mask(context_len)
    scores = query[context_len:] @ key.T
    tree_out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ value
    for node in range(-1, TREE.num_nodes):
        path_slots, walk = [], node
        while walk >= 0:
            path_slots.append(walk + 1)
            walk = TREE.parents[walk]
        rows = list(range(context_len)) + [context_len] + [context_len + s for s in reversed(path_slots)]
        last = rows[-1]  # the node itself attends causally to everything before it on its path
        causal = torch.softmax(query[last] @ key[rows].T, dim=-1) @ value[rows]
        torch.testing.assert_close(tree_out[node + 1], causal)


@pytest.mark.parametrize(
    ("tokens", "parents", "pattern"),
    [
        ((1, 2), (-1,), r"token_ids has 2 nodes but parents 1"),
        ((1, 2), (-1, 1), r"parents\[1\] = 1; valid: -1 \(root\) or a node index in \[0, 1\)"),
        ((1, 2), (-1, -2), r"parents\[1\] = -2"),
        ((1, -3), (-1, 0), r"token_ids\[1\] = -3"),
    ],
)
def test_token_tree_validation(tokens, parents, pattern):
    with pytest.raises(ValueError, match=pattern):
        TokenTree(tokens, parents)


def rows_with_argmax(argmaxes, vocab_size=8):
    rows = torch.full((len(argmaxes), vocab_size), 0.05)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.6
    return rows / rows.sum(dim=1, keepdim=True)


@pytest.mark.parametrize(
    ("argmaxes", "tokens", "nodes"),
    [
        # argmax per slot: root, node0..node4
        ([1, 4, 0, 0, 0, 0], [1, 4, 0, -1], [0, 3, -1]),  # second child of node 0 matches, then leaf bonus
        ([1, 2, 3, 6, 0, 0], [1, 2, 3, 6], [0, 1, 2]),  # deepest path fully accepted + bonus
        ([7, 0, 0, 0, 0, 0], [7, -1, -1, -1], [-1, -1, -1]),  # no root child matches
        ([5, 0, 0, 0, 0, 2], [5, 2, -1, -1], [4, -1, -1]),  # the second root child (a leaf)
    ],
)
def test_greedy_tree_verification_hand_built(argmaxes, tokens, nodes):
    draft_ids, parents = TREE.as_tensors()
    out = verify_tree_greedy(draft_ids, parents, rows_with_argmax(argmaxes)[None])
    assert out.token_ids.tolist() == [tokens]
    assert out.accepted_nodes.tolist() == [nodes]


def test_greedy_on_chains_equals_greedy_rejection_sampling():
    gen = torch.Generator().manual_seed(8)
    num_trees, depth, vocab_size = 64, 4, 5
    target = torch.softmax(torch.randn(num_trees, depth + 1, vocab_size, generator=gen) * 3, dim=-1)
    drafts = torch.where(torch.rand(num_trees, depth, generator=gen) < 0.7, target[:, :depth].argmax(-1),
                         torch.randint(0, vocab_size, (num_trees, depth), generator=gen))
    # Batches may mix shapes: pad some trees by marking their deep nodes absent.
    lengths = torch.randint(0, depth + 1, (num_trees,), generator=gen)
    padded = torch.where(torch.arange(depth)[None] < lengths[:, None], drafts, -1)
    tree = verify_tree_greedy(padded, torch.tensor([-1, 0, 1, 2]), target)
    rows = torch.cat([target[i, : int(lengths[i]) + 1] for i in range(num_trees)])
    chain = rejection_sample(padded[padded >= 0], lengths, rows, greedy=True)
    assert torch.equal(tree.token_ids, chain)
    assert (tree.token_ids[:, 1:] >= 0).any()  # some trees accepted something


def test_stochastic_verification_with_forced_outcomes():
    draft_ids, parents = TREE.as_tensors()
    one_hot = torch.nn.functional.one_hot(torch.tensor([1, 4, 6, 0, 0, 0]), 8).float()
    # root -> '1' (p=1, accepted) -> children '2' (p=0, rejected), '4' (p=1 on residual) -> leaf bonus 6.
    out = verify_tree_stochastic(draft_ids, parents, one_hot[None], generator=torch.Generator().manual_seed(0))
    assert out.token_ids.tolist() == [[1, 4, 0, -1]]
    assert out.accepted_nodes.tolist() == [[0, 3, -1]]


# A bushier tree for the distribution test: root children 0, 1, 2; node 0 -> 3, 4; node 1 -> 5; node 3 -> 6.
BUSHY_PARENTS = torch.tensor([-1, -1, -1, 0, 0, 1, 3])


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_stochastic_tree_emits_the_target_distribution_at_every_level(with_draft_probs):
    """Given the path so far, each emitted token follows that slot's target row.

    Children of a slot are drawn i.i.d. from the slot's draft distribution
    (duplicates allowed). Bound: chi-square p >= 1e-4 for every slot reached
    at least 600 times; power: the root's counts must reject a 10% mixture of
    the draft distribution into the target.
    """
    num_trees, vocab_size, num_nodes = 60_000, 5, BUSHY_PARENTS.numel()
    gen = torch.Generator().manual_seed(17 + with_draft_probs)
    target_rows = torch.softmax(torch.randn(num_nodes + 1, vocab_size, generator=gen) * 1.5, dim=-1)
    draft_rows = torch.softmax(torch.randn(num_nodes + 1, vocab_size, generator=gen) * 1.5, dim=-1)  # per parent slot
    parent_slot = BUSHY_PARENTS + 1
    tokens = torch.stack([torch.multinomial(draft_rows[parent_slot[n]], num_trees, replacement=True, generator=gen)
                          for n in range(num_nodes)], dim=1)
    draft_probs = draft_rows[parent_slot][None].expand(num_trees, -1, -1) if with_draft_probs else None
    out = verify_tree_stochastic(tokens, BUSHY_PARENTS, target_rows[None].expand(num_trees, -1, -1), draft_probs,
                                 generator=torch.Generator().manual_seed(3))
    wrong_root = 0.9 * target_rows[0] + 0.1 * draft_rows[0]
    assert_distributed_as(out.token_ids[:, 0], target_rows[0], wrong=wrong_root, label="root")
    checked = 0
    for level in range(1, out.token_ids.shape[1]):
        for node in range(num_nodes):
            through = out.accepted_nodes[:, level - 1] == node
            if int(through.sum()) >= 600:
                assert_distributed_as(out.token_ids[through, level], target_rows[node + 1], label=f"after node {node}")
                checked += 1
    assert checked >= 5
    assert (out.token_ids[:, 3] >= 0).any()  # some paths reach the deepest leaf and take a bonus token


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"parents": torch.tensor([-1, 1])}, ValueError, r"parents holds 1; valid: -1 \(root\) or an index smaller"),
        ({"parents": torch.tensor([-1, 0, 0])}, ValueError, r"parents must have shape \[N\] or \[B, N\]"),
        ({"target_probs": torch.full((1, 2, 4), 0.25)}, ValueError, r"target_probs must have shape \[B, N \+ 1, vocab\]"),
        ({"draft_token_ids": torch.tensor([[-1, 2]])}, ValueError, r"a present node has an absent \(-1\) parent"),
        ({"draft_token_ids": torch.tensor([[1, 9]])}, ValueError, r"draft_token_ids must be in \[0, 4\) or -1"),
        ({"draft_token_ids": torch.tensor([[1.0, 2.0]])}, TypeError, r"draft_token_ids must be an integer tensor"),
    ],
)
@pytest.mark.parametrize("verify", [verify_tree_greedy, verify_tree_stochastic])
def test_bad_tree_batches_are_refused(verify, kwargs, error, pattern):
    args = {"draft_token_ids": torch.tensor([[1, 2]]), "parents": torch.tensor([-1, 0]),
            "target_probs": torch.full((1, 3, 4), 0.25)}
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        verify(**args)
