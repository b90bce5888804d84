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
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from servelab._internal.frozen_heap import frozen_heap
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.request import RequestMetrics
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.loop import FAKE_TOKEN, Replica, SimLoop, VirtualClock, step_timer
from servelab.scheduling.simulator.metrics import SimulationResult
from servelab.scheduling.simulator.workload import TraceRequest, WorkloadSpec, arrival_stream

NATIVE_POLICIES = {"vllm-fcfs": "fcfs", "vllm-priority": "priority"}
_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class StepView:
    """A vLLM ``SchedulerOutput`` as a cost model reads a servelab one (``num_scheduled_tokens``,
    ``total_num_scheduled_tokens``, ``total_num_kv_tokens``, ``iter_scheduled()``), so every cost
    model's ``time_of`` charges vLLM's steps as it charges servelab's. ``live``: the scheduler's
    requests, whose ``num_computed_tokens`` ``schedule()`` has already advanced past the step."""

    __slots__ = ("num_scheduled_tokens", "total_num_scheduled_tokens", "total_num_kv_tokens", "_computed", "raw")

    def __init__(self, out: Any, live: dict, raw: Any = None) -> None:
        self.raw = raw  # vLLM's own output, for its update_from_output
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
    workload: WorkloadSpec | Iterable[TraceRequest],
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
    """:func:`servelab.scheduling.simulator.simulate` with vLLM's scheduler (same arguments), run by
    the one simulation loop (:class:`.loop.SimLoop`) through :class:`_VllmScheduler`."""
    from servelab.integrations.vllm.harness import build_scheduler, make_request, model_output
    from vllm.v1.request import RequestStatus as VllmStatus

    arrivals = arrival_stream(workload)
    config = scheduler_config or SchedulerConfig()
    time_of = step_timer(cost_model or StepCostModel())
    cls, native = _scheduler_cls(policy)
    vllm_sched = build_scheduler(cls, num_blocks=num_blocks, block_size=block_size, max_num_seqs=config.max_num_seqs,
                                 max_num_batched_tokens=config.max_num_batched_tokens,
                                 max_model_len=config.max_model_len, enable_prefix_caching=enable_prefix_caching,
                                 long_prefill_token_threshold=config.long_prefill_token_threshold,
                                 watermark=watermark, policy=native, reserve_full_prompt=True)
    clock = VirtualClock()
    sched = _VllmScheduler(vllm_sched, config, clock, lambda out: model_output(vllm_sched, out, FAKE_TOKEN),
                           VllmStatus.FINISHED_ERROR, f"{num_blocks} blocks of {block_size} tokens")

    def build(r: TraceRequest) -> Any:
        sched.tracks[r.request_id] = _Track(r)
        return make_request(r.request_id, list(r.prompt_token_ids), r.max_tokens, arrival_time=r.arrival_time,
                            priority=r.priority, client_id=r.client_id, block_size=block_size)

    rep = _VllmReplica(sched, time_of, build)
    loop = SimLoop([rep], clock, lambda trace: rep if loop.add(rep, trace) else None, max_steps=max_steps)
    wall_start = time.perf_counter()
    with frozen_heap():  # as simulate: the collector's full passes skip what was alive at the start
        loop.run(arrivals)
    wall = time.perf_counter() - wall_start
    name = policy if isinstance(policy, str) else getattr(policy, "name", type(policy).__name__)
    num_preemptions = sum(m.num_preemptions for m in rep.finished)
    label = name if name in NATIVE_POLICIES else f"vllm:{name}"
    return SimulationResult(label, rep.finished, rep.num_steps, num_preemptions, np.asarray(rep.kv_times),
                            np.asarray(rep.kv_usage), wall, ttft_slo_s, tpot_slo_s,
                            extra={"num_blocks": num_blocks, "block_size": block_size, "engine": "vllm",
                                   "rate": getattr(workload, "rate", math.nan)})


class _Ended:
    """A final output as the one loop reads it (``finished``, ``metrics``)."""

    __slots__ = ("metrics",)
    finished = True

    def __init__(self, metrics: RequestMetrics) -> None:
        self.metrics = metrics


class _Usage:
    """The KV usage the loop records after each step."""

    def __init__(self, sched: Any) -> None:
        self._sched = sched

    @property
    def usage(self) -> float:
        return float(self._sched.get_kv_cache_usage())


class _VllmScheduler:
    """vLLM's scheduler as the one loop drives a servelab ``Scheduler``: ``add_request``,
    ``schedule()`` (a :class:`StepView` of vLLM's output, timestamps on the virtual clock),
    ``update_from_output`` (vLLM's own fake model output; returns the requests that ended),
    ``requests``, ``waiting``, ``running``, ``num_finished``, ``config``."""

    def __init__(self, sched: Any, config: SchedulerConfig, clock: VirtualClock, model_output: Any,
                 error_status: Any, pool: str) -> None:
        self.sched, self.config, self.clock = sched, config, clock
        self._model_output, self._error_status, self._pool = model_output, error_status, pool
        self.tracks: dict[str, _Track] = {}
        self.by_id: dict[str, Any] = {}
        self.num_finished = 0
        self._ended: list[RequestMetrics] = []

    @property
    def requests(self) -> dict:
        return self.sched.requests

    @property
    def waiting(self) -> Any:
        return self.sched.waiting

    @property
    def running(self) -> list:
        return self.sched.running

    def add_request(self, request: Any) -> None:
        """A prompt vLLM cannot take raises ``ValueError`` (the loop counts it failed, as servelab's)."""
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise ValueError(f"request {request.request_id!r} has a {request.num_prompt_tokens}-token prompt; "
                             f"vLLM needs it shorter than max_model_len={max_len}")
        self.sched.add_request(request)
        self.by_id[request.request_id] = request

    def schedule(self) -> StepView:
        now = self.clock.now
        while True:
            out = self.sched.schedule()
            for new in out.scheduled_new_reqs:
                track = self.tracks.get(new.req_id)
                if track is not None and track.first_scheduled is None:
                    track.first_scheduled, track.cached = now, new.num_computed_tokens
            if out.num_scheduled_tokens or self.sched.running or not self._fail_unfittable_head(now):
                return StepView(out, self.sched.requests, raw=out)
            # The head failed: settle the empty step, then the next request may fit.
            self._record(self.sched.update_from_output(out, self._model_output(out)), now)

    def update_from_output(self, view: StepView, model_out: Any = None) -> list[_Ended]:
        """Apply ``view``'s step with vLLM's fake model output (``model_out``, the loop's, is not read)."""
        self._record(self.sched.update_from_output(view.raw, self._model_output(view.raw)), self.clock.now)
        ended, self._ended = self._ended, []
        self.num_finished += len(ended)
        return [_Ended(m) for m in ended]

    def _fail_unfittable_head(self, now: float) -> bool:
        """Nothing runs and the head of the queue does not fit: it never will (vLLM would wait
        forever), so it fails, as servelab's scheduler fails it. True if one failed."""
        head = self.sched.waiting.peek_request() if self.sched.waiting else None
        if head is None:
            return False
        track = self.tracks.pop(head.request_id)
        track.error = f"request {head.request_id!r} cannot fit in the KV cache even alone ({self._pool})"
        self.sched.finish_requests(head.request_id, self._error_status)
        track.reason, track.finish = "error", now
        self._ended.append(track.metrics(head.num_preemptions))
        self.by_id.pop(head.request_id, None)
        return True

    def _record(self, engine_outputs: dict, now: float) -> None:
        """Token times and finishes from one ``update_from_output`` of vLLM's scheduler."""
        tracks = self.tracks
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                track = tracks.get(o.request_id)
                if track is None:  # ended already (failed above)
                    continue
                if o.new_token_ids:
                    if track.first_token is None:
                        track.first_token = now
                    track.token_times.extend([now] * len(o.new_token_ids))
                    track.num_output += len(o.new_token_ids)
                if o.finish_reason is not None and track.reason is None:
                    track.reason, track.finish = _REASONS.get(str(o.finish_reason), "error"), now
                    request = self.by_id.pop(o.request_id)
                    del tracks[o.request_id]
                    self._ended.append(track.metrics(request.num_preemptions))


class _VllmReplica(Replica):
    """The one loop's replica around :class:`_VllmScheduler` (no backlog: vLLM's queue order is its own)."""

    def __init__(self, sched: _VllmScheduler, time_of: Any, build: Any) -> None:
        super().__init__(0, "both", sched, _Usage(sched.sched), time_of, build)  # type: ignore[arg-type]
        self.vllm = sched

    def failed(self, request: Any, error: str, now: float) -> RequestMetrics:
        track = self.vllm.tracks.pop(request.request_id)
        track.reason, track.finish, track.error = "error", now, error
        return track.metrics(0)
