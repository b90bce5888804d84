"""Prompt-lookup (n-gram) drafting: no model, no probabilities."""

from __future__ import annotations

from collections.abc import Sequence

from servelab.samplers.interfaces import Drafter, DraftProposal, _check_request


class NgramDrafter(Drafter):
    """Prompt-lookup drafting: continue the latest earlier match of the context's tail.

    For ``n`` from ``max_n`` down to ``min_n``, look for the most recent
    earlier occurrence of the last ``n`` tokens in the history; the first
    ``n`` that matches proposes the (up to ``k``) tokens that followed that
    occurrence. Longer matches are tried first because they predict better;
    the most recent occurrence is used because repetition is local (code
    edits, quoted passages). Proposals carry ``probs=None`` (one-hot drafts).
    Registered as ``"ngram"``.
    """

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        for name, value in (("min_n", min_n), ("max_n", max_n)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NgramDrafter {name} = {value!r} is invalid; valid: an int >= 1")
        if min_n > max_n:
            raise ValueError(f"NgramDrafter min_n = {min_n} exceeds max_n = {max_n}; valid: min_n <= max_n")
        self.min_n = min_n
        self.max_n = max_n

    def propose_with_probs(self, token_ids: Sequence[int], k: int) -> DraftProposal:
        history = _check_request(token_ids, k)
        if k == 0:
            return DraftProposal([])
        length = len(history)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = history[length - n :]
            # Latest start i < length - n whose window equals the suffix; the
            # match must end before the last token so something follows it.
            for start in range(length - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    follow = start + n
                    return DraftProposal(history[follow : follow + k])
        return DraftProposal([])
