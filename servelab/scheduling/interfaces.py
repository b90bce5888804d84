"""The scheduling layer's seams, as code: what a policy, a waiting queue and a
scheduler must provide, and who calls what when.

- :class:`SchedulingPolicy` (ABC): the admission order (``key``), the
  preemption victim (``select_victim``), the waiting queue
  (``make_waiting_queue``) and three optional accounting hooks. Subclass it,
  implement ``key``, and pass an instance (or ``register_policy`` a factory and
  pass its name) to :class:`~servelab.scheduling.Scheduler`.
- :class:`RequestQueue` (Protocol): the waiting queue a policy builds.
- :class:`SchedulerInterface` (Protocol): what an engine loop (the pipeline,
  the simulator) calls on a scheduler.

Policies are user code, so the scheduler isolates their faults: when ``key``
or a hook raises an ``Exception``, only the request it was called for ends,
with ``finish_reason="error"`` and the message (see each method below for which
request that is); every other request carries on and no KV block leaks. In
``add_request`` the exception goes to the caller instead, and the request
leaves no trace.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from servelab.scheduling.queues import WaitingQueue

if TYPE_CHECKING:
    from servelab.scheduling.output import ModelRunnerOutput, RequestOutput, SchedulerOutput, SchedulerStats
    from servelab.scheduling.request import Request, RequestStatus

__all__ = ["RequestQueue", "SchedulerInterface", "SchedulingPolicy"]


@runtime_checkable
class RequestQueue(Protocol):
    """Waiting (and preempted) requests in the order they are admitted.

    The scheduler is the only caller. It ``add``\\ s a request when it arrives
    and when it is preempted, ``peek``\\ s at the head each step and ``pop``\\ s
    it once its KV slots are allocated, and ``remove``\\ s a request that ends
    while waiting (abort, failure). A queue holds each request at most once.
    Every method must be atomic: if it raises, the queue is as it was.
    """

    def add(self, request: Request) -> None:
        """Queue ``request``. May call the policy's ``key``."""

    def peek(self) -> Request | None:
        """The next request to admit, without removing it; None when empty."""

    def pop(self) -> Request:
        """Remove and return the request ``peek`` names; ``IndexError`` when empty."""

    def remove(self, request: Request) -> None:
        """Forget ``request`` (no-op if absent); it is never returned after this."""

    def __contains__(self, request: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]:
        """The queued requests in admission order (a snapshot; for inspection)."""


class SchedulingPolicy(abc.ABC):
    """Which waiting request is admitted next, and which running request is
    preempted when KV memory runs out. One policy object serves one scheduler
    (policies may keep per-scheduler state).

    Who calls what, when:

    - ``make_waiting_queue()``: once, in ``Scheduler.__init__``.
    - ``key(request)``: through the default queue, once each time a request
      enters the waiting queue (``add_request``, and each preemption). Lower
      keys are admitted first; ties break by the order requests were added.
      Keys must stay fixed while a request waits (they are stored in a heap);
      a policy whose order changes over time supplies its own queue. If it
      raises in ``add_request`` the exception reaches the caller and nothing
      changes; on a preemption the preempted request fails.
    - ``select_victim(running)``: during ``schedule()``, when a running request
      does not get KV slots; ``running`` is every running request in admission
      order (non-empty, may include the request asking). The victim is
      preempted (its blocks freed, recomputed later). If it raises or returns
      a request that is not running, the request that asked for memory fails.
    - ``on_request_added(request)``: right after the request entered the
      waiting queue in ``add_request``; if it raises, the request is taken out
      again and the exception reaches the caller.
    - ``on_tokens_scheduled(request, n)``: during ``schedule()``, once per
      scheduled request, *before* ``request.num_computed_tokens`` advances by
      ``n`` (so ``num_computed_tokens`` is where this step's tokens start). Only
      called when a subclass overrides it. If it raises, that request fails.
    - ``on_request_finished(request)``: once per request, whatever ended it,
      after its blocks are freed. If it raises, the request's final output
      says ``finish_reason="error"`` with the message.

    Policies act only through admission and preemption: running requests are
    visited in admission order every step (as in vLLM).

    Progress: when ``select_victim`` picks by a static key (the default), the
    running request with the smallest key is never preempted while others run,
    so it always advances; that rules out preemption livelock.
    """

    name: str = "custom"
    """The name the policy is reported under (registry name for built-ins)."""

    @abc.abstractmethod
    def key(self, request: Request) -> Any:
        """Sort key of a waiting request: lower is admitted first."""

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The request to preempt among ``running`` (default: the largest key,
        latest added on ties). May return the request asking for memory, which
        then waits itself."""
        key = self.key
        return max(running, key=lambda r: (key(r), r.arrival_order))

    def make_waiting_queue(self) -> RequestQueue:
        """The waiting queue this policy orders (default: a heap on ``key``)."""
        return WaitingQueue(self.key)

    # ---- optional hooks (no-ops here) -----------------------------------

    def on_request_added(self, request: Request) -> None:
        """A request entered the scheduler."""

    def on_tokens_scheduled(self, request: Request, num_new_tokens: int) -> None:
        """``num_new_tokens`` of ``request`` were scheduled this step."""

    def on_request_finished(self, request: Request) -> None:
        """A request ended (any reason)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@runtime_checkable
class SchedulerInterface(Protocol):
    """What an engine loop calls on a scheduler.

    One step is ``out = schedule()``, the model runner executes ``out``, then
    ``update_from_output(out, model_output)``; if execution fails or is
    interrupted, ``rollback_step(out)`` instead. Between steps a caller may
    add, abort, finish or fail requests. Every method either applies fully or
    leaves no trace (bad arguments raise before anything changes).

    Every request that enters ends with exactly one final ``RequestOutput``
    (``finished=True``): returned by ``fail_requests`` for the requests it
    ends, otherwise by a later ``update_from_output``.

    Attributes:
        requests: the unfinished requests by id (read-only for callers: the
            pipeline checks ids against it).
    """

    requests: Mapping[str, Request]

    def add_request(self, request: Request) -> None:
        """Queue a request (``ValueError`` / ``TypeError`` for bad input; the
        exception of a raising policy hook reaches the caller)."""

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work: which requests advance by how many tokens."""

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply a step's results; one ``RequestOutput`` per request that
        produced tokens or ended. Computed blocks become findable by prefix
        lookup here, never earlier."""

    def rollback_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step was scheduled but not executed (or failed): its requests
        that are still running go back to waiting, their blocks freed."""

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        """End an unfinished request from outside (abort, stop string)."""

    def abort_request(self, request_id: str) -> bool:
        """End an unfinished request with finish reason "abort"."""

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[RequestOutput]:
        """End requests with finish reason "error"; returns their final outputs."""

    def has_unfinished_requests(self) -> bool: ...

    def take_pending_outputs(self) -> list[RequestOutput]: ...

    def get_num_unfinished_requests(self) -> int: ...

    def get_stats(self) -> SchedulerStats: ...
