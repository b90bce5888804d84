"""Reference rejection sampler for speculative decoding (vectorised PyTorch).

Contract (the sampler layer's verification contract), shared with the Triton kernel:

- ``draft_token_ids`` int ``[sum(k_i)]``: request *i* owns ``k_i =
  num_draft_tokens[i]`` consecutive entries (``k_i`` may be 0).
- ``target_probs`` float ``[sum(k_i + 1), vocab]``: request *i*'s rows are
  contiguous, one per draft position then one bonus row; probabilities after
  the sampler's processing (temperature, top-k/p...).
- ``draft_probs`` float ``[sum(k_i), vocab]``, or None for drafts that came
  without a distribution (n-gram): treated as one-hot on the draft token.
- ``greedy``: a bool, or a bool tensor ``[num_reqs]``.
- Output int64 ``[num_reqs, max(k_i) + 1]``: accepted drafts, then one
  recovered or bonus token, then ``-1`` padding.

Greedy: accept draft ``x_j`` while ``x_j == argmax p_j``; then emit
``argmax`` of the row where it stopped (the bonus row if all were accepted).

Random: accept ``x_j`` iff ``u_j * q_j(x_j) < p_j(x_j)`` (that is with
probability ``min(1, p/q)``); at the first rejection emit a sample of
``normalize(max(p_j - q_j, 0))`` and stop; if all are accepted emit a sample
of the bonus row. Each emitted token is then distributed exactly as the
target. A residual with no positive mass (only possible through rounding)
falls back to ``p_j``. Samples use the exponential race with noise from
:func:`servelab._internal.sampling_noise.draw_rejection_noise`, which both
implementations call identically, so the same generator state gives the same
tokens. ``generator`` may also be a list with one generator (or None) per
request, which keeps seeded requests independent of the batch.
``check_inputs=True`` (the default) refuses NaN, infinite or negative
probabilities and rows without mass in ``target_probs`` / ``draft_probs`` with
a ``ValueError`` naming the argument and row; ``check_inputs=False`` skips
these, the shape/dtype checks and the vocabulary range check of the draft ids
(all of which synchronise with the device).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab._internal.draft_layout import DraftIndex
from servelab._internal.sampling_checks import check_draft_batch
from servelab._internal.sampling_noise import draw_rejection_noise


def _race(weights: torch.Tensor, exponential: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exponential race per row: (winner index, whether any weight was positive)."""
    scores = torch.where(weights > 0, weights / exponential, -1.0)
    best = scores.max(dim=-1)
    return best.indices, best.values >= 0


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Verify ragged drafts against the target; see the module docstring."""
    batch = check_draft_batch(
        draft_token_ids, num_draft_tokens, target_probs, draft_probs, greedy, generator, check_inputs=check_inputs
    )
    device = target_probs.device
    num_reqs, max_draft, vocab_size = batch.num_reqs, batch.max_draft, batch.vocab_size
    if num_reqs == 0:
        return torch.full((0, max_draft + 1), -1, dtype=torch.int64, device=device)
    greedy_rows = [row for row, flag in enumerate(batch.greedy) if flag]
    uniform, exponential = draw_rejection_noise(
        batch.num_draft_tokens, vocab_size, device, generator, skip_requests=greedy_rows
    )

    target = target_probs.float()
    draft_ids = draft_token_ids.long()
    index = DraftIndex.build(batch, device)
    is_greedy = torch.tensor(batch.greedy, dtype=torch.bool, device=device)
    request_index = torch.arange(num_reqs, device=device)
    total = draft_ids.shape[0]

    draft_rows = target[index.target_row_of_draft]
    p_of_draft = draft_rows.gather(1, draft_ids[:, None]).squeeze(1)
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.float().gather(1, draft_ids[:, None]).squeeze(1)
    accept_random = uniform * q_of_draft < p_of_draft
    accept_greedy = draft_rows.argmax(dim=-1) == draft_ids
    accept = torch.where(is_greedy[index.request_of_draft], accept_greedy, accept_random)
    num_accepted = index.leading_accepts(accept)
    rejected = num_accepted < index.counts

    final_rows = target[index.stop_rows(num_accepted)]  # [num_reqs, vocab]
    # The draft distribution at the rejected position (rows without a
    # rejection read some other row here; their weights ignore it).
    q_rows = torch.zeros_like(final_rows)
    if total:
        rejected_position = (index.starts + num_accepted).clamp(max=total - 1)
        if draft_probs is None:
            q_rows[request_index, draft_ids[rejected_position]] = 1.0
        else:
            q_rows = draft_probs.float()[rejected_position]
    residual = (final_rows - q_rows).clamp(min=0.0)
    weights = torch.where(rejected[:, None], residual, final_rows)
    sampled, has_mass = _race(weights, exponential)
    fallback, _ = _race(final_rows, exponential)
    sampled = torch.where(has_mass, sampled, fallback)
    final_token = torch.where(is_greedy, final_rows.argmax(dim=-1), sampled)
    return index.assemble(draft_ids, num_accepted, final_token)
