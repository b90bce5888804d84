"""Reference for min-p / top-k / top-p filtering and sampling (sort-based).

Semantics (shared with the Triton kernel of the same name):

Work in float32 on ``l`` = the given logits (already divided by temperature)
and ``e_v = exp(l_v - max(l))`` (probabilities times a constant). Tokens with
``l_v = -inf`` are never kept. Each filter keeps an *upper set* of tokens in
logit order, and the kept set is the intersection, applied in this order:

1. min-p: keep ``v`` iff ``e_v >= min_p`` (that is ``p_v >= min_p * p_max``).
2. top-k: keep ``v`` iff ``l_v >=`` the k-th largest logit (counting
   duplicates), so ties at the boundary are all kept.
3. top-p, on the distribution renormalised over the tokens still kept: keep
   ``v`` iff the mass of kept tokens with a *strictly larger* logit is
   ``< top_p * Z`` (``Z`` = kept mass): the smallest top set reaching
   ``top_p``, ties at the boundary kept. The most likely token is always kept.

Then sample ``argmax_v [kept_v and e_v > 0] * e_v / E_v`` with the given
``E ~ Exp(1)`` noise (see :mod:`servelab._internal.sampling_noise`):
exactly a draw from the kept tokens in proportion to their probabilities.
Ties go to the lowest token id.

Exactness against the kernel: min-p and top-k thresholds are the same
numbers in both (no arithmetic beyond ``exp``); the top-p cut compares sums
that the two implementations accumulate in different orders, so a row whose
cumulative mass lies within float32 rounding of ``top_p * Z`` may be cut one
token differently. On random inputs the sampled tokens agree exactly.
"""

from __future__ import annotations

import torch

from servelab._internal.sampling_checks import check_sampling_inputs
# The keep mask is shared with the sampler's fast path (compute_probs), so it
# lives in a neutral private module; it is part of this reference's API.
from servelab._internal.sampling_filters import top_k_top_p_keep_mask

__all__ = ["top_k_top_p_keep_mask", "top_k_top_p_sample"]


def top_k_top_p_sample(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    exponential_noise: torch.Tensor,
    *,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Sample one token per row from the min-p/top-k/top-p filtered distribution.

    Args:
        logits: float ``[num_rows, vocab]`` (any float dtype; computed in
            float32), temperature already applied.
        top_k: int ``[num_rows]`` or None; entries <= 0 or >= vocab disable it.
        top_p: float ``[num_rows]`` in (0, 1] or None; 1 disables it.
        min_p: float ``[num_rows]`` in [0, 1] or None; 0 disables it.
        exponential_noise: float ``[num_rows, vocab]`` of Exp(1) draws.
        check_inputs: validate shapes, dtypes and value ranges (the range
            checks synchronise with the device; callers that built the inputs
            from validated ``SamplingParams`` pass False).

    Returns:
        int64 ``[num_rows]`` sampled token ids.
    """
    if check_inputs:
        check_sampling_inputs(logits, top_k, top_p, min_p, exponential_noise)
    logits32 = logits.float()
    keep = top_k_top_p_keep_mask(logits32, top_k, top_p, min_p)
    weights = torch.exp(logits32 - logits32.max(dim=-1, keepdim=True).values)
    usable = keep & (weights > 0)
    scores = torch.where(usable, weights / exponential_noise.float(), -1.0)
    return scores.argmax(dim=-1)
