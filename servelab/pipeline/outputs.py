"""What the pipeline hands back: one ``GenerationOutput`` per request, and
``StreamEvent`` records for step-wise consumers.

A stream adds up to the final output: concatenating a request's
``new_token_ids`` gives ``GenerationOutput.token_ids`` and concatenating its
``new_text`` gives ``GenerationOutput.text``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelab.scheduling.request import RequestMetrics

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``): ``index`` is its
    place among the request's ``SamplingParams.n`` completions; the other
    fields are :class:`GenerationOutput`'s for that completion."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[Any] | None = None
    metrics: RequestMetrics | None = None


@dataclass
class GenerationOutput:
    """The result of one request.

    Attributes:
        request_id: the pipeline's id of the request.
        index: position of the prompt in the ``generate`` / ``stream`` call
            (or the ``index`` given to ``add_request``).
        prompt: the prompt text (None when the prompt was token ids).
        prompt_token_ids: the prompt as token ids (empty if it could not be
            tokenized).
        token_ids: generated token ids only; a stop string's tokens are kept
            up to the token that completed it, a stop token id is kept.
        text: decoded ``token_ids`` (special tokens skipped), cut before the
            stop string that ended the request.
        finish_reason: ``"stop"`` (EOS, stop token id or stop string),
            ``"length"`` (max_tokens or max_model_len), ``"abort"``, ``"error"``.
        stop_reason: the stop token id or stop string that ended it, if any.
        error: why the request failed (``finish_reason == "error"``), else None.
        metrics: timestamps and latencies (``ttft``, ``itl``, ``tpot``, ``e2e``,
            ``num_preemptions``, ``num_cached_tokens``, draft counts...).
        logprobs: per generated token, ``[(sampled id, logprob), (top-1 id,
            logprob), ...]`` when ``SamplingParams.logprobs`` was set (None for
            tokens that came out of draft verification).
        prompt_logprobs: when ``SamplingParams.prompt_logprobs`` was set, one
            entry per prompt token: None for the first (nothing predicts it),
            then ``{token id: Logprob(logprob, rank, decoded_token)}`` holding
            the prompt token itself and the top ``prompt_logprobs`` tokens
            (:mod:`servelab.pipeline.prompt_logprobs`). Set once the whole
            prompt has been computed.
        structured_unenforced: for a ``json=`` constraint, the schema keywords
            the grammar backend does not enforce (``"keyword at /pointer: why"``;
            empty: the grammar enforces the whole schema); None otherwise.
        structured_violations: with ``StructuredOutputsParams(validate=True)``
            and ``finish_reason == "stop"``, why the output is not valid under
            the schema (empty list: it is valid); None when not checked.
        completions: with ``SamplingParams(n > 1)``, the ``n`` children's
            outputs in completion order (None for ``n == 1``); the fields above
            then mirror completion 0, and :attr:`outputs` lists all ``n``.
    """

    request_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None
    structured_unenforced: list[str] | None = None
    structured_violations: list[str] | None = None
    completions: list[GenerationOutput] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The request's completions, as vLLM's ``RequestOutput.outputs`` (one when ``n == 1``)."""
        sources = self.completions if self.completions is not None else [self]
        return [CompletionOutput(i, out.text, out.token_ids, out.finish_reason, out.stop_reason, out.error,
                                 out.logprobs, out.metrics) for i, out in enumerate(sources)]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StreamEvent:
    """One request's progress in one step.

    ``new_token_ids`` / ``new_text``: what arrived since the previous event
    (text may lag tokens: characters that could still begin a stop string, or
    an incomplete UTF-8 character, are held back). The final event has
    ``finished=True`` and ``finish_reason`` set (and ``error`` for failures).

    With ``SamplingParams(n > 1)`` a request's events carry the completion
    they belong to in ``completion_index``; ``finish_reason`` is set on the
    last event of each completion, and ``finished`` only on the request's
    last event (every completion has ended).
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    completion_index: int = 0
