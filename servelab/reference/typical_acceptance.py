"""Reference typical acceptance (Medusa) for speculative decoding: a per-request loop.

Same ragged layout as ``rejection_sample`` (no draft probabilities: the rule
looks at the target only). Draft ``x_j`` is accepted while

    p_j(x_j) > min(posterior_threshold, posterior_alpha * exp(-H(p_j)))

with ``H`` the entropy (nats) of the target row. The first draft that fails
stops the walk; then one token is emitted from the target row where it
stopped (the bonus row if all drafts passed): its argmax for greedy requests,
else a sample of it (exponential race against one Exp(1) row per request,
drawn by :func:`servelab._internal.sampling_noise.draw_request_noise`; greedy
requests consume none). Unlike rejection sampling this does not preserve the
target distribution: it trades exactness for more accepted tokens at high
entropy, where a plausible draft is accepted even if the target would rarely
pick it.

Computed in float32, or float64 when ``target_probs`` is float64. The fast
path is :func:`servelab.samplers.verifiers.typical_acceptance_sample`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from servelab._internal.sampling_checks import check_draft_batch, check_typical_options, compute_dtype
from servelab._internal.sampling_noise import draw_request_noise


def typical_acceptance_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    *,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    check_inputs: bool = True,
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
        check_inputs: validate shapes, ids and probabilities (NaN, negative, all-zero rows).
    """
    threshold, alpha = check_typical_options(posterior_threshold, posterior_alpha)
    batch = check_draft_batch(draft_token_ids, num_draft_tokens, target_probs, None, greedy, generator,
                              check_inputs=check_inputs)
    device = target_probs.device
    out = torch.full((batch.num_reqs, batch.max_draft + 1), -1, dtype=torch.int64, device=device)
    if batch.num_reqs == 0:
        return out
    target = target_probs.to(compute_dtype(target_probs))
    drafts = draft_token_ids.tolist()
    greedy_rows = [row for row, flag in enumerate(batch.greedy) if flag]
    noise = draw_request_noise(batch.num_reqs, batch.vocab_size, device, generator, skip_rows=greedy_rows)
    for request, k in enumerate(batch.num_draft_tokens):
        start = batch.draft_offsets[request]
        first_row = start + request  # every earlier request also owns a bonus row
        accepted: list[int] = []
        for j in range(k):
            row = target[first_row + j]
            entropy = float(-torch.special.xlogy(row, row).sum())
            token = drafts[start + j]
            if not float(row[token]) > min(threshold, alpha * math.exp(-entropy)):
                break
            accepted.append(token)
        stop_row = target[first_row + len(accepted)]
        if batch.greedy[request]:
            final = int(stop_row.argmax())
        else:
            final = int(torch.where(stop_row > 0, stop_row / noise[request], -1.0).argmax())
        out[request, : len(accepted) + 1] = torch.tensor([*accepted, final], dtype=torch.int64)
    return out
