"""Fast typical acceptance and tree verification against their references (float64, random shapes)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.reference import tree_verify as ref_tree
from servelab.reference import typical_acceptance as ref_typical
from servelab.samplers import (
    TokenTree,
    get_verifier,
    rejection_sample,
    typical_acceptance_sample,
    verify_tree_greedy,
    verify_tree_stochastic,
)


def random_probs(gen, rows, vocab_size, *, sharp=2.0, sparse=False):
    """float64 rows; sharp logits so drafts are accepted often enough to matter."""
    logits = torch.randn(*rows, vocab_size, generator=gen, dtype=torch.float64) * sharp
    if sparse:  # zero some entries (never a whole row) to exercise p = 0 tokens
        drop = torch.rand(*rows, vocab_size, generator=gen) < 0.3
        drop[..., 0] = False
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def random_tree_batch(seed, num_trees, num_nodes, vocab_size, shared_parents):
    """Random trees, padded: absent nodes (-1) only below absent parents, tokens often the likely ones."""
    gen = torch.Generator().manual_seed(seed)
    rows = 1 if shared_parents else num_trees
    parents = torch.stack([
        torch.tensor([-1] + [int(torch.randint(-1, n, (1,), generator=gen)) for n in range(1, num_nodes)][:num_nodes])
        for _ in range(rows)
    ]) if num_nodes else torch.zeros(rows, 0, dtype=torch.int64)
    parents = parents.expand(num_trees, -1)
    target = random_probs(gen, (num_trees, num_nodes + 1), vocab_size, sparse=True)
    draft = random_probs(gen, (num_trees, num_nodes), vocab_size, sharp=1.0)
    tokens = torch.multinomial(draft.reshape(-1, vocab_size), 1, generator=gen).view(num_trees, num_nodes) \
        if num_nodes else torch.zeros(num_trees, 0, dtype=torch.int64)
    # Make some nodes copy the target's argmax at their parent so greedy paths get long.
    if num_nodes:
        best = target.argmax(dim=-1).gather(1, parents + 1)
        tokens = torch.where(torch.rand(num_trees, num_nodes, generator=gen) < 0.5, best, tokens)
        absent = torch.rand(num_trees, num_nodes, generator=gen) < 0.2
        for node in range(num_nodes):  # an absent parent makes the child absent
            parent = parents[:, node]
            absent[:, node] |= torch.where(parent >= 0, absent.gather(1, parent.clamp(min=0)[:, None]).squeeze(1),
                                           False)
        tokens = tokens.masked_fill(absent, -1)
    return tokens, (parents[0] if shared_parents else parents), target, draft


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31), counts=st.lists(st.integers(0, 6), min_size=0, max_size=6),
       vocab_size=st.sampled_from([1, 2, 5, 17, 64]), greedy_mask=st.integers(0, 63), per_request=st.booleans(),
       threshold=st.sampled_from([0.09, 0.3]), alpha=st.sampled_from([0.3, 0.9]))
def test_typical_fast_path_matches_the_reference(seed, counts, vocab_size, greedy_mask, per_request, threshold, alpha):
    gen = torch.Generator().manual_seed(seed)
    target = random_probs(gen, (sum(counts) + len(counts),), vocab_size, sparse=True)
    drafts = torch.randint(0, min(vocab_size, 3), (sum(counts),), generator=gen)
    greedy = torch.tensor([bool(greedy_mask >> i & 1) for i in range(len(counts))], dtype=torch.bool)

    def generator():
        if per_request:
            return [torch.Generator().manual_seed(seed + i) if i % 2 else None for i in range(len(counts))]
        return torch.Generator().manual_seed(seed)

    torch.manual_seed(seed)  # unseeded rows draw from the default generator: same state for both
    fast = typical_acceptance_sample(drafts, counts, target, posterior_threshold=threshold, posterior_alpha=alpha,
                                     greedy=greedy, generator=generator())
    torch.manual_seed(seed)
    ref = ref_typical.typical_acceptance_sample(drafts, counts, target, posterior_threshold=threshold,
                                                posterior_alpha=alpha, greedy=greedy, generator=generator())
    assert torch.equal(fast, ref)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31), num_trees=st.integers(1, 5), num_nodes=st.integers(0, 9),
       vocab_size=st.sampled_from([2, 5, 16, 50]), shared=st.booleans())
def test_tree_greedy_fast_path_matches_the_reference(seed, num_trees, num_nodes, vocab_size, shared):
    tokens, parents, target, _ = random_tree_batch(seed, num_trees, num_nodes, vocab_size, shared)
    fast = verify_tree_greedy(tokens, parents, target)
    ref = ref_tree.verify_tree_greedy(tokens, parents, target)
    assert torch.equal(fast.token_ids, ref.token_ids)
    assert torch.equal(fast.accepted_nodes, ref.accepted_nodes)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31), num_trees=st.integers(1, 5), num_nodes=st.integers(0, 9),
       vocab_size=st.sampled_from([2, 5, 16, 50]), shared=st.booleans(), with_draft_probs=st.booleans(),
       per_tree=st.booleans())
def test_tree_stochastic_fast_path_matches_the_reference(seed, num_trees, num_nodes, vocab_size, shared,
                                                         with_draft_probs, per_tree):
    tokens, parents, target, draft = random_tree_batch(seed, num_trees, num_nodes, vocab_size, shared)
    draft = draft if with_draft_probs else None

    def generator():
        if per_tree:
            return [torch.Generator().manual_seed(seed + i) if i % 2 else None for i in range(num_trees)]
        return torch.Generator().manual_seed(seed)

    torch.manual_seed(seed)
    fast = verify_tree_stochastic(tokens, parents, target, draft, generator=generator())
    torch.manual_seed(seed)
    ref = ref_tree.verify_tree_stochastic(tokens, parents, target, draft, generator=generator())
    assert torch.equal(fast.token_ids, ref.token_ids)
    assert torch.equal(fast.accepted_nodes, ref.accepted_nodes)


def test_random_trees_accept_deep_paths_so_the_comparison_has_teeth():
    depths = []
    for seed in range(20):
        tokens, parents, target, draft = random_tree_batch(seed, 4, 8, 16, False)
        depths += (verify_tree_greedy(tokens, parents, target).accepted_nodes >= 0).sum(1).tolist()
        out = verify_tree_stochastic(tokens, parents, target, draft, generator=torch.Generator().manual_seed(seed))
        depths += (out.accepted_nodes >= 0).sum(1).tolist()
    assert max(depths) >= 3 and min(depths) == 0  # long accepted paths and immediate rejections both occur


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31), num_reqs=st.integers(1, 5), k=st.integers(0, 5),
       vocab_size=st.sampled_from([3, 16, 40]), with_draft_probs=st.booleans())
def test_tree_verifier_on_chains_equals_rejection_sampling(seed, num_reqs, k, vocab_size, with_draft_probs):
    """A chain is a one-branch tree: with equal k the tree verifier draws the same noise and tokens."""
    gen = torch.Generator().manual_seed(seed)
    counts = [k] * num_reqs
    target = random_probs(gen, (num_reqs * (k + 1),), vocab_size).float()
    draft = random_probs(gen, (num_reqs * k,), vocab_size, sharp=1.0).float() if with_draft_probs else None
    drafts = (torch.multinomial(draft, 1, generator=gen).flatten() if draft is not None and k
              else torch.randint(0, vocab_size, (num_reqs * k,), generator=gen))
    tree = get_verifier("tree")
    for greedy in (True, False):
        flags = torch.full((num_reqs,), greedy)
        expected = rejection_sample(drafts, counts, target, draft, greedy=flags,
                                    generator=torch.Generator().manual_seed(seed), backend="torch")
        torch.manual_seed(seed)  # unseeded requests use the default generator: the same stream
        got = tree.verify(drafts, counts, target, draft, greedy=flags, generators=[None] * num_reqs)
        assert torch.equal(got, expected)
    # One generator per request: both draw k uniforms then one Exp(1) row from it.
    per_request = [torch.Generator().manual_seed(seed + i) for i in range(num_reqs)]
    expected = rejection_sample(drafts, counts, target, draft, generator=per_request, backend="torch")
    per_request = [torch.Generator().manual_seed(seed + i) for i in range(num_reqs)]
    got = tree.verify(drafts, counts, target, draft, greedy=torch.zeros(num_reqs, dtype=torch.bool),
                      generators=per_request)
    assert torch.equal(got, expected)


def test_tree_verifier_mixes_greedy_and_random_ragged_chains():
    gen = torch.Generator().manual_seed(5)
    counts = [2, 0, 3]
    target = random_probs(gen, (sum(counts) + 3,), 8).float()
    drafts = torch.tensor([int(target[0].argmax()), 1, 2, 3, 4])
    out = get_verifier("tree").verify(drafts, counts, target, None, greedy=torch.tensor([True, False, False]),
                                      generators=[None, torch.Generator().manual_seed(1), None])
    assert out.shape == (3, 4) and out.dtype == torch.int64
    assert out[0, 0] == drafts[0]
    assert ((out >= 0).sum(1) >= 1).all() and (out[1, 1:] == -1).all()


def test_tree_verifier_real_trees_and_its_greedy_flags():
    tree = TokenTree.from_paths([[1, 2, 3], [1, 4], [5]])
    tokens, parents = tree.as_tensors()
    target = torch.full((1, tree.num_nodes + 1, 8), 0.01, dtype=torch.float64)
    for slot, best in enumerate([1, 4, 7, 0, 6, 2]):  # root -> 1, node 0 ('1') -> 4, node 3 ('4') -> 6
        target[0, slot, best] = 1.0
    out = get_verifier("tree").verify_trees(tokens, parents, target, greedy=True)
    assert out.token_ids.tolist() == [[1, 4, 6, -1]] and out.accepted_nodes.tolist() == [[0, 3, -1]]


def bench_fast_vs_reference():  # pragma: no cover - run by hand: python tests/samplers/test_verifier_fast_paths.py
    """Median wall time, one thread, inputs already validated (``check_inputs=False`` on the fast path)."""
    import statistics
    import time

    torch.set_num_threads(1)

    def timed(fn, repeat=9):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    gen = torch.Generator().manual_seed(0)
    vocab = 32000
    for label, accept_most in (("random drafts", False), ("likely drafts", True)):
        counts = [4] * 32
        target = random_probs(gen, (sum(counts) + len(counts),), vocab, sharp=4.0).float()
        rows = torch.arange(sum(counts)) + torch.repeat_interleave(torch.arange(32), torch.tensor(counts))
        drafts = target[rows].argmax(-1) if accept_most else torch.randint(0, vocab, (sum(counts),), generator=gen)
        fast = timed(lambda: typical_acceptance_sample(drafts, counts, target, generator=gen, check_inputs=False))
        ref = timed(lambda: ref_typical.typical_acceptance_sample(drafts, counts, target, generator=gen))
        print(f"typical, 32 requests x 4 drafts, vocab {vocab}, {label}: fast {fast:.1f} ms, reference {ref:.1f} ms")
    paths = [[a, b, c] for a in range(4) for b in range(3) for c in range(2)]
    tree = TokenTree.from_paths(paths)
    tokens, parents = tree.as_tensors()
    num_trees = 8
    tokens = tokens.expand(num_trees, -1).contiguous()
    for label, sharp in (("flat target", 1.0), ("peaked target", 6.0)):
        target = random_probs(gen, (num_trees, tree.num_nodes + 1), vocab, sharp=sharp).float()
        target[:, :, :4] += 0.5  # drafts 0..3 likely: deep walks
        target /= target.sum(-1, keepdim=True)
        draft = random_probs(gen, (num_trees, tree.num_nodes), vocab).float()
        for name, fn, kw in (("stochastic", verify_tree_stochastic, {"generator": gen}),
                             ("greedy", verify_tree_greedy, {})):
            args = (tokens, parents, target, draft) if name == "stochastic" else (tokens, parents, target)
            ref_fn = getattr(ref_tree, fn.__name__)
            fast = timed(lambda: fn(*args, check_inputs=False, **kw))
            ref = timed(lambda: ref_fn(*args, **kw))
            print(f"tree {name}, {num_trees} trees x {tree.num_nodes} nodes, vocab {vocab}, {label}: "
                  f"fast {fast:.1f} ms, reference {ref:.1f} ms")


if __name__ == "__main__":  # pragma: no cover
    bench_fast_vs_reference()
