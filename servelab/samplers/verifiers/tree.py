"""Token trees for speculative decoding: structure, attention mask, and the ``"tree"`` verifier.

A :class:`~servelab.samplers.draft_tree.DraftTree` (also exported as
``TokenTree``) holds draft tokens and parent indices (``-1`` = child of the
root, the last committed token; ``parents[n] < n``). One target forward
pass over ``[root, node_0, ..., node_{N-1}]`` with the tree attention mask
gives every node's next-token distribution; the verifiers
(:func:`verify_tree_greedy`, :func:`verify_tree_stochastic`, fast path in
:mod:`servelab.samplers.verifiers.tree_verify`) then pick the accepted path.

:class:`TreeVerifier` is the registered ``"tree"`` verifier. Its
:meth:`~TreeVerifier.verify` takes the chains every drafter proposes today (a
chain is a one-branch tree, and verifying it this way is exactly rejection
sampling); :meth:`~TreeVerifier.verify_trees` takes real trees, which the
model runner schedules when a drafter proposes one (``"ngram_tree"``,
``"layer_skip"`` with ``tree=True``, ``"draft_model"`` with ``tree=``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab._internal.draft_layout import check_tree_batch
from servelab._internal.sampling_checks import check_draft_batch
from servelab.samplers.draft_tree import DraftTree, tree_attention_mask
from servelab.samplers.verifiers.tree_verify import TreeVerifyOutput, verify_tree_greedy, verify_tree_stochastic

__all__ = [
    "DraftTree",
    "TokenTree",
    "TreeVerifier",
    "TreeVerifyOutput",
    "tree_attention_mask",
    "verify_tree_greedy",
    "verify_tree_stochastic",
]


TokenTree = DraftTree
"""The former name of :class:`~servelab.samplers.draft_tree.DraftTree` (the same class)."""


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
