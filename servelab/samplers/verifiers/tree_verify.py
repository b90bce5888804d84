"""Token-tree verification, fast path (greedy and SpecInfer-style stochastic).

Same contract, noise and tokens as the reference
(:mod:`servelab.reference.tree_verify`, read its docstring for the rules).
The reference walks the tree level by level and, at every level, scans every
node of the tree for children of the current node (``depth x nodes`` batched
steps with a host sync each), and it computes a sample for every tree at
every level. Here:

- the children of each slot are laid out once in a table (``[B, N + 1, C]``,
  index order), so a level tries exactly the current node's children:
  ``C`` steps at most, none wasted on other nodes;
- each step works only on the trees that still have a candidate (compacted
  rows), and a level draws the final token only for the trees that stop there;
- the output is assembled by scatters, not per-level writes over all trees.

The arithmetic per candidate is the reference's (accept iff ``u * q(x) <
r(x)``; on rejection ``r = normalize(max(r - q, 0))``), so tokens agree
exactly. Inputs in float64 are computed in float64 (tests), others in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab._internal.draft_layout import TreeVerifyOutput, check_tree_batch, children_table
from servelab._internal.sampling_checks import check_generator_argument, compute_dtype
from servelab._internal.sampling_noise import draw_rejection_noise

__all__ = ["TreeVerifyOutput", "verify_tree_greedy", "verify_tree_stochastic"]

_TINY = torch.finfo(torch.float32).tiny


class _Walk:
    """The per-tree walk state shared by both verifiers: current node, output buffers."""

    def __init__(self, tokens: torch.Tensor, deepest: int) -> None:
        num_trees = tokens.shape[0]
        device = tokens.device
        self.tokens = tokens
        self.current = torch.full((num_trees,), -1, dtype=torch.int64, device=device)  # -1 = root
        self.active = torch.ones(num_trees, dtype=torch.bool, device=device)
        self.out_tokens = torch.full((num_trees, deepest + 1), -1, dtype=torch.int64, device=device)
        self.out_nodes = torch.full((num_trees, deepest), -1, dtype=torch.int64, device=device)

    def stop(self, trees: torch.Tensor, level: int, final_token: torch.Tensor) -> None:
        self.out_tokens[trees, level] = final_token

    def advance(self, trees: torch.Tensor, level: int, nodes: torch.Tensor) -> None:
        if not trees.numel():  # (at the deepest level nobody moves, and column `level` does not exist)
            return
        self.out_tokens[trees, level] = self.tokens[trees, nodes]
        self.out_nodes[trees, level] = nodes
        self.current[trees] = nodes

    def output(self) -> TreeVerifyOutput:
        return TreeVerifyOutput(self.out_tokens, self.out_nodes)


def verify_tree_greedy(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    *,
    check_inputs: bool = True,
) -> TreeVerifyOutput:
    """Longest path whose tokens all equal the target argmax, then that argmax.

    ``draft_token_ids`` int ``[B, N]`` (-1 = absent), ``parents`` int ``[N]`` or
    ``[B, N]``, ``target_probs`` float ``[B, N + 1, V]`` (row 0 = root).
    """
    parents, _, deepest = check_tree_batch(draft_token_ids, parents, target_probs, check_inputs=check_inputs)
    tokens = draft_token_ids.long()
    children = children_table(parents, tokens >= 0)  # [B, N + 1, C]
    walk = _Walk(tokens, deepest)
    trees = torch.arange(tokens.shape[0], device=tokens.device)  # the active trees, compacted
    for level in range(deepest + 1):
        slot = walk.current[trees] + 1
        best = target_probs[trees, slot].argmax(dim=-1)
        kids = children[trees, slot]  # [A, C]
        if not kids.shape[1]:  # no tree has a child here: everybody stops
            walk.stop(trees, level, best)
            break
        matches = (kids >= 0) & (tokens[trees[:, None], kids.clamp(min=0)] == best[:, None])
        moved = matches.any(dim=1)
        walk.stop(trees[~moved], level, best[~moved])
        first = kids.gather(1, matches.long().argmax(dim=1, keepdim=True)).squeeze(1)  # first match in index order
        walk.advance(trees[moved], level, first[moved])
        trees = trees[moved]
        if not trees.numel():
            break
    return walk.output()


def verify_tree_stochastic(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    check_inputs: bool = True,
) -> TreeVerifyOutput:
    """Multi-candidate rejection sampling over token trees (see the module docstring).

    ``draft_probs`` float ``[B, N, V]`` or None (one-hot drafts); ``generator``:
    None, one generator, or one (or None) per tree. Consumes the reference's
    noise: ``N`` uniforms per tree, then one Exp(1) row per tree.
    """
    parents, _, deepest = check_tree_batch(draft_token_ids, parents, target_probs, draft_probs,
                                           check_inputs=check_inputs)
    num_trees, num_nodes = draft_token_ids.shape
    if check_inputs:
        check_generator_argument(generator, num_trees)
    device = draft_token_ids.device
    uniform, exponential = draw_rejection_noise([num_nodes] * num_trees, target_probs.shape[2], device, generator)
    uniform = uniform.view(num_trees, num_nodes)
    dtype = compute_dtype(target_probs)
    tokens = draft_token_ids.long()
    children = children_table(parents, tokens >= 0)
    walk = _Walk(tokens, deepest)
    trees = torch.arange(num_trees, device=device)
    for level in range(deepest + 1):
        slot = walk.current[trees] + 1
        node_target = target_probs[trees, slot].to(dtype)  # [A, V]
        kids = children[trees, slot]  # [A, C]
        residual, chosen = _try_children(node_target, kids, trees, tokens, uniform, draft_probs, dtype)
        moved = chosen >= 0
        stopped = ~moved
        if bool(stopped.any()):
            rows = residual[stopped]
            scores = torch.where(rows > 0, rows / exponential[trees[stopped]], -1.0)
            walk.stop(trees[stopped], level, scores.argmax(dim=-1))
        walk.advance(trees[moved], level, chosen[moved])
        trees = trees[moved]
        if not trees.numel():
            break
    return walk.output()


def _try_children(node_target: torch.Tensor, kids: torch.Tensor, trees: torch.Tensor, tokens: torch.Tensor,
                  uniform: torch.Tensor, draft_probs: torch.Tensor | None,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Try each active tree's children in order; returns (residual ``[A, V]``, accepted node or -1 ``[A]``)."""
    residual = node_target.clone()
    chosen = torch.full((trees.shape[0],), -1, dtype=torch.int64, device=trees.device)
    for j in range(kids.shape[1]):
        rows = ((kids[:, j] >= 0) & (chosen < 0)).nonzero().flatten()  # still trying, with a j-th child
        if not rows.numel():
            break
        tree, node = trees[rows], kids[rows, j]
        token = tokens[tree, node]
        current = residual[rows]
        r_token = current.gather(1, token[:, None]).squeeze(1)
        if draft_probs is None:
            q_token = torch.ones_like(r_token)
            remaining = current.clone()
            remaining.scatter_(1, token[:, None], (r_token - 1.0).clamp(min=0.0)[:, None])
        else:
            q = draft_probs[tree, node].to(dtype)
            q_token = q.gather(1, token[:, None]).squeeze(1)
            remaining = (current - q).clamp(min=0.0)
        accept = uniform[tree, node] * q_token < r_token
        chosen[rows[accept]] = node[accept]
        # A rejected child leaves the normalised residual for the next sibling. No mass
        # left can only come from rounding: fall back to the node's target row.
        rejected = ~accept
        mass = remaining[rejected].sum(dim=-1, keepdim=True)
        renormalised = torch.where(mass > 0, remaining[rejected] / mass.clamp(min=_TINY), node_target[rows[rejected]])
        residual[rows[rejected]] = renormalised
    return residual, chosen
