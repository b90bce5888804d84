"""How requests change state outside the admission decisions: a step's results
applied (``update_from_output``), a failed step rolled back
(``rollback_step``), preemption, and every way a request ends.

:class:`RequestTransitions` is the half of :class:`~servelab.scheduling.Scheduler`
that these live in (the scheduler subclasses it; it is not used alone). The
rules it keeps:

- **Commit after compute**: computed full blocks are made findable by prefix
  lookup (``kv_cache_manager.cache_blocks``) only here, after a step's
  results arrived and rejected drafts were subtracted.
- **Exactly one end**: ``_finish`` is the only way out of
  ``Scheduler.requests``; it frees the blocks, tells the policy, counts the
  end once (``num_finished``, plus ``num_failed`` / ``num_aborted``) and
  builds the final ``RequestOutput``.
- **Faults stay local**: an ``Exception`` from policy code or while applying
  one request's result fails that request only. A ``BaseException``
  (``KeyboardInterrupt``) propagates, after the state is consistent again
  (``_repair``) and outputs already built are kept for the next
  ``update_from_output``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from servelab.scheduling.output import ModelRunnerOutput, RequestOutput, SchedulerOutput, check_step_results
from servelab.scheduling.request import Request, RequestStatus

if TYPE_CHECKING:
    from servelab.blocks.interfaces import KVCacheManagerProtocol
    from servelab.scheduling.config import SchedulerConfig
    from servelab.scheduling.interfaces import RequestQueue, SchedulingPolicy

WAITING = RequestStatus.WAITING
RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED
STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
ABORTED = RequestStatus.FINISHED_ABORTED
FAILED = RequestStatus.FINISHED_FAILED
WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
_EMPTY: list[int] = []
_new_output = object.__new__


def _take_drafts(req: Request, proposed: list[int], num_spec: int, max_len: int) -> None:
    """``req``'s drafts for the next step: the first of ``proposed`` that fit ``num_spec`` and
    ``max_model_len``."""
    room = min(num_spec, max_len - req.num_tokens)
    req.spec_token_ids = list(proposed[:room]) if room > 0 else []


class RequestTransitions:
    """State changes of requests; see the module docstring."""

    # Set by Scheduler.__init__.
    config: SchedulerConfig
    kv_cache_manager: KVCacheManagerProtocol
    policy: SchedulingPolicy
    clock: Callable[[], float]
    block_size: int
    waiting: RequestQueue
    running: list[Request]
    requests: dict[str, Request]
    _finished_ids: set[str]
    _unreported_preempted: set[str]
    _pending_outputs: list[RequestOutput]
    _cache_blocks: Callable[[Request, int], None] | None
    _publish_kv_events: Callable[[float], object] | None
    emit_running_outputs: bool
    num_preemptions: int
    num_finished: int
    num_failed: int
    num_aborted: int
    kv_connector: Any
    _waiting_remote: dict[str, Request]
    _loaded_held: dict[str, Request]
    _settle_kv_step: Callable[[SchedulerOutput, Any], None]
    _connector_holds_blocks: Callable[[Request], bool]

    def _new_waiting_queue(self) -> RequestQueue:
        raise NotImplementedError

    # ---- ending requests from outside ---------------------------------------

    def abort_request(self, request_id: str) -> bool:
        """End an unfinished request now (finish reason "abort"); its blocks
        are freed. Returns False if no such request is unfinished."""
        return self.finish_request(request_id, ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus = ABORTED,
                       stop_reason: int | str | None = None) -> bool:
        """End an unfinished request from outside with a final ``status``:
        ``FINISHED_ABORTED`` (client went away; counted in ``num_aborted``) or
        ``FINISHED_STOPPED`` (e.g. the detokenizer matched a stop *string*;
        pass it as ``stop_reason``; not an abort). Its final
        ``RequestOutput`` comes from the next ``update_from_output``. Returns
        False if no such request is unfinished."""
        if status is not ABORTED and status is not STOPPED:
            raise ValueError(f"status={status!r}; valid: FINISHED_ABORTED or FINISHED_STOPPED")
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._detach(request)
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._pending_outputs.append(self._finish(request, status))
        return True

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[RequestOutput]:
        """End these requests with finish reason "error" and ``error`` as
        their message (blocks freed, the policy told); ids unknown or already
        finished are ignored. Returns their final outputs (they do not come
        again from ``update_from_output``)."""
        if not isinstance(error, str):
            raise TypeError(f"error must be a str (the message), got {type(error).__name__}")
        if isinstance(request_ids, str):
            raise TypeError(f"request_ids must be an iterable of ids, not one str ({request_ids!r})")
        ids = list(dict.fromkeys(request_ids))
        bad = [rid for rid in ids if not isinstance(rid, str)]
        if bad:
            raise TypeError(f"request_ids must hold str ids, got {bad[0]!r}")
        outputs: list[RequestOutput] = []
        try:
            for rid in ids:
                request = self.requests.get(rid)
                if request is None:
                    continue
                self._detach(request)
                request.error = error
                outputs.append(self._finish(request, FAILED))
        except BaseException:
            self._pending_outputs.extend(outputs)  # ended: their outputs come from the next update
            raise
        return outputs

    # ---- a step's results ---------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply one step's results; returns one ``RequestOutput`` per request
        that produced tokens or ended (including ends from abort/failure since
        the last call). A scheduled request missing from ``model_output``
        produced nothing (its last position is recomputed). Drafts count as
        proposed (``num_draft_tokens``) only for a request that came back with
        tokens: drafts never verified are not counted."""
        check_step_results(scheduler_output, model_output)
        self.in_flight_output = None
        if self.kv_connector is not None:  # loads landed or failed, sends done
            self._settle_kv_step(scheduler_output, model_output.kv_connector_output)
        req_ids = model_output.req_ids
        sampled = model_output.sampled_token_ids
        num_scheduled = scheduler_output.num_scheduled_tokens
        if len(req_ids) < len(num_scheduled):  # silent requests produced nothing
            given = set(req_ids)
            missing = [r for r in num_scheduled if r not in given]
            req_ids = list(req_ids) + missing
            sampled = list(sampled) + [_EMPTY] * len(missing)
        outputs, self._pending_outputs = self._pending_outputs, []
        try:
            any_finished = self._fail_errored(model_output.errors, outputs) if model_output.errors else False
            any_finished |= self._apply_tokens(scheduler_output, model_output, req_ids, sampled, outputs)
        except BaseException:
            # Interrupted: what was applied stays (its outputs come with the next
            # call, or take_pending_outputs). A request not reached is rolled back
            # as after a failed step (resumed from its known tokens): the runner
            # already holds this step's tokens for it, which the scheduler never
            # saw, so it must be told to start over rather than to recompute one
            # position.
            self._pending_outputs[:0] = outputs
            self._roll_back_each([r for rid in req_ids if (r := self.requests.get(rid)) is not None
                                  and r.status is RUNNING and r.num_computed_tokens >= r.num_tokens], set())
            self.running = [r for r in self.running if r.status is RUNNING]
            raise
        if any_finished:
            self.running = [r for r in self.running if r.status is RUNNING]
        if self._publish_kv_events is not None:  # this step's index changes, as one batch
            self._publish_kv_events(self.clock())
        return outputs

    def _apply_tokens(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput,
                      req_ids: list[str], sampled: list[list[int]], outputs: list[RequestOutput]) -> bool:
        """The per-request loop of ``update_from_output`` (hot: one pass per
        request and step, kept inline). Returns True if a request ended."""
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        now = self.clock()
        max_len = self.config.max_model_len
        num_spec = self.config.num_speculative_tokens
        drafts_next = model_output.spec_token_ids if num_spec else None
        logprobs = model_output.logprobs
        requests = self.requests
        cache_blocks = self._cache_blocks
        block_size = self.block_size
        append = outputs.append
        any_finished, any_drafts, emit = False, bool(spec_scheduled), self.emit_running_outputs
        for idx, rid in enumerate(req_ids):
            req = requests.get(rid)
            if req is None or req.status is not RUNNING:
                continue  # ended since schedule()
            try:
                num_tokens = req.num_tokens
                if req.num_computed_tokens < num_tokens:  # mid-prefill: nothing to sample (tokens given are ignored)
                    if cache_blocks is not None and req.num_computed_tokens // block_size > req.num_committed_blocks:
                        cache_blocks(req, req.num_computed_tokens)
                        req.num_committed_blocks = req.num_computed_tokens // block_size
                    continue
                if not any_drafts and len(toks := sampled[idx]) == 1:
                    # The decode hot path: one token, no drafts (the general branch below, specialised;
                    # Request.append_token_ids inlined, length limits folded into Request.length_limit).
                    req.num_computed_tokens = computed = num_tokens
                    tok = toks[0]
                    num_tokens += 1
                    all_ids = req.all_token_ids
                    all_ids.append(tok)
                    req.num_tokens = num_tokens
                    if not num_tokens % block_size and req._hasher is not None:
                        req._hasher.update(all_ids)
                    if req.first_token_time is None:
                        req.first_token_time = now
                    req.token_times.append(now)
                    # Commit after compute: the KV of every computed position is written now.
                    if cache_blocks is not None and computed // block_size > req.num_committed_blocks:
                        cache_blocks(req, computed)
                        req.num_committed_blocks = computed // block_size
                    status: RequestStatus | None
                    if tok in req.stop_token_ids and num_tokens - req.num_prompt_tokens >= req.min_tokens:
                        status, req.stop_reason = STOPPED, tok
                    elif num_tokens >= req.length_limit:
                        status = LENGTH_CAPPED
                    else:
                        if drafts_next is not None:
                            _take_drafts(req, drafts_next[idx], num_spec, max_len)
                        if not emit:  # the caller reads ends only (Scheduler.emit_running_outputs)
                            continue
                        if logprobs is None:  # a bare output: two fields set, the rest are class defaults
                            out = _new_output(RequestOutput)
                            out.request_id = rid
                            out.new_token_ids = toks
                            append(out)
                        else:
                            append(RequestOutput(rid, toks, logprobs=logprobs[idx]))
                        continue
                else:
                    toks, status = self._apply_general(req, idx, sampled[idx], spec_scheduled.get(rid), now,
                                                       model_output, outputs)
                    if status is None:
                        continue
                any_finished = True
                out = self._finish(req, status, toks)
                if logprobs is not None:
                    out.logprobs = logprobs[idx]
                append(out)
            except Exception as exc:
                if req.status is RUNNING:  # fail this request only; the others go on
                    any_finished = True
                    self._recompute_last(req)
                    self._fail_now(req, f"applying the step's output to request {rid!r} raised "
                                        f"{type(exc).__name__}: {exc}", outputs)
        return any_finished

    def _apply_general(self, req: Request, idx: int, toks: list[int], drafts: list[int] | None, now: float,
                       model_output: ModelRunnerOutput,
                       outputs: list[RequestOutput]) -> tuple[list[int], RequestStatus | None]:
        """The general case of :meth:`_apply_tokens` (drafts, several tokens, none): apply them
        (:meth:`Request.apply_sampled`), commit, and output a request that goes on. Returns the kept
        tokens and the finishing status (None: nothing left to do for this request)."""
        cfg = self.config
        toks, status = req.apply_sampled(toks, drafts, now, cfg.max_model_len)
        computed = min(req.num_computed_tokens, req.num_tokens)
        if self._cache_blocks is not None and computed // self.block_size > req.num_committed_blocks:
            self._cache_blocks(req, computed)
            req.num_committed_blocks = computed // self.block_size
        if not toks or status is not None:
            return toks, status
        if model_output.spec_token_ids is not None and cfg.num_speculative_tokens:
            _take_drafts(req, model_output.spec_token_ids[idx], cfg.num_speculative_tokens, cfg.max_model_len)
        logprobs = model_output.logprobs
        outputs.append(RequestOutput(req.request_id, toks) if logprobs is None
                       else RequestOutput(req.request_id, toks, logprobs=logprobs[idx]))
        return toks, None

    def _fail_errored(self, errors: dict[str, str], outputs: list[RequestOutput]) -> bool:
        """End the requests the model runner reported errors for; True if any ended."""
        ended = False
        for rid, message in errors.items():
            req = self.requests.get(rid)
            if req is None or req.status is not RUNNING:
                continue  # ended since schedule()
            self._recompute_last(req)
            self._fail_now(req, message, outputs)
            ended = True
        return ended

    @staticmethod
    def _recompute_last(req: Request) -> None:
        """If this step's sampled positions of ``req`` were not applied, forget
        them (and its drafts): the last position is computed again."""
        if req.num_computed_tokens >= req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1
            req.spec_token_ids = []

    # ---- failed steps -----------------------------------------------------------

    def rollback_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step ``scheduler_output`` was scheduled but its model execution
        failed or was interrupted (call it before the next ``schedule()``).

        Every request of that output that is still running is put back in the
        waiting queue at its policy key's place, as after a preemption: its
        blocks freed (safe: commit after compute means none of this step's
        blocks was indexed; blocks committed by earlier steps stay cached, so
        the recompute hits them), ``num_computed_tokens = 0``, drafts dropped.
        ``num_preemptions`` (scheduler and request) is *not* incremented: this
        is not memory pressure. A request whose first step this was goes back
        as never scheduled (it is sent to the runner as new again). The next
        ``SchedulerOutput`` repeats this output's ``finished_req_ids`` and
        ``preempted_req_ids`` and lists the rolled-back requests in
        ``preempted_req_ids`` (the runner may not have seen this output).
        Policy accounting (``on_tokens_scheduled``) is not rewound.
        """
        if not isinstance(scheduler_output, SchedulerOutput):
            raise TypeError(f"scheduler_output must be a SchedulerOutput, got {type(scheduler_output).__name__}")
        if self.in_flight_output is scheduler_output:
            self.in_flight_output = None
        new_ids = {d.req_id for d in scheduler_output.scheduled_new_reqs}
        requests = self.requests
        to_roll = [requests[rid] for rid in scheduler_output.num_scheduled_tokens
                   if rid in requests and requests[rid].status is RUNNING]
        self._finished_ids |= {rid for rid in scheduler_output.finished_req_ids if rid not in requests}
        self._unreported_preempted |= scheduler_output.preempted_req_ids
        self._roll_back_each(to_roll, new_ids)
        if to_roll:
            self.running = [r for r in self.running if r.status is RUNNING]

    def _roll_back(self, req: Request, was_new: bool) -> None:
        """``req`` (running; the caller filters ``running``) goes back to waiting."""
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.num_committed_blocks = 0
        req.spec_token_ids = []
        if was_new:  # its first step never happened
            req.status = WAITING
            req.first_scheduled_time = None
            req.num_cached_tokens = -1
        else:
            req.status = PREEMPTED
        self._unreported_preempted.add(req.request_id)
        self._requeue(req, "rolled back")

    def _roll_back_each(self, reqs: list[Request], new_ids: set[str]) -> None:
        """:meth:`_roll_back` every one of ``reqs`` still running (``running`` is the caller's to
        filter). A ``BaseException`` while one is re-queued (the policy's ``key``) must not stop the
        others: left running with the failed step's tokens counted as computed, a request has
        nothing left to schedule and never ends (nor frees its blocks). So all are rolled back, the
        queues repaired (the interrupted one is queued again), then the first exception re-raised."""
        interrupted: BaseException | None = None
        for req in reqs:
            if req.status is RUNNING and self.requests.get(req.request_id) is req:
                try:
                    self._roll_back(req, req.request_id in new_ids)
                except BaseException as exc:
                    if interrupted is None:
                        interrupted = exc
        if interrupted is not None:
            self._repair(new_ids)
            raise interrupted

    def _undo_step(self, step: Any) -> None:
        """``schedule()`` was interrupted: roll back every request it scheduled."""
        new_ids = {d.req_id for d in step.new_reqs}
        self._unreported_preempted |= step.preempted
        self._roll_back_each([r for rid in step.num_scheduled if (r := self.requests.get(rid)) is not None],
                             new_ids)  # repairs when interrupted
        self._repair(new_ids)

    def _repair(self, new_ids: set[str]) -> None:
        """Re-establish the queue invariants after an interrupted operation:
        ``running`` holds exactly the RUNNING requests; every other unfinished
        request holds no blocks and is in the waiting queue (or failed, if the
        policy cannot queue it)."""
        running = [r for r in self.running if r.status is RUNNING and self.requests.get(r.request_id) is r]
        self.running = running
        in_running = {id(r) for r in running}
        for req in list(self.requests.values()):
            if id(req) in in_running or req.status is WAITING_FOR_REMOTE_KVS:  # a load owns its blocks
                continue
            if req.status is RUNNING:  # left running without being put back
                self._roll_back(req, req.request_id in new_ids)
                continue
            self.kv_cache_manager.free(req)
            req.num_computed_tokens = 0
            req.num_committed_blocks = 0
            self._loaded_held.pop(req.request_id, None)
            if req not in self.waiting:
                self._requeue(req, "put back")

    # ---- preemption and ends ------------------------------------------------------

    def _preempt(self, request: Request, step: Any) -> None:
        """Free ``request``'s blocks (it left ``running``) and queue it again."""
        self.kv_cache_manager.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.num_committed_blocks = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        step.preempted.add(request.request_id)
        self._requeue(request, "preempted")

    def _requeue(self, request: Request, why: str) -> None:
        """Put a request holding no blocks in the waiting queue; it fails if
        the policy's ``key`` (or its queue) raises for it."""
        try:
            self.waiting.add(request)
        except Exception as exc:
            self._fail(request, f"scheduling policy {self.policy!r} could not queue {why} request "
                                f"{request.request_id!r}: {type(exc).__name__}: {exc}")

    def _waiting_queue_failed(self, exc: Exception) -> None:
        """The policy's waiting queue raised on ``peek``/``pop``: it cannot be
        trusted, so every request in it fails and an empty queue replaces it."""
        message = (f"the waiting queue of scheduling policy {self.policy!r} raised "
                   f"{type(exc).__name__}: {exc}; every waiting request failed")
        stranded = [r for r in self.requests.values() if r.status is not RUNNING
                    and r.status is not WAITING_FOR_REMOTE_KVS]  # requeued into the new queue once loaded
        self.waiting = self._new_waiting_queue()
        for req in stranded:
            self._fail(req, message)

    def _detach(self, request: Request) -> None:
        """Take an unfinished request out of ``running`` or the waiting queue."""
        if request.status is RUNNING:
            self.running.remove(request)
        elif request.status is WAITING_FOR_REMOTE_KVS:
            self._waiting_remote.pop(request.request_id)
        else:
            self.waiting.remove(request)

    def _no_room_message(self, request: Request, num_tokens: int) -> str:
        num_blocks = getattr(self.kv_cache_manager, "num_blocks", None)
        usable = num_blocks - 1 if isinstance(num_blocks, int) else "?"
        return (f"request {request.request_id!r} cannot fit in the KV cache even alone: it needs room for "
                f"{request.num_computed_tokens + num_tokens} tokens ({self.block_size}-token blocks) and the cache "
                f"has {usable} usable blocks; add KV blocks or lower max_model_len / max_tokens")

    def _fail(self, request: Request, message: str) -> None:
        """End ``request`` (out of the queues already) as failed; its final
        output comes from the next ``update_from_output``."""
        request.error = message
        self._pending_outputs.append(self._finish(request, FAILED))

    def _fail_now(self, request: Request, message: str, outputs: list[RequestOutput]) -> None:
        """End a running ``request`` as failed; its final output goes to ``outputs``
        (the caller filters ``running``)."""
        request.error = message
        outputs.append(self._finish(request, FAILED))

    def _finish(self, request: Request, status: RequestStatus, new_token_ids: list[int] = _EMPTY) -> RequestOutput:
        """End ``request`` (out of the queues already) with ``status``; returns
        its final output. The only way out of ``self.requests``."""
        connector = self.kv_connector
        if connector is None:
            self.kv_cache_manager.free(request)
        rid = request.request_id
        del self.requests[rid]
        self._finished_ids.add(rid)
        request.status = status
        if connector is not None and not self._connector_holds_blocks(request):
            self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.finish_time = self.clock()
        out = RequestOutput(rid, new_token_ids, True, request.finish_reason, request.stop_reason,
                            request.error, None, request.metrics())
        try:
            self.policy.on_request_finished(request)
        except Exception as exc:
            request.status = FAILED
            request.error = out.error = (f"scheduling policy {self.policy!r}.on_request_finished raised "
                                         f"{type(exc).__name__}: {exc}")
            out.finish_reason = request.finish_reason
            out.metrics = request.metrics()
        except BaseException:
            self._count_end(request)
            self._pending_outputs.append(out)  # ended: the next update delivers it
            raise
        self._count_end(request)
        return out

    def _count_end(self, request: Request) -> None:
        self.num_finished += 1
        status = request.status
        if status is FAILED:
            self.num_failed += 1
        elif status is ABORTED:
            self.num_aborted += 1
