"""What one ``Scheduler.schedule()`` call has decided so far, and two small helpers of its phases."""

from __future__ import annotations

from typing import Any

from servelab.scheduling.output import CachedRequestData, NewRequestData
from servelab.scheduling.request import Request

__all__ = ["Step", "block_ids", "raised"]


def block_ids(blocks: tuple[list[Any], ...]) -> tuple[list[int], ...]:
    """Per-group ids of the blocks ``allocate_slots`` returned (one list per KV-cache
    group): a block is a pool block (``.block_id``) or, from the plain reference
    manager, the id itself."""
    if len(blocks) == 1:  # one group (full attention): no generator
        return ([b if type(b) is int else b.block_id for b in blocks[0]],)
    return tuple([b if type(b) is int else b.block_id for b in group] for group in blocks)


def raised(who: str, exc: BaseException) -> str:
    return f"{who} raised {type(exc).__name__}: {exc}"


class Step:
    """What one ``schedule()`` call has decided so far; its phases share it."""

    __slots__ = ("budget", "now", "num_scheduled", "reqs", "spec_tokens", "new_blocks_of", "preempted", "cached",
                 "new_reqs", "total_kv")

    def __init__(self, budget: int, now: float) -> None:
        self.budget = budget
        self.now = now
        self.num_scheduled: dict[str, int] = {}
        self.spec_tokens: dict[str, list[int]] = {}
        self.reqs: dict[str, Request] = {}
        """The running requests scheduled so far (same ids and order as ``num_scheduled``)."""
        self.new_blocks_of: dict[str, tuple[list[Any], ...]] = {}
        """Blocks ``allocate_slots`` returned (per group), for the running requests that got any."""
        self.preempted: set[str] = set()
        self.cached = CachedRequestData()
        self.new_reqs: list[NewRequestData] = []
        self.total_kv = 0
