"""``Scheduler``: which requests advance by how many tokens, every step.

There is no prefill phase and no decode phase. A request has
``num_computed_tokens`` and ``num_tokens_with_spec``; a step moves the first
toward the second for as many requests as a token budget
(``max_num_batched_tokens``) and a request cap (``max_num_seqs``) allow. A
prompt chunk, a decode token and a batch of drafts to verify are the same
thing: tokens to compute.

One ``schedule()`` call, in named steps:

1. ``_schedule_running``: running requests first, in admission order. Each
   asks for ``min(num_tokens_with_spec - num_computed_tokens,
   long_prefill_token_threshold, budget left, max_model_len - computed)``
   tokens and KV slots for them (plus lookahead slots for the next drafts when
   it reaches the end of its tokens). When ``allocate_slots`` says no,
   ``_make_room`` has the policy name a victim among the running requests; the
   victim is preempted (``_preempt``: blocks freed, ``num_computed_tokens``
   reset to 0, back to waiting as ``PREEMPTED``; the prefix cache makes the
   recompute cheaper), and the allocation is retried. A victim already
   scheduled this step gives its tokens back. If the request is its own
   victim it waits; if it is *alone* and still does not fit, it never will:
   it finishes as failed.
2. ``_start_running``: the policy's ``on_tokens_scheduled`` hook, then
   ``num_computed_tokens`` advances past this step's tokens.
3. ``_schedule_waiting``: waiting requests, in the policy's order, if nothing
   was preempted this step (admitting while evicting would thrash): a
   prefix-cache lookup (capped at ``num_tokens - 1`` by the manager: the last
   token is always recomputed for its logits), then slots for the rest (the
   manager's watermark applies here). The first request that does not fit
   stops admission (no overtaking, so big requests are not starved); if
   nothing else holds KV it can never fit and finishes as failed.

``update_from_output`` applies a step's results: requests named in
``ModelRunnerOutput.errors`` end with ``finish_reason="error"``; rejected
drafts roll ``num_computed_tokens`` back; new tokens are appended; **then**
the request's computed full blocks are made findable by prefix lookup
(``kv_cache_manager.cache_blocks``: *commit after compute* — a block is
indexed only once the step that wrote its KV succeeded, so a failed step, or a
request preempted in the step that scheduled it, never leaves uncomputed
blocks findable); stop conditions are checked (stop token ids and EOS unless
``ignore_eos``, both only from ``min_tokens`` on; then ``max_tokens`` and
``max_model_len``), and finished requests release their blocks.

When the model runner fails or is interrupted, ``rollback_step(output)``
puts the step's running requests back in the waiting queue (blocks freed,
``num_computed_tokens = 0``); nothing they computed in earlier steps is lost
from the prefix cache. ``schedule()`` interrupted by an exception rolls its
own partial step back the same way before re-raising.

Faults, and what they touch:

- Bad input raises ``ValueError`` / ``TypeError`` before anything changes:
  ``add_request`` (duplicate id, prompt over ``max_model_len``, a used
  request), ``update_from_output`` (a request not scheduled this step, more
  tokens than drafts + 1), ``fail_requests``, ``rollback_step``.
- A request that cannot fit in the KV cache even alone finishes as failed
  (finish reason ``"error"``, with a message) when it is scheduled; alone,
  it first gets a smaller chunk when its manager says one serves it
  (``max_chunk_alone``: a hybrid model's sliding groups need only the
  window plus one chunk).
- Policy code (``key``, hooks, ``select_victim``) that raises an
  ``Exception`` fails only the request it was called for (see
  :class:`~servelab.scheduling.interfaces.SchedulingPolicy`); in
  ``add_request`` the exception reaches the caller and the request leaves
  no trace. Other exceptions (``KeyboardInterrupt``) propagate after the
  scheduler's state is made consistent again: nothing half-applied, no
  request lost, no block leaked.

A KV connector (``kv_connector=``, :mod:`servelab.connectors`) adds external
prefix hits, the ``WAITING_FOR_REMOTE_KVS`` state, recompute after a failed
load and delayed frees: see :mod:`servelab.scheduling.connector_states`.

Every request that enters ends with exactly one final ``RequestOutput``
(``finished=True``): from ``fail_requests`` for the requests it ends,
otherwise from ``update_from_output``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from servelab._internal.conformance import check_conforms
from servelab.blocks.interfaces import KVCacheManagerProtocol
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.connector_states import ConnectorStates
from servelab.scheduling.interfaces import RequestQueue, SchedulingPolicy
from servelab.scheduling.lora_slots import LoRASlots
from servelab.scheduling.output import (
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from servelab.scheduling.policies import get_policy
from servelab.scheduling.preemption import Preemption
from servelab.scheduling.request import Request
from servelab.scheduling.step import Step as _Step
from servelab.scheduling.step import block_ids as _block_ids
from servelab.scheduling.step import raised as _raised
from servelab.scheduling.transitions import PREEMPTED, RUNNING, WAITING

_NO_BLOCKS: tuple[list[int], ...] = ()  # new_block_ids entry: nothing new in any KV-cache group


class Scheduler(Preemption, ConnectorStates):
    """Continuous-batching scheduler over one KV cache manager
    (implements :class:`~servelab.scheduling.interfaces.SchedulerInterface`).

    Args:
        config: budgets and limits.
        kv_cache_manager: a :class:`~servelab.blocks.interfaces.KVCacheManagerProtocol`
            (:class:`servelab.blocks.KVCacheManager` or the reference). Uses
            ``block_size``, ``enable_caching``, ``max_model_len``,
            ``get_computed_blocks``, ``allocate_slots``, ``cache_blocks``,
            ``free``, ``get_block_ids`` (and ``usage``, ``num_blocks`` for
            reports).
        policy: a :class:`SchedulingPolicy` or a registered name ("fcfs",
            "priority", "sjf", "vtc"). A policy object serves one scheduler.
        clock: returns the current time in seconds (timestamps, metrics); the
            simulator passes a virtual clock.
        kv_connector: None, or a :class:`~servelab.connectors.KVConnector`
            whose scheduler side this scheduler calls.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManagerProtocol,
        policy: SchedulingPolicy | str = "fcfs",
        *,
        clock: Callable[[], float] = time.monotonic,
        kv_connector: Any = None,
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        check_conforms(kv_cache_manager, KVCacheManagerProtocol, "kv_cache_manager")
        kv_len = getattr(kv_cache_manager, "max_model_len", None)
        if kv_len is not None and kv_len < config.max_model_len:
            raise ValueError(f"kv_cache_manager.max_model_len={kv_len} is below SchedulerConfig.max_model_len="
                             f"{config.max_model_len}; make them equal")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(clock).__name__}")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.policy = get_policy(policy)
        self.clock = clock
        self.block_size: int = kv_cache_manager.block_size
        self.waiting = self._new_waiting_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Ended since the last schedule(): told to the model runner next step.
        self._finished_ids: set[str] = set()
        # Rolled back (or preempted by an interrupted schedule()): told next step.
        self._unreported_preempted: set[str] = set()
        # Final outputs of requests that ended outside update_from_output.
        self._pending_outputs: list[RequestOutput] = []
        self._order = itertools.count()
        # Only call the accounting hook when the policy has one (hot path).
        self._token_hook = (self.policy.on_tokens_scheduled
                            if type(self.policy).on_tokens_scheduled is not SchedulingPolicy.on_tokens_scheduled
                            else None)
        # Commit after compute: update_from_output indexes computed blocks.
        self._cache_blocks = kv_cache_manager.cache_blocks if kv_cache_manager.enable_caching else None
        # Decode hot path: with a manager whose held blocks are exactly its slots (full attention),
        # the scheduler tracks each running request's slots (Request.kv_capacity) and skips
        # allocate_slots when they already cover the step; with any other manager kv_capacity stays 0
        # and every step asks the manager.
        self._track_capacity = getattr(kv_cache_manager, "held_blocks_cover_slots", False) is True
        # KV-cache events (servelab.blocks.events): one batch per step, after the commit.
        self._publish_kv_events = getattr(kv_cache_manager, "publish_kv_events", None)
        self.num_steps = 0
        self.emit_running_outputs = True  # False: no outputs for decode rows that go on (the simulator reads ends)
        self.in_flight_output: SchedulerOutput | None = None
        """The last ``schedule()`` output not yet settled by ``update_from_output`` or
        ``rollback_step`` (what a caller interrupted around ``schedule()`` rolls back)."""
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_failed = 0
        self.num_aborted = 0
        self._init_connector(kv_connector)
        # At most max_loras distinct LoRA adapters among running requests (scheduling.lora_slots).
        self.lora_slots = LoRASlots.for_scheduler(getattr(config, "max_loras", 0), self.policy)

    def _new_waiting_queue(self) -> RequestQueue:
        queue = self.policy.make_waiting_queue()
        if not isinstance(queue, RequestQueue):
            raise TypeError(f"{self.policy!r}.make_waiting_queue() returned {type(queue).__name__}, which lacks "
                            "the RequestQueue methods (add, peek, pop, remove, __contains__, __len__, __iter__)")
        return queue

    # ---- requests in and out -------------------------------------------------

    def _check_new_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"request must be a servelab.scheduling.Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}: a request with this id is still unfinished")
        if rid in self._finished_ids:
            raise ValueError(f"duplicate request id {rid!r}: it just finished and the model runner has not "
                             "been told yet; use a new id or add it after the next schedule()")
        if rid in self._delayed_free:
            raise ValueError(f"duplicate request id {rid!r}: its blocks are still held for the KV connector")
        if request.status is not WAITING or request.num_computed_tokens or request.num_output_tokens:
            raise ValueError(f"request {rid!r} was already scheduled ({request!r}); create a new Request")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(f"request {rid!r} has a {request.num_prompt_tokens}-token prompt, longer than "
                             f"max_model_len={self.config.max_model_len}")

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises (and changes nothing) for a duplicate id, a
        prompt over ``max_model_len`` or a used request (``ValueError``), a
        non-``Request`` (``TypeError``), or whatever the policy's ``key`` /
        ``on_request_added`` raise for it."""
        self._check_new_request(request)
        if self.kv_cache_manager.enable_caching:
            request.init_block_hasher(self.block_size)  # may raise; touches only the request
        stamped = request.arrival_time is None
        if stamped:
            request.arrival_time = self.clock()
        request.arrival_order = next(self._order)
        request.length_limit = min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)
        rid = request.request_id
        self.requests[rid] = request
        try:
            self.waiting.add(request)
            try:
                self.policy.on_request_added(request)
            except BaseException:
                self.waiting.remove(request)
                raise
        except BaseException as exc:
            del self.requests[rid]
            request.arrival_order = -1
            if stamped:
                request.arrival_time = None
            exc.add_note(f"scheduling policy {self.policy!r} raised while request {rid!r} was added; "
                         "the request was not added")
            raise

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs built outside ``update_from_output`` and not yet delivered
        (requests failed or ended while scheduling, or an interrupted update's
        finished part); ``update_from_output`` also returns them. A caller
        with nothing left to schedule drains them here."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self) -> SchedulerStats:
        kv_usage = getattr(self.kv_cache_manager, "usage", 0.0)
        return SchedulerStats(len(self.running), len(self.waiting), kv_usage, self.num_steps,
                              self.num_preemptions, self.num_finished, self.num_failed, self.num_aborted)

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work (see the module docstring)."""
        step = _Step(self.config.max_num_batched_tokens, self.clock())
        try:
            self._schedule_running(step)
            self._start_running(step)
            if not step.preempted:
                self._schedule_waiting(step)
        except BaseException:
            self._undo_step(step)
            raise
        finished, self._finished_ids = self._finished_ids, set()
        preempted = step.preempted
        if self._unreported_preempted:
            preempted |= self._unreported_preempted
            self._unreported_preempted = set()
        self.num_steps += 1
        self.in_flight_output = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            scheduled_spec_decode_tokens=step.spec_tokens,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            total_num_kv_tokens=step.total_kv,
            step=self.num_steps,
        )
        if self.kv_connector is not None:
            try:
                self.in_flight_output.kv_connector_metadata = self.kv_connector.build_connector_meta(
                    self.in_flight_output)
            except BaseException:
                self.rollback_step(self.in_flight_output)
                raise
        return self.in_flight_output

    def _schedule_running(self, step: _Step) -> None:
        """Step 1: tokens and KV slots for running requests, preempting for room."""
        cfg = self.config
        kv = self.kv_cache_manager
        budget = step.budget
        threshold = cfg.long_prefill_token_threshold
        max_len = cfg.max_model_len
        lookahead = cfg.num_speculative_tokens
        num_scheduled, new_blocks_of, spec_tokens = step.num_scheduled, step.new_blocks_of, step.spec_tokens
        scheduled_reqs = step.reqs
        track = self._track_capacity
        block_size = self.block_size
        running = self.running
        spec = lookahead > 0  # without speculative decoding no request ever holds drafts
        ahead = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = (req.num_tokens + len(req.spec_token_ids) if spec else req.num_tokens) - computed
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            if n > max_len - computed:
                n = max_len - computed
            if n <= 0:
                i += 1
                continue
            if spec:
                ahead = lookahead if computed + n >= req.num_tokens else 0
            rid = req.request_id
            if computed + n + ahead > req.kv_capacity:  # always, unless the capacity is tracked
                new_blocks = kv.allocate_slots(req, n, 0, None, ahead)
                if new_blocks is None:
                    step.budget = budget
                    new_blocks, i, n = self._make_room(step, req, i, n, ahead)
                    budget = step.budget
                    if new_blocks is None:
                        continue  # req left `running`; running[i] is the next one
                if any(new_blocks):  # one list per KV-cache group; all empty: nothing new
                    new_blocks_of[rid] = new_blocks
                    if track:  # one group
                        req.kv_capacity += len(new_blocks[0]) * block_size
            num_scheduled[rid] = n
            scheduled_reqs[rid] = req
            budget -= n
            if spec and req.spec_token_ids:
                num_drafts = computed + n - req.num_tokens
                if num_drafts > 0:
                    del req.spec_token_ids[num_drafts:]
                    spec_tokens[rid] = req.spec_token_ids
                else:
                    req.spec_token_ids.clear()
            i += 1
        step.budget = budget

    def _start_running(self, step: _Step) -> None:
        """Step 2: the accounting hook, then ``num_computed_tokens`` advances
        past this step's tokens for every running request scheduled."""
        num_scheduled = step.num_scheduled
        if not num_scheduled:
            return
        if self._token_hook is not None:
            self._run_token_hook(step)
        cached = step.cached
        c_computed = cached.num_computed_tokens
        # step.reqs and num_scheduled hold the same ids in the same order (built and pruned together).
        for req, n in zip(step.reqs.values(), num_scheduled.values()):
            computed = req.num_computed_tokens
            c_computed.append(computed)
            req.num_computed_tokens = computed + n
        cached.req_ids.extend(num_scheduled)
        new_blocks_of = step.new_blocks_of
        if new_blocks_of:
            get = new_blocks_of.get
            cached.new_block_ids.extend([_block_ids(b) if (b := get(rid)) else _NO_BLOCKS for rid in num_scheduled])
        else:
            cached.new_block_ids.extend([_NO_BLOCKS] * len(num_scheduled))
        cached.resumed = [False] * len(c_computed)
        step.total_kv = sum(c_computed) + sum(num_scheduled.values())

    def _run_token_hook(self, step: _Step) -> None:
        """The policy's ``on_tokens_scheduled`` for every running request scheduled; a request
        whose hook raises gives its tokens back and fails (the others go on)."""
        hook = self._token_hook
        num_scheduled = step.num_scheduled
        failed = []
        for req, n in zip(step.reqs.values(), num_scheduled.values()):
            try:
                hook(req, n)
            except Exception as exc:
                failed.append((req, exc))
        for req, exc in failed:
            rid = req.request_id
            step.budget += num_scheduled.pop(rid)
            step.spec_tokens.pop(rid, None)
            step.new_blocks_of.pop(rid, None)
            del step.reqs[rid]
            self.running.remove(req)
            self._fail(req, _raised(f"scheduling policy {self.policy!r}.on_tokens_scheduled", exc))

    def _schedule_waiting(self, step: _Step) -> None:
        """Step 3: admit waiting requests in the policy's order while they fit."""
        cfg = self.config
        kv = self.kv_cache_manager
        budget = step.budget
        threshold = cfg.long_prefill_token_threshold
        lookahead = cfg.num_speculative_tokens
        running = self.running
        waiting = self.waiting
        if self.lora_slots is not None:  # admit only requests whose adapter fits (scheduling.lora_slots)
            self.lora_slots.begin_step(running, waiting)
            waiting = self.lora_slots.view(waiting)
        enable_caching = kv.enable_caching
        hook = self._token_hook
        connector = self.kv_connector
        while budget > 0 and len(running) < cfg.max_num_seqs:
            try:
                req = waiting.peek()
            except Exception as exc:
                self._waiting_queue_failed(exc)
                break
            if req is None:
                break
            if connector is not None:  # external hits, parking for remote KV (connector_states)
                used = self._admit_with_connector(step, req, budget)
                if used is None:
                    break
                budget -= used
                continue
            # A request whose prompt logprobs are incomplete computes its whole prompt (no prefix hit).
            if enable_caching and (req.sampling_params.prompt_logprobs is None
                                   or req.num_tokens > req.num_prompt_tokens):
                hit_blocks, num_hit = kv.get_computed_blocks(req)
            else:
                hit_blocks, num_hit = None, 0
            n = req.num_tokens - num_hit
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = budget
            ahead = lookahead if num_hit + n >= req.num_tokens else 0
            new_blocks = kv.allocate_slots(req, n, num_hit, hit_blocks, ahead)
            if new_blocks is None and ahead:
                new_blocks = kv.allocate_slots(req, n, num_hit, hit_blocks)
            if new_blocks is None and running:
                break  # wait for running requests to free blocks
            try:
                waiting.pop()
            except Exception as exc:
                kv.free(req)
                self._waiting_queue_failed(exc)
                break
            if new_blocks is None:  # alone in the cache and still no room: a smaller chunk, or never
                new_blocks, n = self._allocate_alone(req, n, num_hit, hit_blocks)
                if new_blocks is None:
                    self._fail(req, self._no_room_message(req, n + num_hit))
                    continue
            if hook is not None:
                req.num_computed_tokens = num_hit
                try:
                    hook(req, n)
                except Exception as exc:
                    req.num_computed_tokens = 0
                    self._fail(req, _raised(f"scheduling policy {self.policy!r}.on_tokens_scheduled", exc))
                    continue
            self._admit(step, req, n, num_hit)
            budget -= n
        step.budget = budget

    def _admit(self, step: _Step, req: Request, n: int, num_hit: int) -> None:
        """``req`` (popped, slots allocated) starts running with ``n`` tokens
        this step after a ``num_hit``-token prefix hit."""
        rid = req.request_id
        block_ids = self.kv_cache_manager.get_block_ids(req)
        if self._track_capacity:
            req.kv_capacity = len(block_ids[0]) * self.block_size  # one group
        cached = step.cached
        if req.status is PREEMPTED:
            cached.req_ids.append(rid)
            cached.resumed.append(True)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(num_hit)
            cached.resumed_token_ids[rid] = list(req.all_token_ids)
        else:
            step.new_reqs.append(NewRequestData(rid, req.prompt_token_ids, req.sampling_params, block_ids, num_hit))
        req.status = RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = step.now
            req.num_cached_tokens = num_hit
        self.running.append(req)
        step.num_scheduled[rid] = n
        step.total_kv += num_hit + n
        req.num_computed_tokens = num_hit + n
