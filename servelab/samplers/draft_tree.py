"""The token-tree type of speculative decoding, defined once: :class:`DraftTree`.

A drafter may propose a tree instead of a chain: node ``n`` holds token
``token_ids[n]`` and hangs under ``parents[n]`` (``-1`` = a child of the
root, the request's last committed token). Parents precede their children
(``parents[n] < n``), so every prefix of the node list is itself a tree: the
scheduler may cut a tree to its first ``m`` nodes exactly as it cuts a chain
to its first ``m`` drafts (``num_speculative_tokens`` is the node budget).
A chain is the tree ``parents = (-1, 0, 1, ...)``.

Layout in one target step (the model runner's): the root, then the nodes in
index order, each node's KV in the slot ``context + 1 + n``; its RoPE
position is ``context + depth(n)`` (depth of a root child = 1); it attends
to the whole context, the root, and its ancestors only
(:func:`tree_attention_mask`, or per node the bitmap :meth:`DraftTree.ancestor_bits`
that the attention backends take). For a chain slots and positions coincide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MAX_TREE_NODES", "DraftTree", "check_parents", "tree_attention_mask"]

MAX_TREE_NODES = 64
"""Most nodes one scheduled tree may have: the attention backends hold each node's
ancestors in one int64 bitmap. Chains are not limited (they need no bitmap)."""


def check_parents(parents: Sequence[int]) -> tuple[int, ...]:
    """``parents`` as a tuple, after checking ``-1 <= parents[n] < n`` for every node."""
    out = []
    for node, parent in enumerate(parents):
        if not isinstance(parent, int) or isinstance(parent, bool):
            raise TypeError(f"parents[{node}] must be an int, got {type(parent).__name__}")
        if not -1 <= parent < node:
            raise ValueError(f"parents[{node}] = {parent}; valid: -1 (root) or a node index in [0, {node})")
        out.append(parent)
    return tuple(out)


def tree_attention_mask(
    parents: Sequence[int] | torch.Tensor, context_len: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Bool ``[N + 1, context_len + N + 1]`` attention mask of a token tree (True = may attend).

    Layout: query row 0 is the root, row ``n + 1`` is node ``n``. Columns
    ``[0, context_len)`` are the tokens already in the KV cache (every row sees
    them); column ``context_len + j`` is tree slot ``j`` (0 = root, ``n + 1`` =
    node ``n``). A tree slot sees itself and its ancestors only, so every node
    attends to exactly the prefix it was drafted after. The query at slot ``j``
    sits at position ``context_len + depth(j)`` (see :meth:`DraftTree.positions`).
    """
    if isinstance(parents, torch.Tensor):
        parents = [int(p) for p in parents.tolist()]
    parents = check_parents(parents)
    if not isinstance(context_len, int) or isinstance(context_len, bool) or context_len < 0:
        raise ValueError(f"context_len = {context_len!r}; valid: an int >= 0")
    num_slots = len(parents) + 1
    tree_mask = torch.eye(num_slots, dtype=torch.bool)
    tree_mask[:, 0] = True  # everybody sees the root
    for node, parent in enumerate(parents):  # parents come first: copy their rows
        if parent >= 0:
            tree_mask[node + 1] |= tree_mask[parent + 1]
    context = torch.ones(num_slots, context_len, dtype=torch.bool)
    return torch.cat([context, tree_mask], dim=1).to(device)


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens arranged as a tree (node ``n``: ``token_ids[n]``, parent ``parents[n]``).

    Validated on construction: one parent per node, ``-1 <= parents[n] < n``
    (root-relative, parents first), token ids ints ``>= 0``.
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(
                f"token_ids has {len(self.token_ids)} nodes but parents {len(self.parents)}; give one parent per node"
            )
        for node, token_id in enumerate(self.token_ids):
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(f"token_ids[{node}] = {token_id!r}; valid: an int token id >= 0")
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "parents", check_parents(self.parents))

    @classmethod
    def chain(cls, token_ids: Sequence[int]) -> DraftTree:
        """The one-branch tree of a chain of drafts."""
        return cls(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> DraftTree:
        """A trie of candidate continuations: shared prefixes become shared nodes.

        Nodes are numbered in order of first appearance, so siblings keep the
        order of the paths they came from (earlier paths are tried first).
        """
        token_ids: list[int] = []
        parents: list[int] = []
        child_of: dict[tuple[int, int], int] = {}
        for path in paths:
            parent = -1
            for token_id in path:
                key = (parent, token_id)
                if key not in child_of:
                    child_of[key] = len(token_ids)
                    token_ids.append(token_id)
                    parents.append(parent)
                parent = child_of[key]
        return cls(tuple(token_ids), tuple(parents))

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        """True when every node is the child of the one before (a plain chain of drafts)."""
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    @property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node (children of the root have depth 1)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def truncate(self, num_nodes: int) -> DraftTree:
        """The tree of the first ``num_nodes`` nodes (a prefix of a tree is a tree)."""
        return DraftTree(self.token_ids[:num_nodes], self.parents[:num_nodes])

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (``-1`` = root), in the order verification tries them."""
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """Token ids from the root's first child down to ``node`` (``-1``: the empty path)."""
        tokens: list[int] = []
        while node >= 0:
            tokens.append(self.token_ids[node])
            node = self.parents[node]
        return tokens[::-1]

    def ancestor_bits(self) -> list[int]:
        """Per node, a bitmap of the nodes it attends to: bit ``m`` set iff ``m`` is
        ``n`` itself or one of its ancestors. At most :data:`MAX_TREE_NODES` nodes."""
        if self.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"a tree of {self.num_nodes} nodes has no int64 ancestor bitmap; valid: at most "
                             f"{MAX_TREE_NODES} nodes")
        bits: list[int] = []
        for node, parent in enumerate(self.parents):
            bits.append((1 << node) | (bits[parent] if parent >= 0 else 0))
        # As signed int64 (bit 63 makes a negative number; the kernels only test bits).
        return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]

    def positions(self, start_position: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``[N + 1]``: position of each tree slot when the root sits at ``start_position``."""
        return torch.tensor([start_position, *(start_position + d for d in self.depths)], device=device)

    def attention_mask(self, context_len: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
        """See :func:`tree_attention_mask`."""
        return tree_attention_mask(self.parents, context_len, device)

    def as_tensors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(draft_token_ids [1, N], parents [N])`` for the batch verifiers."""
        return (
            torch.tensor([self.token_ids], dtype=torch.int64, device=device).view(1, -1),
            torch.tensor(self.parents, dtype=torch.int64, device=device),
        )
