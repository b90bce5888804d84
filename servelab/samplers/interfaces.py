"""The contracts of the sampling side: sampler, verifier, drafter, logits processor.

Who calls what, once per engine step (the model runner drives it):

1. Requests without drafts: the runner builds a :class:`SamplingMetadata`
   (one row per request) and calls ``sampler.forward(logits, metadata)``.
   A row that cannot be sampled comes back as token ``-1`` with a message in
   ``SamplerOutput.errors``; the runner fails that request alone
   (``ModelRunnerOutput.errors``) and keeps the others.
2. Requests with drafts: the runner builds a metadata with one row per
   verified position (``k_i + 1`` rows per request), calls
   ``sampler.compute_probs(logits, metadata)`` and hands the probabilities to
   ``verifier.verify(...)``, which returns the accepted drafts plus one
   recovered or bonus token per request.
3. Then ``drafter.propose_for_requests(requests)`` proposes the next drafts
   (one :class:`DraftRequest` per request that wants some), and
   ``drafter.release(req_id)`` is called when a request is preempted or ends.
4. Logits processors run inside the sampler (see :class:`LogitsProcessor`).

Shapes: ``R`` rows, ``V`` vocabulary, ``k_i`` drafts of request ``i``.
Every implementation here is swappable: a sampler is passed to the pipeline,
verifiers and drafters are chosen by name or object through
:func:`servelab.samplers.verifiers.get_verifier` and
:func:`servelab.samplers.drafters.get_drafter`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

from servelab.samplers.params import SamplingParams
from servelab.samplers.processors import LogitsProcessor

if TYPE_CHECKING:
    from servelab.samplers.metadata import SamplingMetadata

__all__ = [
    "DraftProposal",
    "DraftRequest",
    "Drafter",
    "LogitsProcessor",
    "LogprobsOutput",
    "SamplerProtocol",
    "SamplerOutput",
    "Verifier",
]


# --- sampler ---------------------------------------------------------------------


@dataclass
class LogprobsOutput:
    """Logprobs of the raw distribution for a batch.

    ``token_ids`` int64 ``[R, 1 + n]`` and ``logprobs`` float32 ``[R, 1 + n]``:
    column 0 is the sampled token, columns 1..n the top-n tokens (descending),
    ``n`` the largest ``logprobs`` asked in the batch. ``sampled_token_ranks``
    int64 ``[R]``: 1 + the number of tokens strictly more likely than the
    sampled one.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    sampled_token_ranks: torch.Tensor

    def for_request(self, row: int, num_logprobs: int) -> list[tuple[int, float]]:
        """``[(sampled id, logprob), (top-1 id, logprob), ...]`` with ``num_logprobs`` top entries."""
        if not 0 <= num_logprobs < self.token_ids.shape[1]:
            raise ValueError(f"num_logprobs = {num_logprobs}; valid: [0, {self.token_ids.shape[1] - 1}]")
        ids = self.token_ids[row, : num_logprobs + 1].tolist()
        values = self.logprobs[row, : num_logprobs + 1].tolist()
        return list(zip(ids, values))


@dataclass
class SamplerOutput:
    """What ``Sampler.forward`` returns.

    - ``sampled_token_ids`` int64 ``[R]``: one token per row, ``-1`` for rows in ``errors``.
    - ``logprobs``: when some request asked for them (see :class:`LogprobsOutput`).
    - ``errors``: row -> message for rows that could not be sampled (every
      token masked, NaN or +inf logits, logits overflowing after temperature).
      Such a row is never given a made-up token: the caller fails that request.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsOutput | None = None
    errors: dict[int, str] = field(default_factory=dict)


@runtime_checkable
class SamplerProtocol(Protocol):
    """Turns logits into tokens (``forward``) or into the distributions it samples from (``compute_probs``).

    Implementations are stateless across steps: everything per-step comes in
    ``metadata`` (built by :meth:`SamplingMetadata.from_requests`). The
    built-in implementation is :class:`servelab.samplers.Sampler`; the
    reference drop-in is the same class with ``backend="torch"``.
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        ``logits`` float ``[R, V]`` (any float dtype; computed in float32),
        ``R = metadata.num_reqs``, ``V = metadata.vocab_size``. Must not raise
        for a row that cannot be sampled: report it in ``SamplerOutput.errors``.
        """
        ...

    def compute_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """float32 ``[R, V]``: per row, the distribution ``forward`` would sample from.

        This is the verifiers' ``target_probs``. Rows that cannot be sampled
        are NaN (see :meth:`servelab.samplers.Sampler.compute_probs_and_errors`
        for the messages).
        """
        ...


# --- verifier --------------------------------------------------------------------


@runtime_checkable
class Verifier(Protocol):
    """Decides which drafts of a step to accept (speculative decoding).

    Registered by name in :mod:`servelab.samplers.verifiers` (``"rejection"``,
    the default, ``"typical"``, ``"tree"``); ``get_verifier(obj)`` accepts any
    object with this shape.
    """

    name: str

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
        """Verify one step's drafts; int64 ``[num_reqs, max k_i + 1]``, ``-1`` padded.

        Args:
            draft_token_ids: int64 ``[sum k_i]``, request ``i``'s drafts back to back.
            num_draft_tokens: ``k_i`` per request (0 allowed).
            target_probs: float32 ``[sum(k_i + 1), V]``: per request one row per
                draft position, then the bonus row (``Sampler.compute_probs``).
            draft_probs: float32 ``[sum k_i, V]`` the drafts were drawn from, or
                None for deterministic (one-hot) drafts such as n-gram ones.
            greedy: bool ``[num_reqs]``: verify by argmax instead of sampling.
            generators: one per request; a seeded request's generator, else None.

        Row ``i`` of the result: the accepted drafts (a prefix of request ``i``'s
        drafts), then exactly one recovered or bonus token, then ``-1``.
        Invalid probabilities (NaN, negative, a row without mass) raise
        ``ValueError`` naming the argument.
        """
        ...


# --- drafter ---------------------------------------------------------------------


@dataclass(frozen=True)
class DraftProposal:
    """``token_ids``: the drafts; ``probs``: float ``[len(token_ids), vocab]`` they were drawn from, or None."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class DraftRequest(NamedTuple):
    """One request to draft for: its id, full history (prompt + output), how
    many drafts at most, and its sampling params (None or greedy: argmax drafts)."""

    req_id: str
    token_ids: Sequence[int]
    k: int
    params: SamplingParams | None = None


def _check_request(token_ids: object, k: object) -> list[int]:
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k = {k!r} is invalid; valid: an int >= 0 (number of draft tokens)")
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    return list(token_ids)


class Drafter(ABC):
    """Proposes the next few tokens of requests cheaply.

    The runner calls exactly two methods: :meth:`propose_for_requests` once per
    step with every request that wants drafts, and :meth:`release` when a
    request is preempted or finishes (drop any per-request state). Subclasses
    implement :meth:`propose_with_probs` (one history, stateless); override
    :meth:`propose_for_requests` to batch a model or keep per-request caches.

    A proposal may be shorter than ``k`` (even empty). ``probs``, when given,
    is float ``[len(token_ids), V]``: what the drafts were drawn from, which
    rejection sampling needs to stay exact; None means one-hot.
    """

    @abstractmethod
    def propose_with_probs(self, token_ids: Sequence[int], k: int) -> DraftProposal:
        """Up to ``k`` drafts continuing ``token_ids``, with their draft distributions if any."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft token ids continuing ``token_ids``."""
        return self.propose_with_probs(token_ids, k).token_ids

    def propose_batch(self, histories: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """``propose`` for each history of a batch."""
        return [self.propose(history, k) for history in histories]

    def propose_for_requests(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """One :class:`DraftProposal` per request, in order (default: ``propose_with_probs`` each)."""
        return [self.propose_with_probs(request.token_ids, request.k) for request in requests]

    def release(self, req_id: str) -> None:  # noqa: B027 - a no-op default is the point
        """Forget any state held for ``req_id`` (idempotent; default: nothing to forget)."""
