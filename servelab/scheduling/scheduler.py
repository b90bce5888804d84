"""``Scheduler``: which requests advance by how many tokens, every step.

There is no prefill phase and no decode phase. A request has
``num_computed_tokens`` and ``num_tokens_with_spec``; a step moves the first
toward the second for as many requests as a token budget
(``max_num_batched_tokens``) and a request cap (``max_num_seqs``) allow. A
prompt chunk, a decode token and a batch of drafts to verify are the same
thing: tokens to compute.

One ``schedule()`` call:

1. **Running requests first**, in admission order. Each asks for
   ``min(num_tokens_with_spec - num_computed_tokens,
   long_prefill_token_threshold, budget left, max_model_len - computed)``
   tokens and KV slots for them (plus lookahead slots for the next drafts when
   it reaches the end of its tokens). When ``allocate_slots`` says no, the
   policy names a victim among the running requests; the victim's blocks are
   freed, its ``num_computed_tokens`` reset to 0 and it goes back to waiting
   (``PREEMPTED``; the prefix cache makes the recompute cheaper), and the
   allocation is retried. A victim already scheduled this step gives its
   tokens back. If the request is its own victim it waits; if it is *alone*
   and still does not fit, it never will: it finishes as failed.
2. **Then waiting requests**, in the policy's order, if nothing was preempted
   this step (admitting while evicting would thrash): a prefix-cache lookup
   (capped at ``num_tokens - 1`` by the manager: the last token is always
   recomputed for its logits), then slots for the rest (the manager's
   watermark applies here). The first request that does not fit stops
   admission (no overtaking, so big requests are not starved); if nothing
   else holds KV it can never fit and finishes as failed.

``update_from_output`` applies a step's results: rejected drafts roll
``num_computed_tokens`` back, new tokens are appended (hashing blocks they
fill), stop conditions are checked (stop token ids and EOS unless
``ignore_eos``, both only from ``min_tokens`` on; then ``max_tokens`` and
``max_model_len``), and finished requests release their blocks.

Bad input:

- ``add_request`` raises ``ValueError`` (and changes nothing) for a duplicate
  id, a prompt longer than ``max_model_len``, or a request already used; an
  empty prompt or bad token ids are rejected earlier, by ``Request``.
- A request that cannot fit in the KV cache even alone is *finished as
  failed* (finish reason ``"error"``, with a message): that is only known
  when it is scheduled. Its ``RequestOutput`` comes out of the next
  ``update_from_output``; every other request carries on.
- A ``ModelRunnerOutput`` naming a request not scheduled this step, or with
  more tokens than drafts + 1, raises ``ValueError`` before any state
  changes.

Every request that enters ends with exactly one final ``RequestOutput``
(``finished=True``) from ``update_from_output``, whatever the reason.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from servelab.scheduling.policies import SchedulingPolicy, get_policy
from servelab.scheduling.request import Request, RequestStatus

WAITING = RequestStatus.WAITING
RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED
STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
ABORTED = RequestStatus.FINISHED_ABORTED
FAILED = RequestStatus.FINISHED_FAILED
_NO_BLOCKS: tuple[int, ...] = ()


class Scheduler:
    """Continuous-batching scheduler over one ``KVCacheManager``.

    Args:
        config: budgets and limits.
        kv_cache_manager: a :class:`servelab.blocks.KVCacheManager` (or any
            object with its ``get_computed_blocks``, ``allocate_slots``,
            ``free``, ``get_block_ids``, ``block_size``, ``enable_caching``).
        policy: a :class:`SchedulingPolicy` or a registered name ("fcfs",
            "priority", "sjf", "vtc"). A policy object serves one scheduler.
        clock: returns the current time in seconds (timestamps, metrics); the
            simulator passes a virtual clock.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager,
        policy: SchedulingPolicy | str = "fcfs",
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(config).__name__}")
        kv_len = getattr(kv_cache_manager, "max_model_len", None)
        if kv_len is not None and kv_len < config.max_model_len:
            raise ValueError(f"kv_cache_manager.max_model_len={kv_len} is below SchedulerConfig.max_model_len="
                             f"{config.max_model_len}; make them equal")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.policy = get_policy(policy)
        self.clock = clock
        self.block_size: int = kv_cache_manager.block_size
        self.waiting = self.policy.make_waiting_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Ended since the last schedule(): told to the model runner next step.
        self._finished_ids: set[str] = set()
        # Final outputs of requests that ended outside update_from_output.
        self._pending_outputs: list[RequestOutput] = []
        self._order = itertools.count()
        # Only call the accounting hook when the policy has one (hot path).
        self._token_hook = (self.policy.on_tokens_scheduled
                            if type(self.policy).on_tokens_scheduled is not SchedulingPolicy.on_tokens_scheduled
                            else None)
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_failed = 0
        self.num_aborted = 0

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ``ValueError`` (nothing changes) for a
        duplicate id, a prompt over ``max_model_len`` or a used request."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a servelab.scheduling.Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}: a request with this id is still unfinished")
        if rid in self._finished_ids:
            raise ValueError(f"duplicate request id {rid!r}: it just finished and the model runner has not "
                             "been told yet; use a new id or add it after the next schedule()")
        if request.status is not WAITING or request.num_computed_tokens or request.num_output_tokens:
            raise ValueError(f"request {rid!r} was already scheduled ({request!r}); create a new Request")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(f"request {rid!r} has a {request.num_prompt_tokens}-token prompt, longer than "
                             f"max_model_len={self.config.max_model_len}")
        if self.kv_cache_manager.enable_caching:
            request.init_block_hasher(self.block_size)
        if request.arrival_time is None:
            request.arrival_time = self.clock()
        request.arrival_order = next(self._order)
        self.requests[rid] = request
        self.waiting.add(request)
        self.policy.on_request_added(request)

    def abort_request(self, request_id: str) -> bool:
        """End an unfinished request now (finish reason "abort"); its blocks
        are freed. Returns False if no such request is unfinished."""
        return self.finish_request(request_id, ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus = ABORTED,
                       stop_reason: int | str | None = None) -> bool:
        """End an unfinished request from outside with a final ``status``:
        ``FINISHED_ABORTED`` (client went away) or ``FINISHED_STOPPED`` (e.g.
        the detokenizer matched a stop *string*; pass it as ``stop_reason``).
        Its final ``RequestOutput`` comes from the next ``update_from_output``.
        Returns False if no such request is unfinished."""
        if status not in (ABORTED, STOPPED):
            raise ValueError(f"status={status!r}; valid: FINISHED_ABORTED or FINISHED_STOPPED")
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status is RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._finish(request, status)
        self.num_aborted += status is ABORTED
        self._pending_outputs.append(self._final_output(request, []))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self) -> SchedulerStats:
        kv_usage = getattr(self.kv_cache_manager, "usage", 0.0)
        return SchedulerStats(len(self.running), len(self.waiting), kv_usage, self.num_steps,
                              self.num_preemptions, self.num_finished, self.num_failed, self.num_aborted)

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work (see the module docstring)."""
        cfg = self.config
        kv = self.kv_cache_manager
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        max_len = cfg.max_model_len
        lookahead = cfg.num_speculative_tokens
        now = self.clock()
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_blocks_of: dict[str, tuple[Request, list]] = {}
        preempted: set[str] = set()
        running = self.running

        # 1. Running requests.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            n = req.num_tokens + len(req.spec_token_ids) - computed
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            if n > max_len - computed:
                n = max_len - computed
            if n <= 0:
                i += 1
                continue
            ahead = lookahead if computed + n >= req.num_tokens else 0
            new_blocks = kv.allocate_slots(req, n, 0, None, ahead)
            while new_blocks is None:
                if len(running) == 1:  # alone, and still no room: it never will be
                    if ahead:
                        new_blocks = kv.allocate_slots(req, n)
                        if new_blocks is not None:
                            break
                    running.pop(i)
                    self._fail(req, n)
                    break
                victim = self.policy.select_victim(running)
                try:
                    j = running.index(victim)
                except ValueError:
                    raise RuntimeError(f"policy {self.policy!r} chose {victim!r}, which is not running") from None
                running.pop(j)
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim.request_id in num_scheduled:  # give its share of this step back
                    budget += num_scheduled.pop(victim.request_id)
                    spec_tokens.pop(victim.request_id, None)
                    del new_blocks_of[victim.request_id]
                if j < i:
                    i -= 1
                if victim is req:
                    break
                new_blocks = kv.allocate_slots(req, n, 0, None, ahead)
            if new_blocks is None:
                continue  # req left `running`; running[i] is the next one
            rid = req.request_id
            num_scheduled[rid] = n
            new_blocks_of[rid] = (req, new_blocks)
            budget -= n
            if req.spec_token_ids:
                num_drafts = computed + n - req.num_tokens
                if num_drafts > 0:
                    del req.spec_token_ids[num_drafts:]
                    spec_tokens[rid] = req.spec_token_ids
                else:
                    req.spec_token_ids.clear()
            i += 1

        cached = CachedRequestData()
        total_kv = 0
        hook = self._token_hook
        if num_scheduled:
            c_ids, c_new, c_computed = cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
            for rid, n in num_scheduled.items():
                req, blocks = new_blocks_of[rid]
                computed = req.num_computed_tokens
                if hook is not None:
                    hook(req, n)
                c_ids.append(rid)
                c_new.append([b.block_id for b in blocks] if blocks else _NO_BLOCKS)
                c_computed.append(computed)
                total_kv += computed + n
                req.num_computed_tokens = computed + n
            cached.resumed = [False] * len(c_ids)

        # 2. Waiting requests.
        new_reqs: list[NewRequestData] = []
        if not preempted:
            waiting = self.waiting
            enable_caching = kv.enable_caching
            while budget > 0 and len(running) < cfg.max_num_seqs:
                req = waiting.peek()
                if req is None:
                    break
                if enable_caching:
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
                if new_blocks is None:
                    if running:
                        break  # wait for running requests to free blocks
                    waiting.pop()  # alone in the cache and still no room: never
                    self._fail(req, n + num_hit)
                    continue
                waiting.pop()
                rid = req.request_id
                resumed = req.status is PREEMPTED
                req.status = RUNNING
                req.num_computed_tokens = num_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    req.num_cached_tokens = num_hit
                running.append(req)
                num_scheduled[rid] = n
                budget -= n
                total_kv += num_hit + n
                if hook is not None:
                    hook(req, n)
                if resumed:
                    cached.req_ids.append(rid)
                    cached.resumed.append(True)
                    cached.new_block_ids.append(kv.get_block_ids(req))
                    cached.num_computed_tokens.append(num_hit)
                    cached.resumed_token_ids[rid] = list(req.all_token_ids)
                else:
                    new_reqs.append(NewRequestData(rid, req.prompt_token_ids, req.sampling_params,
                                                   kv.get_block_ids(req), num_hit))
                req.num_computed_tokens = num_hit + n

        finished, self._finished_ids = self._finished_ids, set()
        self.num_steps += 1
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=finished,
            preempted_req_ids=preempted,
            total_num_kv_tokens=total_kv,
            step=self.num_steps,
        )

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply one step's results; returns one ``RequestOutput`` per request
        that produced tokens or ended (including ends from abort/failure since
        the last call)."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        spec_scheduled = scheduler_output.scheduled_spec_decode_tokens
        req_ids = model_output.req_ids
        sampled = model_output.sampled_token_ids
        # Validate everything before touching any state.
        if not num_scheduled.keys() >= set(req_ids):
            unknown = sorted(set(req_ids) - num_scheduled.keys())
            raise ValueError(f"ModelRunnerOutput names requests not scheduled in this step: {unknown[:5]}")
        if len(set(req_ids)) != len(req_ids):
            raise ValueError("ModelRunnerOutput.req_ids holds duplicates")
        for rid, toks in zip(req_ids, sampled):
            if len(toks) > 1 and len(toks) > len(spec_scheduled.get(rid, ())) + 1:
                raise ValueError(f"request {rid!r} got {len(toks)} tokens but had "
                                 f"{len(spec_scheduled.get(rid, ()))} drafts scheduled; at most drafts + 1")

        outputs, self._pending_outputs = self._pending_outputs, []
        now = self.clock()
        max_len = self.config.max_model_len
        num_spec = self.config.num_speculative_tokens
        drafts_next = model_output.spec_token_ids
        logprobs = model_output.logprobs
        requests = self.requests
        any_finished = False
        if len(req_ids) < len(num_scheduled):  # silent requests produced nothing
            given = set(req_ids)
            missing = [r for r in num_scheduled if r not in given]
            req_ids = list(req_ids) + missing
            sampled = list(sampled) + [[]] * len(missing)

        for idx, rid in enumerate(req_ids):
            req = requests.get(rid)
            if req is None or req.status is not RUNNING:
                continue  # aborted since schedule()
            num_tokens = req.num_tokens
            if req.num_computed_tokens < num_tokens:
                continue  # mid-prefill: nothing to sample (tokens given are ignored)
            toks = sampled[idx]
            k = len(toks)
            # Positions past the last accepted token must be computed again:
            # rejected drafts, or the last position when nothing came back.
            req.num_computed_tokens = num_tokens + k - 1
            drafts = spec_scheduled.get(rid)
            if drafts is not None:
                req.num_draft_tokens += len(drafts)
                req.num_accepted_tokens += max(k - 1, 0)
                req.spec_token_ids = []
            if not k:
                continue

            # Stop conditions, token by token (several arrive with drafts).
            status = None
            stop_ids = req.stop_token_ids
            num_out = num_tokens - req.num_prompt_tokens
            for pos, tok in enumerate(toks):
                num_out += 1
                if tok in stop_ids and num_out >= req.min_tokens:
                    status, req.stop_reason = STOPPED, tok
                elif num_out >= req.max_tokens or num_tokens + pos + 1 >= max_len:
                    status = LENGTH_CAPPED
                else:
                    continue
                if pos + 1 < k:
                    toks = toks[:pos + 1]
                break
            req.append_output_token_ids(toks, now)

            if status is None:
                if drafts_next is not None and num_spec:
                    proposed = drafts_next[idx]
                    room = min(num_spec, max_len - req.num_tokens)
                    req.spec_token_ids = list(proposed[:room]) if room > 0 else []
                outputs.append(RequestOutput(rid, toks, logprobs=logprobs[idx] if logprobs is not None else None))
            else:
                self._finish(req, status)
                any_finished = True
                out = self._final_output(req, toks)
                if logprobs is not None:
                    out.logprobs = logprobs[idx]
                outputs.append(out)
        if any_finished:
            self.running = [r for r in self.running if r.status is RUNNING]
        return outputs

    # ---- internals ---------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)

    def _fail(self, request: Request, num_tokens: int) -> None:
        pool = getattr(self.kv_cache_manager, "block_pool", None)
        num_blocks = pool.num_blocks - 1 if pool is not None else "?"
        request.error = (
            f"request {request.request_id!r} cannot fit in the KV cache even alone: it needs room for "
            f"{request.num_computed_tokens + num_tokens} tokens ({self.block_size}-token blocks) and the cache "
            f"has {num_blocks} usable blocks; add KV blocks or lower max_model_len / max_tokens"
        )
        self._finish(request, FAILED)
        self.num_failed += 1
        self._pending_outputs.append(self._final_output(request, []))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.kv_cache_manager.free(request)
        request.status = status
        request.finish_time = self.clock()
        request.spec_token_ids = []
        rid = request.request_id
        del self.requests[rid]
        self._finished_ids.add(rid)
        self.num_finished += 1
        self.policy.on_request_finished(request)

    @staticmethod
    def _final_output(request: Request, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(request.request_id, new_token_ids, True, request.finish_reason, request.stop_reason,
                             request.error, None, request.metrics())
