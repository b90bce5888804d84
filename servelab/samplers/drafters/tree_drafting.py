"""Top-k token trees from a draft model (static shapes, or EAGLE-2-style dynamic trees).

Used by :class:`~servelab.samplers.drafters.DraftModelDrafter` (and so by
``"layer_skip"``) when built with ``tree="static"`` or ``tree="dynamic"``.
One forward feeds each request's uncached history suffix (its logits rank
the root's children); each later forward feeds the nodes chosen for
expansion, all requests batched, with a tree mask over the draft cache:

- **static** (``w`` = ``tree_width``): the root's top-``w`` tokens, then each
  of those ``w`` branches continued by its top-1 token, depth after depth,
  until the node budget ``k`` is spent — a fixed shape, ``w`` chains sharing the root.
- **dynamic** (EAGLE-2): every candidate is scored by its path's draft
  log-probability; at each depth the top-``w`` newest candidates are
  expanded with their top-``w`` children, for ``tree_depth`` depths (default
  ``max(1, k // w)``); finally the ``k`` best-scored candidates are kept (a
  child never outscores its parent, so the kept set is a tree).

The drafts are deterministic top-k choices, returned with ``probs=None``:
the tree verifier treats them as one-hot, which keeps verification exact.
Draft-cache layout of a tree being grown: history at positions ``0 .. L-1``;
the ``f``-th fed node at slot ``L + f``, RoPE position ``L - 1 + depth``,
seeing the history and its fed ancestors (a :class:`~servelab.attention.TreeMask`
whose region is the fed nodes). The fed nodes' KV is dropped afterwards
(the request's cache keeps its history only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from servelab._internal.tree_mask import TreeMask
from servelab.samplers.draft_tree import MAX_TREE_NODES, DraftTree

__all__ = ["TREE_MODES", "grow_trees"]

TREE_MODES = ("static", "dynamic")


@dataclass
class _Growth:
    """One request's tree being grown (candidates in creation order: parents first)."""

    history_len: int
    budget: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # candidate index of each fed node, in feeding order
    frontier: list[int] = field(default_factory=list)  # candidates created at the last depth

    def add_children(self, parent: int, logprobs: torch.Tensor, width: int) -> list[int]:
        base = 0.0 if parent < 0 else self.scores[parent]
        depth = 1 if parent < 0 else self.depths[parent] + 1
        values, ids = logprobs.topk(width)
        made = []
        for value, token in zip(values.tolist(), ids.tolist()):
            made.append(len(self.tokens))
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(base + value)
            self.depths.append(depth)
        return made

    def fed_bits(self, candidate: int) -> int:
        """Ancestor bitmap over fed indices (itself included)."""
        bits, node = 0, candidate
        while node >= 0:
            bits |= 1 << self.fed.index(node)
            node = self.parents[node]
        return bits - (1 << 64) if bits >= 1 << 63 else bits

    def result(self, dynamic: bool) -> DraftTree:
        keep = list(range(len(self.tokens)))
        if dynamic:  # best path scores; ties keep the earlier (an ancestor before its child)
            keep = sorted(sorted(keep, key=lambda c: (-self.scores[c], c))[: self.budget])
        keep = keep[: self.budget]
        new_index = {c: i for i, c in enumerate(keep)}
        return DraftTree(tuple(self.tokens[c] for c in keep),
                         tuple(new_index[self.parents[c]] if self.parents[c] >= 0 else -1 for c in keep))


def grow_trees(drafter: Any, active: list, root_logits: torch.Tensor, mode: str, width: int,
               depth: int | None) -> dict[int, DraftTree]:
    """Trees for the ``active`` requests of :meth:`DraftModelDrafter.propose_for_requests`
    (``(index, request, state, history, valid)``, history already fed), from their
    root logits fp32 ``[A, V]``; returns request index -> tree."""
    dynamic = mode == "dynamic"
    growths = []
    for row, (_, req, _, history, _) in enumerate(active):
        growth = _Growth(len(history), min(req.k, MAX_TREE_NODES))
        logprobs = torch.log_softmax(root_logits[row].float(), dim=-1)
        growth.frontier = growth.add_children(-1, logprobs, min(width, growth.budget))
        growths.append(growth)
    max_depth = depth if dynamic and depth else max(1, -(-max(g.budget for g in growths) // width))
    for _ in range(max_depth - 1):
        expand = [_to_expand(g, width, dynamic) for g in growths]
        if not any(expand):
            break
        logits = _feed(drafter, active, growths, expand)
        row = 0
        for g, nodes in zip(growths, expand):
            new = []
            for node in nodes:
                logprobs = torch.log_softmax(logits[row].float(), dim=-1)
                new += g.add_children(node, logprobs, width if dynamic else 1)
                row += 1
            g.frontier = new
    return {i: g.result(dynamic) for (i, *_), g in zip(active, growths)}


def _to_expand(growth: _Growth, width: int, dynamic: bool) -> list[int]:
    """Frontier candidates to feed next (none once the static budget is spent or the cache bound is hit)."""
    if not dynamic and len(growth.tokens) >= growth.budget:
        return []
    nodes = sorted(growth.frontier, key=lambda c: (-growth.scores[c], c))[:width] if dynamic else growth.frontier
    room = min(growth.budget, MAX_TREE_NODES) - len(growth.fed)  # fed slots reserved: history + k
    return sorted(nodes[:max(room, 0)])


def _feed(drafter: Any, active: list, growths: list[_Growth], expand: list[list[int]]) -> torch.Tensor:
    """One draft forward over the nodes to expand; fp32 logits ``[sum len(expand_i), V]``."""
    chunks, starts, rows, rope, bits, lens = [], [], [], [], [], []
    for (_, _, state, _, _), g, nodes in zip(active, growths, expand):
        if not nodes:
            continue
        starts.append(g.history_len + len(g.fed))
        g.fed += nodes
        chunks.append([g.tokens[c] for c in nodes])
        rows.append(state.blocks)
        rope += [g.history_len - 1 + g.depths[c] for c in nodes]
        bits += [g.fed_bits(c) for c in nodes]
        lens.append(len(g.fed))
    tree_mask = TreeMask(torch.tensor(bits, dtype=torch.int64), torch.tensor(lens, dtype=torch.int32))
    return drafter.forward_chunks(chunks, starts, rows, positions=rope, tree_mask=tree_mask)
