"""Fault injection into a ``Pipeline``: one armed fault per stage, raised once.

Every stage the issue names has a seam here, reached through public API only:

============  =================================================================
stage         where the fault is raised
============  =================================================================
schedule      ``pipe.scheduler.schedule`` wrapped (before it runs, or after it
              returned: the step's plan is lost before the runner sees it)
policy_key    the user policy's ``key(request)`` (admission order, preemption)
policy_victim the user policy's ``select_victim(running)``
policy_tokens the user policy's ``on_tokens_scheduled(request, n)``
policy_finish the user policy's ``on_request_finished(request)``
allocate      ``pipe.kv_cache_manager.allocate_slots`` wrapped (before it runs)
forward       ``pipe.model.forward`` patched (before, or after the real
              forward wrote the KV)
sampler       a logits processor (argmax-changing, so greedy rows see it)
verifier      a user ``Verifier`` object (delegates to ``"rejection"``)
drafter       a user ``Drafter`` (delegates to n-gram)
detokenize    the tokenizer's ``decode`` (the incremental detokenizer's call)
stop          ``pipe.scheduler.finish_request`` wrapped (how a stop string ends
              a request)
============  =================================================================

A fault is ``"error"`` (a ``RuntimeError`` whose message starts with
``INJECTED``) or ``"interrupt"`` (``KeyboardInterrupt``, Ctrl-C in a notebook).
Per-request seams fire only when the armed target request is among the
requests of the call (``target=None``: any call). Requests carry their id in
``SamplingParams.extra_args["rid"]`` so the logits processor can tell rows apart.

A fired fault records its **blast radius** (``Fault.scope``): the requests it
may fail. A fault aimed at a request may fail that request only; an unaimed
one, the requests of the call it fired in. Calls made for a whole batch
(``forward``, ``verifier``, ``policy_victim`` — the victim is chosen on behalf
of one of the running requests) may fail any request of the batch. The driver
checks that every request ending with ``"error"`` is in the scope of a fired
fault (:meth:`FaultPlan.may_fail`): a fault never fails a bystander.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from servelab.scheduling.interfaces import SchedulingPolicy

INJECTED = "INJECTED"
STAGES = ("schedule", "policy_key", "policy_victim", "policy_tokens", "policy_finish", "allocate", "forward",
          "sampler", "verifier", "drafter", "detokenize", "stop")
# Stages where an Exception is the engine's own failure (the scheduler, the
# block manager): step() may let it through. Everywhere else it is user code
# or the model, which must fail requests, never the engine.
ENGINE_STAGES = frozenset({"schedule", "allocate", "stop"})
# A raising policy key() while a request is queued reaches the caller of
# add_request / generate by contract (the request leaves no trace).
QUEUEING_STAGES = frozenset({"policy_key"})
SPEC_STAGES = frozenset({"verifier", "drafter"})
# Calls made for a batch: a fault there may fail any request of the call, aimed or not.
BATCH_STAGES = frozenset({"forward", "verifier", "policy_victim"})


class InjectedError(RuntimeError):
    """The exception an ``"error"`` fault raises."""


@dataclass
class Fault:
    stage: str
    kind: str  # "error" | "interrupt"
    target: str | None = None  # request id, or None: the next call
    when: str = "before"  # schedule/forward: "before" or "after" the real call
    scope: frozenset[str] = frozenset()  # once fired: the requests it may fail

    def exception(self) -> BaseException:
        if self.kind == "interrupt":
            return KeyboardInterrupt(f"{INJECTED} interrupt at {self.stage}")
        return InjectedError(f"{INJECTED} error at {self.stage} (target {self.target})")


@dataclass
class FaultPlan:
    """Armed faults (one per stage) and a log of those that fired."""

    armed: dict[str, Fault] = field(default_factory=dict)
    fired: list[Fault] = field(default_factory=list)
    # The requests of the step in flight (set by ``instrument``): the scope of a batch call.
    batch_ids: Any = field(default=lambda: ())

    def arm(self, fault: Fault) -> None:
        if fault.stage not in STAGES:
            raise ValueError(f"unknown stage {fault.stage!r}; valid: {STAGES}")
        self.armed[fault.stage] = fault

    def disarm(self) -> None:
        self.armed.clear()

    def check(self, stage: str, request_ids: Iterable[str] = (), when: str = "before",
              call_ids: Iterable[str] | None = None) -> None:
        """Raise the fault armed at ``stage`` (once) if it applies to this call.

        ``request_ids``: the requests the call is for (decides whether an aimed
        fault fires); ``call_ids``: the requests the call affects when they are
        not given as ``request_ids`` (the batch of a forward, the request being
        delivered). Together they give the fault's ``scope``."""
        fault = self.armed.get(stage)
        if fault is None or fault.when != when:
            return
        request_ids = set(request_ids)
        if fault.target is not None and fault.target not in request_ids:
            return
        affected = request_ids | set(call_ids or ())
        aimed = fault.target is not None and stage not in BATCH_STAGES
        fault.scope = frozenset({fault.target}) if aimed else frozenset(affected)
        del self.armed[stage]
        self.fired.append(fault)
        raise fault.exception()

    def may_fail(self, request_id: str) -> bool:
        """True if a fired fault's scope holds ``request_id`` (it may end with "error")."""
        return any(request_id in f.scope for f in self.fired)


def rid_of(params: Any) -> str | None:
    extra = getattr(params, "extra_args", None) or {}
    return extra.get("rid")


class FaultyPolicy(SchedulingPolicy):
    """FCFS whose ``key``, ``select_victim`` and hooks raise when armed."""

    name = "faulty-fcfs"

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan

    def key(self, request: Any) -> Any:
        self.plan.check("policy_key", [request.request_id])
        return request.arrival_time

    def select_victim(self, running: Sequence[Any]) -> Any:
        self.plan.check("policy_victim", [r.request_id for r in running])
        return max(running, key=lambda r: (r.arrival_time, r.arrival_order))

    def on_tokens_scheduled(self, request: Any, num_new_tokens: int) -> None:
        self.plan.check("policy_tokens", [request.request_id])

    def on_request_finished(self, request: Any) -> None:
        self.plan.check("policy_finish", [request.request_id])


class RaisingProcessor:
    """A logits processor that raises for the armed request's rows (identity otherwise)."""

    argmax_invariant = False  # runs before the greedy argmax, so greedy rows see it too

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan

    def apply(self, logits: Any, metadata: Any) -> Any:
        rids = [rid_of(p) for p in metadata.params]
        # Requests added by generate() carry no rid: their scope is the step's batch.
        self.plan.check("sampler", [r for r in rids if r is not None],
                        call_ids=self.plan.batch_ids() if None in rids else None)
        return logits


def make_verifier(plan: FaultPlan) -> Any:
    """A user ``Verifier``: rejection sampling, raising when armed."""
    from servelab.samplers.verifiers import get_verifier

    inner = get_verifier("rejection")

    class FaultyVerifier:
        name = "faulty-rejection"

        def verify(self, draft_token_ids, num_draft_tokens, target_probs, draft_probs, *, greedy, generators):
            plan.check("verifier", call_ids=plan.batch_ids())
            return inner.verify(draft_token_ids, num_draft_tokens, target_probs, draft_probs, greedy=greedy,
                                generators=generators)

    return FaultyVerifier()


def make_drafter(plan: FaultPlan) -> Any:
    """A user ``Drafter``: n-gram proposals, raising when armed for a request of the batch."""
    from servelab.samplers.drafters import Drafter, NgramDrafter

    class FaultyDrafter(Drafter):
        def __init__(self) -> None:
            self.inner = NgramDrafter()

        def propose_with_probs(self, token_ids, k):
            return self.inner.propose_with_probs(token_ids, k)

        def propose_for_requests(self, requests):
            plan.check("drafter", [r.req_id for r in requests])
            return [self.inner.propose_with_probs(r.token_ids, r.k) for r in requests]

    return FaultyDrafter()


class FaultyTokenizer:
    """Delegates to a tokenizer; ``decode`` raises when the ``detokenize`` stage is armed.
    ``delivering`` names the request whose output is being delivered (set by
    :func:`instrument`): the one a raising ``decode`` fails."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner, self._plan = inner, plan
        self.delivering: list[str] = []

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        self._plan.check("detokenize", call_ids=self.delivering)
        return self._inner.decode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


def _wrap(obj: Any, method: str, plan: FaultPlan, stage: str, ids_of=None, after: bool = False,
          call_ids_of=None) -> None:
    """Replace ``obj.method`` (instance attribute) by a wrapper checking ``stage``."""
    real = getattr(obj, method)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ids = ids_of(*args, **kwargs) if ids_of else ()
        call_ids = call_ids_of() if call_ids_of else None
        plan.check(stage, ids, "before", call_ids)
        result = real(*args, **kwargs)
        if after:
            plan.check(stage, ids, "after", call_ids)
        return result

    setattr(obj, method, wrapper)


def in_flight_ids(pipe: Any) -> list[str]:
    """The requests of the step being executed (the batch of a forward or a verifier call)."""
    out = getattr(pipe.scheduler, "in_flight_output", None)
    return list(out.num_scheduled_tokens) if out is not None else []


def _track_delivery(pipe: Any) -> None:
    """Wrap ``pipe._apply`` so the tokenizer knows whose output is being delivered."""
    real, tokenizer = pipe._apply, pipe.tokenizer

    @functools.wraps(real)
    def apply(out: Any) -> Any:
        tokenizer.delivering[:] = [out.request_id]
        try:
            return real(out)
        finally:
            tokenizer.delivering.clear()

    pipe._apply = apply


def instrument(pipe: Any, plan: FaultPlan) -> None:
    """Install the engine-side seams (schedule, allocate, forward, stop) on ``pipe``."""
    _wrap(pipe.scheduler, "schedule", plan, "schedule", after=True)
    _wrap(pipe.kv_cache_manager, "allocate_slots", plan, "allocate",
          ids_of=lambda request, *a, **k: [request.request_id])
    plan.batch_ids = lambda: in_flight_ids(pipe)
    _wrap(pipe.model, "forward", plan, "forward", after=True, call_ids_of=plan.batch_ids)
    _wrap(pipe.scheduler, "finish_request", plan, "stop", ids_of=lambda rid, *a, **k: [rid])
    if isinstance(pipe.tokenizer, FaultyTokenizer):
        _track_delivery(pipe)


def uninstrument(pipe: Any) -> None:
    """Remove the instance-level wrappers (the model is shared between pipelines)."""
    for obj, method in ((pipe.scheduler, "schedule"), (pipe.kv_cache_manager, "allocate_slots"),
                        (pipe.model, "forward"), (pipe.scheduler, "finish_request"), (pipe, "_apply")):
        obj.__dict__.pop(method, None)


def leak_report(pipe: Any) -> list[str]:
    """What is wrong with a pipeline that should be idle (empty list: nothing)."""
    problems = []
    manager = pipe.kv_cache_manager
    free, usable = manager.num_free_blocks, pipe.num_blocks - 1
    if free != usable:
        problems.append(f"leaked blocks: {usable - free} of {usable} not free")
    held = getattr(manager, "req_to_blocks", None)
    if held:
        problems.append(f"manager still holds blocks of {sorted(held)[:5]}")
    if pipe.scheduler.has_unfinished_requests():
        problems.append(f"zombie: scheduler has unfinished requests {sorted(pipe.scheduler.requests)[:5]}")
    if pipe.has_unfinished_requests():
        problems.append("zombie: pipeline.has_unfinished_requests() is True")
    if pipe.runner.requests:
        problems.append(f"runner still holds {sorted(pipe.runner.requests)[:5]}")
    return problems
