"""The scheduler's states for a KV connector (:mod:`servelab.connectors`).

:class:`ConnectorStates` is a mixin of :class:`~servelab.scheduling.Scheduler`;
with no connector (``kv_connector=None``) none of it runs but one ``is None``
test per admission, step end and request end.

What it adds, following vLLM v1's scheduler:

- **External hits.** On admission, after the local prefix-cache lookup, the
  connector says how many more tokens it can provide
  (``get_num_new_matched_tokens``; capped block-aligned below the request's
  last token, which is always computed). The scheduler allocates slots for
  them and tells the connector where (``update_state_after_alloc``).
- **Waiting for remote KV.** An asynchronous load parks the request in
  ``WAITING_FOR_REMOTE_KVS``: out of the waiting queue, not running, holding
  its blocks, costing no token budget. When the worker reports the load
  finished (``KVTransferResult.finished_recving``) its blocks are committed
  (findable by prefix lookup: their KV is now really in the pool) and
  released to the prefix cache, and the request goes back to the waiting
  queue; its admission then finds them as a local prefix hit. (vLLM keeps
  them held instead; releasing them means a landed request holds nothing
  while it waits, so waiting requests can never deadlock the pool. The price:
  under heavy pressure the pool may evict them before the request is
  admitted; it then recomputes them — a request is offered external tokens
  once, so this always ends.) Connectors therefore need prefix caching.
- **Window blocks only.** For a hybrid manager, a sliding-window group's
  blocks of the external range that the window at its end does not read are
  released (null, never committed) as soon as the blocks are held: the
  connector loads only the window's blocks (:mod:`servelab.connectors.windows`).
- **Failed loads recompute.** A request in ``failed_recving`` (async), or
  whose synchronous load in this step failed, loses its blocks and goes back
  to the waiting queue with nothing computed; it is never offered external
  tokens again, so it recomputes from its local prefix hit (the KV of a
  failed load is never read by a result that is kept, never committed).
- **Delayed frees.** ``request_finished`` returning True (the connector is
  still sending the blocks), or a request ending while its load is in flight
  (the worker may still write them), keeps its blocks held — not reusable,
  not newly findable — until ``finished_sending`` / ``finished_recving``
  names it. A request id is not reusable meanwhile. While a connector holds
  blocks (loads, sends, a producer's leases: ``has_pending_kv_transfers``), a
  request that finds no room waits for them instead of failing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from servelab.scheduling.request import Request, RequestStatus

if TYPE_CHECKING:
    from servelab.blocks.interfaces import KVCacheManagerProtocol
    from servelab.scheduling.interfaces import RequestQueue

WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING = RequestStatus.WAITING


class ConnectorStates:
    """See the module docstring (uses the scheduler's manager, queues and transitions)."""

    kv_cache_manager: KVCacheManagerProtocol
    waiting: RequestQueue
    running: list[Request]
    requests: dict[str, Request]
    block_size: int
    _unreported_preempted: set[str]
    config: Any
    policy: Any
    _token_hook: Callable[[Request, int], None] | None
    _requeue: Callable[[Request, str], None]
    _roll_back: Callable[[Request, bool], None]
    _fail: Callable[[Request, str], None]
    _no_room_message: Callable[[Request, int], str]
    _admit: Callable[[Any, Request, int, int], None]
    _waiting_queue_failed: Callable[[Exception], None]

    def _init_connector(self, kv_connector: Any) -> None:
        if kv_connector is not None and not self.kv_cache_manager.enable_caching:
            raise ValueError("kv_connector needs prefix caching (enable_prefix_caching=True): loaded KV reaches "
                             "its request through the prefix cache")
        self.kv_connector = kv_connector
        self._waiting_remote: dict[str, Request] = {}
        """Requests parked while their KV loads (``WAITING_FOR_REMOTE_KVS``)."""
        self._remote_plan: dict[str, tuple[RequestStatus, int, int, bool]] = {}
        """Per loading request: (status to return to, local hit tokens, external tokens, async)."""
        self._delayed_free: dict[str, Request] = {}
        """Ended requests whose blocks the connector still holds (sending, or a load in flight)."""
        self._no_external: set[str] = set()
        """Requests whose load landed or failed: never offered external tokens again."""
        self.num_external_hit_tokens = 0
        self.num_failed_loads = 0
        self._holds_loaded = bool(getattr(kv_connector, "holds_loaded_blocks", False))
        """vLLM's P/D consumer semantics (a connector with ``holds_loaded_blocks = True``): a load may
        cover the prompt through a partial last block, and a landed request keeps its loaded blocks
        (allocated to it, never in the evictable pool) until it is admitted."""
        self._loaded_held: dict[str, Request] = {}
        """Waiting requests that hold their landed, loaded KV (only with ``holds_loaded_blocks``)."""
        self.num_released_loads = 0
        """Held loads released to the prefix cache to break a stall (nothing else could free memory)."""

    def attach_kv_connector(self, kv_connector: Any) -> None:
        """Give a scheduler that holds no request yet a KV connector (what ``kv_connector=`` does)."""
        if self.requests:
            raise ValueError("attach_kv_connector: the scheduler already holds requests")
        self._init_connector(kv_connector)

    # ---- admission -----------------------------------------------------------------

    def _external_tokens(self, req: Request, num_hit: int) -> tuple[int, bool]:
        """Tokens the connector adds to a ``num_hit``-token local hit, and whether they load async."""
        if req.request_id in self._no_external:
            return 0, False
        num_ext, load_async = self.kv_connector.get_num_new_matched_tokens(req, num_hit)
        if not num_ext:
            return 0, False
        room = max(req.num_tokens - 1 - num_hit, 0)  # the last token is computed for its logits
        num_ext = min(int(num_ext), room)
        if not (self._holds_loaded and num_ext == room):  # a remote prefill sends its partial last block too
            num_ext = num_ext // self.block_size * self.block_size
        return num_ext, bool(load_async) and num_ext > 0

    def _park_for_load(self, req: Request, num_hit: int, hit_blocks: Any, num_ext: int) -> bool:
        """Hold blocks for ``num_ext`` external tokens and park ``req`` (popped by the caller
        after True). False: no room (nothing changed)."""
        if self.kv_cache_manager.allocate_slots(req, num_ext, num_hit, hit_blocks) is None:
            return False
        return True

    def _after_park(self, req: Request, num_hit: int, num_ext: int) -> None:
        rid = req.request_id
        self._remote_plan[rid] = (req.status, num_hit, num_ext, True)
        req.status = WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = num_hit
        self._waiting_remote[rid] = req
        self.num_external_hit_tokens += num_ext
        self._drop_out_of_window(req, num_hit + num_ext)
        self.kv_connector.update_state_after_alloc(req, self.kv_cache_manager.get_block_ids(req), num_ext)

    def _after_sync_alloc(self, req: Request, num_hit: int, num_ext: int) -> None:
        """A synchronous load of ``num_ext`` tokens happens before this step's forward."""
        self._remote_plan[req.request_id] = (req.status, num_hit, num_ext, False)
        self.num_external_hit_tokens += num_ext
        req.num_computed_tokens = num_hit  # the external tokens follow the local hit (then _admit)
        self._drop_out_of_window(req, num_hit + num_ext)
        self.kv_connector.update_state_after_alloc(req, self.kv_cache_manager.get_block_ids(req), num_ext)

    def _drop_out_of_window(self, req: Request, num_tokens: int) -> None:
        """Release the sliding-window blocks a prefix of ``num_tokens`` does not read (hybrid
        managers; see :mod:`servelab.connectors.windows`): the connector loads only the window
        blocks, so the others hold no KV and must never be committed. The manager releases
        exactly those when asked for no new token at ``num_computed_tokens = num_tokens``."""
        if getattr(self.kv_cache_manager, "groups", None) is None:
            return
        computed = req.num_computed_tokens
        req.num_computed_tokens = num_tokens
        try:
            self.kv_cache_manager.allocate_slots(req, 0)
        finally:
            req.num_computed_tokens = computed

    # ---- the worker's reports ----------------------------------------------------------

    def has_pending_kv_transfers(self) -> bool:
        """True while blocks are held for a connector or a load is in flight."""
        connector = getattr(self, "kv_connector", None)
        return bool(self._delayed_free or self._waiting_remote or self._loaded_held) or (
            connector is not None and connector.has_pending_work())

    def _update_kv_transfers(self, result: Any) -> None:
        """Apply a :class:`~servelab.connectors.KVTransferResult` (loads landed or failed, sends done)."""
        failed = result.failed_recving
        for rid in result.finished_recving | failed:
            req = self._waiting_remote.pop(rid, None)
            plan = self._remote_plan.pop(rid, None)
            if req is None:
                if plan is not None and not plan[3]:  # a synchronous load in the step just run
                    req = self.requests.get(rid)
                    if rid in failed and req is not None and req.status is _RUNNING:
                        self._sync_load_failed(req)
                self._release_delayed(rid)  # ended while loading
                continue
            if plan is None:  # parked without a plan: cannot happen; never leave it parked
                self._requeue(req, "loaded")
                continue
            status, num_hit, num_ext, _ = plan
            if rid in failed:
                self._load_failed(req, status)
                continue
            # Commit after compute: the loaded KV is in the pool now. Then the blocks go to the
            # prefix cache and the request's admission finds them as a local hit (or, with
            # holds_loaded_blocks, the request keeps them until its admission, as vLLM does).
            req.num_computed_tokens = num_hit + num_ext
            self.kv_cache_manager.cache_blocks(req, num_hit + num_ext)
            if self._holds_loaded:
                self._loaded_held[rid] = req
            else:
                self.kv_cache_manager.free(req)
                req.num_computed_tokens = 0
            req.status = status
            self._no_external.add(rid)
            self._requeue(req, "loaded")
        for rid in result.finished_sending:
            self._release_delayed(rid)

    def _settle_kv_step(self, scheduler_output: Any, result: Any) -> None:
        """A step's results arrived: apply the worker's transfer report; the step's
        synchronous loads are settled (a failure was reported with them)."""
        if result:
            self._update_kv_transfers(result)
        if self._remote_plan:
            scheduled = scheduler_output.num_scheduled_tokens
            for rid in [r for r, plan in self._remote_plan.items() if not plan[3] and r in scheduled]:
                del self._remote_plan[rid]

    def _load_failed(self, req: Request, status: RequestStatus) -> None:
        """An async load failed: free its blocks and recompute from scratch (local hits only)."""
        self.num_failed_loads += 1
        self._no_external.add(req.request_id)
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.num_committed_blocks = 0
        req.status = status
        self._requeue(req, "failed to load")

    def _sync_load_failed(self, req: Request) -> None:
        """This step read a failed synchronous load: discard the step for ``req``, recompute."""
        self.num_failed_loads += 1
        self._no_external.add(req.request_id)
        self.running.remove(req)
        self._roll_back(req, req.num_output_tokens == 0 and req.num_preemptions == 0)

    def _release_delayed(self, rid: str) -> None:
        req = self._delayed_free.pop(rid, None)
        if req is not None:
            self.kv_cache_manager.free(req)

    # ---- ends ------------------------------------------------------------------------------

    def _connector_holds_blocks(self, request: Request) -> bool:
        """A request is ending: True if its blocks must stay held (delayed free)."""
        rid = request.request_id
        self._waiting_remote.pop(rid, None)
        self._loaded_held.pop(rid, None)
        plan = self._remote_plan.pop(rid, None)
        loading = plan is not None and plan[3]
        self._no_external.discard(rid)
        try:
            delay, params = self.kv_connector.request_finished(request, self.kv_cache_manager.get_block_ids(request))
        except Exception as exc:  # the connector's bookkeeping failed: it gets nothing to send
            delay, params = False, None
            request.error = request.error or f"kv connector request_finished raised {type(exc).__name__}: {exc}"
        if params is not None:
            request.kv_transfer_params = params
        if delay or loading:
            self._delayed_free[rid] = request
            return True
        return False

    # ---- admission of one waiting request (Scheduler._schedule_waiting with a connector) ----

    def _admit_with_connector(self, step: Any, req: Request, budget: int) -> int | None:
        """Admit ``req`` (the head of the waiting queue) as ``_schedule_waiting`` does, plus
        external tokens; returns the budget it used, or None to stop admitting."""
        kv, cfg = self.kv_cache_manager, self.config
        if req.request_id in self._loaded_held:
            return self._admit_loaded(step, req, budget)
        if getattr(req.sampling_params, "prompt_logprobs", None) is not None and req.num_tokens <= req.num_prompt_tokens:
            hit_blocks, num_hit, num_ext, load_async = None, 0, 0, False  # prompt logprobs: compute it all
        else:
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            num_ext, load_async = self._external_tokens(req, num_hit)
        others_hold_kv = bool(self.running) or self.has_pending_kv_transfers()  # their blocks come back
        if load_async:
            if self._park_for_load(req, num_hit, hit_blocks, num_ext):
                if not self._pop_waiting(req):
                    return None
                self._after_park(req, num_hit, num_ext)
                return 0
            if self._release_loaded(req):
                return self._admit_with_connector(step, req, budget)  # once: nothing is held any more
            if others_hold_kv:
                return None
            num_ext = 0  # alone and the external part does not fit: compute it instead
        start = num_hit + num_ext
        n = self._prompt_chunk(req.num_tokens - start, budget)
        if n is None:
            return None
        ahead = cfg.num_speculative_tokens if start + n >= req.num_tokens else 0
        new_blocks = kv.allocate_slots(req, num_ext + n, num_hit, hit_blocks, ahead)
        if new_blocks is None and ahead:
            new_blocks = kv.allocate_slots(req, num_ext + n, num_hit, hit_blocks)
        if new_blocks is None and self._release_loaded(req):
            return self._admit_with_connector(step, req, budget)  # once: nothing is held any more
        if new_blocks is None and others_hold_kv:
            return None
        if not self._pop_waiting(req):
            return None
        if new_blocks is None:
            self._fail(req, self._no_room_message(req, n + start))
            return 0
        if num_ext:
            self._after_sync_alloc(req, num_hit, num_ext)
        if self._token_hook is not None:
            req.num_computed_tokens = start
            try:
                self._token_hook(req, n)
            except Exception as exc:
                req.num_computed_tokens = 0
                self._fail(req, f"scheduling policy {self.policy!r}.on_tokens_scheduled raised "
                                f"{type(exc).__name__}: {exc}")
                return 0
        self._admit(step, req, n, start)
        return n

    def _prompt_chunk(self, remaining: int, budget: int) -> int | None:
        """How many of a request's ``remaining`` prompt tokens an admission computes this step:
        capped by ``long_prefill_token_threshold`` and the step's ``budget``; None when they do not
        fit and chunked prefill is off."""
        cfg = self.config
        n = remaining
        if cfg.long_prefill_token_threshold and n > cfg.long_prefill_token_threshold:
            n = cfg.long_prefill_token_threshold
        if n > budget:
            if not cfg.enable_chunked_prefill:
                return None
            n = budget
        return n

    def _admit_loaded(self, step: Any, req: Request, budget: int) -> int | None:
        """Admit ``req``, which holds its landed KV (``holds_loaded_blocks``): it computes only the
        tokens past the load (a P/D decode: its first output token). None: stop admitting."""
        kv = self.kv_cache_manager
        start = req.num_computed_tokens
        n = self._prompt_chunk(req.num_tokens - start, budget)
        if n is None:
            return None
        new_blocks = kv.allocate_slots(req, n)
        if new_blocks is None and self._release_loaded(req):
            new_blocks = kv.allocate_slots(req, n)
        if new_blocks is None and (self.running or self._delayed_free or self._waiting_remote
                                   or len(self._loaded_held) > 1 or self.kv_connector.has_pending_work()):
            return None  # their blocks come back
        if not self._pop_waiting(req):
            return None
        del self._loaded_held[req.request_id]
        if new_blocks is None:
            self._fail(req, self._no_room_message(req, n))
            return 0
        if self._token_hook is not None:
            try:
                self._token_hook(req, n)
            except Exception as exc:
                self._fail(req, f"scheduling policy {self.policy!r}.on_tokens_scheduled raised "
                                f"{type(exc).__name__}: {exc}")
                return 0
        self._admit(step, req, n, start)
        return n

    def _release_loaded(self, req: Request) -> bool:
        """``req`` finds no room and only waiting requests holding landed loads could free any
        (nothing runs, no transfer is in flight): release every such load but ``req``'s to the
        prefix cache (their KV stays findable until evicted; counted in ``num_released_loads``).
        True if one was released. Never happens without ``holds_loaded_blocks``."""
        if not self._loaded_held or self.running or self._delayed_free or self._waiting_remote:
            return False
        if self.kv_connector.has_pending_work():
            return False
        others = [r for rid, r in self._loaded_held.items() if r is not req]
        for other in others:
            del self._loaded_held[other.request_id]
            self.kv_cache_manager.free(other)
            other.num_computed_tokens = 0
            other.num_committed_blocks = 0
            self.num_released_loads += 1
        return bool(others)

    def _pop_waiting(self, req: Request) -> bool:
        """Pop ``req`` (the head); False if the policy's queue raised (then every waiting request failed)."""
        try:
            self.waiting.pop()
        except Exception as exc:
            if req.status is not WAITING_FOR_REMOTE_KVS and req.request_id not in self._remote_plan:
                self.kv_cache_manager.free(req)
            self._waiting_queue_failed(exc)
            return False
        return True
