"""Typical acceptance (Medusa rule) on hand-built and random cases."""

import math

import pytest
import torch
from sampling_stats import assert_distributed_as

from servelab.samplers import typical_acceptance_sample


def test_hand_built_low_and_high_entropy_rows():
    peaked = torch.tensor([0.9, 0.05, 0.05] + [0.0] * 7)  # H = 0.39: bar = min(0.09, 0.3 * e^-0.39 = 0.20) = 0.09
    flat = torch.full((10,), 0.1)  # H = ln 10: bar = min(0.09, 0.3 * 0.1) = 0.03
    bonus = torch.zeros(10)
    bonus[6] = 1.0
    target = torch.stack([peaked, flat, bonus, peaked, flat])
    out = typical_acceptance_sample(torch.tensor([0, 7, 1]), [2, 1], target, greedy=True)
    # Request 0: 0 is typical under the peaked row, 7 under the flat one, bonus argmax 6.
    # Request 1: 1 has p = 0.05 <= 0.09 -> rejected; the argmax of that row (0) is emitted.
    assert out.tolist() == [[0, 7, 6], [0, -1, -1]]
    # threshold 0.5, alpha 1.5: the flat row's bar becomes min(0.5, 0.15) = 0.15 >= 0.1, so 7 is rejected
    # and the flat row's argmax (0, first of equals) is emitted; the peaked row's bar is 0.5 < 0.9.
    strict = typical_acceptance_sample(torch.tensor([0, 7, 1]), [2, 1], target, posterior_threshold=0.5,
                                       posterior_alpha=1.5, greedy=True)
    assert strict.tolist() == [[0, 0, -1], [0, -1, -1]]


def test_matches_the_rule_draft_by_draft_on_random_inputs():
    gen = torch.Generator().manual_seed(3)
    counts = [3, 0, 5, 2, 4]
    total, vocab_size = sum(counts), 12
    target = torch.softmax(torch.randn(total + len(counts), vocab_size, generator=gen) * 2.5, dim=-1)
    drafts = torch.randint(0, 3, (total,), generator=gen)  # small ids: often the typical ones
    out = typical_acceptance_sample(drafts, counts, target, posterior_threshold=0.2, posterior_alpha=0.4, greedy=True)
    start, accepted_somewhere = 0, False
    for row, k in enumerate(counts):
        expected = []
        for j in range(k):
            probs = target[start + row + j].double()
            entropy = -sum(float(x) * math.log(float(x)) for x in probs if x > 0)
            token = int(drafts[start + j])
            if not probs[token] > min(0.2, 0.4 * math.exp(-entropy)):
                break
            expected.append(token)
        accepted_somewhere |= bool(expected)
        expected.append(int(target[start + row + len(expected)].argmax()))
        assert out[row, : len(expected)].tolist() == expected
        assert (out[row, len(expected):] == -1).all()
        start += k
    assert accepted_somewhere


def test_random_final_token_follows_the_stop_row():
    num_reqs, vocab_size = 30_000, 5
    row = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    target = row.expand(2 * num_reqs, -1)
    drafts = torch.zeros(num_reqs, dtype=torch.int64)  # p = 0.05, never typical: stop at row 0
    out = typical_acceptance_sample(drafts, [1] * num_reqs, target, generator=torch.Generator().manual_seed(0))
    assert (out[:, 1] == -1).all()
    assert_distributed_as(out[:, 0], row, wrong=torch.tensor([0.0, 0.45, 0.3, 0.2, 0.05]), label="typical final")


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"posterior_threshold": 0.0}, ValueError, r"posterior_threshold = 0.0 is invalid; valid: finite and > 0"),
        ({"posterior_alpha": float("inf")}, ValueError, r"posterior_alpha = inf"),
        ({"posterior_alpha": "0.3"}, TypeError, r"posterior_alpha must be a real number"),
        ({"num_draft_tokens": [2]}, ValueError, r"draft_token_ids has 1 entries"),
    ],
)
def test_bad_inputs(kwargs, error, pattern):
    args = {"draft_token_ids": torch.tensor([1]), "num_draft_tokens": [1], "target_probs": torch.full((2, 4), 0.25)}
    options = {name: kwargs.pop(name) for name in list(kwargs) if name.startswith("posterior")}
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        typical_acceptance_sample(*args.values(), **options)
