"""Scheduling policies: which waiting request is admitted next, and which
running request is preempted when KV memory runs out.

A policy is an object with two decisions::

    key(request)              -> sortable; waiting requests are admitted in
                                 increasing key order
    select_victim(running)    -> the running request to preempt (default: the
                                 one with the largest key)

and three optional hooks for policies with state (``on_request_added``,
``on_tokens_scheduled``, ``on_request_finished``). A new policy subclasses
:class:`SchedulingPolicy`, overrides ``key`` (and ``select_victim`` if the
default is wrong for it), and is passed to the scheduler; nothing in the
scheduler changes. ``register_policy`` makes it reachable by name (CLI).

Keys must be *static* while a request waits (they are stored in a heap). A
policy whose order changes over time (fair share) supplies its own queue
through ``make_waiting_queue``.

Running requests are visited in admission order each step (as in vLLM); the
policy acts through admission and preemption.

Progress: the built-in victims are chosen by a static key, so the running
request with the smallest key is never preempted while others run; it always
advances, which rules out preemption livelock.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from servelab.scheduling.request import Request, RequestStatus

_FINISHED = RequestStatus.FINISHED_STOPPED


class WaitingQueue:
    """Waiting requests in a policy's order. Removal is lazy: an aborted
    request's entry stays in the heap and is skipped when it reaches the top."""

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._key = key
        self._heap: list[tuple[Any, int, Request]] = []
        self._len = 0

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), request.arrival_order, request))
        self._len += 1

    def _drop_dead(self) -> None:
        heap = self._heap
        while heap and heap[0][2].status >= _FINISHED:
            heapq.heappop(heap)

    def peek(self) -> Request | None:
        """The next request to admit, or None."""
        self._drop_dead()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_dead()
        self._len -= 1
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        """Forget ``request``; the caller marks it finished (that is what lets
        its heap entry be dropped later)."""
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Live requests in admission order."""
        return iter([e[2] for e in sorted(self._heap, key=lambda e: e[:2]) if e[2].status < _FINISHED])


class SchedulingPolicy:
    """Base policy: first come, first served. Subclass and override ``key``."""

    name = "fcfs"

    def key(self, request: Request) -> Any:
        """Sort key of a waiting request: lower is admitted first. Ties break
        by the order requests were added."""
        return request.arrival_time

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The request to preempt, among ``running`` (non-empty; may be the
        request asking for memory, in which case it preempts itself)."""
        key = self.key
        return max(running, key=lambda r: (key(r), r.arrival_order))

    def make_waiting_queue(self) -> WaitingQueue:
        """The waiting queue this policy orders (called once per scheduler)."""
        return WaitingQueue(self.key)

    # ---- optional hooks (no-ops here) -----------------------------------

    def on_request_added(self, request: Request) -> None:
        """A request entered the scheduler."""

    def on_tokens_scheduled(self, request: Request, num_new_tokens: int) -> None:
        """``num_new_tokens`` of ``request`` were scheduled this step; called
        before ``request.num_computed_tokens`` advances past them."""

    def on_request_finished(self, request: Request) -> None:
        """A request ended (any reason)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; preempts the latest arrival."""

    name = "fcfs"


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first, ties by arrival; preempts the lowest
    priority (largest value), latest arrival."""

    name = "priority"

    def key(self, request: Request) -> Any:
        return (request.priority, request.arrival_time)


class ShortestPromptFirstPolicy(SchedulingPolicy):
    """Shortest prompt first, ties by arrival; preempts the longest prompt.

    Cuts mean TTFT under load; long prompts can starve while short ones keep
    arriving."""

    name = "sjf"

    def key(self, request: Request) -> Any:
        return (request.num_prompt_tokens, request.arrival_time)


class FairSharePolicy(SchedulingPolicy):
    """Fair share across clients with virtual token counters (VTC, Sheng et
    al., "Fairness in Serving Large Language Models", OSDI 2024).

    Each client has a counter of the service it received: ``prompt_weight``
    per prompt position computed plus ``output_weight`` per output position
    computed (recomputation after preemption counts: it is service the GPU
    gave). The next admitted request is the oldest one of the client with the
    smallest counter. A client that had nothing pending and comes back has its
    counter lifted to the smallest counter among clients with pending
    requests, so idle time is not banked as credit.

    Bound (two continuously backlogged clients A and B): when A is admitted its
    counter is the smaller one; afterwards it grows only through A's requests
    already running, and A is not admitted again while ahead. So
    ``|W_A - W_B| <= max_num_seqs * U`` with ``U = prompt_weight * P_max +
    output_weight * O_max`` the largest cost of one request (P_max, O_max the
    longest prompt and output). tests/scheduling/test_policies.py checks it.

    The preemption victim is the latest arrival (a static key): choosing by
    counter could preempt the request that must advance, and admission already
    carries the fairness.
    """

    name = "vtc"

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        for field_name, w in (("prompt_weight", prompt_weight), ("output_weight", output_weight)):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
                raise ValueError(f"FairSharePolicy.{field_name}={w!r} must be a number >= 0")
        self.prompt_weight = float(prompt_weight)
        self.output_weight = float(output_weight)
        self.counters: dict[str, float] = defaultdict(float)
        self.pending: dict[str, int] = defaultdict(int)

    def key(self, request: Request) -> Any:
        return request.arrival_time

    def make_waiting_queue(self) -> WaitingQueue:
        return _FairShareQueue(self)

    def on_request_added(self, request: Request) -> None:
        client = request.client_id
        if self.pending[client] == 0:
            active = [self.counters[c] for c, n in self.pending.items() if n > 0]
            if active:
                self.counters[client] = max(self.counters[client], min(active))
        self.pending[client] += 1

    def on_tokens_scheduled(self, request: Request, num_new_tokens: int) -> None:
        start = request.num_computed_tokens
        num_prompt = min(max(request.num_prompt_tokens - start, 0), num_new_tokens)
        self.counters[request.client_id] += (self.prompt_weight * num_prompt
                                             + self.output_weight * (num_new_tokens - num_prompt))

    def on_request_finished(self, request: Request) -> None:
        self.pending[request.client_id] -= 1

    def __repr__(self) -> str:
        return f"FairSharePolicy(prompt_weight={self.prompt_weight}, output_weight={self.output_weight})"


class _FairShareQueue(WaitingQueue):
    """One FIFO heap per client; the head of the least-served client goes first."""

    def __init__(self, policy: FairSharePolicy) -> None:
        super().__init__(policy.key)
        self._policy = policy
        self._per_client: dict[str, list[tuple[Any, int, Request]]] = {}

    def add(self, request: Request) -> None:
        heap = self._per_client.setdefault(request.client_id, [])
        heapq.heappush(heap, (request.arrival_time, request.arrival_order, request))
        self._len += 1

    def _best_heap(self) -> list | None:
        counters = self._policy.counters
        best, best_key = None, None
        for client, heap in self._per_client.items():
            while heap and heap[0][2].status >= _FINISHED:
                heapq.heappop(heap)
            if heap:
                k = (counters[client], heap[0][0], heap[0][1])
                if best_key is None or k < best_key:
                    best, best_key = heap, k
        return best

    def peek(self) -> Request | None:
        heap = self._best_heap()
        return heap[0][2] if heap else None

    def pop(self) -> Request:
        heap = self._best_heap()
        if heap is None:
            raise IndexError("pop from an empty waiting queue")
        self._len -= 1
        return heapq.heappop(heap)[2]

    def __iter__(self) -> Iterator[Request]:
        entries = [e for heap in self._per_client.values() for e in heap if e[2].status < _FINISHED]
        return iter([e[2] for e in sorted(entries, key=lambda e: e[:2])])


_POLICIES: dict[str, Callable[..., SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "sjf": ShortestPromptFirstPolicy,
    "vtc": FairSharePolicy,
}


def register_policy(name: str, factory: Callable[..., SchedulingPolicy]) -> None:
    """Make ``get_policy(name)`` build policies with ``factory``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name {name!r} must be a non-empty string")
    if not callable(factory):
        raise TypeError(f"factory for policy {name!r} must be callable")
    _POLICIES[name] = factory


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def get_policy(name: str | SchedulingPolicy, **kwargs: Any) -> SchedulingPolicy:
    """A fresh policy object by name ("fcfs", "priority", "sjf", "vtc", or a
    registered one); a policy object is returned as is."""
    if isinstance(name, SchedulingPolicy):
        return name
    if not isinstance(name, str):
        raise TypeError(f"policy must be a name or a SchedulingPolicy subclass instance, got {type(name).__name__}")
    if name not in _POLICIES:
        raise ValueError(f"policy={name!r} is not known; valid: {policy_names()}")
    return _POLICIES[name](**kwargs)
