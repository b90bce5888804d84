"""What crosses the scheduler's boundary each step.

``schedule()`` returns a :class:`SchedulerOutput`; the model runner executes
it and answers with a :class:`ModelRunnerOutput`; ``update_from_output``
turns that into :class:`RequestOutput` records for the caller.

A model runner keeps one block-table row per request it knows and builds its
inputs from a ``SchedulerOutput`` alone:

- a request in ``scheduled_new_reqs`` is new to the runner: its row is
  ``block_ids`` and its tokens are ``prompt_token_ids``;
- a request in ``scheduled_cached_reqs`` is known: append ``new_block_ids[i]``
  to its row, or, when ``resumed[i]`` (it was preempted, and the runner
  dropped it when it appeared in ``preempted_req_ids``), *replace* the row with
  ``new_block_ids[i]`` and its tokens with ``resumed_token_ids[req_id]``;
- request ``r`` computes positions ``c .. c + n - 1`` where ``c`` is its
  ``num_computed_tokens`` entry and ``n = num_scheduled_tokens[r]``; the input
  token at position ``p`` is the request's token ``p``, or draft
  ``p - num_tokens`` from ``scheduled_spec_decode_tokens[r]`` past the known
  tokens. Position ``p`` goes to slot ``row[p // block_size] * block_size +
  p % block_size``; ``seq_len = c + n``.
- ids in ``finished_req_ids`` and ``preempted_req_ids`` are to be dropped
  *before* the scheduled requests are applied: after ``rollback_step`` (or an
  interrupted ``schedule()``), the rolled-back requests are listed in the next
  output's ``preempted_req_ids`` and may be scheduled again in that same
  output (resumed, or new if their first step was the one rolled back).

**Block ids: one list per KV-cache group, always** (vLLM's shape).
``block_ids`` and each ``new_block_ids[i]`` are a **tuple of lists, one per
group** in the manager's group order: ``block_ids[g]`` is group ``g``'s row,
``new_block_ids[i][g]`` what to append to it (possibly empty). A single-group
manager (the :class:`~servelab.blocks.KVCacheManager`, full attention) gives
1-tuples: ``block_ids == ([3, 7, 9],)``, its row is ``block_ids[0]``. A
manager of several groups (:class:`~servelab.blocks.HybridKVCacheManager`,
e.g. Gemma 2's sliding and full layers) gives one list per group, and the
runner keeps one table per group
(:class:`~servelab.pipeline.hybrid.HybridModelRunner`). ``new_block_ids[i]``
may be the empty tuple ``()``: nothing new in any group. Position ``p``
of group ``g`` goes to slot ``row_g[p // block_size_g] * block_size_g + p %
block_size_g``. A row may hold the null block (0) for positions a sliding
window released; releases while a request runs are not reported (the window
never reads those positions again).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from servelab.samplers.params import SamplingParams
from servelab.scheduling.request import RequestMetrics


@dataclass(slots=True)
class NewRequestData:
    """A request the model runner has not seen: everything to start it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    """The request's whole block-table rows, one list per KV-cache group (a
    1-tuple for a single-group manager; see the module docstring)."""
    num_computed_tokens: int
    """Tokens already in the cache before this step (a prefix-cache hit)."""


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already knows, as parallel lists (one entry each)."""

    req_ids: list[str] = field(default_factory=list)
    resumed: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    """Blocks to append to the rows, one list per KV-cache group (``()``: nothing
    new); for a resumed request, the whole new rows."""
    num_computed_tokens: list[int] = field(default_factory=list)
    """Tokens in the cache before this step."""
    resumed_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """All token ids (prompt + output) of each resumed request."""

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work (see the module docstring for how a runner reads it)."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """Tokens computed this step per request (prompt chunk, or 1 + drafts)."""
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    """Draft tokens verified this step, per request that has any."""
    finished_req_ids: set[str]
    """Requests that ended since the previous step (finished, aborted, failed)."""
    preempted_req_ids: set[str]
    """Requests preempted by this step, or rolled back since the previous one:
    their blocks are gone. Drop them before applying the rest of this output."""
    total_num_kv_tokens: int = 0
    """Sum over scheduled requests of ``num_computed_tokens + scheduled``: the
    KV positions attention reads this step (what a cost model charges)."""
    step: int = 0
    kv_connector_metadata: Any = None
    """The KV connector's per-step metadata (``build_connector_meta``), or None without a connector."""

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def iter_scheduled(self) -> Iterator[tuple[str, int, int]]:
        """``(req_id, num_computed_tokens, num_scheduled_tokens)`` of every
        scheduled request: new ones first, then continuing ones."""
        nst = self.num_scheduled_tokens
        for data in self.scheduled_new_reqs:
            yield data.req_id, data.num_computed_tokens, nst[data.req_id]
        cached = self.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            yield req_id, computed, nst[req_id]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced, per scheduled request.

    ``sampled_token_ids[i]`` belongs to ``req_ids[i]``: empty while a chunked
    prefill has not reached the end of the prompt (tokens given for such a
    request are ignored), one token normally, accepted drafts plus one with
    speculative decoding. A scheduled request missing from ``req_ids`` counts
    as having produced nothing: its last position is recomputed next step.

    Optional, aligned with ``req_ids`` when given: ``spec_token_ids`` (draft
    tokens proposed for the next step), ``logprobs`` (passed through to the
    request's output, opaque to the scheduler).

    ``errors`` maps a scheduled request's id to why the runner could not serve
    it this step (its row could not be sampled, user code raised for it): the
    scheduler ends that request with ``finish_reason="error"`` and this
    message, discards any tokens given for it, and goes on with the others.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    spec_token_ids: list[list[int]] | None = None
    logprobs: list[Any] | None = None
    errors: dict[str, str] = field(default_factory=dict)
    kv_connector_output: Any = None
    """The KV connector's :class:`~servelab.connectors.KVTransferResult` for this step, or None."""

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        for name in ("sampled_token_ids", "spec_token_ids", "logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"ModelRunnerOutput.{name} has {len(value)} entries for {n} req_ids")
        errors = self.errors
        if type(errors) is not dict:
            raise TypeError(f"ModelRunnerOutput.errors must be a dict (request id -> message), "
                            f"got {type(errors).__name__}")
        for rid, message in errors.items():
            if not isinstance(rid, str) or not isinstance(message, str):
                raise TypeError(f"ModelRunnerOutput.errors must map request ids (str) to messages (str), "
                                f"got {rid!r}: {message!r}")


@dataclass
class RequestOutput:
    """New tokens of one request from one step, and its end when it ended.

    Not slotted on purpose: the defaults live on the class, so the scheduler's
    decode hot path builds the common output (two fields) without running the
    nine-field ``__init__`` (one output per request per step).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error" once finished."""
    stop_reason: int | str | None = None
    """The stop token id (or stop string, via ``finish_request``) that ended it."""
    error: str | None = None
    """Why it failed (finish_reason "error")."""
    logprobs: Any = None
    metrics: RequestMetrics | None = None
    """Set on the final output."""


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues and counters."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_steps: int
    num_preemptions: int
    num_finished: int
    num_failed: int
    num_aborted: int


def check_step_results(scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> None:
    """Raise ``TypeError`` / ``ValueError`` unless ``model_output`` can be applied to the step
    ``scheduler_output`` scheduled (what ``update_from_output`` checks before any state changes)."""
    if not isinstance(scheduler_output, SchedulerOutput):
        raise TypeError(f"scheduler_output must be a SchedulerOutput, got {type(scheduler_output).__name__}")
    if not isinstance(model_output, ModelRunnerOutput):
        raise TypeError(f"model_output must be a ModelRunnerOutput, got {type(model_output).__name__}")
    num_scheduled = scheduler_output.num_scheduled_tokens
    spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
    req_ids = model_output.req_ids
    given = set(req_ids)
    if not num_scheduled.keys() >= given:
        unknown = sorted(given - num_scheduled.keys())
        raise ValueError(f"ModelRunnerOutput names requests not scheduled in this step: {unknown[:5]}")
    if not num_scheduled.keys() >= model_output.errors.keys():
        unknown = sorted(model_output.errors.keys() - num_scheduled.keys())
        raise ValueError(f"ModelRunnerOutput.errors names requests not scheduled in this step: {unknown[:5]}")
    if len(given) != len(req_ids):
        raise ValueError("ModelRunnerOutput.req_ids holds duplicates")
    if max(map(len, model_output.sampled_token_ids), default=0) <= 1:
        return  # one token or none each: always valid (the per-request check below is for drafts)
    for rid, toks in zip(req_ids, model_output.sampled_token_ids):
        if len(toks) > 1 and len(toks) > len(spec_scheduled.get(rid, ())) + 1:
            raise ValueError(f"request {rid!r} got {len(toks)} tokens but had "
                             f"{len(spec_scheduled.get(rid, ()))} drafts scheduled; at most drafts + 1")
