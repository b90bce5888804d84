"""Reference token-tree verification (greedy and SpecInfer-style stochastic).

A batch of ``B`` draft trees, padded to ``N`` nodes each:

- ``draft_token_ids`` int ``[B, N]``: the token of each node, ``-1`` for an
  absent (padding) node.
- ``parents`` int ``[N]`` (one shape for the whole batch) or ``[B, N]``:
  the parent node of each node, ``-1`` for children of the root (the last
  committed token). Nodes are topologically ordered: ``parents[n] < n``.
  Siblings are tried in index order.
- ``target_probs`` float ``[B, N + 1, V]``: row 0 is the target distribution
  after the root, row ``n + 1`` the one after node ``n``'s path (one target
  pass over the tree with the tree attention mask produces exactly these).
- ``draft_probs`` float ``[B, N, V]`` or None: the distribution node ``n``'s
  token was drawn from (given its parent's path). Siblings must be drawn
  independently given their parent; None means deterministic drafts
  (one-hot), e.g. n-gram or top-k expansions.

Output :class:`TreeVerifyOutput`: ``token_ids`` int64 ``[B, D + 1]`` (the
accepted path's tokens then one final token, ``-1`` padded) and
``accepted_nodes`` int64 ``[B, D]`` (node indices of the accepted path, whose
KV entries the caller keeps), ``D`` = the deepest tree in the batch.

Greedy: from the root, move to the first child whose token equals the target
argmax at the current node; when none does, emit that argmax and stop.

Stochastic (multi-candidate rejection, SpecInfer): at the current node start
from the residual ``r = p`` (its target row); for each child ``c`` in order,
accept its token ``x`` iff ``u_c * q_c(x) < r(x)``; on rejection set
``r = normalize(max(r - q_c, 0))`` and try the next child. Accepting moves to
the child (whose target row becomes the new ``r``). When no child is
accepted, emit a sample of ``r`` and stop (at a leaf that is the bonus
token). Each emitted token is distributed exactly as the target given the
tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from servelab.reference._sampling_checks import check_generator_argument, check_tensor
from servelab.reference._sampling_noise import draw_rejection_noise


class TreeVerifyOutput(NamedTuple):
    token_ids: torch.Tensor  # int64 [B, D + 1], -1 padded
    accepted_nodes: torch.Tensor  # int64 [B, D], -1 padded


def check_tree_batch(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Validate a batch of trees; return (parents as int64 ``[B, N]``, deepest depth ``D``)."""
    check_tensor("draft_token_ids", draft_token_ids, ndim=2, floating=False)
    num_trees, num_nodes = draft_token_ids.shape
    if not isinstance(parents, torch.Tensor):
        raise TypeError(f"parents must be a torch.Tensor, got {type(parents).__name__}")
    check_tensor("parents", parents, ndim=2 if parents.dim() == 2 else 1, floating=False)
    device = draft_token_ids.device
    parents = parents.to(device=device, dtype=torch.int64)
    if parents.dim() == 1:
        parents = parents[None, :].expand(num_trees, -1)
    if tuple(parents.shape) != (num_trees, num_nodes):
        raise ValueError(f"parents must have shape [N] or [B, N] = {(num_trees, num_nodes)}, got {tuple(parents.shape)}")
    check_tensor("target_probs", target_probs, ndim=3, floating=True)
    vocab_size = target_probs.shape[2]
    if tuple(target_probs.shape[:2]) != (num_trees, num_nodes + 1):
        raise ValueError(
            f"target_probs must have shape [B, N + 1, vocab] with (B, N + 1) = {(num_trees, num_nodes + 1)}, "
            f"got {tuple(target_probs.shape)} (row 0 is the root)"
        )
    if target_probs.device != device:
        raise ValueError(f"target_probs is on {target_probs.device} but draft_token_ids on {device}")
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=3, floating=True)
        if tuple(draft_probs.shape) != (num_trees, num_nodes, vocab_size):
            raise ValueError(
                f"draft_probs must have shape [B, N, vocab] = {(num_trees, num_nodes, vocab_size)}, "
                f"got {tuple(draft_probs.shape)}"
            )
    node_index = torch.arange(num_nodes, device=device)
    if num_nodes and num_trees:
        if bool(((parents < -1) | (parents >= node_index)).any()):
            bad = parents[(parents < -1) | (parents >= node_index)][0].item()
            raise ValueError(f"parents holds {bad}; valid: -1 (root) or an index smaller than the node's own")
        present = draft_token_ids >= 0
        if bool((draft_token_ids < -1).any()) or bool((draft_token_ids >= vocab_size).any()):
            raise ValueError(f"draft_token_ids must be in [0, {vocab_size}) or -1 for absent nodes")
        parent_present = torch.where(parents >= 0, present.gather(1, parents.clamp(min=0)), True)
        if bool((present & ~parent_present).any()):
            raise ValueError("a present node has an absent (-1) parent; valid: absent nodes only have absent children")
    depth = torch.zeros(num_trees, num_nodes, dtype=torch.int64, device=device)
    for node in range(num_nodes):  # topological order: a parent's depth is known first
        parent = parents[:, node]
        parent_depth = depth.gather(1, parent.clamp(min=0)[:, None]).squeeze(1)
        depth[:, node] = torch.where(parent >= 0, parent_depth + 1, 1)
    deepest = int(torch.where(draft_token_ids >= 0, depth, 0).max()) if num_nodes and num_trees else 0
    return parents, deepest


def verify_tree_greedy(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
) -> TreeVerifyOutput:
    """Longest path whose tokens all equal the target argmax, then that argmax (see module docstring)."""
    parents, deepest = check_tree_batch(draft_token_ids, parents, target_probs)
    num_trees, num_nodes = draft_token_ids.shape
    device = draft_token_ids.device
    tokens = draft_token_ids.long()
    present = tokens >= 0
    out_tokens = torch.full((num_trees, deepest + 1), -1, dtype=torch.int64, device=device)
    out_nodes = torch.full((num_trees, deepest), -1, dtype=torch.int64, device=device)
    tree_index = torch.arange(num_trees, device=device)
    current = torch.full((num_trees,), -1, dtype=torch.int64, device=device)  # -1 = root
    active = torch.ones(num_trees, dtype=torch.bool, device=device)
    for level in range(deepest + 1):
        best = target_probs[tree_index, current + 1].argmax(dim=-1)
        out_tokens[:, level] = torch.where(active, best, -1)
        if level == deepest:
            break
        matches = present & (parents == current[:, None]) & (tokens == best[:, None])
        moved = active & matches.any(dim=1)
        child = matches.long().argmax(dim=1)  # first matching child in index order
        out_nodes[:, level] = torch.where(moved, child, -1)
        current = torch.where(moved, child, current)
        active = moved
    return TreeVerifyOutput(out_tokens, out_nodes)


def verify_tree_stochastic(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> TreeVerifyOutput:
    """Multi-candidate rejection sampling over a token tree (see module docstring).

    ``generator``: None, one generator, or one (or None) per tree.
    """
    parents, deepest = check_tree_batch(draft_token_ids, parents, target_probs, draft_probs)
    num_trees, num_nodes = draft_token_ids.shape
    check_generator_argument(generator, num_trees)
    device = draft_token_ids.device
    vocab_size = target_probs.shape[2]
    uniform, exponential = draw_rejection_noise([num_nodes] * num_trees, vocab_size, device, generator)
    uniform = uniform.view(num_trees, num_nodes)
    target = target_probs.float()
    tokens = draft_token_ids.long()
    present = tokens >= 0
    safe_tokens = tokens.clamp(min=0)

    out_tokens = torch.full((num_trees, deepest + 1), -1, dtype=torch.int64, device=device)
    out_nodes = torch.full((num_trees, deepest), -1, dtype=torch.int64, device=device)
    current = torch.full((num_trees,), -1, dtype=torch.int64, device=device)
    active = torch.ones(num_trees, dtype=torch.bool, device=device)
    tree_index = torch.arange(num_trees, device=device)
    for level in range(deepest + 1):
        node_target = target[tree_index, current + 1]
        residual = node_target
        moved = torch.zeros(num_trees, dtype=torch.bool, device=device)
        next_node = current.clone()
        for node in range(num_nodes):
            candidate = active & ~moved & present[:, node] & (parents[:, node] == current)
            if not bool(candidate.any()):
                continue
            token = safe_tokens[:, node]
            if draft_probs is None:
                q = torch.nn.functional.one_hot(token, vocab_size).float()
            else:
                q = draft_probs[:, node].float()
            r_token = residual.gather(1, token[:, None]).squeeze(1)
            q_token = q.gather(1, token[:, None]).squeeze(1)
            accept = candidate & (uniform[:, node] * q_token < r_token)
            reject = candidate & ~accept
            remaining = (residual - q).clamp(min=0.0)
            mass = remaining.sum(dim=-1, keepdim=True)
            # No mass left can only come from rounding; fall back to the target row.
            renormalised = torch.where(mass > 0, remaining / mass.clamp(min=torch.finfo(torch.float32).tiny), node_target)
            residual = torch.where(reject[:, None], renormalised, residual)
            moved |= accept
            next_node = torch.where(accept, node, next_node)
        scores = torch.where(residual > 0, residual / exponential, -1.0)
        sampled = scores.argmax(dim=-1)
        emitted = torch.where(moved, safe_tokens.gather(1, next_node.clamp(min=0)[:, None]).squeeze(1), sampled)
        out_tokens[:, level] = torch.where(active, emitted, -1)
        if level < deepest:
            out_nodes[:, level] = torch.where(moved, next_node, -1)
        current = torch.where(moved, next_node, current)
        active = moved
        if not bool(active.any()):
            break
    return TreeVerifyOutput(out_tokens, out_nodes)
