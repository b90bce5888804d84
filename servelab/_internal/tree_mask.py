"""The tree attention mask as the attention backends take it: :class:`TreeMask`.

Token trees (speculative decoding) are verified in one step: sequence ``i``'s
last ``tree_lens[i]`` keys are tree nodes (node ``n`` at key position
``seq_len - tree_lens[i] + n``), laid out after the context and the root
(a drafter growing a tree level by level has the earlier levels in its
cache already: only the newest nodes are query rows). A
query row sees, besides what the causal rule gives it, only the tree nodes
whose bit is set in its ``ancestors`` bitmap (itself and its ancestors). Rows
outside the tree (the root, a chunk of known tokens) have bitmap 0 and are
plain causal rows: every tree key is after them anyway. Bit ``m`` of an int64
is node ``m``, so a tree has at most 64 nodes
(:data:`servelab.samplers.draft_tree.MAX_TREE_NODES`).

Rule, for query row ``t`` of sequence ``i`` at position ``p`` and key ``j``::

    visible = j <= p  and  (j < seq_len - tree_lens[i]  or  ancestors[t] >> (j - (seq_len - tree_lens[i])) & 1)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TreeMask", "check_tree_mask", "tree_visible"]


class TreeMask(NamedTuple):
    """``ancestors`` int64 ``[T]`` (per query row, bit ``m`` = may see tree node ``m``),
    ``tree_lens`` int32 ``[S]`` (tree nodes at the end of each sequence; 0 = no tree)."""

    ancestors: torch.Tensor
    tree_lens: torch.Tensor

    def to(self, device: torch.device | str) -> TreeMask:
        return TreeMask(self.ancestors.to(device), self.tree_lens.to(device))


def check_tree_mask(tree_mask: object, num_tokens: int, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                    sliding_window: int | None, check_values: bool = True) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming ``tree_mask`` unless it fits the step."""
    if not isinstance(tree_mask, TreeMask):
        raise TypeError(f"tree_mask must be a TreeMask(ancestors, tree_lens) or None, got {type(tree_mask).__name__}")
    if sliding_window is not None:
        raise ValueError(f"tree_mask with sliding_window={sliding_window}: tree nodes sit at depth-based positions "
                         "that a window over slots cannot express; valid: no window")
    ancestors, lens = tree_mask
    if not isinstance(ancestors, torch.Tensor) or ancestors.dtype != torch.int64 or ancestors.shape != (num_tokens,):
        got = f"{getattr(ancestors, 'dtype', type(ancestors).__name__)} {tuple(getattr(ancestors, 'shape', ()))}"
        raise ValueError(f"tree_mask.ancestors must be int64 [{num_tokens}], got {got}")
    num_seqs = seq_lens.shape[0]
    if not isinstance(lens, torch.Tensor) or lens.dtype != torch.int32 or lens.shape != (num_seqs,):
        raise ValueError(f"tree_mask.tree_lens must be int32 [{num_seqs}], got "
                         f"{getattr(lens, 'dtype', type(lens).__name__)} {tuple(getattr(lens, 'shape', ()))}")
    if check_values and num_seqs:
        if bool(((lens < 0) | (lens > 64) | (lens > seq_lens.to(lens.device))).any()):
            raise ValueError(f"tree_mask.tree_lens = {lens.tolist()}; valid: 0..64 and at most each sequence's "
                             "length (the tree nodes are its last keys)")


def tree_visible(ancestors: torch.Tensor, key_pos: torch.Tensor, tree_start: torch.Tensor | int) -> torch.Tensor:
    """Bool ``[..., Q, K]``: which keys the tree rule lets each query row see.

    ``ancestors`` int64 ``[..., Q]``, ``key_pos`` int64 ``[..., K]`` (or broadcastable),
    ``tree_start`` the first tree key position (``seq_len - tree_len``), broadcastable
    to ``[..., 1]``. Keys before ``tree_start`` are always visible here (the causal
    rule is applied separately).
    """
    offset = key_pos - (tree_start if isinstance(tree_start, int) else tree_start[..., None])
    in_tree = offset >= 0
    bit = (ancestors[..., :, None] >> offset.clamp(0, 63)[..., None, :]) & 1
    return ~in_tree[..., None, :] | (bit == 1)
