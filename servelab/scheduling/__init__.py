"""Scheduling: which requests advance by how many tokens each step.

- :mod:`~servelab.scheduling.request`: ``Request`` and its life cycle
  (``RequestStatus``), ``RequestMetrics`` (TTFT, ITL, TPOT, e2e).
- :mod:`~servelab.scheduling.config`: ``SchedulerConfig``.
- :mod:`~servelab.scheduling.scheduler`: ``Scheduler`` — one loop, no
  prefill/decode phases: ``num_computed_tokens`` catches up with
  ``num_tokens_with_spec`` under a token budget and a request cap; running
  requests first, then waiting ones; chunked prefill; prefix-cache hits on
  admission; preemption of a policy-chosen victim.
- :mod:`~servelab.scheduling.policies`: FCFS, priority, shortest-prompt-first,
  fair share (VTC), and the interface a new policy implements.
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
    SchedulingPolicy,
    ShortestPromptFirstPolicy,
    WaitingQueue,
    get_policy,
    policy_names,
    register_policy,
)
from servelab.scheduling.request import Request, RequestMetrics, RequestStatus
from servelab.scheduling.scheduler import Scheduler
from servelab.scheduling.simulator import StepCostModel, WorkloadSpec, compare_policies, simulate

__all__ = [
    "CachedRequestData", "FCFSPolicy", "FairSharePolicy", "ModelRunnerOutput", "NewRequestData",
    "PriorityPolicy", "Request", "RequestMetrics", "RequestOutput", "RequestStatus", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "SchedulerStats", "SchedulingPolicy", "ShortestPromptFirstPolicy",
    "StepCostModel", "WaitingQueue", "WorkloadSpec", "compare_policies", "get_policy", "policy_names",
    "register_policy", "simulate",
]
