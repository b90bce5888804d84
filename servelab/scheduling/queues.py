"""``WaitingQueue``: waiting requests in a policy's key order (a heap).

The default :class:`~servelab.scheduling.interfaces.RequestQueue` built by
``SchedulingPolicy.make_waiting_queue``. Removal is lazy (the heapq
"tombstone" recipe): ``remove`` marks the entry dead in O(1) and ``peek`` /
``pop`` drop dead entries when they reach the top. Whether a request is in the
queue depends only on ``add`` / ``pop`` / ``remove``, never on its status.

Every method is atomic: ``add`` computes the key (user code, may raise)
before it touches the heap, and a key that cannot be compared with the keys
already queued (``TypeError`` from the heap) leaves the queue as it was.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from servelab.scheduling.request import Request

__all__ = ["WaitingQueue"]


class WaitingQueue:
    """Waiting requests ordered by ``(key(request), request.arrival_order)``.

    Args:
        key: the policy's sort key; called once per ``add`` (keys must stay
            fixed while a request waits: they are stored in the heap).
    """

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._key = key
        # Entries are [key, arrival_order, request]; a removed entry's request
        # slot becomes None. arrival_order is unique, so request is never compared.
        self._heap: list[list[Any]] = []
        self._entries: dict[str, list[Any]] = {}

    def _push(self, heap: list[list[Any]], entry: list[Any]) -> None:
        """Push atomically: a failed comparison takes the entry back out."""
        try:
            heapq.heappush(heap, entry)
        except BaseException:
            for i, e in enumerate(heap):
                if e is entry:
                    heap[i] = heap[-1]
                    heap.pop()
                    heapq.heapify(heap)
                    break
            raise

    def add(self, request: Request) -> None:
        """Queue ``request`` (at its key's place). Raises ``ValueError`` if it
        is already queued, and whatever ``key`` raises; nothing changes then."""
        rid = request.request_id
        if rid in self._entries:
            raise ValueError(f"request {rid!r} is already in the waiting queue")
        entry = [self._key(request), request.arrival_order, request]
        self._push(self._heap, entry)
        self._entries[rid] = entry

    def _top(self) -> list[Any] | None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def peek(self) -> Request | None:
        """The next request to admit, or None when empty."""
        top = self._top()
        return None if top is None else top[2]

    def pop(self) -> Request:
        """Remove and return the next request; ``IndexError`` when empty."""
        if self._top() is None:
            raise IndexError("pop from an empty waiting queue")
        request = heapq.heappop(self._heap)[2]
        del self._entries[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        """Forget ``request`` (no-op if it is not queued)."""
        entry = self._entries.pop(request.request_id, None)
        if entry is not None:
            entry[2] = None

    def __contains__(self, request: object) -> bool:
        entry = self._entries.get(getattr(request, "request_id", None))
        return entry is not None and entry[2] is request

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """Queued requests in admission order (a snapshot)."""
        entries = sorted(self._entries.values(), key=lambda e: (e[0], e[1]))
        return iter([e[2] for e in entries])
