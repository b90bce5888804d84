"""``simulate_cluster``: N replicas, a router in front, one virtual clock.

Each replica is the real :class:`~servelab.scheduling.Scheduler` and
:class:`~servelab.blocks.KVCacheManager`, stepped as in the single-replica
simulator (:mod:`servelab.scheduling.simulator.engine`): a step starts with
``schedule()``, lasts what the :class:`StepCostModel` says, and ends with
``update_from_output`` (one fake token for each request whose computation
reached its end). Replicas step independently; a discrete-event loop orders
arrivals, step ends and (with P/D) KV arrivals on the shared clock.

At its arrival a request is hashed (its full prompt blocks) and the router
chooses a replica from their :class:`~servelab.cluster.router.ReplicaState`;
the prefix-hit estimate comes from a :class:`~servelab.blocks.events.KVEventIndex`
per replica, fed only by the replica's KV-cache events (what a real router
would subscribe to). The request joins that replica's waiting queue and is
scheduled at the replica's next step.

With ``pd=PD(...)`` (:mod:`servelab.cluster.pd`) the router chooses among the
prefill replicas; after its first token the request's KV crosses the prefill
replica's link to the least-loaded decode replica, waits there for memory,
and decodes.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from servelab._internal.validation import check_int
from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.blocks.events import KVEventIndex
from servelab.blocks.specs import AttentionSpec
from servelab.cluster.pd import DEFAULT_KV_SPEC, DEFAULT_NUM_LAYERS, PD, kv_bytes_per_token
from servelab.cluster.result import ClusterResult
from servelab.cluster.router import ReplicaState, RouteRequest, Router, get_router
from servelab.samplers.params import SamplingParams
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.output import ModelRunnerOutput
from servelab.scheduling.policies import SchedulingPolicy, get_policy
from servelab.scheduling.request import Request, RequestMetrics, RequestStatus
from servelab.scheduling.scheduler import Scheduler
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.engine import FAKE_TOKEN, VirtualClock
from servelab.scheduling.simulator.metrics import SimulationResult
from servelab.scheduling.simulator.workload import TraceRequest, WorkloadSpec, generate_workload, validate_trace

__all__ = ["simulate_cluster"]

_STEP_END, _KV_ARRIVAL = 0, 1
_ONE = [FAKE_TOKEN]
_NOTHING: list[int] = []


class _Placeholder:
    """A transferred prompt as the decode replica's KV manager sees it while its blocks are written."""

    __slots__ = ("request_id", "num_tokens", "num_computed_tokens", "block_hashes")

    def __init__(self, request_id: str, num_tokens: int, block_hashes: Sequence[bytes]) -> None:
        self.request_id, self.num_tokens, self.num_computed_tokens = request_id, num_tokens, 0
        self.block_hashes = block_hashes


class _Replica:
    """One replica's scheduler, cache, event-fed index and bookkeeping."""

    def __init__(self, index: int, role: str, sched: Scheduler, kv: KVCacheManager, kv_index: KVEventIndex) -> None:
        self.index, self.role, self.sched, self.kv, self.kv_index = index, role, sched, kv, kv_index
        self.outstanding = 0
        self.tokens_of: dict[str, int] = {}
        self.busy = False
        self.in_flight = None
        self.finished: list[RequestMetrics] = []
        self.num_steps = 0
        self.kv_times: list[float] = []
        self.kv_usage: list[float] = []
        self.routed = 0
        self.remote_wait: list[Request] = []  # decode halves whose KV arrived, waiting for memory
        self.link_free = 0.0  # prefill replicas: when the outgoing KV link is idle again

    def state(self, request: RouteRequest) -> ReplicaState:
        sched = self.sched
        return ReplicaState(self.index, len(sched.waiting), len(sched.running), self.outstanding, self.kv.usage,
                            sched.running, self.kv_index, request)


def simulate_cluster(
    trace: WorkloadSpec | Sequence[TraceRequest],
    replicas: int | None = None,
    router: str | Router = "round_robin",
    *,
    pd: PD | None = None,
    policy: str = "fcfs",
    scheduler_config: SchedulerConfig | None = None,
    num_blocks: int = 4096,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    watermark: float = 0.01,
    cost_model: StepCostModel | None = None,
    ttft_slo_s: float = 1.0,
    tpot_slo_s: float = 0.1,
    kv_spec: AttentionSpec = DEFAULT_KV_SPEC,
    num_layers: int = DEFAULT_NUM_LAYERS,
    router_kwargs: dict[str, Any] | None = None,
) -> ClusterResult:
    """Serve ``trace`` with ``replicas`` replicas behind ``router``; return the metrics.

    Args:
        trace: a :class:`WorkloadSpec` (generated here, seeded) or requests.
        replicas: number of replicas (colocated); with ``pd`` it may be left
            None or must equal ``pd.prefill_replicas + pd.decode_replicas``.
        router: a registered name (``available_routers()``; built fresh, with
            ``router_kwargs``) or a :class:`Router` object.
        pd: prefill/decode disaggregation (:class:`PD`); None: colocated.
        policy: each replica's scheduling policy, by registered name.
        scheduler_config, num_blocks, block_size, enable_prefix_caching,
            watermark, cost_model, ttft_slo_s, tpot_slo_s: per replica, as
            in :func:`servelab.scheduling.simulator.simulate`.
        kv_spec, num_layers: the model's KV (bytes moved by P/D transfers).

    Returns:
        A :class:`ClusterResult`.
    """
    num_replicas, roles = _replica_roles(replicas, pd)
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a registered policy name (each replica builds its own), "
                        f"got {type(policy).__name__}")
    router_obj = get_router(router, **(router_kwargs or {})) if isinstance(router, str) else get_router(router)
    requests = generate_workload(trace) if isinstance(trace, WorkloadSpec) else list(trace)
    validate_trace(requests)
    config = scheduler_config or SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192)
    clock = VirtualClock(min((r.arrival_time for r in requests), default=0.0))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype="float16")
    reps = []
    for i, role in enumerate(roles):
        index = KVEventIndex()
        kv = KVCacheManager(spec, num_blocks, enable_prefix_caching, max_model_len=config.max_model_len,
                            watermark=watermark, kv_event_subscribers=[index] if enable_prefix_caching else None)
        reps.append(_Replica(i, role, Scheduler(config, kv, get_policy(policy), clock=clock), kv, index))
    loop = _Loop(reps, router_obj, clock, cost_model or StepCostModel(), pd, block_size,
                 kv_bytes_per_token(kv_spec, num_layers) if pd is not None and pd.kv_bytes_per_token is None
                 else (pd.kv_bytes_per_token if pd is not None else 0), enable_prefix_caching)
    wall = time.perf_counter()
    loop.run(sorted(requests, key=lambda r: r.arrival_time), _RequestFactory(pd is not None))
    wall = time.perf_counter() - wall
    return _result(loop, router, router_obj, policy, pd, ttft_slo_s, tpot_slo_s, wall, num_blocks, block_size)


def _replica_roles(replicas: int | None, pd: PD | None) -> tuple[int, list[str]]:
    if pd is not None:
        if not isinstance(pd, PD):
            raise TypeError(f"pd must be a servelab.cluster.PD, got {type(pd).__name__}")
        if replicas is not None and check_int("replicas", replicas, min_value=2) != pd.num_replicas:
            raise ValueError(f"replicas={replicas} differs from pd's {pd.prefill_replicas} prefill + "
                             f"{pd.decode_replicas} decode replicas; leave replicas=None with pd")
        return pd.num_replicas, ["prefill"] * pd.prefill_replicas + ["decode"] * pd.decode_replicas
    if replicas is None:
        raise ValueError("replicas is required (an int >= 1) unless pd= gives the split")
    check_int("replicas", replicas, min_value=1)
    return replicas, ["both"] * replicas


class _RequestFactory:
    """The scheduler ``Request`` of a trace request, built at its arrival (a real
    trace's prompts are lists only while live); with P/D, the prefill half (one
    output token). ``SamplingParams`` are shared per ``max_tokens``."""

    def __init__(self, prefill_only: bool) -> None:
        self.prefill_only = prefill_only
        self._params: dict[int, SamplingParams] = {}

    def __call__(self, r: TraceRequest) -> Request:
        n = 1 if self.prefill_only else r.max_tokens
        params = self._params.get(n)
        if params is None:
            params = self._params[n] = SamplingParams(max_tokens=n, ignore_eos=True)
        return Request(r.request_id, r.prompt_token_ids, params, arrival_time=r.arrival_time,
                       priority=r.priority, client_id=r.client_id)


class _Loop:
    """The discrete-event loop (arrivals, step ends, KV arrivals on one clock)."""

    def __init__(self, reps: list[_Replica], router: Router, clock: VirtualClock, cost: StepCostModel,
                 pd: PD | None, block_size: int, bytes_per_token: int, hashing: bool) -> None:
        self.reps, self.router, self.clock, self.cost, self.pd = reps, router, clock, cost, pd
        self.block_size, self.bytes_per_token, self.hashing = block_size, bytes_per_token, hashing
        self.front = [r for r in reps if r.role != "decode"]
        self.decoders = [r for r in reps if r.role == "decode"]
        self.heap: list[tuple] = []
        self.seq = itertools.count()
        self.done: list[RequestMetrics] = []
        self.trace_of: dict[str, TraceRequest] = {}
        self.imbalance_sum, self.imbalance_n = 0.0, 0
        self.prefill_part: dict[str, RequestMetrics] = {}
        self.num_kv_waits = 0  # transfers that found no memory on arrival

    # ---- the loop ----------------------------------------------------------------

    def run(self, pending: list[TraceRequest], build: _RequestFactory) -> None:
        heap, clock = self.heap, self.clock
        i, n = 0, len(pending)
        while i < n or heap:
            t_arrival = pending[i].arrival_time if i < n else math.inf
            kick: set[_Replica] = set()
            if heap and heap[0][0] < t_arrival:
                t, _, kind, obj = heapq.heappop(heap)
                clock.now = t
                if kind == _STEP_END:
                    self._end_step(obj)
                    kick.add(obj)
                else:
                    kick.add(self._kv_arrived(*obj))
            else:
                clock.now = t_arrival
                while i < n and pending[i].arrival_time <= t_arrival:
                    kick.add(self._route(build(pending[i]), pending[i]))
                    i += 1
            for rep in kick:
                if not rep.busy:
                    self._start_step(rep)
        stuck = [r.index for r in self.reps if r.sched.requests or r.remote_wait]
        if stuck:
            raise RuntimeError(f"replicas {stuck} still hold requests that can never be scheduled "
                               "(a prompt larger than the KV cache?)")

    def _route(self, request: Request, trace: TraceRequest) -> _Replica:
        if self.hashing:
            request.init_block_hasher(self.block_size)
        route = RouteRequest(request.request_id, request.prompt_token_ids, request.block_hashes,
                             self.block_size, trace.max_tokens, request.client_id)
        front = self.front
        states = [r.state(route) for r in front]
        choice = self.router.choose(route, states)
        if type(choice) is not int or not 0 <= choice < len(front):
            raise ValueError(f"router {self.router!r} returned {choice!r} for request {request.request_id!r}; "
                             f"valid: an int in range({len(front)})")
        loads = [s.outstanding_tokens for s in states]
        mean = sum(loads) / len(loads)
        if mean > 0:
            self.imbalance_sum += max(loads) / mean
            self.imbalance_n += 1
        rep = front[choice]
        rep.routed += 1
        if self.pd is not None:
            self.trace_of[request.request_id] = trace
        tokens = request.num_prompt_tokens + trace.max_tokens
        rep.outstanding += tokens
        rep.tokens_of[request.request_id] = tokens
        self._add(rep, request)
        return rep

    def _add(self, rep: _Replica, request: Request) -> bool:
        try:
            rep.sched.add_request(request)
        except ValueError as exc:  # e.g. a prompt over max_model_len: counted as failed
            self._fail(rep, request, str(exc))
            return False
        return True

    def _fail(self, rep: _Replica, request: Request, error: str) -> None:
        request.status, request.error = RequestStatus.FINISHED_FAILED, error
        request.finish_time = self.clock.now
        self._finished(rep, request.metrics())

    # ---- steps ---------------------------------------------------------------------

    def _start_step(self, rep: _Replica) -> None:
        sched = rep.sched
        if not sched.requests:
            return
        out = sched.schedule()
        if out.num_scheduled_tokens:
            rep.busy, rep.in_flight = True, out
            end = self.clock.now + self.cost.step_time(out.total_num_scheduled_tokens, out.total_num_kv_tokens)
            heapq.heappush(self.heap, (end, next(self.seq), _STEP_END, rep))
        else:  # only failures this step: report them; the replica waits for new work
            self._apply(rep, out, ModelRunnerOutput([], []))

    def _end_step(self, rep: _Replica) -> None:
        out, rep.in_flight, rep.busy = rep.in_flight, None, False
        live = rep.sched.requests
        ids = list(out.num_scheduled_tokens)
        sampled = [_ONE if live[r].num_computed_tokens >= live[r].num_tokens else _NOTHING for r in ids]
        self._apply(rep, out, ModelRunnerOutput(ids, sampled))
        if rep.remote_wait:
            self._admit_waiting(rep)

    def _apply(self, rep: _Replica, out, model_out: ModelRunnerOutput) -> None:
        for o in rep.sched.update_from_output(out, model_out):
            if o.finished:
                self._finished(rep, o.metrics)
        rep.num_steps += 1
        rep.kv_times.append(self.clock.now)
        rep.kv_usage.append(rep.kv.usage)

    def _finished(self, rep: _Replica, m: RequestMetrics) -> None:
        rep.finished.append(m)
        rep.outstanding -= rep.tokens_of.pop(m.request_id, 0)
        if rep.role == "prefill":
            self._prefilled(rep, m)
        elif rep.role == "decode":
            self.done.append(_join(self.prefill_part.pop(m.request_id), m))
        else:
            self.done.append(m)

    # ---- P/D -------------------------------------------------------------------------

    def _prefilled(self, rep: _Replica, m: RequestMetrics) -> None:
        """A prefill ended: send its KV to the least-loaded decode replica (or finish)."""
        trace = self.trace_of.pop(m.request_id)
        if m.finish_reason not in ("stop", "length") or trace.max_tokens <= 1:
            self.done.append(m)
            return
        self.prefill_part[m.request_id] = m
        dest = min(self.decoders, key=lambda r: r.outstanding)
        tokens = m.num_prompt_tokens + trace.max_tokens - 1
        dest.outstanding += tokens
        dest.tokens_of[m.request_id] = tokens
        start = max(self.clock.now, rep.link_free)
        rep.link_free = start + self.pd.transfer_s(m.num_prompt_tokens, self.bytes_per_token)
        decode = Request(m.request_id, list(trace.prompt_token_ids) + [FAKE_TOKEN],
                         SamplingParams(max_tokens=trace.max_tokens - 1, ignore_eos=True),
                         arrival_time=rep.link_free, priority=trace.priority, client_id=trace.client_id)
        heapq.heappush(self.heap, (rep.link_free, next(self.seq), _KV_ARRIVAL, (dest, decode)))

    def _kv_arrived(self, dest: _Replica, decode: Request) -> _Replica:
        dest.remote_wait.append(decode)
        self._admit_waiting(dest)
        if dest.remote_wait and dest.remote_wait[-1] is decode:
            self.num_kv_waits += 1
        return dest

    def _admit_waiting(self, rep: _Replica) -> None:
        """Give memory to transferred KV, first come first served (WAITING_FOR_REMOTE_KVS)."""
        kv = rep.kv
        while rep.remote_wait:
            decode = rep.remote_wait[0]
            if self.hashing:
                decode.init_block_hasher(self.block_size)
            n = decode.num_prompt_tokens - 1  # the prompt's KV; the first output token is computed here
            hold = _Placeholder("kv-transfer/" + decode.request_id, n, decode.block_hashes)
            blocks, hit = kv.get_computed_blocks(hold)
            if kv.allocate_slots(hold, n - hit, hit, blocks) is None:
                if not kv.req_to_blocks:  # nothing will ever free memory: it cannot fit
                    rep.remote_wait.pop(0)
                    self._fail(rep, decode, "the transferred KV does not fit the decode replica's cache")
                    continue
                return
            rep.remote_wait.pop(0)
            kv.cache_blocks(hold, n)  # the KV is written: the blocks join the prefix cache ...
            kv.free(hold)  # ... and are released to it, most recently used: the request's admission hits them
            self._add(rep, decode)


def _join(prefill: RequestMetrics, decode: RequestMetrics) -> RequestMetrics:
    """One request's metrics from its prefill and decode halves."""
    return RequestMetrics(
        prefill.request_id, prefill.client_id, prefill.priority, decode.finish_reason, prefill.num_prompt_tokens,
        prefill.num_output_tokens + decode.num_output_tokens, prefill.num_cached_tokens,
        prefill.num_preemptions + decode.num_preemptions, 0, 0, prefill.arrival_time, prefill.first_scheduled_time,
        prefill.first_token_time, decode.finish_time, list(prefill.token_times) + list(decode.token_times))


def _result(loop: _Loop, router: str | Router, router_obj: Router, policy: str, pd: PD | None, ttft_slo_s: float,
            tpot_slo_s: float, wall: float, num_blocks: int, block_size: int) -> ClusterResult:
    name = router if isinstance(router, str) else getattr(router_obj, "name", type(router_obj).__name__)
    per = [SimulationResult(f"{policy}@{r.index}", r.finished, r.num_steps, r.sched.num_preemptions,
                            np.asarray(r.kv_times), np.asarray(r.kv_usage), wall, ttft_slo_s, tpot_slo_s)
           for r in loop.reps]
    kv_times = np.concatenate([p.kv_times for p in per]) if per else np.array([])
    kv_usage = np.concatenate([p.kv_usage for p in per]) if per else np.array([])
    cluster = SimulationResult(policy, loop.done, sum(p.num_steps for p in per),
                               sum(p.num_preemptions for p in per), kv_times, kv_usage, wall, ttft_slo_s,
                               tpot_slo_s, extra={"num_blocks": num_blocks, "block_size": block_size})
    imbalance = loop.imbalance_sum / loop.imbalance_n if loop.imbalance_n else 1.0
    pd_fields = {} if pd is None else {
        "prefill": pd.prefill_replicas, "decode": pd.decode_replicas, "bandwidth_gbps": pd.kv_bandwidth_gbps,
        "latency_s": pd.kv_latency_s, "bytes_per_token": loop.bytes_per_token, "kv_waits": loop.num_kv_waits}
    return ClusterResult(name, cluster, per, imbalance, [r.routed for r in loop.reps], [r.role for r in loop.reps],
                         pd_fields, wall)
