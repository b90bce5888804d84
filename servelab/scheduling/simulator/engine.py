"""The simulation loop: a real ``Scheduler`` and ``KVCacheManager``, a fake model
and a virtual clock.

Each iteration admits the requests that have arrived by now, calls
``schedule()``, charges the step's cost-model time to the clock, answers with
one token for every request whose computation reached the end of its tokens
(nothing for a partial prefill), and calls ``update_from_output``. When
nothing is pending the clock jumps to the next arrival. Output lengths are
imposed through ``max_tokens`` (the fake token is never a stop token). A
request the scheduler refuses (a prompt over ``max_model_len``) counts as
failed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from servelab._internal.frozen_heap import frozen_heap
from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.samplers.params import SamplingParams
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.output import ModelRunnerOutput
from servelab.scheduling.policies import SchedulingPolicy, get_policy
from servelab.scheduling.request import Request, RequestStatus
from servelab.scheduling.scheduler import Scheduler
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.metrics import SimulationResult
from servelab.scheduling.simulator.workload import TraceRequest, WorkloadSpec, generate_workload, validate_trace

FAKE_TOKEN = 7
ENGINES = ("servelab", "vllm")


class VirtualClock:
    """The simulator's time; the scheduler reads it by calling it."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def simulate(
    workload: WorkloadSpec | Sequence[TraceRequest],
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
        workload: a spec (generated here, seeded) or a list of requests.
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

    The workload is validated first (:func:`.workload.validate_trace`):
    ``ValueError`` naming the request and field for a non-finite or negative
    arrival time, an empty prompt or ``max_tokens < 1``.
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
    requests = generate_workload(workload) if isinstance(workload, WorkloadSpec) else list(workload)
    validate_trace(requests)
    config = scheduler_config or SchedulerConfig()
    cost = cost_model or StepCostModel()
    policy_obj = get_policy(policy)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype="float16")
    kv = KVCacheManager(spec, num_blocks, enable_prefix_caching, max_model_len=config.max_model_len,
                        watermark=watermark, eviction_policy=eviction_policy)
    clock = VirtualClock(requests[0].arrival_time if requests else 0.0)
    sched = Scheduler(config, kv, policy_obj, clock=clock)

    pending = sorted(requests, key=lambda r: r.arrival_time)
    wall_start = time.perf_counter()
    # Everything alive now (modules, the pool's blocks) is left out of the collector's full passes:
    # they would otherwise rescan it every few hundred steps (a third of a long run's time).
    with frozen_heap():
        finished, steps, kv_times, kv_usage = _run(sched, kv, pending, clock, cost, max_steps)
    wall = time.perf_counter() - wall_start
    name = policy if isinstance(policy, str) else getattr(policy_obj, "name", type(policy_obj).__name__)
    return SimulationResult(name, finished, steps, sched.num_preemptions, np.asarray(kv_times),
                            np.asarray(kv_usage), wall, ttft_slo_s, tpot_slo_s,
                            extra={"num_blocks": num_blocks, "block_size": block_size,
                                   "rate": getattr(workload, "rate", math.nan)})


class _RequestFactory:
    """Builds the scheduler ``Request`` of a trace request when it arrives (a long real
    trace's prompts exist as lists only while live); ``SamplingParams`` are shared per
    ``max_tokens``."""

    def __init__(self) -> None:
        self._params: dict[int, SamplingParams] = {}

    def __call__(self, r: TraceRequest) -> Request:
        params = self._params.get(r.max_tokens)
        if params is None:
            params = self._params[r.max_tokens] = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        # xxhash: the simulator's cache is private to one run, collision resistance buys nothing there.
        return Request(r.request_id, r.prompt_token_ids, params, arrival_time=r.arrival_time,
                       priority=r.priority, client_id=r.client_id, hash_fn="xxhash")


def _run(sched: Scheduler, kv: KVCacheManager, pending: list[TraceRequest], clock: VirtualClock,
         cost: StepCostModel, max_steps: int | None) -> tuple[list, int, list[float], list[float]]:
    """The event loop: admit arrivals, step (one fake token per finished
    computation), advance the virtual clock by the cost model. Returns
    (finished request metrics, steps, KV-usage times, KV usage)."""
    live = sched.requests
    finished = []
    kv_times, kv_usage = [], []
    one = [FAKE_TOKEN]
    next_arrival, total = 0, len(pending)
    steps = 0
    build = _RequestFactory()
    time_of = getattr(cost, "time_of", None) or (
        lambda out: cost.step_time(out.total_num_scheduled_tokens, out.total_num_kv_tokens))
    while next_arrival < total or live:
        while next_arrival < total and pending[next_arrival].arrival_time <= clock.now:
            request = build(pending[next_arrival])
            next_arrival += 1
            try:
                sched.add_request(request)
            except ValueError as exc:  # e.g. a prompt over max_model_len: counted as failed
                request.status, request.error, request.finish_time = RequestStatus.FINISHED_FAILED, str(exc), clock.now
                finished.append(request.metrics())
        if not live:
            if next_arrival >= total:  # the last arrivals were all refused
                break
            clock.now = pending[next_arrival].arrival_time
            continue
        ended_before = sched.num_finished
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        if ids:
            clock.now += time_of(out)
        elif next_arrival < total:  # only failures this step; let time pass to the next arrival
            clock.now = max(clock.now, pending[next_arrival].arrival_time)
        # One token for everyone: the scheduler ignores tokens given to a request mid-prefill.
        outputs = sched.update_from_output(out, ModelRunnerOutput(ids, [one] * len(ids)))
        if sched.num_finished != ended_before:  # only then is there a final output to collect
            finished.extend([o.metrics for o in outputs if o.finished and o.metrics is not None])
        kv_times.append(clock.now)
        kv_usage.append(kv.usage)
        steps += 1
        if max_steps is not None and steps >= max_steps and live:
            raise RuntimeError(f"simulation hit max_steps={max_steps} with {len(live)} requests unfinished")
        if not ids and not out.finished_req_ids and live and next_arrival >= total and not sched.running:
            raise RuntimeError("scheduler made no progress with requests pending and none arriving")
    return finished, steps, kv_times, kv_usage


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
