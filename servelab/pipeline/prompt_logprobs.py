"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``): how likely the model found each prompt token.

Semantics (vLLM's): for a prompt of ``P`` tokens the output holds ``P``
entries, ``None`` for the first token (nothing predicts it), then for token
``j >= 1`` a dict ``{token id: Logprob(logprob, rank, decoded_token)}`` with
the prompt token itself (its logprob under the model's distribution at
position ``j - 1``, and its rank: 1 + the number of tokens more likely, ties
counted as ahead, i.e. ``#{t: logprob_t >= logprob_token}``) and the ``k`` most
likely tokens (ranks 1..k; when the prompt token is among them it appears
once, first, with its top-k rank — the two differ only under ties).
``k = 0``: the prompt token only; ``k = -1``: the whole vocabulary.
Logprobs are ``log_softmax`` of the raw logits (no temperature, penalties or
processors: those are sampling settings, the prompt was not sampled).

Cost: nothing for requests that do not ask. For those that do, the runner
(:class:`PromptLogprobsCollector`, called once per step with the forward's
hidden states ``[T, hidden]``) computes logits for their prompt positions
only, in chunks of :data:`CHUNK_ROWS` rows so a long prompt never holds a
``[P, V]`` tensor. Chunked prefill fills the entry position by position; the
entry is complete in the step that computes the prompt's last position.
A request asking for prompt logprobs skips prefix-cache hits while its
prompt logprobs are incomplete (the scheduler's admission), since a hit
would leave positions uncomputed; a position that still was not computed
(a KV cache manager that ignores that) is returned as ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = ["CHUNK_ROWS", "Logprob", "PromptLogprobsCollector", "gather_prompt_logprobs", "render_prompt_logprobs"]

CHUNK_ROWS = 256
"""Prompt positions turned into logits at once (bounds the ``[rows, V]`` temporaries)."""


class Logprob(NamedTuple):
    """One token's logprob at one position, its rank (1 = most likely), and its text (None without a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def gather_prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob and rank of each target, and the top ``k``.

    Args:
        logits: float ``[R, V]`` (any float dtype; computed in that dtype).
        targets: int64 ``[R]``: row ``r``'s actual next token.
        k: top tokens per row (``-1``: all ``V``).

    Returns:
        ``(target_logprobs [R], target_ranks int64 [R], top_ids int64 [R, k], top_logprobs [R, k])``.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    target_lp = logprobs.gather(1, targets[:, None])
    ranks = (logprobs >= target_lp).sum(dim=-1)
    k = logprobs.shape[1] if k == -1 else k
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
    return target_lp[:, 0], ranks, top_ids, top_lp


@dataclass
class _Entry:
    """Prompt logprobs of one request, filled position by position (positions ``0..P-2``)."""

    k: int
    prompt: list[int]
    rows: list[tuple[int, float, int, list[int], list[float]] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rows = [None] * max(len(self.prompt) - 1, 0)


class PromptLogprobsCollector:
    """The runner's part: which requests want prompt logprobs, and their entries.

    The runner calls :meth:`add` for each new request, :meth:`collect` once per
    step (only while :attr:`pending` is non-empty: no cost otherwise) and
    :meth:`discard` when a request ends. Complete entries move to
    :attr:`finished` (request id -> entry) until the pipeline takes them
    (:func:`render_prompt_logprobs`).
    """

    def __init__(self) -> None:
        self.pending: dict[str, _Entry] = {}
        self.finished: dict[str, _Entry] = {}

    def add(self, req_id: str, k: int | None, prompt: Sequence[int]) -> None:
        if k is not None:
            self.pending[req_id] = _Entry(k, list(prompt))

    def discard(self, req_id: str) -> None:
        self.pending.pop(req_id, None)
        self.finished.pop(req_id, None)

    def collect(self, model: Any, batch: Sequence[tuple[Any, int, int]], hidden: torch.Tensor,
                ends: Sequence[int]) -> None:
        """Fill the scheduled prompt positions of pending requests.

        Args:
            model: has ``compute_logits(hidden [n, H]) -> [n, V]``.
            batch: the step's ``(state, computed, scheduled)`` per request (``state.req_id``).
            hidden: the forward's hidden states ``[T, H]``, request-contiguous.
            ends: each request's end row in ``hidden`` (exclusive).
        """
        for (state, computed, scheduled), end in zip(batch, ends):
            entry = self.pending.get(state.req_id)
            if entry is None:
                continue
            stop = min(computed + scheduled, len(entry.prompt) - 1)  # position p predicts prompt token p + 1
            first_row = end - scheduled - computed  # hidden row of position 0 (virtual)
            for start in range(computed, stop, CHUNK_ROWS):
                positions = range(start, min(start + CHUNK_ROWS, stop))
                rows = torch.arange(first_row + positions.start, first_row + positions.stop, device=hidden.device)
                logits = model.compute_logits(hidden.index_select(0, rows))
                targets = torch.tensor(entry.prompt[positions.start + 1:positions.stop + 1], device=logits.device)
                lp, ranks, top_ids, top_lp = gather_prompt_logprobs(logits, targets, entry.k)
                for p, row in zip(positions, zip(targets.tolist(), lp.tolist(), ranks.tolist(), top_ids.tolist(),
                                                 top_lp.tolist())):
                    entry.rows[p] = row
            if computed + scheduled >= len(entry.prompt):
                self.finished[state.req_id] = self.pending.pop(state.req_id)


def render_prompt_logprobs(entry: _Entry, tokenizer: Any = None) -> list[dict[int, Logprob] | None]:
    """The output form: ``[None, {token id: Logprob}, ...]`` (one per prompt token; see the module docstring)."""
    texts: dict[int, str | None] = {}

    def decode(token: int) -> str | None:
        if token not in texts:
            texts[token] = tokenizer.decode([token]) if tokenizer is not None else None
        return texts[token]

    out: list[dict[int, Logprob] | None] = [None]
    for row in entry.rows:
        if row is None:
            out.append(None)
            continue
        token, lp, rank, top_ids, top_lp = row
        position = {token: Logprob(lp, rank, decode(token))}
        for r, (t, v) in enumerate(zip(top_ids, top_lp), start=1):  # a top-k entry replaces the prompt
            position[t] = Logprob(v, r, decode(t))  # token's when it is one of them (its top-k rank, as vLLM)
        out.append(position)
    return out if entry.prompt else []
