"""The n-gram drafter, the drafter interface, and acceptance-rate bookkeeping."""

import pytest
import torch

from servelab.samplers import (
    AcceptanceStats,
    DraftProposal,
    Drafter,
    NgramDrafter,
    num_accepted_tokens,
    rejection_sample,
)


def test_ngram_prefers_the_longest_then_the_latest_match():
    drafter = NgramDrafter(min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    # Suffix [5, 1, 2] never occurred before; [1, 2] did, latest at 4 -> continue with 3, 5, 1.
    assert drafter.propose(history, 3) == [3, 5, 1]
    assert drafter.propose(history, 1) == [3]
    # A longer match wins over a more recent shorter one: [9, 7] matches at 0, [7] alone also at 3.
    assert drafter.propose([9, 7, 8, 7, 6, 9, 7], 2) == [8, 7]
    assert NgramDrafter(min_n=1, max_n=1).propose([9, 7, 8, 7, 6, 9, 7], 2) == [6, 9]


def test_ngram_returns_short_or_empty_proposals():
    drafter = NgramDrafter(min_n=2, max_n=3)
    assert drafter.propose([1, 2, 3], 4) == []  # no repeated bigram
    assert drafter.propose([5, 6, 5, 6], 4) == [5, 6]  # the match runs into the end of the history
    assert drafter.propose([], 2) == [] and drafter.propose([4], 2) == []
    assert drafter.propose([5, 6, 5, 6], 0) == []
    assert drafter.propose(torch.tensor([5, 6, 5, 6]), 1) == [5]
    assert drafter.propose_with_probs([5, 6, 5, 6], 2) == DraftProposal([5, 6], None)
    assert drafter.propose_batch([[5, 6, 5, 6], [1, 2]], 1) == [[5], []]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"min_n": 0}, r"min_n = 0"), ({"max_n": 1.5}, r"max_n = 1.5"), ({"min_n": 3, "max_n": 2}, r"min_n = 3 exceeds")],
)
def test_ngram_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        NgramDrafter(**kwargs)


def test_bad_propose_arguments():
    with pytest.raises(ValueError, match=r"k = -1 is invalid"):
        NgramDrafter().propose([1, 2], -1)
    with pytest.raises(TypeError, match="token_ids must be a sequence of ints"):
        NgramDrafter().propose("abc", 1)


class ConstantModelDrafter(Drafter):
    """What a draft-model drafter looks like: tokens plus the distributions they came from."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def propose_with_probs(self, token_ids, k):
        probs = torch.full((k, self.vocab_size), 1.0 / self.vocab_size)
        return DraftProposal([token_ids[-1]] * k, probs)


def test_a_model_drafter_feeds_rejection_sampling_through_the_same_interface():
    drafter = ConstantModelDrafter(vocab_size=4)
    proposal = drafter.propose_with_probs([3, 1], 2)
    assert drafter.propose([3, 1], 2) == [1, 1]
    target = torch.zeros(3, 4)
    target[:, 1] = 1.0  # the target agrees: both drafts accepted, bonus 1
    out = rejection_sample(torch.tensor(proposal.token_ids), [2], target, proposal.probs)
    assert out.tolist() == [[1, 1, 1]]


def test_acceptance_stats_per_step_and_per_position():
    stats = AcceptanceStats()
    step1 = torch.tensor([[5, 6, 7, 8], [5, -1, -1, -1], [9, -1, -1, -1]])
    stats.update_from_output(step1, [3, 2, 0])  # accepted 3, 0, 0
    stats.update([2], [1])
    assert num_accepted_tokens(step1).tolist() == [3, 0, 0]
    assert stats.num_request_steps == 4
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (7, 4)
    assert stats.proposed_per_position == [3, 3, 1]
    assert stats.accepted_per_position == [2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(4 / 7)
    assert stats.mean_accepted_per_step == pytest.approx(1.0)
    assert stats.mean_emitted_per_step == pytest.approx(2.0)
    assert stats.per_position_acceptance_rate == pytest.approx([2 / 3, 1 / 3, 1.0])
    assert AcceptanceStats().acceptance_rate == 0.0 and AcceptanceStats().mean_emitted_per_step == 0.0
    with pytest.raises(ValueError, match=r"request 0: num_accepted = 3 with 2 drafts"):
        stats.update([2], [3])
    with pytest.raises(ValueError, match="num_draft_tokens has 2 entries but num_accepted 1"):
        stats.update([2, 1], [0])
