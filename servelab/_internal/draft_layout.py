"""Index bookkeeping for draft batches (shared by the fast verifiers and the references).

Chains: request *i* owns draft entries ``starts[i] : starts[i] + k_i`` and
target rows ``starts[i] + i : starts[i] + i + k_i + 1`` (one bonus row per
request, so every earlier request shifts the rows by one more).

Trees: see the section "token trees" below (validation, depths by pointer
jumping, the children table the fast verifiers walk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from servelab._internal.sampling_checks import DraftBatch


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


# --- token trees -----------------------------------------------------------------
#
# A batch of B trees padded to N nodes: tokens int64 [B, N] (-1 = absent node),
# parents int64 [B, N] (-1 = child of the root, parents[n] < n), and per tree
# N + 1 "slots" (slot 0 = root, slot n + 1 = node n) for target rows.


class TreeVerifyOutput(NamedTuple):
    """Result of a tree verifier.

    ``token_ids`` int64 ``[B, D + 1]``: the accepted path's tokens, then one
    final (recovered or bonus) token, ``-1`` padded. ``accepted_nodes`` int64
    ``[B, D]``: node indices of the accepted path (whose KV the caller keeps),
    ``-1`` padded. ``D`` = the deepest present node in the batch.
    """

    token_ids: torch.Tensor
    accepted_nodes: torch.Tensor


def _jump_steps(num_nodes: int) -> int:
    # Pointer jumping doubles the covered distance per step; a path has at most N nodes.
    return max(1, num_nodes).bit_length()


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, N]``: depth of each node (children of the root: 1), by pointer jumping."""
    depth = torch.ones_like(parents)
    ancestor = parents.clone()
    for _ in range(_jump_steps(parents.shape[1])):
        has = ancestor >= 0
        safe = ancestor.clamp(min=0)
        depth = depth + torch.where(has, depth.gather(1, safe), 0)
        ancestor = torch.where(has, ancestor.gather(1, safe), -1)
    return depth


def earlier_siblings(parents: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """bool ``[B, N, N]``: ``[b, n, m]`` is True iff ``m < n`` is a present sibling of node ``n``."""
    num_nodes = parents.shape[1]
    before = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=parents.device).tril(-1)
    return (parents[:, :, None] == parents[:, None, :]) & before & present[:, None, :]


def children_table(parents: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, N + 1, C]``: the present children of each slot in index order (-1 padded).

    Slot 0 is the root, slot ``n + 1`` node ``n``; ``C`` = the largest number of children.
    """
    num_trees, num_nodes = parents.shape
    device = parents.device
    rank = earlier_siblings(parents, present).sum(dim=-1)  # position among the parent's present children
    width = int(torch.where(present, rank + 1, 0).max()) if num_nodes and num_trees else 0
    # One spare entry at the end absorbs the absent nodes; dropped afterwards.
    flat = torch.full((num_trees * (num_nodes + 1) * width + 1,), -1, dtype=torch.int64, device=device)
    tree_index = torch.arange(num_trees, device=device)[:, None]
    position = ((tree_index * (num_nodes + 1) + parents + 1) * width + rank)
    position = torch.where(present, position, flat.numel() - 1)
    node_index = torch.arange(num_nodes, device=device).expand(num_trees, -1)
    flat.scatter_(0, position.flatten(), torch.where(present, node_index, -1).flatten())
    return flat[:-1].view(num_trees, num_nodes + 1, width)


def check_tree_batch(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Validate a batch of trees; return (parents int64 ``[B, N]``, depths int64 ``[B, N]``, deepest ``D``).

    With ``check_inputs=False`` only the layout is derived (no validation, no
    probability scan); ``D`` still costs one device sync.
    """
    from servelab._internal.sampling_checks import check_probabilities, check_tensor

    if check_inputs:
        check_tensor("draft_token_ids", draft_token_ids, ndim=2, floating=False)
        if not isinstance(parents, torch.Tensor):
            raise TypeError(f"parents must be a torch.Tensor, got {type(parents).__name__}")
        check_tensor("parents", parents, ndim=2 if parents.dim() == 2 else 1, floating=False)
    num_trees, num_nodes = draft_token_ids.shape
    device = draft_token_ids.device
    parents = parents.to(device=device, dtype=torch.int64)
    if parents.dim() == 1:
        parents = parents[None, :].expand(num_trees, -1)
    if check_inputs:
        _check_tree_shapes(draft_token_ids, parents, target_probs, draft_probs)
    present = draft_token_ids >= 0
    depth = tree_depths(parents) if num_nodes else torch.zeros_like(parents)
    if check_inputs:
        slots = torch.cat([torch.ones(num_trees, 1, dtype=torch.bool, device=device), present], dim=1)
        check_probabilities("target_probs", target_probs, slots)
        if draft_probs is not None:
            check_probabilities("draft_probs", draft_probs, present)
    deepest = int(torch.where(present, depth, 0).max()) if num_nodes and num_trees else 0
    return parents, depth, deepest


def _check_tree_shapes(draft_token_ids: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                       draft_probs: torch.Tensor | None) -> None:
    from servelab._internal.sampling_checks import check_tensor

    num_trees, num_nodes = draft_token_ids.shape
    device = draft_token_ids.device
    if tuple(parents.shape) != (num_trees, num_nodes):
        raise ValueError(f"parents must have shape [N] or [B, N] = {(num_trees, num_nodes)}, got {tuple(parents.shape)}")
    check_tensor("target_probs", target_probs, ndim=3, floating=True)
    vocab_size = target_probs.shape[2]
    if tuple(target_probs.shape[:2]) != (num_trees, num_nodes + 1):
        raise ValueError(
            f"target_probs must have shape [B, N + 1, vocab] with (B, N + 1) = {(num_trees, num_nodes + 1)}, "
            f"got {tuple(target_probs.shape)} (row 0 is the root)"
        )
    if vocab_size == 0:
        raise ValueError("target_probs has an empty vocabulary dimension")
    if target_probs.device != device:
        raise ValueError(f"target_probs is on {target_probs.device} but draft_token_ids on {device}")
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=3, floating=True)
        if tuple(draft_probs.shape) != (num_trees, num_nodes, vocab_size):
            raise ValueError(
                f"draft_probs must have shape [B, N, vocab] = {(num_trees, num_nodes, vocab_size)}, "
                f"got {tuple(draft_probs.shape)}"
            )
        if draft_probs.device != device:
            raise ValueError(f"draft_probs is on {draft_probs.device} but draft_token_ids on {device}")
    if not (num_nodes and num_trees):
        return
    node_index = torch.arange(num_nodes, device=device)
    invalid = (parents < -1) | (parents >= node_index)
    if bool(invalid.any()):
        raise ValueError(f"parents holds {parents[invalid][0].item()}; valid: -1 (root) or an index smaller "
                         "than the node's own")
    if bool((draft_token_ids < -1).any()) or bool((draft_token_ids >= vocab_size).any()):
        raise ValueError(f"draft_token_ids must be in [0, {vocab_size}) or -1 for absent nodes")
    present = draft_token_ids >= 0
    parent_present = torch.where(parents >= 0, present.gather(1, parents.clamp(min=0)), True)
    if bool((present & ~parent_present).any()):
        raise ValueError("a present node has an absent (-1) parent; valid: absent nodes only have absent children")
