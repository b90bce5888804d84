"""The scheduler's LoRA constraint: at most ``max_loras`` distinct adapters among
running requests, so every step's adapters fit the device slots.

A waiting request is admitted only when its adapter (``Request.lora_name``;
None is the base model, always admissible) is already used by a running
request, or a slot can be freed: fewer than ``max_loras`` distinct adapters
run. The scheduler looks at the waiting queue through :meth:`LoRASlots.view`,
a queue that ``peek``\\ s the first admissible request in the policy's order
and passes over the others, which keep their place.

**No starvation.** Passing over a request lets later requests of active
adapters overtake it, which could keep its adapter out forever. So a request
passed over in ``starvation_steps`` scheduling steps becomes a barrier: from
then on nothing behind it in the policy's order is admitted until it is;
running requests finish, their adapters' slots free up, and it gets one.

**A policy sees the constraint**: the scheduler gives this object to a policy
that defines ``bind_lora_slots(slots)``; ``slots.active`` (adapter -> running
requests), ``slots.admissible(request)`` and ``slots.passed_over`` (request id
-> steps passed over) are what it can read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from servelab.scheduling.request import Request

__all__ = ["LoRASlots", "STARVATION_STEPS"]

#: Steps a waiting request may be passed over for its adapter before it becomes a barrier.
STARVATION_STEPS = 8


class LoRASlots:
    """The ``max_loras`` admission constraint of one scheduler (see the module docstring)."""

    def __init__(self, max_loras: int, *, starvation_steps: int = STARVATION_STEPS) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras={max_loras!r} is invalid; valid: an int >= 1")
        self.max_loras = max_loras
        self.starvation_steps = starvation_steps
        self.active: Counter[str] = Counter()
        self.passed_over: dict[str, int] = {}
        self._passed_this_step: set[str] = set()

    @classmethod
    def for_scheduler(cls, max_loras: int, policy: Any) -> LoRASlots | None:
        """The constraint of a scheduler whose config has ``max_loras`` (0: none), shown to a
        policy that asks for it (``policy.bind_lora_slots(slots)``, optional)."""
        if not max_loras:
            return None
        slots = cls(max_loras)
        bind = getattr(policy, "bind_lora_slots", None)
        if callable(bind):
            bind(slots)
        return slots

    def begin_step(self, running: Iterable[Request], waiting: Any = ()) -> None:
        """Count the running requests' adapters (called once per ``schedule()``); pass-over
        counts of requests no longer ``waiting`` are dropped now and then."""
        self.active = Counter(r.lora_name for r in running if r.lora_name is not None)
        self._passed_this_step = set()
        if len(self.passed_over) > 2 * len(waiting) + 64:
            still = {r.request_id for r in waiting}
            self.passed_over = {rid: n for rid, n in self.passed_over.items() if rid in still}

    def admissible(self, request: Request) -> bool:
        """Its adapter runs already, or a slot can be freed for it."""
        name = request.lora_name
        return name is None or name in self.active or len(self.active) < self.max_loras

    def admitted(self, request: Request) -> None:
        if request.lora_name is not None:
            self.active[request.lora_name] += 1
        self.passed_over.pop(request.request_id, None)

    def forget(self, request_id: str) -> None:
        """The request ended (or was admitted): no pass-over count kept."""
        self.passed_over.pop(request_id, None)

    def _pass_over(self, request: Request) -> bool:
        """Count one step of waiting for a slot; True when it has become a barrier."""
        rid = request.request_id
        if rid not in self._passed_this_step:
            self._passed_this_step.add(rid)
            self.passed_over[rid] = self.passed_over.get(rid, 0) + 1
        return self.passed_over[rid] >= self.starvation_steps

    def view(self, queue: Any) -> _AdmissibleView:
        """``queue`` as the scheduler's admission loop sees it under the constraint."""
        return _AdmissibleView(self, queue)


class _AdmissibleView:
    """A waiting queue's admissible requests, in its order (``peek`` / ``pop`` / iteration)."""

    def __init__(self, slots: LoRASlots, queue: Any) -> None:
        self.slots = slots
        self.queue = queue
        self._next: Request | None = None

    def peek(self) -> Request | None:
        self._next = None
        head = self.queue.peek()
        if head is None or self.slots.admissible(head):  # the common case: no walk of the queue
            self._next = head
            return head
        for request in self.queue:
            if self.slots.admissible(request):
                self._next = request
                return request
            if self.slots._pass_over(request):
                return None  # a starving request: nothing behind it goes first
        return None

    def pop(self) -> Request:
        request = self._next if self._next is not None else self.peek()
        if request is None:
            raise IndexError("no admissible waiting request")
        self.queue.remove(request)
        self._next = None
        self.slots.admitted(request)
        return request

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.queue)
