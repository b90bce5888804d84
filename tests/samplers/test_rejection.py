"""rejection_sample: hand-built cases, kernel vs reference, per-position target distribution."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_stats import assert_distributed_as

from servelab.kernels.rejection_sample import rejection_sample as kernel_rejection
from servelab.reference.rejection_sample import rejection_sample as reference_rejection
from servelab.samplers import rejection_sample

pytestmark = pytest.mark.interpreter
IMPLEMENTATIONS = [kernel_rejection, reference_rejection]


def one_hot_rows(tokens, vocab_size):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab_size).float()


def peaked_rows(argmaxes, vocab_size):
    """Rows whose argmax is the given token but every token has some mass."""
    rows = torch.full((len(argmaxes), vocab_size), 0.1)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.5
    return rows / rows.sum(dim=1, keepdim=True)


GREEDY_CASES = {
    # name: (drafts, argmax of each target row incl. bonus, expected output row)
    "all accepted + bonus": ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),
    "first rejected": ([0, 2], [1, 2, 0], [1, -1, -1, -1]),
    "middle rejected": ([1, 0, 3], [1, 2, 3, 0], [1, 2, -1, -1]),
    "zero drafts": ([], [0], [0, -1, -1, -1]),
}


def batch_of(cases, vocab_size, row_builder):
    drafts, counts, rows, expected = [], [], [], []
    for draft, argmaxes, out in cases:
        drafts += draft
        counts.append(len(draft))
        rows.append(row_builder(argmaxes, vocab_size))
        expected.append(out)
    return torch.tensor(drafts, dtype=torch.int64), counts, torch.cat(rows), torch.tensor(expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_greedy_hand_built_cases(implementation):
    drafts, counts, target, expected = batch_of(GREEDY_CASES.values(), 5, peaked_rows)
    assert torch.equal(implementation(drafts, counts, target, greedy=True), expected)
    # The same batch as a per-request flag, and with draft probabilities present (ignored by greedy).
    flags = torch.ones(len(counts), dtype=torch.bool)
    draft_probs = torch.full((drafts.numel(), 5), 0.2)
    assert torch.equal(implementation(drafts, counts, target, draft_probs, greedy=flags), expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_random_mode_cases_with_forced_outcomes(implementation, with_draft_probs):
    # One-hot targets force every decision: p(x) = 1 always accepts, p(x) = 0 always
    # rejects, and the residual max(p - q, 0) is then all on the target's token.
    drafts, counts, target, expected = batch_of(GREEDY_CASES.values(), 5, one_hot_rows)
    draft_probs = torch.full((drafts.numel(), 5), 0.2) if with_draft_probs else None
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(implementation(drafts, counts, target, draft_probs, generator=gen), expected)


def test_greedy_and_random_requests_mix_in_one_batch():
    drafts = torch.tensor([2, 2])
    target = torch.cat([peaked_rows([1, 3], 4), one_hot_rows([2, 3], 4)])
    flags = torch.tensor([True, False])
    for implementation in IMPLEMENTATIONS:
        out = implementation(drafts, [1, 1], target, greedy=flags, generator=torch.Generator().manual_seed(1))
        assert out.tolist() == [[1, -1], [2, 3]]


def random_batch(seed, num_reqs, vocab_size, max_draft, with_draft_probs):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_draft + 1, (num_reqs,), generator=gen).tolist()
    total = sum(counts)
    target = torch.softmax(torch.randn(total + num_reqs, vocab_size, generator=gen) * 2, dim=-1)
    draft_probs = torch.softmax(torch.randn(total, vocab_size, generator=gen) * 2, dim=-1) if with_draft_probs else None
    drafts = torch.randint(0, vocab_size, (total,), generator=gen)
    rows = torch.arange(total) + torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(counts))
    take_argmax = torch.rand(total, generator=gen) < 0.5  # so greedy requests accept some drafts
    drafts = torch.where(take_argmax, target[rows].argmax(dim=-1), drafts)
    greedy = torch.rand(num_reqs, generator=gen) < 0.3
    return drafts, counts, target, draft_probs, greedy


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31), num_reqs=st.integers(1, 7), vocab_size=st.sampled_from([1, 3, 16, 100, 1500]),
       max_draft=st.integers(0, 5), with_draft_probs=st.booleans(), per_request_generators=st.booleans())
def test_kernel_matches_reference_on_random_inputs(seed, num_reqs, vocab_size, max_draft, with_draft_probs,
                                                   per_request_generators):
    drafts, counts, target, draft_probs, greedy = random_batch(seed, num_reqs, vocab_size, max_draft, with_draft_probs)

    def generators():
        if per_request_generators:
            return [torch.Generator().manual_seed(seed + i) if i % 2 == 0 else None for i in range(num_reqs)]
        return torch.Generator().manual_seed(seed)

    torch.manual_seed(seed)  # requests without their own generator use the default one
    expected = reference_rejection(drafts, counts, target, draft_probs, greedy=greedy, generator=generators())
    torch.manual_seed(seed)
    actual = kernel_rejection(drafts, counts, target, draft_probs, greedy=greedy, generator=generators())
    assert torch.equal(actual, expected)
    assert actual.shape == (num_reqs, max(counts) + 1)
    num_emitted = (actual >= 0).sum(dim=1)
    assert bool(((num_emitted >= 1) & (num_emitted <= torch.tensor(counts) + 1)).all())


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_each_emitted_token_is_distributed_as_the_target(k, with_draft_probs):
    """Per position j, the emitted token (when position j is reached) follows p_j.

    60k requests share position-wise p_j, q_j (a model whose distributions do not
    depend on the prefix), drafts drawn from q_j. Bound: chi-square p >= 1e-4 at
    every position; power: at position 0 the counts must reject what a sampler
    that recovers from p instead of the residual would produce.
    """
    vocab_size, num_reqs = 6, 60_000
    gen = torch.Generator().manual_seed(100 * k + with_draft_probs)
    peaks = torch.nn.functional.one_hot(torch.randint(0, vocab_size, (k + 1,), generator=gen), vocab_size)
    p = torch.softmax(torch.randn(k + 1, vocab_size, generator=gen) + 2.5 * peaks, dim=-1)
    # A draft close to the target (as a useful drafter is), so deep positions are reached often.
    q = 0.7 * p[:k] + 0.3 * torch.softmax(torch.randn(k, vocab_size, generator=gen), dim=-1)
    # Without draft probabilities (an n-gram drafter) the draft is usually the target's favourite.
    draw_from = q if with_draft_probs else 0.8 * peaks[:k] + 0.2 * q
    drafts = torch.stack([torch.multinomial(draw_from[j], num_reqs, replacement=True, generator=gen)
                          for j in range(k)], dim=1)
    out = rejection_sample(
        drafts.flatten(),
        [k] * num_reqs,
        p.repeat(num_reqs, 1),
        q.repeat(num_reqs, 1) if with_draft_probs else None,
        generator=torch.Generator().manual_seed(7),
        backend="torch",
    )
    # Wrong (power check): emit accepted drafts, but recover from p instead of max(p - q, 0).
    accept_mass = torch.minimum(p[0], q[0]) if with_draft_probs else draw_from[0] * p[0]
    wrong = accept_mass + (1 - accept_mass.sum()) * p[0]
    for position in range(k + 1):
        column = out[:, position]
        reached = column[column >= 0]
        assert reached.numel() > 1_000  # enough samples for the chi-square approximation at every position
        assert_distributed_as(reached, p[position], wrong=wrong if position == 0 else None,
                              label=f"k={k} position {position}")


def test_per_request_generators_make_requests_independent_of_the_batch():
    drafts, counts, target, draft_probs, _ = random_batch(5, 6, 50, 4, True)
    gens = [torch.Generator().manual_seed(40 + i) for i in range(6)]
    batched = reference_rejection(drafts, counts, target, draft_probs, generator=gens)
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    for i in range(6):
        alone = reference_rejection(
            drafts[offsets[i]:offsets[i + 1]], [counts[i]], target[offsets[i] + i: offsets[i + 1] + i + 1],
            draft_probs[offsets[i]:offsets[i + 1]], generator=[torch.Generator().manual_seed(40 + i)],
        )
        assert alone[0].tolist() == batched[i, : alone.shape[1]].tolist()


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"num_draft_tokens": [2, -1]}, ValueError, r"num_draft_tokens\[1\] = -1 is negative"),
        ({"num_draft_tokens": [1, 1]}, ValueError, r"draft_token_ids has 1 entries but sum\(num_draft_tokens\) = 2"),
        ({"target_probs": torch.full((2, 4), 0.25)}, ValueError, r"target_probs has 2 rows but sum\(num_draft_tokens \+ 1\) = 3"),
        ({"draft_token_ids": torch.tensor([4])}, ValueError, r"draft_token_ids holds 4, outside the vocabulary; valid: \[0, 4\)"),
        ({"draft_token_ids": torch.tensor([1.0])}, TypeError, r"draft_token_ids must be an integer tensor"),
        ({"draft_probs": torch.full((2, 4), 0.25)}, ValueError, r"draft_probs must have shape \[sum\(num_draft_tokens\), vocab\]"),
        ({"greedy": torch.tensor([1, 0])}, ValueError, r"greedy must be a bool or a bool tensor with one entry per request"),
        ({"greedy": "yes"}, TypeError, r"greedy must be a bool"),
        ({"generator": [None]}, ValueError, r"generator holds 1 entries"),
        ({"generator": 3}, TypeError, r"generator must be None, a torch.Generator"),
    ],
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_inputs_are_refused(implementation, kwargs, error, pattern):
    args = {"draft_token_ids": torch.tensor([1]), "num_draft_tokens": [1, 0], "target_probs": torch.full((3, 4), 0.25),
            "draft_probs": None, "greedy": False, "generator": None}
    args.update(kwargs)
    greedy, generator = args.pop("greedy"), args.pop("generator")
    with pytest.raises(error, match=pattern):
        implementation(*args.values(), greedy=greedy, generator=generator)


def test_public_entry_point_picks_backends_and_handles_empty_batches():
    drafts, counts, target, expected = batch_of(GREEDY_CASES.values(), 5, peaked_rows)
    for backend in ("auto", "torch", "triton"):
        assert torch.equal(rejection_sample(drafts, counts, target, greedy=True, backend=backend), expected)
    empty = rejection_sample(torch.zeros(0, dtype=torch.int64), [], torch.zeros(0, 5))
    assert empty.shape == (0, 1)
    with pytest.raises(ValueError, match="unknown sampling backend 'gpu'; known: 'auto', 'torch', 'triton'"):
        rejection_sample(drafts, counts, target, backend="gpu")
