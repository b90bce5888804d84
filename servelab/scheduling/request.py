"""``Request``: one generation request as the scheduler sees it.

Life cycle::

    WAITING --admitted--> RUNNING --preempted--> PREEMPTED --readmitted--> RUNNING ...
    RUNNING --stop token / EOS--> FINISHED_STOPPED         finish_reason "stop"
    RUNNING --max_tokens / max_model_len--> FINISHED_LENGTH_CAPPED   "length"
    any unfinished --abort_request--> FINISHED_ABORTED      "abort"
    WAITING/RUNNING --cannot fit in the KV cache even alone--> FINISHED_FAILED   "error"

There is no prefill or decode state: a request has ``num_tokens`` (prompt plus
output so far), ``num_tokens_with_spec`` (plus draft tokens awaiting
verification) and ``num_computed_tokens`` (positions whose KV is in the cache,
or scheduled to be this step). The scheduler moves the last toward the second.

A request satisfies the block layer's ``KVCacheRequest`` protocol
(``request_id``, ``num_tokens``, ``num_computed_tokens``, ``block_hashes``);
its full blocks are hashed incrementally as output tokens arrive.

Timestamps (``arrival_time``, ``first_scheduled_time``, ``first_token_time``,
``token_times``, ``finish_time``) come from the scheduler's clock: wall time in
an engine, virtual time in the simulator.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from servelab._internal.validation import check_int, check_number
from servelab.blocks.hashing import BlockHash, MultiModalSpan, RequestBlockHasher
from servelab.samplers.params import SamplingParams

# max_tokens=None means "until max_model_len"; the scheduler checks that bound
# separately, so a count no request can reach stands in for "no limit".
_NO_LIMIT = sys.maxsize


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every status >= FINISHED_STOPPED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_FAILED = 6
    WAITING_FOR_REMOTE_KVS = -1
    """Holding blocks while a KV connector loads its KV (not finished, not queued)."""

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason: "stop", "length", "abort", "error" (None while unfinished)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_FAILED: "error",
}


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timestamps and counts of one finished request, and the latencies derived from them.

    Times are in the scheduler clock's unit (seconds). Latencies are None when
    undefined (no output token, or a single one for TPOT).
    """

    request_id: str
    client_id: str
    priority: int
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    num_draft_tokens: int
    num_accepted_tokens: int
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    token_times: list[float]

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled step."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Arrival to finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies (tokens accepted together in one step are 0 apart)."""
        t = self.token_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]


def _check_token_ids(token_ids: Sequence[int], name: str) -> list[int]:
    ids = list(token_ids)
    if getattr(type(token_ids), "holds_checked_token_ids", False) is True:
        return ids  # a sequence type that only ever yields ints >= 0 (the simulator's generated prompts)
    # map(type) + set keeps the check at C speed for long prompts.
    if ids and (not set(map(type, ids)) <= {int} or min(ids) < 0):
        bad = next(t for t in ids if type(t) is not int or t < 0)
        raise ValueError(f"{name} holds {bad!r}; token ids must be non-negative ints")
    return ids


def _checked_args(request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams | None,
                  priority: int, arrival_time: float | None,
                  eos_token_id: int | None) -> tuple[list[int], SamplingParams]:
    """``Request``'s arguments checked (``ValueError`` / ``TypeError`` naming the argument):
    the prompt as a fresh list, and the sampling parameters (the defaults when None)."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={request_id!r} must be a non-empty string")
    prompt = _check_token_ids(prompt_token_ids, f"prompt_token_ids of request {request_id!r}")
    if not prompt:
        raise ValueError(f"request {request_id!r} has an empty prompt; at least one token is needed "
                         "(the model needs a position to produce logits from)")
    if sampling_params is None:
        sampling_params = SamplingParams()
    elif not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    check_int("priority", priority)  # lower is served first
    if arrival_time is not None:
        check_number("arrival_time", arrival_time)
    if eos_token_id is not None:
        check_int("eos_token_id", eos_token_id, min_value=0)
    return prompt, sampling_params


class Request:
    """One request: prompt, sampling parameters, progress and timestamps.

    Args:
        request_id: unique among the scheduler's unfinished requests.
        prompt_token_ids: at least one token id (>= 0).
        sampling_params: read for ``max_tokens``, ``min_tokens``,
            ``stop_token_ids`` and ``ignore_eos``; default ``SamplingParams()``.
        arrival_time: when the request arrived (scheduler clock); None: the
            scheduler stamps it in ``add_request``.
        priority: lower is served first by the priority policy.
        client_id: who sent it (fair-share accounting).
        eos_token_id: ends the request unless ``ignore_eos``.
        lora_name, cache_salt, mm_spans: extra keys of the block hashes, so
            requests that must not share KV never do.
        hash_fn: block hash function ("sha256" or "xxhash").
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority", "client_id",
        "eos_token_id", "lora_name", "cache_salt", "mm_spans", "hash_fn", "all_token_ids", "num_prompt_tokens",
        "num_tokens", "num_computed_tokens", "spec_token_ids", "status", "stop_reason", "error", "max_tokens",
        "min_tokens", "stop_token_ids", "block_hashes", "_hasher", "arrival_order", "num_cached_tokens",
        "num_preemptions", "num_draft_tokens", "num_accepted_tokens", "first_scheduled_time", "first_token_time",
        "token_times", "finish_time", "num_committed_blocks", "kv_capacity", "kv_transfer_params", "length_limit",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        client_id: str = "default",
        eos_token_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_spans: Sequence[MultiModalSpan] = (),
        hash_fn: str = "sha256",
    ) -> None:
        prompt, sampling_params = _checked_args(request_id, prompt_token_ids, sampling_params, priority,
                                                arrival_time, eos_token_id)
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.sampling_params = sampling_params
        self.arrival_time = None if arrival_time is None else float(arrival_time)
        self.priority = priority
        self.client_id = str(client_id)
        self.eos_token_id = eos_token_id
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.mm_spans = tuple(mm_spans)
        self.hash_fn = hash_fn

        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None

        self.max_tokens = _NO_LIMIT if sampling_params.max_tokens is None else sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        self.stop_token_ids = frozenset(sampling_params.all_stop_token_ids(eos_token_id))
        # Tokens (prompt + output) at which the request ends "length": max_tokens here, lowered to the
        # scheduler's max_model_len by add_request (one comparison per decoded token).
        self.length_limit = self.num_prompt_tokens + self.max_tokens

        # Hashes need the cache's block size, which the scheduler knows:
        # init_block_hasher is called by add_request.
        self.block_hashes: list[BlockHash] = []
        self._hasher: RequestBlockHasher | None = None
        # Full blocks the scheduler has made findable by prefix lookup
        # (kv_cache_manager.cache_blocks) since the request last got blocks;
        # it calls cache_blocks again only when computed tokens cover more.
        self.num_committed_blocks = 0
        self.kv_transfer_params: dict | None = None
        """What a KV connector returned for this request when it ended (see servelab.connectors)."""
        # Token slots its KV blocks hold, as the scheduler last saw them (blocks x block size; kept
        # only with a KV manager whose held_blocks_cover_slots): a decode that fits skips allocate_slots.
        self.kv_capacity = 0

        self.arrival_order = -1
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None

    # ---- derived counts ----------------------------------------------------

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens to have computed once this request's drafts are verified."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    # ---- mutation ------------------------------------------------------------

    def init_block_hasher(self, block_size: int, known_hashes: Sequence[BlockHash] = ()) -> None:
        """Hash this request's full blocks of ``block_size`` tokens from now on.
        Idempotent for the same block size; a different one is an error (the
        hashes already handed out would not match the cache). ``known_hashes``:
        the hashes of this request's first blocks, computed already for the same
        tokens, block size, hash function and keys (a shared prefix hashed once,
        as the simulator does); only the blocks past them are hashed."""
        if self._hasher is not None:
            if self._hasher.block_size != block_size:
                raise ValueError(f"request {self.request_id!r} is hashed with block_size="
                                 f"{self._hasher.block_size}, the KV cache uses {block_size}")
            return
        if len(known_hashes) * block_size > self.num_tokens:
            raise ValueError(f"known_hashes has {len(known_hashes)} blocks; request {self.request_id!r} has "
                             f"{self.num_tokens} tokens ({self.num_tokens // block_size} full blocks)")
        self._hasher = RequestBlockHasher(block_size, self.hash_fn, self.lora_name, self.cache_salt, self.mm_spans)
        self.block_hashes = self._hasher.block_hashes
        self.block_hashes.extend(known_hashes)
        self._hasher.update(self.all_token_ids)

    def append_output_token_ids(self, token_ids: Sequence[int], now: float | None = None) -> None:
        """Append generated tokens (hashing blocks they fill) and stamp their time."""
        self.all_token_ids.extend(token_ids)
        self.num_tokens = len(self.all_token_ids)
        if self._hasher is not None and self.num_tokens // self._hasher.block_size > len(self.block_hashes):
            self._hasher.update(self.all_token_ids)
        if now is not None:
            if self.first_token_time is None:
                self.first_token_time = now
            if len(token_ids) == 1:
                self.token_times.append(now)
            else:
                self.token_times.extend([now] * len(token_ids))

    def apply_sampled(self, toks: list[int], drafts: list[int] | None, now: float,
                      max_len: int) -> tuple[list[int], RequestStatus | None]:
        """Apply one step's sampled ``toks`` (accepted drafts plus one, or none) to a running
        request whose ``drafts`` were verified: roll back rejected drafts, apply the stop
        conditions token by token, append what stays. Returns the kept tokens and the finishing
        status (None: the request goes on). The scheduler's general case; its one-token hot path
        is inlined in ``update_from_output``."""
        num_tokens = self.num_tokens
        k = len(toks)
        # Positions past the last accepted token must be computed again:
        # rejected drafts, or the last position when nothing came back.
        self.num_computed_tokens = num_tokens + k - 1
        if drafts is not None:
            self.spec_token_ids = []
            if k:
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += k - 1
        # Stop conditions, token by token (several arrive with drafts).
        status: RequestStatus | None = None
        stop_ids = self.stop_token_ids
        num_out = num_tokens - self.num_prompt_tokens
        for pos, tok in enumerate(toks):
            num_out += 1
            if tok in stop_ids and num_out >= self.min_tokens:
                status, self.stop_reason = RequestStatus.FINISHED_STOPPED, tok
            elif num_out >= self.max_tokens or num_tokens + pos + 1 >= max_len:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
            else:
                continue
            if pos + 1 < k:
                toks = toks[:pos + 1]
            break
        if k:
            self.append_output_token_ids(toks, now)
        return toks, status

    def metrics(self) -> RequestMetrics:
        """A snapshot of this request's timestamps and counts."""
        return RequestMetrics(
            self.request_id, self.client_id, self.priority, self.finish_reason, self.num_prompt_tokens,
            self.num_output_tokens, max(self.num_cached_tokens, 0), self.num_preemptions, self.num_draft_tokens,
            self.num_accepted_tokens, self.arrival_time if self.arrival_time is not None else 0.0,
            self.first_scheduled_time, self.first_token_time, self.finish_time, self.token_times,
        )

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"drafts={len(self.spec_token_ids)})")
