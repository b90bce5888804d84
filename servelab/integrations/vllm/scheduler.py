"""servelab scheduling policies as a vLLM v1 scheduler class.

``make_scheduler_cls(policy)`` returns a subclass of vLLM's
``vllm.v1.core.sched.scheduler.Scheduler`` whose two policy decisions come
from a servelab :class:`~servelab.scheduling.policies.SchedulingPolicy`:

- **waiting order**: ``self.waiting`` (and ``self.kv_holding_waiting``) are
  replaced by :class:`PolicyRequestQueue`, which holds the policy's own
  waiting queue (``policy.make_waiting_queue()``: a heap by ``policy.key``,
  or the policy's custom queue such as VTC's per-client queues);
- **preemption victim**: ``policy.select_victim(running)``. vLLM picks the
  victim inline in ``schedule()`` with ``max(self.running, key=lambda r:
  (r.priority, r.arrival_time))`` when its policy is ``PRIORITY`` — the
  branch that also handles a victim scheduled earlier in the step (its tokens
  are given back) and a request that preempts itself. The bridge runs vLLM in
  that branch and stores in each request's ``priority`` attribute a
  :class:`_VictimKey` that compares greatest exactly for the policy's victim
  (the user's priority is kept on the :class:`VllmRequestView`). Nothing else
  in vLLM reads ``Request.priority``.
- **hooks**: ``on_request_added`` after ``add_request``,
  ``on_request_finished`` from ``_free_request`` (every end: stop, length,
  abort), and ``on_tokens_scheduled`` at the same moments servelab's own
  scheduler calls it — for running requests after the running pass (before
  the first waiting request is looked at), for a waiting request when it is
  admitted — so a fair-share policy sees its counters move between two
  admissions of one step, as in servelab. The token counts come from the
  successful ``kv_cache_manager.allocate_slots`` calls of the step (wrapped
  per instance, only when the policy has the hook).

Policies read a :class:`VllmRequestView`: the fields of servelab's
``Request`` a policy uses (``request_id``, ``arrival_time``,
``arrival_order``, ``priority``, ``client_id``, ``num_prompt_tokens``,
``num_tokens``, ``num_computed_tokens``, ``num_output_tokens``,
``max_tokens``, ``num_preemptions``, ``status`` as servelab's
``RequestStatus``...) over a vLLM ``Request``. vLLM's request carries no
tenant: the client id (fair share) is ``sampling_params.extra_args
["client_id"]`` (OpenAI server: ``"vllm_xargs": {"client_id": ...}``),
``"default"`` when absent.

**Base class.** ``Scheduler`` by default. vLLM warns that a custom class
extending ``Scheduler`` instead of ``AsyncScheduler`` disables async
scheduling; pass ``base="async"`` (or any ``Scheduler`` subclass) to bridge
onto ``AsyncScheduler`` — the overridden methods are the same ones. The
differential tests run the synchronous one (that is what vLLM's own
scheduler tests drive).

**Where it differs from servelab's own scheduler** (the differential tests
keep out of these cases; see tests/integrations/): vLLM admits a request only
if its whole prompt fits (``scheduler_reserve_full_isl``, on by default),
servelab only its first chunk; vLLM makes blocks findable by prefix lookup
when they are allocated, servelab after the step computed them; vLLM leaves a
request that can never fit waiting, servelab fails it; vLLM stops a request
one position earlier at ``max_model_len`` and disables
``long_prefill_token_threshold`` when one request is eligible.

**Policy objects.** A policy given by name is built fresh for every scheduler
instance (``get_policy(name, **policy_kwargs)``); a policy object is deep-
copied into each instance (vLLM's engine runs the scheduler in another
process, which gets a copy anyway). Read the live one as
``scheduler.servelab_policy``. The returned classes pickle by value (a
``copyreg`` reducer on their metaclass), so they survive vLLM's spawn of the
engine process when the policy object is picklable.

**Faults.** A policy whose ``select_victim`` raises or names a request that is
not running does not take the engine down: the step falls back to vLLM's
default victim (the latest admitted running request) and the error is logged
once per scheduler. A ``key`` that raises when a request is added makes
``add_request`` raise ``ValueError`` naming the policy and the request before
anything is queued.
"""

from __future__ import annotations

import copy
import copyreg
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from servelab.integrations.vllm._compat import require_vllm

require_vllm()

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy as VllmQueuePolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402
from vllm.v1.request import RequestStatus as VllmStatus  # noqa: E402

from servelab.scheduling.policies import SchedulingPolicy, get_policy  # noqa: E402
from servelab.scheduling.request import RequestStatus  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["PolicyRequestQueue", "VllmRequestView", "make_scheduler_cls"]

_STATUS = {
    VllmStatus.WAITING: RequestStatus.WAITING,
    VllmStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: RequestStatus.WAITING,
    VllmStatus.WAITING_FOR_REMOTE_KVS: RequestStatus.WAITING,
    VllmStatus.WAITING_FOR_STREAMING_REQ: RequestStatus.WAITING,
    VllmStatus.RUNNING: RequestStatus.RUNNING,
    VllmStatus.PREEMPTED: RequestStatus.PREEMPTED,
    VllmStatus.FINISHED_STOPPED: RequestStatus.FINISHED_STOPPED,
    VllmStatus.FINISHED_LENGTH_CAPPED: RequestStatus.FINISHED_LENGTH_CAPPED,
    VllmStatus.FINISHED_ABORTED: RequestStatus.FINISHED_ABORTED,
    VllmStatus.FINISHED_IGNORED: RequestStatus.FINISHED_LENGTH_CAPPED,
    VllmStatus.FINISHED_ERROR: RequestStatus.FINISHED_FAILED,
    VllmStatus.FINISHED_REPETITION: RequestStatus.FINISHED_STOPPED,
}


def client_id_of(request) -> str:
    """The tenant of a vLLM request: ``sampling_params.extra_args["client_id"]``, else ``"default"``."""
    params = request.sampling_params
    extra = getattr(params, "extra_args", None) if params is not None else None
    if extra and extra.get("client_id") is not None:
        return str(extra["client_id"])
    return "default"


class VllmRequestView:
    """What a servelab policy reads, over one vLLM ``Request`` (read-only).

    One view per queue entry: when a request leaves a waiting queue by removal
    (abort) its view is marked dead (``status`` reads ``FINISHED_ABORTED``, which
    is how servelab's lazy heaps drop entries) and the request gets a fresh view.
    """

    __slots__ = ("request", "arrival_order", "priority", "client_id", "dead", "queue", "_computed")

    def __init__(self, request, arrival_order: int, priority: int, client_id: str) -> None:
        self.request = request
        self.arrival_order = arrival_order
        self.priority = priority
        self.client_id = client_id
        self.dead = False
        self.queue: PolicyRequestQueue | None = None
        self._computed: int | None = None

    def renewed(self) -> VllmRequestView:
        return VllmRequestView(self.request, self.arrival_order, self.priority, self.client_id)

    request_id = property(lambda self: self.request.request_id)
    arrival_time = property(lambda self: self.request.arrival_time)
    num_prompt_tokens = property(lambda self: self.request.num_prompt_tokens)
    num_tokens = property(lambda self: self.request.num_tokens)
    num_output_tokens = property(lambda self: self.request.num_output_tokens)
    num_tokens_with_spec = property(lambda self: self.request.num_tokens_with_spec)
    max_tokens = property(lambda self: self.request.max_tokens)
    num_preemptions = property(lambda self: self.request.num_preemptions)
    prompt_token_ids = property(lambda self: self.request.prompt_token_ids)
    all_token_ids = property(lambda self: self.request.all_token_ids)
    output_token_ids = property(lambda self: self.request.output_token_ids)
    spec_token_ids = property(lambda self: self.request.spec_token_ids)
    block_hashes = property(lambda self: self.request.block_hashes)
    sampling_params = property(lambda self: self.request.sampling_params)
    num_cached_tokens = property(lambda self: self.request.num_cached_tokens)

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens if self._computed is None else self._computed

    @property
    def status(self) -> RequestStatus:
        if self.dead:
            return RequestStatus.FINISHED_ABORTED
        return _STATUS[self.request.status]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def __repr__(self) -> str:
        return f"VllmRequestView({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens})"


class _VictimKey:
    """Stored in ``Request.priority``: in vLLM's ``max(running, key=(priority,
    arrival_time))`` exactly the policy's victim compares greater than every
    other request."""

    __slots__ = ("scheduler", "view")

    def __init__(self, scheduler, view: VllmRequestView) -> None:
        self.scheduler = scheduler
        self.view = view

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __gt__(self, other: object) -> bool:
        return self.scheduler._servelab_victim() is self.view.request

    def __lt__(self, other: object) -> bool:
        return isinstance(other, _VictimKey) and other > self

    def __int__(self) -> int:
        return int(self.view.priority)

    def __repr__(self) -> str:
        return f"priority={self.view.priority} (servelab victim key)"


class PolicyRequestQueue(RequestQueue):
    """vLLM's ``RequestQueue`` over a servelab policy's waiting queue.

    A policy queue has no front: ``prepend_request`` (a preempted or skipped
    request going back) adds it in the policy's order, as servelab's own
    scheduler does (``FCFS`` therefore still puts a preempted request ahead of
    later arrivals: it is older).
    """

    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler
        self._queue = scheduler.servelab_policy.make_waiting_queue()

    def add_request(self, request) -> None:
        view = self._scheduler._servelab_views[request.request_id]
        if view.queue is not None:
            raise ValueError(f"request {request.request_id!r} is already in a waiting queue")
        view.queue = self
        self._queue.add(view)

    def pop_request(self):
        if not len(self._queue):
            raise IndexError("pop from an empty waiting queue")
        view = self._queue.pop()
        view.queue = None
        self._scheduler._servelab_admitting(view)
        return view.request

    def peek_request(self):
        self._scheduler._servelab_running_hooks()
        view = self._queue.peek()
        if view is None:
            raise IndexError("peek from an empty waiting queue")
        return view.request

    def prepend_request(self, request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable) -> None:
        for request in requests:
            self.add_request(request)

    def _remove(self, request) -> bool:
        views = self._scheduler._servelab_views
        view = views.get(request.request_id)
        if view is None or view.queue is not self:
            return False
        view.dead = True
        view.queue = None
        self._queue.remove(view)
        views[request.request_id] = fresh = view.renewed()
        request.priority = _VictimKey(self._scheduler, fresh)
        return True

    def remove_request(self, request) -> None:
        if not self._remove(request):
            raise ValueError(f"request {request.request_id!r} is not in this waiting queue")

    def remove_requests(self, requests: Iterable) -> None:
        for request in requests:
            self._remove(request)

    def __bool__(self) -> bool:
        return len(self._queue) > 0

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator:
        return (view.request for view in self._queue)


class _PolicyBridge:
    """The overrides; mixed in front of a vLLM ``Scheduler`` subclass by :func:`make_scheduler_cls`."""

    _servelab_policy_spec: tuple[Any, dict]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        policy, policy_kwargs = self._servelab_policy_spec
        self.servelab_policy: SchedulingPolicy = (
            get_policy(policy, **policy_kwargs) if isinstance(policy, str) else copy.deepcopy(policy))
        self._servelab_views: dict[str, VllmRequestView] = {}
        self._servelab_order = itertools.count()
        self._servelab_victim_cache = None
        self._servelab_victim_error_logged = False
        # vLLM's PRIORITY branch picks any victim (see the module docstring).
        self.policy = VllmQueuePolicy.PRIORITY
        if len(self.waiting) or len(self.kv_holding_waiting):
            raise RuntimeError("the bridged scheduler must replace vLLM's queues before any request arrives")
        self.waiting = PolicyRequestQueue(self)
        self.kv_holding_waiting = PolicyRequestQueue(self)
        hook = self.servelab_policy.on_tokens_scheduled
        has_hook = type(self.servelab_policy).on_tokens_scheduled is not SchedulingPolicy.on_tokens_scheduled
        self._servelab_hook = hook if has_hook else None
        self._servelab_allocs: dict[str, tuple[int, int, bool]] = {}
        self._servelab_hooked: set[str] = set()
        self._servelab_running_hooked = False
        if has_hook:
            self._wrap_allocate_slots()

    def _wrap_allocate_slots(self) -> None:
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots
        allocs = self._servelab_allocs

        def allocate_slots(request, num_new_tokens, *args, **kwargs):
            blocks = allocate(request, num_new_tokens, *args, **kwargs)
            if blocks is not None and num_new_tokens > 0:
                hit = kwargs.get("num_new_computed_tokens", 0) + kwargs.get("num_external_computed_tokens", 0)
                allocs[request.request_id] = (num_new_tokens, request.num_computed_tokens + hit,
                                              request.status == VllmStatus.RUNNING)
            return blocks

        manager.allocate_slots = allocate_slots

    # ---- requests in and out ---------------------------------------------------

    def add_request(self, request) -> None:
        rid = request.request_id
        if rid in self.requests:  # streaming-input continuation: vLLM's own path
            return super().add_request(request)
        view = VllmRequestView(request, next(self._servelab_order), request.priority, client_id_of(request))
        try:
            self.servelab_policy.key(view)
        except Exception as exc:
            raise ValueError(f"policy {self.servelab_policy!r} cannot order request {rid!r}: {exc!r}") from exc
        self._servelab_views[rid] = view
        request.priority = _VictimKey(self, view)
        try:
            super().add_request(request)
        except BaseException:
            self._servelab_views.pop(rid, None)
            request.priority = view.priority
            raise
        self.servelab_policy.on_request_added(view)

    def _free_request(self, request, delay_free_blocks: bool = False):
        result = super()._free_request(request, delay_free_blocks)
        view = self._servelab_views.pop(request.request_id, None)
        if view is not None:
            request.priority = view.priority
            self.servelab_policy.on_request_finished(view)
        return result

    # ---- one step ---------------------------------------------------------------

    def schedule(self, *args, **kwargs):
        self._servelab_victim_cache = None
        self._servelab_allocs.clear()
        self._servelab_hooked.clear()
        self._servelab_running_hooked = False
        return super().schedule(*args, **kwargs)

    def _preempt_request(self, request, *args, **kwargs) -> None:
        self._servelab_victim_cache = None
        return super()._preempt_request(request, *args, **kwargs)

    def _servelab_victim(self):
        """The running vLLM request the policy preempts now (cached until the next preemption)."""
        victim = self._servelab_victim_cache
        if victim is None:
            running = self.running
            views = self._servelab_views
            try:
                chosen = self.servelab_policy.select_victim([views[r.request_id] for r in running])
                victim = chosen.request if isinstance(chosen, VllmRequestView) else None
                if victim is None or not any(r is victim for r in running):
                    raise RuntimeError(f"select_victim returned {chosen!r}, which is not a running request")
            except Exception as exc:  # a research policy must not take the engine down
                if not self._servelab_victim_error_logged:
                    logger.error("policy %r failed to choose a preemption victim (%r); using vLLM's default "
                                 "(the latest admitted request) for this and later failures", self.servelab_policy,
                                 exc)
                    self._servelab_victim_error_logged = True
                victim = running[-1]
            self._servelab_victim_cache = victim
        return victim

    def _servelab_running_hooks(self) -> None:
        """``on_tokens_scheduled`` for the running requests this step kept (called once per step,
        before the first waiting request is looked at, as servelab's scheduler does)."""
        if self._servelab_running_hooked or self._servelab_hook is None:
            return
        self._servelab_running_hooked = True
        views, hooked = self._servelab_views, self._servelab_hooked
        for rid, (n, computed, was_running) in self._servelab_allocs.items():
            request = self.requests.get(rid)
            if was_running and request is not None and request.status == VllmStatus.RUNNING:
                self._servelab_call_hook(views[rid], n, computed)
                hooked.add(rid)

    def _servelab_admitting(self, view: VllmRequestView) -> None:
        """A waiting request is being admitted (popped after its slots were allocated)."""
        if self._servelab_hook is None:
            return
        self._servelab_running_hooks()
        rid = view.request_id
        record = self._servelab_allocs.get(rid)
        if record is not None and not record[2] and rid not in self._servelab_hooked:
            self._servelab_call_hook(view, record[0], record[1])
            self._servelab_hooked.add(rid)

    def _servelab_call_hook(self, view: VllmRequestView, n: int, computed: int) -> None:
        view._computed = computed
        try:
            self._servelab_hook(view, n)
        finally:
            view._computed = None

    def _update_after_schedule(self, scheduler_output) -> None:
        if self._servelab_hook is not None:
            self._servelab_running_hooks()
            views = self._servelab_views
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                if rid not in self._servelab_hooked and rid in views:
                    record = self._servelab_allocs.get(rid)
                    computed = record[1] if record is not None else self.requests[rid].num_computed_tokens
                    self._servelab_call_hook(views[rid], n, computed)
        super()._update_after_schedule(scheduler_output)


class _BridgeMeta(type(VllmScheduler)):
    """Metaclass of bridged classes: pickles them by value (policy + base), not by name."""


def _rebuild(policy, base, policy_kwargs):
    return make_scheduler_cls(policy, base=base, **policy_kwargs)


def _reduce_bridge_class(cls):
    policy, policy_kwargs = cls._servelab_policy_spec
    return _rebuild, (policy, cls._servelab_base, policy_kwargs)


copyreg.pickle(_BridgeMeta, _reduce_bridge_class)


def _resolve_base(base) -> type:
    if base is None or base == "sync":
        return VllmScheduler
    if base == "async":
        return AsyncScheduler
    if isinstance(base, type) and issubclass(base, VllmScheduler):
        return base
    raise ValueError(f"base={base!r} is invalid; valid: None or 'sync' (vLLM's Scheduler), 'async' "
                     "(AsyncScheduler), or a subclass of vllm.v1.core.sched.scheduler.Scheduler")


def make_scheduler_cls(policy: str | SchedulingPolicy = "fcfs", *, base: str | type | None = None,
                       **policy_kwargs: Any) -> type:
    """A vLLM v1 scheduler class that schedules with a servelab policy.

    Args:
        policy: a registered policy name (``"fcfs"``, ``"priority"``, ``"sjf"``,
            ``"vtc"``, or any name given to ``register_policy``) or a policy object.
        base: ``None``/``"sync"`` (vLLM's ``Scheduler``), ``"async"``
            (``AsyncScheduler``, for engines with async scheduling on) or a
            ``Scheduler`` subclass.
        **policy_kwargs: options of a policy given by name
            (``make_scheduler_cls("vtc", output_weight=4.0)``).

    Returns:
        The class, for ``LLM(..., scheduler_cls=cls)`` or
        ``SchedulerConfig(scheduler_cls=cls)``. ``ValueError`` now (not at
        engine start) for an unknown name or bad options.
    """
    base_cls = _resolve_base(base)
    probe = get_policy(policy, **policy_kwargs)  # validates the name and options now
    if not isinstance(policy, str):
        copy.deepcopy(probe)  # a policy object must be copyable: each scheduler gets its own
    label = policy if isinstance(policy, str) else type(policy).__name__
    name = f"Servelab{''.join(p.capitalize() for p in str(label).replace('-', '_').split('_'))}Scheduler"
    cls = _BridgeMeta(name, (_PolicyBridge, base_cls), {
        "__module__": __name__,
        "__doc__": f"vLLM's {base_cls.__name__} with servelab's {label!r} scheduling policy "
                   "(waiting order, preemption victim, accounting hooks).",
        "_servelab_policy_spec": (policy, dict(policy_kwargs)),
        "_servelab_base": base if isinstance(base, (str, type(None))) else base_cls,
    })
    return cls
