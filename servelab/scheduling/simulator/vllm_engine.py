"""The simulation loop over vLLM's real v1 scheduler (``simulate(..., engine="vllm")``).

Same trace, same step-cost model and cost call (``time_of`` of a per-run
:func:`.loop.step_timer`, on a :class:`StepView` of vLLM's own scheduler
output), same virtual clock, same metrics as the servelab engine (:mod:`.engine`); only the scheduler and its KV cache manager
are vLLM's, built on the CPU as vLLM's own scheduler tests build them
(:mod:`servelab.integrations.vllm.harness`). vLLM is imported lazily: without
it, :func:`simulate_vllm` raises ``ImportError`` saying how to install it.

Policies:

- a servelab policy (name or object: ``"fcfs"``, ``"priority"``, ``"sjf"``,
  ``"vtc"``...) runs *inside* vLLM's scheduler through
  :func:`servelab.integrations.vllm.make_scheduler_cls`;
- ``"vllm-fcfs"`` / ``"vllm-priority"`` are vLLM's own policies, unmodified.

Results are named ``vllm:<policy>`` (bridged) or ``vllm-fcfs`` / ``vllm-priority`` (native). Where vLLM's semantics differ from
servelab's scheduler (so the same policy can give different numbers): vLLM
admits a waiting request only when its whole prompt fits in free KV blocks
(``scheduler_reserve_full_isl``, vLLM's default, kept here), makes blocks
findable by prefix lookup at allocation rather than after the step, and
stops one position before ``max_model_len``. A request whose prompt is not
shorter than ``max_model_len`` is refused before it reaches vLLM (vLLM's
input processor refuses it too), and one that cannot fit in the KV cache
even alone — which vLLM would keep waiting forever — is ended as failed
(finish reason ``"error"``) when nothing else runs, as servelab does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.request import RequestMetrics
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.loop import FAKE_TOKEN, step_timer
from servelab.scheduling.simulator.metrics import SimulationResult
from servelab.scheduling.simulator.workload import TraceRequest, WorkloadSpec, generate_workload, validate_trace

NATIVE_POLICIES = {"vllm-fcfs": "fcfs", "vllm-priority": "priority"}
_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class StepView:
    """A vLLM ``SchedulerOutput`` as a cost model reads a servelab one (``num_scheduled_tokens``,
    ``total_num_scheduled_tokens``, ``total_num_kv_tokens``, ``iter_scheduled()``), so every cost
    model's ``time_of`` charges vLLM's steps as it charges servelab's. ``live``: the scheduler's
    requests, whose ``num_computed_tokens`` ``schedule()`` has already advanced past the step."""

    __slots__ = ("num_scheduled_tokens", "total_num_scheduled_tokens", "total_num_kv_tokens", "_computed")

    def __init__(self, out: Any, live: dict) -> None:
        scheduled = out.num_scheduled_tokens
        self.num_scheduled_tokens = scheduled
        self.total_num_scheduled_tokens = out.total_num_scheduled_tokens
        self._computed = {rid: live[rid].num_computed_tokens - n for rid, n in scheduled.items()}
        self.total_num_kv_tokens = sum(self._computed.values()) + out.total_num_scheduled_tokens

    def iter_scheduled(self) -> Iterator[tuple[str, int, int]]:
        computed = self._computed
        for rid, n in self.num_scheduled_tokens.items():
            yield rid, computed[rid], n


class _Track:
    """Timestamps of one request on the virtual clock (vLLM's own are wall time)."""

    __slots__ = ("trace", "first_scheduled", "first_token", "token_times", "cached", "finish", "reason",
                 "num_output", "error")

    def __init__(self, trace: TraceRequest) -> None:
        self.trace = trace
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.token_times: list[float] = []
        self.cached = 0
        self.finish: float | None = None
        self.reason: str | None = None
        self.num_output = 0
        self.error: str | None = None

    def metrics(self, num_preemptions: int) -> RequestMetrics:
        t = self.trace
        return RequestMetrics(t.request_id, t.client_id, t.priority, self.reason, len(t.prompt_token_ids),
                              self.num_output, self.cached, num_preemptions, 0, 0, t.arrival_time,
                              self.first_scheduled, self.first_token, self.finish, self.token_times)


def _scheduler_cls(policy):
    from servelab.integrations.vllm import make_scheduler_cls

    if isinstance(policy, str) and policy in NATIVE_POLICIES:
        return None, NATIVE_POLICIES[policy]
    return make_scheduler_cls(policy), "fcfs"


def simulate_vllm(
    workload: WorkloadSpec | Sequence[TraceRequest],
    policy="fcfs",
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
) -> SimulationResult:
    """:func:`servelab.scheduling.simulator.simulate` with vLLM's scheduler (same arguments)."""
    from servelab.integrations.vllm.harness import build_scheduler, make_request, model_output
    from vllm.v1.request import RequestStatus as VllmStatus

    requests = generate_workload(workload) if isinstance(workload, WorkloadSpec) else list(workload)
    validate_trace(requests)
    config = scheduler_config or SchedulerConfig()
    time_of = step_timer(cost_model or StepCostModel())
    cls, native = _scheduler_cls(policy)
    sched = build_scheduler(cls, num_blocks=num_blocks, block_size=block_size, max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=config.max_model_len, enable_prefix_caching=enable_prefix_caching,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            watermark=watermark, policy=native, reserve_full_prompt=True)
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    tracks = {r.request_id: _Track(r) for r in ordered}
    pending = [make_request(r.request_id, list(r.prompt_token_ids), r.max_tokens, arrival_time=r.arrival_time,
                            priority=r.priority, client_id=r.client_id, block_size=block_size) for r in ordered]
    by_id = {r.request_id: r for r in pending}
    now = ordered[0].arrival_time if ordered else 0.0
    live = sched.requests
    finished: list[RequestMetrics] = []
    kv_times: list[float] = []
    kv_usage: list[float] = []
    next_arrival, total, steps = 0, len(pending), 0
    max_len = config.max_model_len
    wall_start = time.perf_counter()
    while next_arrival < total or live:
        while next_arrival < total and ordered[next_arrival].arrival_time <= now:
            _admit(sched, pending[next_arrival], tracks, now, finished, max_len)
            next_arrival += 1
        if not live:
            if next_arrival >= total:
                break
            now = ordered[next_arrival].arrival_time
            continue
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        for new in out.scheduled_new_reqs:
            track = tracks[new.req_id]
            if track.first_scheduled is None:
                track.first_scheduled, track.cached = now, new.num_computed_tokens
        if ids:
            now += time_of(StepView(out, live))  # the one cost call, on what vLLM scheduled
        elif not sched.running:
            _fail_unfittable_head(sched, tracks, now, finished, f"{num_blocks} blocks of {block_size} tokens",
                                  VllmStatus.FINISHED_ERROR)
        _record_outputs(sched.update_from_output(out, model_output(sched, out, FAKE_TOKEN)), tracks, by_id,
                        now, finished)
        kv_times.append(now)
        kv_usage.append(sched.get_kv_cache_usage())
        steps += 1
        if max_steps is not None and steps >= max_steps and live:
            raise RuntimeError(f"simulation hit max_steps={max_steps} with {len(live)} requests unfinished")
    wall = time.perf_counter() - wall_start
    name = policy if isinstance(policy, str) else getattr(policy, "name", type(policy).__name__)
    num_preemptions = sum(m.num_preemptions for m in finished)
    label = name if name in NATIVE_POLICIES else f"vllm:{name}"
    return SimulationResult(label, finished, steps, num_preemptions, np.asarray(kv_times),
                            np.asarray(kv_usage), wall, ttft_slo_s, tpot_slo_s,
                            extra={"num_blocks": num_blocks, "block_size": block_size, "engine": "vllm",
                                   "rate": getattr(workload, "rate", math.nan)})


def _fail_unfittable_head(sched, tracks: dict, now: float, finished: list, pool: str, error_status) -> None:
    """Nothing runs and the head of the queue does not fit: it never will (vLLM would
    wait forever), so it fails, as servelab's scheduler fails it."""
    head = sched.waiting.peek_request() if sched.waiting else None
    if head is None:
        return
    track = tracks[head.request_id]
    track.error = f"request {head.request_id!r} cannot fit in the KV cache even alone ({pool})"
    sched.finish_requests(head.request_id, error_status)
    track.reason, track.finish = "error", now
    finished.append(track.metrics(head.num_preemptions))


def _record_outputs(engine_outputs: dict, tracks: dict, by_id: dict, now: float, finished: list) -> None:
    """Token times and finishes from one ``update_from_output`` of vLLM's scheduler."""
    for outputs in engine_outputs.values():
        for o in outputs.outputs:
            track = tracks[o.request_id]
            if o.new_token_ids:
                if track.first_token is None:
                    track.first_token = now
                track.token_times.extend([now] * len(o.new_token_ids))
                track.num_output += len(o.new_token_ids)
            if o.finish_reason is not None and track.reason is None:
                track.reason, track.finish = _REASONS.get(str(o.finish_reason), "error"), now
                finished.append(track.metrics(by_id[o.request_id].num_preemptions))


def _admit(sched, request, tracks: dict, now: float, finished: list, max_len: int) -> None:
    """Hand an arrival to vLLM's scheduler; a prompt vLLM cannot take fails (as servelab fails it)."""
    if request.num_prompt_tokens >= max_len:
        track = tracks[request.request_id]
        track.reason, track.finish = "error", now
        track.error = (f"request {request.request_id!r} has a {request.num_prompt_tokens}-token prompt; "
                       f"vLLM needs it shorter than max_model_len={max_len}")
        finished.append(track.metrics(0))
        return
    sched.add_request(request)
