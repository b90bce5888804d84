"""Drafters: propose the next few tokens of a request cheaply.

Every drafter implements :class:`Drafter`: ``propose(token_ids, k)`` returns
up to ``k`` draft tokens (possibly none) continuing ``token_ids`` (the
request's prompt plus output so far). Drafters that sample from a model also
return the distributions they drew from through ``propose_with_probs``, which
``rejection_sample`` needs as ``draft_probs``; drafters without one (n-gram)
return ``probs=None``, which the verifiers treat as one-hot.

A draft-model drafter is wired by the pipeline: subclass :class:`Drafter`,
override ``propose_with_probs`` (run the small model ``k`` steps), and
``propose`` comes for free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftProposal:
    """``token_ids``: the drafts; ``probs``: float ``[len(token_ids), vocab]`` they were drawn from, or None."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


def _check_request(token_ids: object, k: object) -> list[int]:
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k = {k!r} is invalid; valid: an int >= 0 (number of draft tokens)")
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    return list(token_ids)


class Drafter(ABC):
    """Interface of a drafter (see the module docstring)."""

    @abstractmethod
    def propose_with_probs(self, token_ids: Sequence[int], k: int) -> DraftProposal:
        """Up to ``k`` drafts continuing ``token_ids``, with their draft distributions if any."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft token ids continuing ``token_ids``."""
        return self.propose_with_probs(token_ids, k).token_ids

    def propose_batch(self, histories: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """``propose`` for each request of a batch (override to batch a model)."""
        return [self.propose(history, k) for history in histories]


class NgramDrafter(Drafter):
    """Prompt-lookup drafting: continue the latest earlier match of the context's tail.

    For ``n`` from ``max_n`` down to ``min_n``, look for the most recent
    earlier occurrence of the last ``n`` tokens in the history; the first
    ``n`` that matches proposes the (up to ``k``) tokens that followed that
    occurrence. Longer matches are tried first because they predict better;
    the most recent occurrence is used because repetition is local (code
    edits, quoted passages). No model, no probabilities.
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
