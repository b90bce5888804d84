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

Validation (:func:`servelab._internal.draft_layout.check_tree_batch`, shared
with the fast path) refuses NaN, negative or all-zero probability rows of
present nodes with a ``ValueError`` naming the argument. Computed in float32,
or float64 when ``target_probs`` is float64. The fast path is
:mod:`servelab.samplers.verifiers.tree_verify`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab._internal.draft_layout import TreeVerifyOutput, check_tree_batch
from servelab._internal.sampling_checks import check_generator_argument, compute_dtype
from servelab._internal.sampling_noise import draw_rejection_noise

__all__ = ["TreeVerifyOutput", "check_tree_batch", "verify_tree_greedy", "verify_tree_stochastic"]


def verify_tree_greedy(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
) -> TreeVerifyOutput:
    """Longest path whose tokens all equal the target argmax, then that argmax (see module docstring)."""
    parents, _, deepest = check_tree_batch(draft_token_ids, parents, target_probs)
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
    parents, _, deepest = check_tree_batch(draft_token_ids, parents, target_probs, draft_probs)
    num_trees, num_nodes = draft_token_ids.shape
    check_generator_argument(generator, num_trees)
    device = draft_token_ids.device
    vocab_size = target_probs.shape[2]
    uniform, exponential = draw_rejection_noise([num_nodes] * num_trees, vocab_size, device, generator)
    uniform = uniform.view(num_trees, num_nodes)
    dtype = compute_dtype(target_probs)
    target = target_probs.to(dtype)
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
                q = torch.nn.functional.one_hot(token, vocab_size).to(dtype)
            else:
                q = draft_probs[:, node].to(dtype)
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
        if num_nodes:
            emitted = torch.where(moved, safe_tokens.gather(1, next_node.clamp(min=0)[:, None]).squeeze(1), sampled)
        else:  # an empty tree: the root's sample is the bonus token
            emitted = sampled
        out_tokens[:, level] = torch.where(active, emitted, -1)
        if level < deepest:
            out_nodes[:, level] = torch.where(moved, next_node, -1)
        current = torch.where(moved, next_node, current)
        active = moved
        if not bool(active.any()):
            break
    return TreeVerifyOutput(out_tokens, out_nodes)
