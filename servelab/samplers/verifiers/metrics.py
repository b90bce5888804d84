"""Acceptance-rate bookkeeping for speculative decoding (pipeline metrics)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def num_accepted_tokens(output_token_ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[num_reqs]``: accepted drafts per request of a verifier output.

    ``output_token_ids`` int ``[num_reqs, max_k + 1]`` as returned by
    ``rejection_sample`` / ``typical_acceptance_sample`` (or a tree
    verifier's ``token_ids``): accepted drafts, one final token, ``-1`` padding.
    """
    if not isinstance(output_token_ids, torch.Tensor) or output_token_ids.dim() != 2:
        raise TypeError("output_token_ids must be a 2-D tensor [num_reqs, max_k + 1]")
    return ((output_token_ids >= 0).sum(dim=1) - 1).clamp(min=0).long()


@dataclass
class AcceptanceStats:
    """Running totals over verification steps.

    ``proposed_per_position[j]`` counts request-steps that drafted a token at
    position ``j``; ``accepted_per_position[j]`` those whose first ``j + 1``
    drafts were all accepted.
    """

    num_request_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def update(self, num_draft_tokens: Sequence[int] | torch.Tensor, num_accepted: Sequence[int] | torch.Tensor) -> None:
        """Record one step: per request, how many drafts it proposed and how many were accepted."""
        drafted = num_draft_tokens.tolist() if isinstance(num_draft_tokens, torch.Tensor) else list(num_draft_tokens)
        accepted = num_accepted.tolist() if isinstance(num_accepted, torch.Tensor) else list(num_accepted)
        if len(drafted) != len(accepted):
            raise ValueError(
                f"num_draft_tokens has {len(drafted)} entries but num_accepted {len(accepted)}; give one per request"
            )
        for row, (k, a) in enumerate(zip(drafted, accepted)):
            if not 0 <= a <= k:
                raise ValueError(f"request {row}: num_accepted = {a} with {k} drafts; valid: 0 <= accepted <= drafted")
            grow = k - len(self.proposed_per_position)
            if grow > 0:
                self.proposed_per_position.extend([0] * grow)
                self.accepted_per_position.extend([0] * grow)
            for position in range(k):
                self.proposed_per_position[position] += 1
            for position in range(a):
                self.accepted_per_position[position] += 1
        self.num_request_steps += len(drafted)
        self.num_draft_tokens += sum(drafted)
        self.num_accepted_tokens += sum(accepted)

    def update_from_output(self, output_token_ids: torch.Tensor, num_draft_tokens: Sequence[int] | torch.Tensor) -> None:
        """Record one step from a verifier output (see :func:`num_accepted_tokens`)."""
        self.update(num_draft_tokens, num_accepted_tokens(output_token_ids))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.num_accepted_tokens / self.num_request_steps if self.num_request_steps else 0.0

    @property
    def mean_emitted_per_step(self) -> float:
        """Tokens emitted per request-step: accepted drafts plus the recovered/bonus token."""
        return 1.0 + self.mean_accepted_per_step if self.num_request_steps else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """For each draft position, P(accepted up to there | proposed there)."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]
