"""Making room: preemption when a running request's next tokens find no KV slots.

:meth:`Preemption._make_room` is step 1's fallback in :class:`~servelab.scheduling.scheduler.Scheduler`:
the policy names a victim among the running requests (``select_victim``; a policy that raises fails only
the request room was being made for), the victim is preempted (blocks freed, back to waiting; a victim
already scheduled this step gives its tokens back) and the allocation is retried. A request alone in the
pool that still does not fit may get a smaller chunk (a hybrid model's sliding groups need only the
window plus one chunk, ``max_chunk_alone``), or it never fits and fails with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from servelab.scheduling.request import Request
from servelab.scheduling.step import Step as _Step
from servelab.scheduling.step import raised as _raised
from servelab.scheduling.transitions import RequestTransitions


class Preemption(RequestTransitions):
    """The scheduler's preemption steps (a mixin of :class:`~servelab.scheduling.scheduler.Scheduler`)."""

    has_pending_kv_transfers: Callable[[], bool]

    def _make_room(self, step: _Step, req: Request, i: int, n: int, ahead: int
                   ) -> tuple[tuple[list[Any], ...] | None, int, int]:
        """Preempt policy-chosen victims until ``req`` (``running[i]``) gets
        slots for ``n`` tokens (alone: maybe a smaller chunk, see
        :meth:`_allocate_alone`). Returns its new blocks (per group), or None when it left
        ``running`` (its own victim, failed); the index of the request after
        it; and the tokens it gets."""
        kv = self.kv_cache_manager
        running = self.running
        while True:
            if len(running) == 1:  # alone, and still no room: a smaller chunk, or never
                if ahead:
                    new_blocks = kv.allocate_slots(req, n)
                    if new_blocks is not None:
                        return new_blocks, i, n
                new_blocks, fit = self._allocate_alone(req, n)
                if new_blocks is not None:
                    return new_blocks, i, fit
                running.pop(i)
                if self.has_pending_kv_transfers():  # blocks a KV connector holds (loads, sends, leases) come back
                    self._preempt(req, step)
                    return None, i, n
                self._fail(req, self._no_room_message(req, n))
                return None, i, n
            victim, error = self._select_victim(req)
            if victim is None:
                running.pop(i)
                self._fail(req, error)
                return None, i, n
            j = next(k for k, r in enumerate(running) if r is victim)
            running.pop(j)
            rid = victim.request_id
            if rid in step.num_scheduled:  # give its share of this step back
                step.budget += step.num_scheduled.pop(rid)
                step.spec_tokens.pop(rid, None)
                step.new_blocks_of.pop(rid, None)
                del step.reqs[rid]
            if j < i:
                i -= 1
            self._preempt(victim, step)
            if victim is req:
                return None, i, n
            new_blocks = kv.allocate_slots(req, n, 0, None, ahead)
            if new_blocks is not None:
                return new_blocks, i, n

    def _allocate_alone(self, req: Request, n: int, num_hit: int = 0, hit_blocks: tuple[Sequence[Any], ...] | None = None
                        ) -> tuple[tuple[list[Any], ...] | None, int]:
        """``req`` has the pool to itself and ``n`` tokens find no room: a manager
        with ``max_chunk_alone`` (the hybrid one: sliding windows need only the
        window plus one chunk) may serve it in smaller chunks. Returns the new
        blocks (per group) and the chunk, or (None, n): it can never run here."""
        fit = getattr(self.kv_cache_manager, "max_chunk_alone", None)
        if fit is None or not self.config.enable_chunked_prefill:
            return None, n
        chunk = fit(req, n)
        if not 0 < chunk < n:
            return None, n
        new_blocks = self.kv_cache_manager.allocate_slots(req, chunk, num_hit, hit_blocks)
        return (None, n) if new_blocks is None else (new_blocks, chunk)

    def _select_victim(self, req: Request) -> tuple[Request | None, str]:
        """The policy's victim, or (None, why) when the policy failed."""
        running = self.running
        who = f"scheduling policy {self.policy!r}.select_victim (making room for request {req.request_id!r})"
        try:
            victim = self.policy.select_victim(tuple(running))
        except Exception as exc:
            return None, _raised(who, exc)
        if not any(r is victim for r in running):
            return None, f"{who} chose {victim!r}, which is not running"
        return victim, ""
