"""Prompt-lookup drafting of token trees: several continuations merged into one tree.

The chain drafter (:mod:`~servelab.samplers.drafters.ngram`) continues the
single most recent match of the context's tail. Repetitive text often has
several earlier matches that continue differently (a variable used in
several statements, a phrase quoted twice with different endings); a tree
can carry all of them, and the target verifies them in one step.
"""

from __future__ import annotations

from collections.abc import Sequence

from servelab.samplers.draft_tree import DraftTree
from servelab.samplers.interfaces import Drafter, DraftProposal, _check_request

__all__ = ["NgramTreeDrafter"]


class NgramTreeDrafter(Drafter):
    """Registered as ``"ngram_tree"``: up to ``max_branches`` prompt-lookup continuations as a tree.

    Candidates: for ``n`` from ``max_n`` down to ``min_n``, every earlier
    occurrence of the history's last ``n`` tokens, most recent first (longer
    matches, then more recent ones, rank higher), each proposing the tokens
    that followed it; identical continuations count once. The tree is their
    trie, filled breadth first within the node budget ``k``: depth 1 of every
    candidate (in rank order), then depth 2, ..., so shared prefixes cost one
    node and the budget is spread over the branches instead of spent on the
    first one. Node indices follow that order (parents first, siblings in rank
    order: verification tries higher-ranked candidates first). With one
    candidate the tree is the chain the ``"ngram"`` drafter proposes.
    Proposals carry ``probs=None`` (one-hot drafts).
    """

    def __init__(self, min_n: int = 1, max_n: int = 3, max_branches: int = 4) -> None:
        for name, value in (("min_n", min_n), ("max_n", max_n), ("max_branches", max_branches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NgramTreeDrafter {name} = {value!r} is invalid; valid: an int >= 1")
        if min_n > max_n:
            raise ValueError(f"NgramTreeDrafter min_n = {min_n} exceeds max_n = {max_n}; valid: min_n <= max_n")
        self.min_n, self.max_n, self.max_branches = min_n, max_n, max_branches

    def candidates(self, history: Sequence[int], k: int) -> list[list[int]]:
        """Up to ``max_branches`` distinct continuations (at most ``k`` tokens each), best first."""
        length = len(history)
        found: list[list[int]] = []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = list(history[length - n:])
            for start in range(length - n - 1, -1, -1):
                if list(history[start:start + n]) == suffix:
                    follow = list(history[start + n:start + n + k])
                    if follow and follow not in found:
                        found.append(follow)
                        if len(found) == self.max_branches:
                            return found
        return found

    def propose_with_probs(self, token_ids: Sequence[int], k: int) -> DraftProposal:
        history = _check_request(token_ids, k)
        paths = self.candidates(history, k) if k else []
        return DraftProposal.from_tree(breadth_first_trie(paths, k))


def breadth_first_trie(paths: Sequence[Sequence[int]], budget: int) -> DraftTree:
    """The trie of ``paths`` with at most ``budget`` nodes, filled one depth at a time
    (depth ``d`` of every path, in path order, before depth ``d + 1``)."""
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, ...], int] = {}
    for depth in range(1, max((len(p) for p in paths), default=0) + 1):
        for path in paths:
            if len(path) < depth:
                continue
            prefix = tuple(path[:depth])
            if prefix in node_of:
                continue
            if len(tokens) == budget:
                return DraftTree(tuple(tokens), tuple(parents))
            node_of[prefix] = len(tokens)
            tokens.append(prefix[-1])
            parents.append(node_of[prefix[:-1]] if depth > 1 else -1)
    return DraftTree(tuple(tokens), tuple(parents))
