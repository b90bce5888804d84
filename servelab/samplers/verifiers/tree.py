"""Token trees for speculative decoding: structure, attention mask, and the ``"tree"`` verifier.

A :class:`TokenTree` holds draft tokens and parent indices (``-1`` = child of
the root, the last committed token; ``parents[n] < n``). One target forward
pass over ``[root, node_0, ..., node_{N-1}]`` with the tree attention mask
gives every node's next-token distribution; the verifiers
(:func:`verify_tree_greedy`, :func:`verify_tree_stochastic`, fast path in
:mod:`servelab.samplers.verifiers.tree_verify`) then pick the accepted path.

:class:`TreeVerifier` is the registered ``"tree"`` verifier. Its
:meth:`~TreeVerifier.verify` takes the chains every drafter proposes today (a
chain is a one-branch tree, and verifying it this way is exactly rejection
sampling); :meth:`~TreeVerifier.verify_trees` takes real trees. No built-in
drafter proposes trees yet, and the pipeline's runner schedules chains only:
tree drafting needs a drafter that returns a :class:`TokenTree` and a runner
step that feeds the tree with :func:`tree_attention_mask`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servelab._internal.draft_layout import check_tree_batch
from servelab._internal.sampling_checks import check_draft_batch
from servelab.samplers.verifiers.tree_verify import TreeVerifyOutput, verify_tree_greedy, verify_tree_stochastic

__all__ = [
    "TokenTree",
    "TreeVerifier",
    "TreeVerifyOutput",
    "tree_attention_mask",
    "verify_tree_greedy",
    "verify_tree_stochastic",
]


def _check_parents(parents: Sequence[int]) -> tuple[int, ...]:
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
    sits at position ``context_len + depth(j)`` (see :meth:`TokenTree.positions`).
    """
    if isinstance(parents, torch.Tensor):
        parents = [int(p) for p in parents.tolist()]
    parents = _check_parents(parents)
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
class TokenTree:
    """Draft tokens arranged as a tree (node ``n``: ``token_ids[n]``, parent ``parents[n]``)."""

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
        object.__setattr__(self, "parents", _check_parents(self.parents))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TokenTree:
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
    def depths(self) -> tuple[int, ...]:
        """Depth of each node (children of the root have depth 1)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (``-1`` = root), in the order verification tries them."""
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """Token ids from the root's first child down to ``node``."""
        tokens: list[int] = []
        while node >= 0:
            tokens.append(self.token_ids[node])
            node = self.parents[node]
        return tokens[::-1]

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


class TreeVerifier:
    """The ``"tree"`` verifier: SpecInfer-style multi-candidate verification (see the module docstring).

    Greedy trees are verified by argmax, the others stochastically (each
    emitted token distributed as the target). ``check_inputs`` validates every
    call (shapes, ids, NaN / negative / all-zero probabilities).
    """

    name = "tree"

    def __init__(self, *, check_inputs: bool = True) -> None:
        self.check_inputs = bool(check_inputs)

    def __repr__(self) -> str:
        return "TreeVerifier()"

    def verify(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: Sequence[int],
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor | None,
        *,
        greedy: torch.Tensor,
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Chains as one-branch trees; see :class:`servelab.samplers.interfaces.Verifier`."""
        generators = list(generators)
        batch = check_draft_batch(draft_token_ids, num_draft_tokens, target_probs, draft_probs, greedy,
                                  generators, check_inputs=self.check_inputs)
        device = target_probs.device
        num_reqs, max_draft, vocab_size = batch.num_reqs, batch.max_draft, batch.vocab_size
        counts = torch.tensor(batch.num_draft_tokens, dtype=torch.int64, device=device)
        starts = torch.tensor(batch.draft_offsets[:-1], dtype=torch.int64, device=device)
        slots = torch.arange(max_draft + 1, device=device)
        present = slots[None, :max_draft] < counts[:, None]  # [B, K]
        tokens = torch.full((num_reqs, max_draft), -1, dtype=torch.int64, device=device)
        tokens[present] = draft_token_ids.long()
        # Slot j of request i reads its row j; slots past its drafts repeat its bonus row (never read).
        first_row = starts + torch.arange(num_reqs, device=device)
        tree_target = target_probs[first_row[:, None] + torch.minimum(slots[None, :], counts[:, None])]
        tree_draft = None
        if draft_probs is not None:
            tree_draft = draft_probs.new_zeros(num_reqs, max_draft, vocab_size)
            tree_draft[present] = draft_probs
        parents = torch.arange(max_draft, device=device) - 1
        out = self._verify(tokens, parents, tree_target, tree_draft, batch.greedy, generators, check_inputs=False)
        return out.token_ids

    def verify_trees(
        self,
        draft_token_ids: torch.Tensor,
        parents: torch.Tensor,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
        *,
        greedy: torch.Tensor | bool = False,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> TreeVerifyOutput:
        """Verify a batch of real trees (layout of :mod:`servelab.reference.tree_verify`).

        ``draft_token_ids`` int ``[B, N]`` (-1 = absent node), ``parents`` int
        ``[N]`` or ``[B, N]``, ``target_probs`` float ``[B, N + 1, V]`` (row 0 =
        root), ``draft_probs`` float ``[B, N, V]`` or None, ``greedy`` bool or
        bool ``[B]``, ``generators`` None or one (or None) per tree.
        """
        num_trees = draft_token_ids.shape[0] if isinstance(draft_token_ids, torch.Tensor) else 0
        if isinstance(greedy, bool):
            flags = [greedy] * num_trees
        elif isinstance(greedy, torch.Tensor) and greedy.dtype == torch.bool and greedy.shape == (num_trees,):
            flags = [bool(flag) for flag in greedy.tolist()]
        else:
            raise ValueError(f"greedy must be a bool or a bool tensor [{num_trees}]; got {greedy!r}")
        if generators is not None and len(generators) != num_trees:
            raise ValueError(f"generators holds {len(generators)} entries; valid: None or one per tree ({num_trees})")
        return self._verify(draft_token_ids, parents, target_probs, draft_probs, flags,
                            list(generators) if generators is not None else [None] * num_trees,
                            check_inputs=self.check_inputs)

    @staticmethod
    def _verify(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
                greedy: list[bool], generators: list[torch.Generator | None], *,
                check_inputs: bool) -> TreeVerifyOutput:
        """Greedy trees by argmax, the others stochastically; results merged back in batch order."""
        if check_inputs:  # validate the whole batch once, then run the parts unchecked
            check_tree_batch(tokens, parents, target, draft)
        num_trees, num_nodes = tokens.shape
        parents = parents.to(device=tokens.device, dtype=torch.int64)
        parents = parents[None, :].expand(num_trees, -1) if parents.dim() == 1 else parents
        parts = []
        for want_greedy in (True, False):
            rows = [row for row, flag in enumerate(greedy) if flag == want_greedy]
            if not rows:
                continue
            index = torch.tensor(rows, dtype=torch.int64, device=tokens.device)
            if want_greedy:
                part = verify_tree_greedy(tokens[index], parents[index], target[index], check_inputs=False)
            else:
                part_generators = [generators[row] for row in rows]
                part = verify_tree_stochastic(
                    tokens[index], parents[index], target[index], None if draft is None else draft[index],
                    generator=part_generators if any(g is not None for g in part_generators) else None,
                    check_inputs=False,
                )
            parts.append((index, part))
        depth = max((part.accepted_nodes.shape[1] for _, part in parts), default=0)
        token_ids = torch.full((num_trees, depth + 1), -1, dtype=torch.int64, device=tokens.device)
        nodes = torch.full((num_trees, depth), -1, dtype=torch.int64, device=tokens.device)
        for index, part in parts:
            token_ids[index, : part.token_ids.shape[1]] = part.token_ids
            nodes[index, : part.accepted_nodes.shape[1]] = part.accepted_nodes
        return TreeVerifyOutput(token_ids, nodes)
