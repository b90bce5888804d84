"""Scheduling policies: which waiting request is admitted next, and which
running request is preempted when KV memory runs out.

The contract (who calls what, when, and what happens when a policy raises) is
the docstring of :class:`~servelab.scheduling.interfaces.SchedulingPolicy`. A
new policy subclasses it, implements ``key`` (and ``select_victim`` if the
default is wrong for it) and is passed to the scheduler; nothing in the
scheduler changes. ``register_policy(name, factory)`` makes it reachable by
name (CLI, simulator)::

    class LongestPromptFirst(SchedulingPolicy):
        name = "lpf"
        def key(self, request):
            return -request.num_prompt_tokens

    register_policy("lpf", LongestPromptFirst)
    Scheduler(config, kv_cache_manager, "lpf")

Built-ins: ``"fcfs"``, ``"priority"``, ``"sjf"``, ``"vtc"`` (fair share).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from servelab._internal.registry import Registry
from servelab._internal.validation import check_number
from servelab.scheduling.interfaces import RequestQueue, SchedulingPolicy
from servelab.scheduling.queues import WaitingQueue
from servelab.scheduling.request import Request

__all__ = [
    "FCFSPolicy", "FairSharePolicy", "PriorityPolicy", "RequestQueue", "SchedulingPolicy",
    "ShortestPromptFirstPolicy", "WaitingQueue", "available_policies", "get_policy", "policy_names",
    "register_policy",
]


class FCFSPolicy(SchedulingPolicy):
    """First come, first served (by ``arrival_time``); preempts the latest arrival."""

    name = "fcfs"

    def key(self, request: Request) -> Any:
        return request.arrival_time


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
        self.prompt_weight = check_number("FairSharePolicy.prompt_weight", prompt_weight, min_value=0)
        self.output_weight = check_number("FairSharePolicy.output_weight", output_weight, min_value=0)
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
    """One FIFO heap per client; the head of the least-served client goes
    first. Entries and removal as in :class:`WaitingQueue`."""

    def __init__(self, policy: FairSharePolicy) -> None:
        super().__init__(policy.key)
        self._policy = policy
        self._per_client: dict[str, list[list[Any]]] = {}

    def add(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._entries:
            raise ValueError(f"request {rid!r} is already in the waiting queue")
        entry = [request.arrival_time, request.arrival_order, request]
        self._push(self._per_client.setdefault(request.client_id, []), entry)
        self._entries[rid] = entry

    def _best_heap(self) -> list[list[Any]] | None:
        counters = self._policy.counters
        best, best_key = None, None
        for client, heap in self._per_client.items():
            while heap and heap[0][2] is None:
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
        request = heapq.heappop(heap)[2]
        del self._entries[request.request_id]
        return request

    def __iter__(self) -> Iterator[Request]:
        entries = sorted(self._entries.values(), key=lambda e: (e[0], e[1]))
        return iter([e[2] for e in entries])


def _check_policy(obj: object) -> None:
    if not isinstance(obj, SchedulingPolicy):
        raise TypeError(f"policy must be a registered name or a SchedulingPolicy subclass instance "
                        f"(servelab.scheduling.SchedulingPolicy), got {type(obj).__name__}")


_POLICIES: Registry[SchedulingPolicy] = Registry("scheduling policy", factory=True, check=_check_policy)
_POLICIES.register("fcfs", FCFSPolicy)
_POLICIES.register("priority", PriorityPolicy)
_POLICIES.register("sjf", ShortestPromptFirstPolicy)
_POLICIES.register("vtc", FairSharePolicy)


def register_policy(name: str, factory: Callable[..., SchedulingPolicy], *, override: bool = False) -> None:
    """Make ``get_policy(name, **kwargs)`` build policies with ``factory(**kwargs)``
    (usually the policy class; a fresh object per scheduler). A name already
    registered raises ``ValueError`` unless ``override=True``."""
    if not callable(factory) or isinstance(factory, SchedulingPolicy):
        raise TypeError(f"factory for policy {name!r} must be a callable that returns a SchedulingPolicy "
                        f"(e.g. the class), got {type(factory).__name__}")
    _POLICIES.register(name, factory, override=override)


def get_policy(name_or_obj: str | SchedulingPolicy, **kwargs: Any) -> SchedulingPolicy:
    """A fresh policy by registered name (``kwargs`` go to its factory), or a
    :class:`SchedulingPolicy` object as it is. Unknown name: ``ValueError``
    listing the known ones; anything else: ``TypeError``."""
    policy = _POLICIES.get(name_or_obj, **kwargs)
    if isinstance(name_or_obj, str):
        _check_policy(policy)  # a factory that built something else
    return policy


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return _POLICIES.available()


policy_names = available_policies  # old name
