"""Scheduling: which requests advance by how many tokens each step.

- :mod:`~servelab.scheduling.request`: ``Request`` and its life cycle
  (``RequestStatus``), ``RequestMetrics`` (TTFT, ITL, TPOT, e2e).
- :mod:`~servelab.scheduling.config`: ``SchedulerConfig``.
- :mod:`~servelab.scheduling.scheduler`: ``Scheduler`` — one loop, no
  prefill/decode phases: ``num_computed_tokens`` catches up with
  ``num_tokens_with_spec`` under a token budget and a request cap; running
  requests first, then waiting ones; chunked prefill; prefix-cache hits on
  admission; preemption of a policy-chosen victim.
- :mod:`~servelab.scheduling.transitions`: the scheduler's other half — a
  step's results applied (blocks committed to the prefix cache only after
  the step that computed them), ``rollback_step`` for a failed step,
  ``fail_requests``, and fault isolation (policy code that raises fails only
  its own request).
- :mod:`~servelab.scheduling.queues`: ``WaitingQueue``, the default
  policy-ordered waiting queue.
- :mod:`~servelab.scheduling.interfaces`: the seams as code —
  ``SchedulingPolicy`` (the ABC a policy implements; its docstring is the
  contract), ``RequestQueue`` (a policy's waiting queue) and
  ``SchedulerInterface`` (what an engine loop calls).
- :mod:`~servelab.scheduling.schedulers`: whole schedulers by name
  (``"servelab"``, ``"vllm"``): ``register_scheduler`` / ``get_scheduler`` /
  ``available_schedulers``; what ``Pipeline(scheduler=...)`` takes.
- :mod:`~servelab.scheduling.policies`: FCFS, priority, shortest-prompt-first,
  fair share (VTC); ``register_policy`` / ``get_policy`` /
  ``available_policies``.
- :mod:`~servelab.scheduling.output`: ``SchedulerOutput`` (what a model runner
  needs), ``ModelRunnerOutput`` (what it answers), ``RequestOutput``.
- :mod:`~servelab.scheduling.simulator`: a real scheduler and KV cache driven
  over a synthetic or traced workload with a step-cost model on a virtual
  clock; metrics, tables and figures.

A fake model is three lines (one token per request whose computation reached
the end of its tokens, nothing for a partial prefill)::

    out = scheduler.schedule()
    ids, reqs = list(out.num_scheduled_tokens), scheduler.requests
    scheduler.update_from_output(out, ModelRunnerOutput(
        ids, [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]))
"""

from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.interfaces import RequestQueue, SchedulerInterface, SchedulingPolicy
from servelab.scheduling.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
)
from servelab.scheduling.policies import (
    FairSharePolicy,
    FCFSPolicy,
    PriorityPolicy,
    ShortestPromptFirstPolicy,
    WaitingQueue,
    available_policies,
    get_policy,
    policy_names,
    register_policy,
)
from servelab.scheduling.request import Request, RequestMetrics, RequestStatus
from servelab.scheduling.scheduler import Scheduler
from servelab.scheduling.schedulers import available_schedulers, get_scheduler, register_scheduler
from servelab.scheduling.simulator import StepCostModel, WorkloadSpec, compare_policies, simulate

__all__ = [
    "CachedRequestData", "FCFSPolicy", "FairSharePolicy", "ModelRunnerOutput", "NewRequestData",
    "PriorityPolicy", "Request", "RequestMetrics", "RequestOutput", "RequestQueue", "RequestStatus", "Scheduler",
    "SchedulerConfig", "SchedulerInterface", "SchedulerOutput", "SchedulerStats", "SchedulingPolicy",
    "ShortestPromptFirstPolicy", "StepCostModel", "WaitingQueue", "WorkloadSpec", "available_policies",
    "available_schedulers", "compare_policies", "get_policy", "get_scheduler", "policy_names", "register_policy",
    "register_scheduler", "simulate",
]
