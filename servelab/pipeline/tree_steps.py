"""Token trees in the model runner: layout, verification, and KV compaction.

A drafter may propose a tree (:class:`~servelab.samplers.draft_tree.DraftTree`).
The scheduler sees its nodes as ordinary draft tokens (``num_speculative_tokens``
is the node budget; cutting a tree to its first ``m`` nodes keeps a tree), so
one step of a request verifying a tree schedules ``[root, node_0 .. node_{N-1}]``
in consecutive KV slots. This mixin of :class:`~servelab.pipeline.runner.ModelRunner`
then:

1. **layout** (:meth:`TreeSteps._tree_layout`): RoPE position of node ``n`` =
   root position + depth(n) (slots stay consecutive), and a
   :class:`~servelab.attention.TreeMask` (node ``n`` sees the context, the
   root and its ancestors) in the step's attention metadata;
2. **verification** (:meth:`TreeSteps._verify_trees`): one
   ``sampler.compute_probs`` row per tree slot (penalties and grammars see the
   path to that node), then ``verifier.verify_trees``; the result must be a
   root path of the tree plus one token;
3. **compaction** (:meth:`TreeSteps._compact_kv`): the accepted nodes' K/V
   move, in every layer, to the slots right after the root, where a chain's
   would be. The scheduler then counts ``root + accepted`` positions as
   computed (as for a chain) and commits full blocks to the prefix cache only
   after this step returned, so no rejected branch's KV is ever findable by
   prefix lookup; the rejected nodes' slots lie past the computed tokens and
   are overwritten by the request's next step.

Trees whose scheduled prefix is a chain take the chain path (no mask, no
compaction). Runners that cannot lay a tree out (``supports_draft_trees =
False``: the hybrid runner), and verifiers without ``verify_trees``, get each
tree's first branch instead (:meth:`TreeSteps._as_proposed`), and so do
models with sliding-window layers (a window counts slots, not tree depths).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from servelab._internal.sampling_noise import seeded_generator
from servelab._internal.tree_mask import TreeMask
from servelab.pipeline.sampling_steps import RowError, SamplingSteps, _subset, call_isolated
from servelab.samplers.draft_tree import DraftTree

__all__ = ["TreeSteps", "first_branch"]


def first_branch(tree: DraftTree) -> DraftTree:
    """The chain root -> node 0 -> its first child -> ... of ``tree``."""
    tokens: list[int] = []
    node = -1
    while True:
        children = [child for child, parent in enumerate(tree.parents) if parent == node]
        if not children:
            return DraftTree.chain(tokens)
        node = children[0]
        tokens.append(tree.token_ids[node])


class TreeSteps(SamplingSteps):
    """Tree handling for :class:`~servelab.pipeline.runner.ModelRunner` (a mixin over
    :class:`SamplingSteps`; uses the runner's ``model``, ``kv_caches``, ``block_size``, ``_bt``)."""

    # Set by ModelRunner.__init__.
    model: Any
    kv_caches: Any
    block_size: int
    _bt: np.ndarray

    supports_draft_trees = True
    """False for runners whose attention metadata cannot carry a tree mask."""

    def _trees_enabled(self) -> bool:
        # A sliding window counts positions by slot; tree nodes sit at depth-based positions.
        windows = getattr(getattr(self.model, "config", None), "sliding_windows", None) or ()
        return (self.supports_draft_trees and callable(getattr(self.verifier, "verify_trees", None))
                and all(window is None for window in windows))

    def _as_proposed(self, proposal: Any, k: int) -> tuple[list[int], DraftTree | None, torch.Tensor | None]:
        """(drafts for the scheduler, the tree to remember or None for a chain, probs) of a proposal."""
        ids = list(proposal.token_ids[:k])
        probs = proposal.probs
        if proposal.parents is None:
            return ids, None, probs
        tree = DraftTree(tuple(ids), tuple(proposal.parents[:k]))
        if tree.is_chain:
            return ids, None, probs
        if not self._trees_enabled():
            branch = first_branch(tree)
            if probs is not None:
                path, node = [], -1
                for _ in branch.token_ids:
                    node = next(c for c, p in enumerate(tree.parents) if p == node)
                    path.append(node)
                probs = probs[torch.tensor(path, dtype=torch.long, device=probs.device)] if path else None
            return list(branch.token_ids), None, probs
        return ids, tree, probs

    @staticmethod
    def _scheduled_tree(state: Any, num_drafts: int) -> Any:
        """The tree of a request's scheduled drafts, or None when they form a chain."""
        tree = state.draft_tree
        if tree is None or num_drafts <= 0:
            return None
        tree = tree.truncate(num_drafts)
        return None if tree.is_chain else tree

    def _tree_layout(self, batch: list, qsl: np.ndarray, positions: np.ndarray
                     ) -> tuple[np.ndarray, TreeMask] | None:
        """Depth-based positions ``[T]`` and the tree mask of a step, or None without trees."""
        found = []
        for i, (state, c, n) in enumerate(batch):
            tree = self._scheduled_tree(state, c + n - len(state.token_ids))
            if tree is not None:
                found.append((i, tree, len(state.token_ids)))
        if not found:
            return None
        rope = positions.copy()
        ancestors = np.zeros(positions.shape[0], np.int64)
        lens = np.zeros(len(batch), np.int32)
        for i, tree, num_known in found:
            end = int(qsl[i + 1])
            nodes = slice(end - tree.num_nodes, end)
            rope[nodes] = num_known - 1 + np.asarray(tree.depths, np.int64)  # the root sits at num_known - 1
            ancestors[nodes] = tree.ancestor_bits()
            lens[i] = tree.num_nodes
        return rope, TreeMask(torch.from_numpy(ancestors), torch.from_numpy(lens))

    def _tree_grammar_rows(self, rid: str, tree: DraftTree) -> list[tuple[str, list[int]]]:
        """Grammar rows of one tree: slot ``s`` sees the path to it (row 0: the root)."""
        return [(rid, [])] + [(rid, tree.path_to(node)) for node in range(tree.num_nodes)]

    def _tree_bitmask_rows(self, rows: list[tuple[str, list[int]]]) -> list[int]:
        """Which bitmask rows of ``structured.fill_bitmasks(rows)`` belong to the slots (each entry's last)."""
        picked, start = [], 0
        for _, path in rows:
            start += len(path) + 1
            picked.append(start - 1)
        return picked

    def _tree_target(self, trees: list[DraftTree], probs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Pad a batch of trees: tokens / parents int64 ``[B, N]``, target float ``[B, N + 1, V]``
        (absent slots repeat the root row) from request-contiguous ``probs`` ``[sum(N_i + 1), V]``."""
        device = probs.device
        width = max(t.num_nodes for t in trees)
        tokens = torch.full((len(trees), width), -1, dtype=torch.int64)
        parents = torch.full((len(trees), width), -1, dtype=torch.int64)
        index = torch.zeros(len(trees), width + 1, dtype=torch.int64)
        start = 0
        for b, tree in enumerate(trees):
            n = tree.num_nodes
            tokens[b, :n] = torch.tensor(tree.token_ids)
            parents[b, :n] = torch.tensor(tree.parents)
            index[b] = start
            index[b, : n + 1] = torch.arange(start, start + n + 1)
            start += n + 1
        return tokens.to(device), parents.to(device), probs[index.to(device)]

    def _tree_draft_probs(self, states: list, trees: list[DraftTree], device: torch.device) -> torch.Tensor | None:
        """float32 ``[B, N, V]`` the nodes were drawn from, or None when every node is one-hot."""
        if all(s.draft_probs is None for s in states):
            return None
        width = max(t.num_nodes for t in trees)
        out = torch.zeros(len(trees), width, self.vocab_size, device=device)
        for b, (state, tree) in enumerate(zip(states, trees)):
            n = tree.num_nodes
            q = state.draft_probs
            if q is None or q.shape[0] < n:
                out[b, torch.arange(n), torch.tensor(tree.token_ids)] = 1.0
            else:
                out[b, :n, : q.shape[1]] = q[:n].to(device, torch.float32)
        return out

    def _check_tree_result(self, tree: DraftTree, toks: list[int], nodes: list[int]) -> str | None:
        """Why a verifier's tree result breaks the contract, or None."""
        if not toks or len(nodes) != len(toks) - 1 or not 0 <= toks[-1] < self.vocab_size:
            return "not the accepted path's nodes plus one token"
        parent = -1
        for node, token in zip(nodes, toks):
            if not 0 <= node < tree.num_nodes or tree.parents[node] != parent or tree.token_ids[node] != token:
                return f"node {node} does not continue a root path of the tree with token {token}"
            parent = node
        return None

    def _run_tree_verifier(self, states: list, trees: list[DraftTree], target: torch.Tensor) -> list[Any]:
        """``verifier.verify_trees`` over a batch; per tree ``(tokens, accepted nodes)`` or an error string."""
        device = target.device
        tokens, parents, tree_target = self._tree_target(trees, target)
        generators = [seeded_generator(s.params.seed, len(s.token_ids) - s.num_prompt_tokens, device)
                      if s.params.seed is not None and not s.params.is_greedy else None for s in states]
        out = getattr(self.verifier, "verify_trees")(  # (checked by _trees_enabled when the tree was proposed)
            tokens, parents, tree_target, self._tree_draft_probs(states, trees, device),
            greedy=torch.tensor([s.params.is_greedy for s in states], device=device), generators=generators)
        token_rows, node_rows = out[0].tolist(), out[1].tolist()
        if len(token_rows) != len(trees):
            raise ValueError(f"the verifier returned {len(token_rows)} trees for {len(trees)} requests")
        results: list[Any] = []
        for tree, row, node_row in zip(trees, token_rows, node_rows):
            toks, nodes = [t for t in row if t >= 0], [n for n in node_row if n >= 0]
            problem = self._check_tree_result(tree, toks, nodes)
            name = getattr(self.verifier, "name", type(self.verifier).__name__)
            results.append(f"verifier {name!r} returned {row} / nodes {node_row} for tree {tree}: {problem}"
                           if problem else (toks, nodes))
        return results

    def _compact_kv(self, state: Any, nodes: list[int]) -> None:
        """Move the accepted nodes' K/V (slots ``L + node``) to ``L + j`` in every layer
        (``L`` = the request's known tokens: the root sits at ``L - 1``)."""
        num_known = len(state.token_ids)
        moves = [(num_known + node, num_known + j) for j, node in enumerate(nodes) if node != j]
        if not moves:
            return
        src, dst = np.array(moves, np.int64).T
        size = self.block_size
        row = self._bt[state.row]
        src_blocks, dst_blocks = (torch.from_numpy(row[p // size].astype(np.int64)) for p in (src, dst))
        src_offsets, dst_offsets = torch.from_numpy(src % size), torch.from_numpy(dst % size)
        caches: Any = getattr(self.kv_caches, "views", self.kv_caches)
        for key_cache, value_cache in caches:
            device = key_cache.device
            sb, so, db, do = (t.to(device) for t in (src_blocks, src_offsets, dst_blocks, dst_offsets))
            key_cache[db, do] = key_cache[sb, so]  # the gather copies first: overlapping moves are safe
            value_cache[db, do] = value_cache[sb, so]

    def _verify_trees(self, batch, verify: list[tuple[int, int]], entries: list[int], logits: torch.Tensor,
                      starts: list[int], total: int, sampled: list[list[int]], logprobs: list[Any],
                      errors: dict[str, str]) -> None:
        """Verify the tree ``entries`` of ``verify``; ``logits`` fp32 ``[total, V]`` (entry ``e``'s
        ``d + 1`` rows from ``starts[e]``: the root, then node ``n`` at ``n + 1``)."""

        def call(items: list[int]) -> list[Any]:
            rows: list[int] = []
            row_states: list[Any] = []
            row_outputs: list[list[int]] = []
            states: list[Any] = []
            trees: list[DraftTree] = []
            for e in items:
                i, d = verify[e]
                state = batch[i][0]
                tree = self._scheduled_tree(state, d)
                history = state.token_ids[state.num_prompt_tokens:]
                row_states += [state] * (d + 1)
                row_outputs += [history] + [history + tree.path_to(node) for node in range(d)]
                rows += range(starts[e], starts[e] + d + 1)
                states.append(state)
                trees.append(tree)
            target = self.sampler.compute_probs(_subset(logits, rows, total), self._metadata(row_states, row_outputs))
            return [RowError(r) if isinstance(r, str) else r for r in self._run_tree_verifier(states, trees, target)]

        results = call_isolated(call, entries, lambda e: batch[verify[e][0]][0].req_id, errors,
                                "draft verification (the sampler's compute_probs or the verifier)")
        raw = None
        for e, result in zip(entries, results):
            i, d = verify[e]
            state = batch[i][0]
            state.draft_probs = None
            if isinstance(result, RowError):
                errors[state.req_id] = str(result)
            if result is None or isinstance(result, RowError):
                continue
            toks, nodes = result
            self._compact_kv(state, nodes)
            sampled[i] = toks
            self.last_verification.append((d, len(toks) - 1))
            n = state.params.logprobs
            if n is not None:  # emitted token j came from the slot of accepted node j - 1 (the root for j = 0)
                if raw is None:
                    raw = torch.log_softmax(logits.float(), dim=-1)
                slot_rows = raw[[starts[e] + slot for slot in [0] + [node + 1 for node in nodes]]]
                picked = slot_rows.gather(1, torch.tensor(toks, device=slot_rows.device)[:, None])[:, 0].tolist()
                values, indices = slot_rows.topk(n, dim=-1) if n else (slot_rows[:, :0], slot_rows[:, :0].long())
                logprobs[i] = [[(t, lp)] + list(zip(indices[j].tolist(), values[j].tolist()))
                               for j, (t, lp) in enumerate(zip(toks, picked))]
