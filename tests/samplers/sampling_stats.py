"""Goodness-of-fit helpers for the distribution tests (no scipy needed).

Every distribution test draws ``n`` samples with a fixed seed and computes
Pearson's chi-square statistic against the exact expected distribution.
The test passes when the p-value is at least ``P_VALUE_FLOOR``: a correct
sampler fails such a check with probability 1e-4 on a fresh seed. To show a
test has power (it can fail), the same counts are also checked against a
nearby wrong distribution, which must be rejected with p < ``POWER_CEILING``.
"""

from __future__ import annotations

import torch

P_VALUE_FLOOR = 1e-4
POWER_CEILING = 1e-6


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of ``counts`` against ``expected_probs``.

    Categories with expected count below 5 are pooled into one (the usual
    validity rule). A positive count in a zero-probability category gives 0.
    """
    counts = counts.double().flatten()
    probs = expected_probs.double().flatten()
    probs = probs / probs.sum()
    total = counts.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    expected = probs * total
    big = expected >= 5
    observed_bins = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected_bins = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = expected_bins > 0
    observed_bins, expected_bins = observed_bins[keep], expected_bins[keep]
    dof = observed_bins.numel() - 1
    if dof < 1:
        return 1.0
    statistic = ((observed_bins - expected_bins) ** 2 / expected_bins).sum()
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def assert_distributed_as(samples: torch.Tensor, expected_probs: torch.Tensor, *, wrong: torch.Tensor | None = None,
                          label: str = "") -> None:
    """Assert integer ``samples`` follow ``expected_probs`` (chi-square p >= P_VALUE_FLOOR).

    ``wrong``: a distribution the samples must *not* pass as (power check).
    """
    vocab_size = expected_probs.numel()
    counts = torch.bincount(samples.long().flatten(), minlength=vocab_size).double()
    assert counts.numel() == vocab_size, f"{label}: sample outside the vocabulary"
    p_value = chi_square_p_value(counts, expected_probs)
    assert p_value >= P_VALUE_FLOOR, (
        f"{label}: chi-square p = {p_value:.2e} < {P_VALUE_FLOOR} over {int(counts.sum())} samples; "
        f"observed {(counts / counts.sum()).tolist()} expected {expected_probs.tolist()}"
    )
    if wrong is not None:
        wrong_p = chi_square_p_value(counts, wrong)
        assert wrong_p < POWER_CEILING, f"{label}: the test cannot tell the wrong distribution apart (p = {wrong_p:.2e})"
