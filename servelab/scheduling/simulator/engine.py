"""``simulate``: one replica — a real ``Scheduler`` and ``KVCacheManager``, a fake model and a
virtual clock — through the one simulation loop (:mod:`.loop`, shared with
:func:`servelab.cluster.simulate_cluster`).

Each step starts with ``schedule()``, lasts what the cost model says of the
step's ``SchedulerOutput`` (one call, :func:`.loop.step_timer`), and ends with
``update_from_output`` answering one token for every request whose
computation reached the end of its tokens (nothing for a partial prefill).
When nothing is pending the clock jumps to the next arrival. Output lengths
are imposed through ``max_tokens`` (the fake token is never a stop token). A
request the scheduler refuses (a prompt over ``max_model_len``) counts as
failed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence

import numpy as np

from servelab._internal.frozen_heap import frozen_heap
from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.policies import SchedulingPolicy, get_policy
from servelab.scheduling.scheduler import Scheduler
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.loop import (
    FAKE_TOKEN,
    Replica,
    RequestFactory,
    SimLoop,
    VirtualClock,
    is_arrival_ordered,
    step_timer,
)
from servelab.scheduling.simulator.metrics import SimulationResult
from servelab.scheduling.simulator.workload import TraceRequest, WorkloadSpec, arrival_stream, generate_workload

__all__ = ["ENGINES", "FAKE_TOKEN", "VirtualClock", "compare_policies", "simulate"]

ENGINES = ("servelab", "vllm")


def simulate(
    workload: WorkloadSpec | Iterable[TraceRequest],
    policy: str | SchedulingPolicy = "fcfs",
    *,
    scheduler_config: SchedulerConfig | None = None,
    num_blocks: int = 4096,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    watermark: float = 0.01,
    cost_model: StepCostModel | None = None,
    ttft_slo_s: float = 1.0,
    tpot_slo_s: float = 0.1,
    max_steps: int | None = None,
    engine: str = "servelab",
    eviction_policy: str | object = "lru",
) -> SimulationResult:
    """Run ``workload`` through a scheduler with ``policy``; return its metrics.

    Args:
        workload: a spec (generated here, seeded, as it is read), a list of requests, or an
            iterable of them in arrival order (read lazily: a trace too big to hold).
        policy: a policy object or a registered name.
        scheduler_config: limits; default ``SchedulerConfig()`` (servelab's one set of
            scheduling defaults).
        num_blocks, block_size, enable_prefix_caching, watermark: the KV
            cache (one full-attention group).
        cost_model: seconds per step: anything with ``time_of(scheduler_output)`` (a
            :class:`StepCostModel`, fitted by :func:`.calibrate`, or a roofline from
            ``StepCostModel.for_hardware``) or ``step_time(num_tokens, num_kv_tokens)``;
            default :class:`StepCostModel`.
        ttft_slo_s, tpot_slo_s: SLOs for goodput.
        max_steps: stop after this many steps (raises if requests remain).
        eviction_policy: the KV block pool's eviction policy (a registered name
            or a new policy object; see ``servelab.blocks.available_eviction_policies``).
        engine: ``"servelab"`` (servelab's ``Scheduler`` and ``KVCacheManager``)
            or ``"vllm"`` (vLLM's real v1 scheduler, with ``policy`` bridged
            into it, or vLLM's own ``"vllm-fcfs"`` / ``"vllm-priority"``; see
            :mod:`.vllm_engine`). Same trace, cost model and metrics.

    The workload is validated (:func:`.workload.arrival_stream`: a list first,
    a stream as it is read): ``ValueError`` naming the request and field for a
    non-finite or negative arrival time, an empty prompt or ``max_tokens < 1``.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is invalid; valid: {', '.join(ENGINES)}")
    if engine == "vllm":
        if eviction_policy != "lru":
            raise ValueError(f"eviction_policy={eviction_policy!r} needs engine='servelab' (vLLM's pool is LRU)")
        from servelab.scheduling.simulator.vllm_engine import simulate_vllm

        return simulate_vllm(workload, policy, scheduler_config=scheduler_config, num_blocks=num_blocks,
                             block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                             watermark=watermark, cost_model=cost_model, ttft_slo_s=ttft_slo_s,
                             tpot_slo_s=tpot_slo_s, max_steps=max_steps)
    arrivals = arrival_stream(workload)
    config = scheduler_config or SchedulerConfig()
    time_of = step_timer(cost_model or StepCostModel())
    policy_obj = get_policy(policy)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype="float16")
    kv = KVCacheManager(spec, num_blocks, enable_prefix_caching, max_model_len=config.max_model_len,
                        watermark=watermark, eviction_policy=eviction_policy)
    clock = VirtualClock()
    sched = Scheduler(config, kv, policy_obj, clock=clock)
    name = policy if isinstance(policy, str) else getattr(policy_obj, "name", type(policy_obj).__name__)
    build = RequestFactory(block_size=block_size if enable_prefix_caching else None)
    rep = Replica(0, "both", sched, kv, time_of, build, backlog=is_arrival_ordered(sched.policy))
    loop = SimLoop([rep], clock, lambda trace: rep if loop.add(rep, trace) else None, max_steps=max_steps)
    wall_start = time.perf_counter()
    # Everything alive now (modules, the pool's blocks) is left out of the collector's full passes:
    # they would otherwise rescan it every few hundred steps (a third of a long run's time).
    with frozen_heap():
        loop.run(arrivals)
    wall = time.perf_counter() - wall_start
    return SimulationResult(name, rep.finished, rep.num_steps, sched.num_preemptions, np.asarray(rep.kv_times),
                            np.asarray(rep.kv_usage), wall, ttft_slo_s, tpot_slo_s,
                            extra={"num_blocks": num_blocks, "block_size": block_size,
                                   "rate": getattr(workload, "rate", math.nan)})


def compare_policies(
    workload: WorkloadSpec | Sequence[TraceRequest],
    policies: Sequence[str | SchedulingPolicy] = ("fcfs", "priority", "sjf", "vtc"),
    **kwargs,
) -> list[SimulationResult]:
    """:func:`simulate` each policy on the same requests (``engine=`` and the other
    options are passed through)."""
    if not policies:
        raise ValueError("policies is empty; give at least one policy name or object")
    requests = generate_workload(workload) if isinstance(workload, WorkloadSpec) else list(workload)
    results = []
    for p in policies:
        result = simulate(requests, p, **kwargs)
        result.extra["rate"] = getattr(workload, "rate", math.nan)
        results.append(result)
    return results
