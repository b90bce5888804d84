"""Which blocks of each KV-cache group a prefix needs: the rule connectors share.

A prefix of ``L`` tokens (a multiple of the manager's ``hit_alignment``) is
served, group by group, by these group blocks (``bs``: the group's block size):

- a full-attention group: every block, ``0 .. L/bs - 1``;
- a sliding-window group (window ``W``: position ``p`` sees keys ``j`` with
  ``p - j < W``): only the blocks covering the last ``W - 1`` tokens, i.e.
  ``L/bs - ceil((W - 1) / bs) .. L/bs - 1`` (clipped at 0). The next token
  (position ``L``) sees keys back to ``L - W + 1``, which lies in block
  ``(L - W + 1) // bs = L/bs - ceil((W - 1)/bs)``. This is exactly the run of
  blocks :meth:`~servelab.blocks.single_type.SlidingWindowManager.find_longest_cache_hit`
  requires for a hit of length ``L``, and the blocks
  ``release_skipped_blocks`` keeps at ``num_computed_tokens = L`` — so a
  window block loaded for ``L`` is never released before it is read, and a
  block it does not need is released (never committed) by the scheduler
  (:meth:`~servelab.scheduling.connector_states.ConnectorStates._drop_out_of_window`).

Connectors store, send and load a sliding group's **window blocks** only.
:class:`GroupView` answers "which blocks does a prefix ending at ``L`` need
beyond the first ``start`` tokens"; :func:`longest_servable` finds the longest
prefix every group can serve from a store.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from servelab.blocks.specs import SlidingWindowSpec

__all__ = ["GroupView", "block_rows", "group_hashes", "group_views", "longest_servable"]


@dataclass(frozen=True)
class GroupView:
    """One KV-cache group as a connector sees it.

    Attributes:
        block_size: tokens per block of this group.
        window_blocks: blocks a prefix needs at its end (sliding window), or
            None (every block: full attention and anything else).
    """

    block_size: int
    window_blocks: int | None = None

    def needed(self, start: int, end: int) -> range:
        """Group block indices a prefix of ``end`` tokens needs past the first ``start``
        tokens (both multiples of ``block_size``; ``start``'s blocks are already held)."""
        lo, hi = start // self.block_size, end // self.block_size
        if self.window_blocks is not None:
            lo = max(lo, hi - self.window_blocks)
        return range(lo, hi)


def group_views(kv_cache_manager: Any) -> list[GroupView]:
    """A :class:`GroupView` per KV-cache group of a manager. A single-group manager gets one
    view that needs every block (it keeps a sliding window's out-of-window blocks, so they
    must hold real KV)."""
    groups = getattr(kv_cache_manager, "groups", None)
    if groups is None:
        return [GroupView(kv_cache_manager.spec.block_size)]
    views = []
    for spec in (g.spec for g in groups):
        window = None
        if isinstance(spec, SlidingWindowSpec):
            window = math.ceil((spec.sliding_window - 1) / spec.block_size)
        views.append(GroupView(spec.block_size, window))
    return views


def group_hashes(kv_cache_manager: Any, request: Any, group: int) -> Sequence[bytes]:
    """Group ``group``'s block hashes of ``request`` (hybrid managers tag them per group)."""
    if getattr(kv_cache_manager, "groups", None) is not None:
        return kv_cache_manager.group_hashes(request, group)
    return request.block_hashes


def block_rows(block_ids: tuple[Sequence[int], ...], num_groups: int) -> tuple[list[int], ...]:
    """``block_ids`` (one block-id row per KV-cache group, as every manager gives them) as
    fresh lists; ``ValueError`` if it does not hold ``num_groups`` rows."""
    if type(block_ids) is not tuple or len(block_ids) != num_groups:
        raise ValueError(f"block_ids must be a tuple of {num_groups} per-group rows, got {block_ids!r:.80}")
    return tuple(list(r) for r in block_ids)


def longest_servable(views: Sequence[GroupView], hashes: Sequence[Sequence[bytes]], have: Callable[[bytes], bool],
                     start: int, cap: int, align: int) -> int:
    """The longest prefix ``L`` (a multiple of ``align``, ``start < L <= cap``) for which
    every group's needed blocks past ``start`` are in a store (``have(hash)``); ``start``
    when there is none. ``hashes[g]``: group ``g``'s block hashes of the request."""
    for g, view in enumerate(views):  # full groups need a contiguous run from start
        cap = min(cap, len(hashes[g]) * view.block_size)
        if view.window_blocks is None:
            i = start // view.block_size
            while i < cap // view.block_size and have(hashes[g][i]):
                i += 1
            cap = min(cap, i * view.block_size)
    end = cap // align * align
    while end > start:  # a sliding group needs its window at the end: try shorter prefixes
        if all(all(have(hashes[g][i]) for i in view.needed(start, end))
               for g, view in enumerate(views) if view.window_blocks is not None):
            return end
        end -= align
    return start
