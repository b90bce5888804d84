"""Index bookkeeping for ragged draft batches (shared by the verifier references).

Layout: request *i* owns draft entries ``starts[i] : starts[i] + k_i`` and
target rows ``starts[i] + i : starts[i] + i + k_i + 1`` (one bonus row per
request, so every earlier request shifts the rows by one more).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelab.reference._sampling_checks import DraftBatch


@dataclass(frozen=True)
class DraftIndex:
    counts: torch.Tensor  # int64 [num_reqs]: k_i
    starts: torch.Tensor  # int64 [num_reqs]: first draft entry of each request
    request_of_draft: torch.Tensor  # int64 [total]: owning request of each draft entry
    position_of_draft: torch.Tensor  # int64 [total]: position within its request
    target_row_of_draft: torch.Tensor  # int64 [total]: target row verifying it
    max_draft: int

    @classmethod
    def build(cls, batch: DraftBatch, device: torch.device) -> DraftIndex:
        counts = torch.tensor(batch.num_draft_tokens, dtype=torch.int64, device=device)
        starts = torch.tensor(batch.draft_offsets[:-1], dtype=torch.int64, device=device)
        total = batch.draft_offsets[-1]
        entries = torch.arange(total, device=device)
        request_of_draft = torch.repeat_interleave(torch.arange(batch.num_reqs, device=device), counts)
        return cls(
            counts=counts,
            starts=starts,
            request_of_draft=request_of_draft,
            position_of_draft=entries - starts[request_of_draft],
            target_row_of_draft=entries + request_of_draft,
            max_draft=batch.max_draft,
        )

    def stop_rows(self, num_accepted: torch.Tensor) -> torch.Tensor:
        """Target row index where each request stops: first rejection, or its bonus row."""
        request_index = torch.arange(self.counts.shape[0], device=self.counts.device)
        return self.starts + request_index + num_accepted

    def leading_accepts(self, accept: torch.Tensor) -> torch.Tensor:
        """int64 ``[num_reqs]``: length of each request's leading run of ``accept`` (bool ``[total]``)."""
        num_reqs = self.counts.shape[0]
        # Padding stays 0 (= rejected), so a run never extends past a request's own drafts.
        grid = torch.zeros(num_reqs, self.max_draft, dtype=torch.int64, device=accept.device)
        grid[self.request_of_draft, self.position_of_draft] = accept.long()
        return grid.cumprod(dim=1).sum(dim=1)

    def assemble(self, draft_ids: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> torch.Tensor:
        """int64 ``[num_reqs, max_draft + 1]``: accepted drafts, the final token, then -1."""
        num_reqs = self.counts.shape[0]
        device = draft_ids.device
        out = torch.full((num_reqs, self.max_draft + 1), -1, dtype=torch.int64, device=device)
        if self.max_draft:
            out[self.request_of_draft, self.position_of_draft] = draft_ids.long()
            beyond = torch.arange(self.max_draft + 1, device=device)[None, :] >= num_accepted[:, None]
            out.masked_fill_(beyond, -1)
        out[torch.arange(num_reqs, device=device), num_accepted] = final_token
        return out
