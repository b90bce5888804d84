"""Sampling with the trees our drafters build: the emitted tokens follow the target.

The tree drafters (``ngram_tree``, ``draft_model`` / ``layer_skip`` with a
top-k tree) propose *deterministic*, distinct siblings with ``probs=None``;
the runner hands them to ``verify_trees`` of the pipeline's verifier
(``"tree"`` or ``"rejection"``), which treats them as one-hot drafts. Given
the path so far, each emitted token must be distributed as that slot's target
row (chi-square, p >= 1e-4), with power against a nearby wrong distribution.
"""

import pytest
import torch
from sampling_stats import assert_distributed_as

from servelab.samplers.draft_tree import DraftTree
from servelab.samplers.drafters.ngram_tree import breadth_first_trie
from servelab.samplers.verifiers import get_verifier

VOCAB = 6
# ngram_tree-style trie (3 continuations, BFS-filled), and a static top-2 tree (2 chains of depth 3).
TREES = {
    "ngram_tree": breadth_first_trie([[0, 1, 2], [0, 3], [4, 5, 1]], 8),
    "static_top2": DraftTree((2, 0, 1, 3, 4, 5), (-1, -1, 0, 1, 2, 3)),
}


@pytest.mark.parametrize("verifier", ["tree", "rejection"])
@pytest.mark.parametrize("shape", sorted(TREES))
def test_each_emitted_token_follows_the_target_given_its_path(verifier, shape):
    tree = TREES[shape]
    num_trees = 20_000
    gen = torch.Generator().manual_seed(5)
    target_rows = torch.softmax(torch.randn(tree.num_nodes + 1, VOCAB, generator=gen) * 1.2, dim=-1)
    tokens, parents = tree.as_tensors()
    out = get_verifier(verifier).verify_trees(
        tokens.expand(num_trees, -1), parents, target_rows[None].expand(num_trees, -1, -1), None,
        greedy=torch.zeros(num_trees, dtype=torch.bool), generators=[torch.Generator().manual_seed(9)] + [None] * (
            num_trees - 1))
    # Power: tokens of the root's children are over-represented if drafts are accepted without the residual.
    biased = target_rows[0].clone()
    for child in tree.children(-1):
        biased[tree.token_ids[child]] += 0.1
    assert_distributed_as(out.token_ids[:, 0], target_rows[0], wrong=biased / biased.sum(), label="root")
    checked = 0
    for level in range(1, out.token_ids.shape[1]):
        for node in range(tree.num_nodes):
            through = out.accepted_nodes[:, level - 1] == node
            if int(through.sum()) >= 600:
                assert_distributed_as(out.token_ids[through, level], target_rows[node + 1],
                                      label=f"after node {node}")
                checked += 1
    assert checked >= 1
    assert (out.accepted_nodes >= 0).sum(dim=1).max() >= 2  # some walks go two levels deep


def test_greedy_trees_follow_the_argmax_path():
    tree = TREES["ngram_tree"]
    target = torch.full((1, tree.num_nodes + 1, VOCAB), 0.01)
    # root argmax = 4 (node 1's token), node 1 argmax = 5 (its child), then argmax 3 at the leaf's slot.
    target[0, 0, 4] = target[0, 2, 5] = 1.0
    leaf = tree.children(1)[0]
    target[0, leaf + 1, 3] = 1.0
    tokens, parents = tree.as_tensors()
    for name in ("tree", "rejection", "typical"):
        out = get_verifier(name).verify_trees(tokens, parents, target / target.sum(-1, keepdim=True), greedy=True)
        assert out.token_ids[0].tolist()[:3] == [4, 5, 3], name
        assert out.accepted_nodes[0].tolist()[:2] == [1, leaf], name
