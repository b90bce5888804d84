"""The min-p / top-k / top-p keep mask, shared by the sampler's fast path and the references.

Semantics are documented in :mod:`servelab.reference.sampling` (the reference
sampling op is this mask plus an exponential race); the Triton kernel
implements the same thresholds without a sort. The mask lives here because
:meth:`servelab.samplers.Sampler.compute_probs` (fast path) and the draft-model
drafter need it too, and no fast-path module imports the references.
"""

from __future__ import annotations

import torch


def top_k_top_p_keep_mask(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool ``[num_rows, vocab]``: the tokens min-p, top-k and top-p keep.

    ``logits`` float ``[num_rows, vocab]``; ``top_k`` int ``[num_rows]``
    (entries <= 0 or >= vocab disable it for that row); ``top_p`` float
    ``[num_rows]`` in (0, 1] (1 disables); ``min_p`` float ``[num_rows]`` in
    [0, 1] (0 disables). ``None`` disables a filter for every row.
    """
    logits = logits.float()
    num_rows, vocab_size = logits.shape
    max_logit = logits.max(dim=-1, keepdim=True).values
    weights = torch.exp(logits - max_logit)
    keep = logits > float("-inf")
    if min_p is not None:
        keep &= weights >= min_p.float()[:, None]
    if top_k is not None:
        k = top_k.long()
        active = (k > 0) & (k < vocab_size)
        if bool(active.any()):
            masked = logits.masked_fill(~keep, float("-inf"))
            # The k largest values in descending order (torch.topk keeps duplicates),
            # so column k - 1 is the k-th largest logit counting ties.
            largest = masked.topk(int(k[active].max()), dim=-1).values
            kth_value = largest.gather(1, (k.clamp(1, largest.shape[1]) - 1)[:, None])
            keep &= (logits >= kth_value) | ~active[:, None]
    if top_p is not None and bool((top_p < 1).any()):
        masked = logits.masked_fill(~keep, float("-inf"))
        # Only kept tokens carry mass, and they are the largest values of
        # `masked`: sorting the top `width` of each row is the full sort's head.
        width = max(int(keep.sum(dim=-1).max()), 1)
        sorted_logits, order = masked.topk(width, dim=-1)
        sorted_weights = torch.where(keep, weights, 0.0).gather(1, order)
        total = sorted_weights.sum(dim=-1, keepdim=True)
        mass_before = sorted_weights.cumsum(dim=-1) - sorted_weights  # exclusive prefix sums
        # mass_before is non-decreasing, so the tokens passing the test form a
        # prefix; the cut value is the logit at its end, and every token tied
        # with it is kept too (their strictly-larger mass is no bigger). Within
        # a run of ties the order does not matter: the first of the run sees
        # exactly the mass strictly above it.
        num_passing = (mass_before < top_p.float()[:, None] * total).sum(dim=-1, keepdim=True)
        cut_value = sorted_logits.gather(1, (num_passing - 1).clamp(min=0))
        keep &= (logits >= cut_value) | (top_p >= 1)[:, None]
    return keep
