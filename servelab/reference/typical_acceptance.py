"""Reference typical acceptance (Medusa) for speculative decoding.

Same ragged layout as ``rejection_sample`` (no draft probabilities: the rule
looks at the target only). Draft ``x_j`` is accepted while

    p_j(x_j) > min(posterior_threshold, posterior_alpha * exp(-H(p_j)))

with ``H`` the entropy (nats) of the target row. The first draft that fails
stops the walk; then one token is emitted from the target row where it
stopped (the bonus row if all drafts passed): its argmax for greedy requests,
else a sample of it (exponential race with per-request noise). Unlike
rejection sampling this does not preserve the target distribution: it trades
exactness for more accepted tokens at high entropy, where a plausible draft
is accepted even if the target would rarely pick it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from servelab.reference._draft_layout import DraftIndex
from servelab.reference._sampling_checks import check_draft_batch
from servelab.reference._sampling_noise import draw_exponential_noise


def _check_positive(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} = {value} is invalid; valid: finite and > 0")
    return float(value)


def typical_acceptance_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    *,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:
    """Medusa's typical acceptance; returns int64 ``[num_reqs, max(k_i) + 1]`` padded with -1.

    Args:
        draft_token_ids: int ``[sum(k_i)]``, request *i* owns ``k_i`` consecutive entries.
        num_draft_tokens: ``k_i`` per request (list or 1-D int tensor; 0 allowed).
        target_probs: float ``[sum(k_i + 1), vocab]``, per request its draft rows then a bonus row.
        posterior_threshold: the hard cap ``epsilon`` on the acceptance threshold (Medusa: 0.09).
        posterior_alpha: the entropy scale ``delta`` (Medusa: 0.3, about sqrt(epsilon)).
        greedy: bool or bool ``[num_reqs]``: emit the argmax instead of a sample at the stop.
        generator: None, one generator, or one (or None) per request.
    """
    threshold = _check_positive("posterior_threshold", posterior_threshold)
    posterior_alpha = _check_positive("posterior_alpha", posterior_alpha)
    batch = check_draft_batch(draft_token_ids, num_draft_tokens, target_probs, None, greedy, generator)
    device = target_probs.device
    num_reqs, max_draft, vocab_size = batch.num_reqs, batch.max_draft, batch.vocab_size
    if num_reqs == 0:
        return torch.full((0, max_draft + 1), -1, dtype=torch.int64, device=device)

    target = target_probs.float()
    draft_ids = draft_token_ids.long()
    index = DraftIndex.build(batch, device)
    draft_rows = target[index.target_row_of_draft]
    entropy = -torch.special.xlogy(draft_rows, draft_rows).sum(dim=-1)
    bar = torch.clamp(posterior_alpha * torch.exp(-entropy), max=threshold)
    accept = draft_rows.gather(1, draft_ids[:, None]).squeeze(1) > bar
    num_accepted = index.leading_accepts(accept)

    stop_rows = target[index.stop_rows(num_accepted)]
    greedy_rows = [row for row, flag in enumerate(batch.greedy) if flag]
    if isinstance(generator, Sequence):
        seeded = {row: gen for row, gen in enumerate(generator) if gen is not None}
        noise = draw_exponential_noise(num_reqs, vocab_size, device, generators=seeded, skip_rows=greedy_rows)
    else:
        noise = draw_exponential_noise(num_reqs, vocab_size, device, generator=generator, skip_rows=greedy_rows)
    sampled = torch.where(stop_rows > 0, stop_rows / noise, -1.0).argmax(dim=-1)
    is_greedy = torch.tensor(batch.greedy, dtype=torch.bool, device=device)
    final_token = torch.where(is_greedy, stop_rows.argmax(dim=-1), sampled)
    return index.assemble(draft_ids, num_accepted, final_token)
