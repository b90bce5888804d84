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


class InjectedError(RuntimeError):
    """The exception an ``"error"`` fault raises."""


@dataclass
class Fault:
    stage: str
    kind: str  # "error" | "interrupt"
    target: str | None = None  # request id, or None: the next call
    when: str = "before"  # schedule/forward: "before" or "after" the real call

    def exception(self) -> BaseException:
        if self.kind == "interrupt":
            return KeyboardInterrupt(f"{INJECTED} interrupt at {self.stage}")
        return InjectedError(f"{INJECTED} error at {self.stage} (target {self.target})")


@dataclass
class FaultPlan:
    """Armed faults (one per stage) and a log of those that fired."""

    armed: dict[str, Fault] = field(default_factory=dict)
    fired: list[Fault] = field(default_factory=list)

    def arm(self, fault: Fault) -> None:
        if fault.stage not in STAGES:
            raise ValueError(f"unknown stage {fault.stage!r}; valid: {STAGES}")
        self.armed[fault.stage] = fault

    def disarm(self) -> None:
        self.armed.clear()

    def check(self, stage: str, request_ids: Iterable[str] = (), when: str = "before") -> None:
        """Raise the fault armed at ``stage`` (once) if it applies to this call."""
        fault = self.armed.get(stage)
        if fault is None or fault.when != when:
            return
        if fault.target is not None and fault.target not in set(request_ids):
            return
        del self.armed[stage]
        self.fired.append(fault)
        raise fault.exception()


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
        self.plan.check("sampler", [rid_of(p) for p in metadata.params])
        return logits


def make_verifier(plan: FaultPlan) -> Any:
    """A user ``Verifier``: rejection sampling, raising when armed."""
    from servelab.samplers.verifiers import get_verifier

    inner = get_verifier("rejection")

    class FaultyVerifier:
        name = "faulty-rejection"

        def verify(self, draft_token_ids, num_draft_tokens, target_probs, draft_probs, *, greedy, generators):
            plan.check("verifier")
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
    """Delegates to a tokenizer; ``decode`` raises when the ``detokenize`` stage is armed."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self._inner, self._plan = inner, plan

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        self._plan.check("detokenize")
        return self._inner.decode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)


def _wrap(obj: Any, method: str, plan: FaultPlan, stage: str, ids_of=None, after: bool = False) -> None:
    """Replace ``obj.method`` (instance attribute) by a wrapper checking ``stage``."""
    real = getattr(obj, method)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ids = ids_of(*args, **kwargs) if ids_of else ()
        plan.check(stage, ids, "before")
        result = real(*args, **kwargs)
        if after:
            plan.check(stage, ids, "after")
        return result

    setattr(obj, method, wrapper)


def instrument(pipe: Any, plan: FaultPlan) -> None:
    """Install the engine-side seams (schedule, allocate, forward, stop) on ``pipe``."""
    _wrap(pipe.scheduler, "schedule", plan, "schedule", after=True)
    _wrap(pipe.kv_cache_manager, "allocate_slots", plan, "allocate",
          ids_of=lambda request, *a, **k: [request.request_id])
    _wrap(pipe.model, "forward", plan, "forward", after=True)
    _wrap(pipe.scheduler, "finish_request", plan, "stop", ids_of=lambda rid, *a, **k: [rid])


def uninstrument(pipe: Any) -> None:
    """Remove the instance-level wrappers (the model is shared between pipelines)."""
    for obj, method in ((pipe.scheduler, "schedule"), (pipe.kv_cache_manager, "allocate_slots"),
                        (pipe.model, "forward"), (pipe.scheduler, "finish_request")):
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
