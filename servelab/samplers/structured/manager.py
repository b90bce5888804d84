"""``StructuredOutputManager``: the per-pipeline owner of grammars and matchers.

Life of a constrained request (vLLM v1's design, CPU side):

1. **add** (:meth:`add_request`, when the request is added): the constraint
   is compiled — once per constraint, cached here for this tokenizer — and a
   matcher is started. A constraint that does not compile raises
   ``ValueError`` with the compiler's message, which fails that request alone.
   A backend with an ``audit(params)`` method (the default one) also says
   which JSON-schema keywords it will not enforce
   (:mod:`~servelab.samplers.structured.schema_audit`); ``add_request``
   returns them, and the pipeline warns and puts them on the output.
2. **mask** (:meth:`fill_bitmasks`, every step, before sampling): one bitmask
   row per sampled position. A request verifying ``d`` drafts needs ``d + 1``
   rows: row ``j`` is the mask after the first ``j`` drafts, so the matcher is
   advanced through the drafts while filling and rolled back afterwards. If
   the grammar rejects draft ``j``, rows ``j+1..d`` copy row ``j`` (those
   positions can never be reached: the verifier stops at a draft whose target
   probability is 0, which the mask guarantees for a forbidden draft).
3. **accept** (:meth:`accept_tokens`, after sampling/verification): the
   matcher advances by the tokens actually emitted. This is the only place
   state advances for real, so preemption (which keeps a request's tokens and
   recomputes only KV) needs no grammar rollback, and rejected drafts were
   already rolled back in step 2.
4. **remove** (:meth:`remove_request`, when the request ends).

Requests without a constraint get all-ones rows (``-1`` words), so a batch
mixing constrained and free requests is masked in one call and the free ones
are unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from servelab._internal.bitmask_checks import num_bitmask_words
from servelab.samplers.structured.backend import (
    GrammarBackend,
    GrammarMatcher,
    available_grammar_backends,
    get_grammar_backend,
)
from servelab.samplers.structured.bitmask import bitmask_allows_nothing
from servelab.samplers.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputManager"]


class StructuredOutputManager:
    """Grammars and per-request matchers for one pipeline (one tokenizer and vocabulary).

    Args:
        tokenizer: the pipeline's Hugging Face tokenizer (None: every grammar is refused).
        vocab_size: the model's vocabulary size ``V``; bitmask rows have ``ceil(V / 32)`` words.
        stop_token_ids: the model's EOS ids (allowed once a grammar completes).
        backend: a registered backend name (default ``"xgrammar"``) or a
            :class:`GrammarBackend` object. Built lazily, on the first constrained request.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] = (),
                 backend: str | GrammarBackend = "xgrammar") -> None:
        if isinstance(backend, str) and backend not in available_grammar_backends():
            # refused when the pipeline is built, not by every structured request later
            raise ValueError(f"grammar_backend={backend!r} is not a registered grammar backend; valid: "
                             f"{', '.join(available_grammar_backends())} (or a GrammarBackend object)")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = num_bitmask_words(vocab_size)
        self.stop_token_ids = tuple(stop_token_ids)
        self._backend_choice = backend
        self._backend: GrammarBackend | None = None
        self._compiled: dict[tuple[str, str], Any] = {}
        self._unenforced: dict[tuple[str, str], tuple[str, ...]] = {}
        self._matchers: dict[str, GrammarMatcher] = {}

    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend (built on first use)."""
        if self._backend is None:
            if isinstance(self._backend_choice, str):
                if self.tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer; the pipeline has none")
                self._backend = get_grammar_backend(self._backend_choice, tokenizer=self.tokenizer,
                                                    vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            else:
                self._backend = get_grammar_backend(self._backend_choice)
        return self._backend

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``params`` (cached); ``ValueError`` if it does not compile."""
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be a StructuredOutputsParams, got {type(params).__name__}")
        key = params.key
        if key not in self._compiled:
            self._compiled[key] = self.backend.compile(params)
        return self._compiled[key]

    def unenforced(self, params: StructuredOutputsParams) -> tuple[str, ...]:
        """What the backend will not enforce of ``params`` (cached; empty for a backend without ``audit``)."""
        key = params.key
        if key not in self._unenforced:
            audit = getattr(self.backend, "audit", None)
            result = audit(params) if audit is not None else None
            self._unenforced[key] = tuple(str(u) for u in result.unenforced) if result is not None else ()
        return self._unenforced[key]

    def add_request(self, req_id: str, params: StructuredOutputsParams) -> tuple[str, ...]:
        """Compile (or reuse) the constraint and start a matcher; nothing is kept if it fails.

        Returns what the backend will not enforce (:meth:`unenforced`), each
        ``"keyword at /json/pointer: why"``; empty when everything is enforced.
        """
        if req_id in self._matchers:
            raise ValueError(f"request {req_id!r} already has a grammar")
        matcher = self.backend.new_matcher(self.compile(params))
        unenforced = self.unenforced(params)
        self._matchers[req_id] = matcher
        return unenforced

    def remove_request(self, req_id: str) -> None:
        """Forget a request's matcher (unknown ids are ignored)."""
        self._matchers.pop(req_id, None)

    def fill_bitmasks(self, rows: Sequence[tuple[str, Sequence[int]]]) -> tuple[torch.Tensor | None, dict[str, str]]:
        """Bitmasks for one step's sampled positions.

        Args:
            rows: per request in logits-row order, ``(req_id, drafts)``: the
                request owns ``len(drafts) + 1`` consecutive logits rows.

        Returns:
            ``(bitmask, errors)``: int32 ``[sum(len(drafts) + 1), ceil(V / 32)]``
            (None when no request of the step has a grammar), and request id ->
            message for constrained requests whose grammar allows no token at
            all (they must fail rather than emit an arbitrary token).
        """
        if not any(rid in self._matchers for rid, _ in rows):
            return None, {}
        total = sum(len(drafts) + 1 for _, drafts in rows)
        bitmask = torch.full((total, self.num_words), -1, dtype=torch.int32)
        errors: dict[str, str] = {}
        start = 0
        for rid, drafts in rows:
            matcher = self._matchers.get(rid)
            if matcher is not None:
                self._fill_one(matcher, bitmask, start, drafts)
                if bool(bitmask_allows_nothing(bitmask[start:start + 1], self.vocab_size)[0]):
                    errors[rid] = "the grammar allows no token here (every token is masked)"
            start += len(drafts) + 1
        return bitmask, errors

    @staticmethod
    def _fill_one(matcher: GrammarMatcher, bitmask: torch.Tensor, start: int, drafts: Sequence[int]) -> None:
        advanced = 0
        for j in range(len(drafts) + 1):
            row = start + j
            if j and advanced < j:  # draft j-1 was rejected: later positions are unreachable
                bitmask[row] = bitmask[row - 1]
                continue
            matcher.fill_bitmask(bitmask, row)
            if j < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[j]):
                advanced += 1
        matcher.rollback(advanced)

    def accept_tokens(self, req_id: str, token_ids: Sequence[int]) -> tuple[int, str | None]:
        """Advance a request's matcher by its emitted tokens.

        Returns ``(accepted, error)``: how many tokens the matcher took (it
        stops at termination: tokens after the stop token are the scheduler's
        to drop) and, if the grammar refused one, why — the request must then
        fail (its matcher is left before the refused token).
        """
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return 0, None
        accepted = 0
        for token in token_ids:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                return accepted, f"token {token} violates the request's grammar"
            accepted += 1
        return accepted, None

    def rollback_tokens(self, req_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens of a request (a step that was rolled back)."""
        matcher = self._matchers.get(req_id)
        if matcher is not None and num_tokens:
            matcher.rollback(num_tokens)

    def is_terminated(self, req_id: str) -> bool:
        """Whether a request's grammar has completed (its stop token was accepted)."""
        matcher = self._matchers.get(req_id)
        return matcher is not None and matcher.is_terminated()
