"""``simulate_cluster``: N replicas, a router in front, one virtual clock.

Each replica is the real :class:`~servelab.scheduling.Scheduler` and
:class:`~servelab.blocks.KVCacheManager`, stepped by the one simulation loop
(:mod:`servelab.scheduling.simulator.loop`, the single-replica simulator's):
a step starts with ``schedule()``, lasts what the cost model says of its
``SchedulerOutput``, and ends with ``update_from_output``. Replicas step
independently; the loop orders arrivals, step ends and (with P/D) KV
transfers landing on the shared clock. One replica gives exactly
:func:`~servelab.scheduling.simulator.simulate`'s answers, for every cost model.

At its arrival a request is hashed (its full prompt blocks) and the router
chooses a replica from their :class:`~servelab.cluster.router.ReplicaState`;
the prefix-hit estimate comes from a :class:`~servelab.blocks.events.KVEventIndex`
per replica, fed only by the replica's KV-cache events (what a real router
would subscribe to). The request joins that replica's waiting queue and is
scheduled at the replica's next step.

With ``pd=PD(...)`` (:mod:`servelab.cluster.pd`) the router chooses among the
prefill replicas; after its first token the request goes to the least-loaded
decode replica, whose scheduler loads its KV through its own connector path
(``WAITING_FOR_REMOTE_KVS``, :class:`~servelab.cluster.pd.RemotePrefillConnector`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from servelab._internal.frozen_heap import frozen_heap
from servelab._internal.validation import check_int
from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.blocks.events import KVEventIndex
from servelab.blocks.specs import AttentionSpec
from servelab.cluster.pd import DEFAULT_KV_SPEC, DEFAULT_NUM_LAYERS, PD, RemotePrefillConnector, kv_bytes_per_token
from servelab.cluster.result import ClusterResult
from servelab.cluster.router import ReplicaState, RouteRequest, Router, get_router
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.policies import get_policy
from servelab.scheduling.request import RequestMetrics
from servelab.scheduling.scheduler import Scheduler
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.loop import Replica, RequestFactory, SimLoop, VirtualClock, step_timer
from servelab.scheduling.simulator.metrics import SimulationResult
from servelab.scheduling.simulator.workload import TraceRequest, WorkloadSpec, arrival_stream

__all__ = ["simulate_cluster"]


def simulate_cluster(
    trace: WorkloadSpec | Iterable[TraceRequest],
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
        trace: a :class:`WorkloadSpec` (generated here, seeded, as read), a list of
            requests or an iterable of them in arrival order (read lazily).
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
        A :class:`ClusterResult`: with P/D, its ``pd`` dict counts the decode
        side's cached (transferred or locally hit) and recomputed tokens.
    """
    num_replicas, roles = _replica_roles(replicas, pd)
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a registered policy name (each replica builds its own), "
                        f"got {type(policy).__name__}")
    if pd is not None and not enable_prefix_caching:
        raise ValueError("pd needs enable_prefix_caching=True: the decode replica's scheduler commits the "
                         "transferred KV to its prefix cache (its connector path)")
    router_obj = get_router(router, **(router_kwargs or {})) if isinstance(router, str) else get_router(router)
    arrivals = arrival_stream(trace)
    config = scheduler_config or SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192)
    cost = cost_model or StepCostModel()
    clock = VirtualClock()
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype="float16")
    bytes_per_token = 0 if pd is None else (pd.kv_bytes_per_token or kv_bytes_per_token(kv_spec, num_layers))
    cluster = _Cluster(router_obj, clock, pd, block_size, bytes_per_token, enable_prefix_caching)
    hash_size = block_size if enable_prefix_caching else None
    front_build = RequestFactory(prefill_only=pd is not None, block_size=hash_size)
    decode_build = RequestFactory(block_size=hash_size)
    for i, role in enumerate(roles):
        index = KVEventIndex() if enable_prefix_caching and role != "decode" else None
        kv = KVCacheManager(spec, num_blocks, enable_prefix_caching, max_model_len=config.max_model_len,
                            watermark=watermark, kv_event_subscribers=[index] if index is not None else None)
        connector = RemotePrefillConnector(cluster.transfer_starter(i)) if role == "decode" else None
        sched = Scheduler(config, kv, get_policy(policy), clock=clock, kv_connector=connector)
        time_of = step_timer(cost)  # one per replica: a stateful cost model's state is the replica's
        if role == "decode":
            time_of = cluster.counting(time_of)
        cluster.add_replica(Replica(i, role, sched, kv, time_of, decode_build if role == "decode" else front_build,
                                    kv_index=index))
    wall = time.perf_counter()
    with frozen_heap():  # as simulate: the collector's full passes skip what was alive at the start
        cluster.run(arrivals)
    wall = time.perf_counter() - wall
    return _result(cluster, router, router_obj, policy, pd, ttft_slo_s, tpot_slo_s, wall, num_blocks, block_size)


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


class _Cluster:
    """The router and P/D hand-offs over the one simulation loop."""

    def __init__(self, router: Router, clock: VirtualClock, pd: PD | None, block_size: int, bytes_per_token: int,
                 hashing: bool) -> None:
        self.router, self.clock, self.pd = router, clock, pd
        self.block_size, self.bytes_per_token, self.hashing = block_size, bytes_per_token, hashing
        self.reps: list[Replica] = []
        self.front: list[Replica] = []
        self.decoders: list[Replica] = []
        self.loop = SimLoop(self.reps, clock, self._route, self._finished)
        self.done: list[RequestMetrics] = []
        self.imbalance_sum, self.imbalance_n = 0.0, 0
        # P/D: requests between their halves.
        self.trace_of: dict[str, TraceRequest] = {}
        self.prefill_part: dict[str, RequestMetrics] = {}
        self.source_of: dict[str, Replica] = {}  # the prefill replica whose link carries the KV
        # When each decode half reached its decode replica, and that replica's step count then.
        self.handed_at: dict[str, tuple[float, int]] = {}
        self.decode_scheduled: dict[str, int] = {}  # tokens each decode half was scheduled on its replica
        self.num_kv_waits = 0  # transfers passed over by a decode replica's schedule() (memory, queue, budget)
        self.kv_wait_s = 0.0  # hand-off to transfer start, summed
        self.num_transfers = 0
        self.transferred_tokens = 0
        self.decode_cached_tokens = 0
        self.decode_recomputed_tokens = 0
        self.decode_recomputed_requests = 0
        self.decode_recomputed: dict[str, int] = {}

    def add_replica(self, rep: Replica) -> None:
        self.reps.append(rep)
        (self.decoders if rep.role == "decode" else self.front).append(rep)

    def run(self, arrivals: Iterable[TraceRequest]) -> None:
        self.loop.run(arrivals)

    # ---- arrivals ------------------------------------------------------------------

    def _route(self, trace: TraceRequest) -> Replica | None:
        front = self.front
        request = front[0].build(trace)  # hashed (the router reads its block hashes)
        route = RouteRequest(request.request_id, request.prompt_token_ids, request.block_hashes,
                             self.block_size, trace.max_tokens, request.client_id)
        states = [_state(r, route) for r in front]
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
        self.loop.add_request(rep, request)
        return rep

    # ---- ends -----------------------------------------------------------------------

    def _finished(self, rep: Replica, m: RequestMetrics) -> None:
        if rep.role == "prefill":
            self._prefilled(rep, m)
        elif rep.role == "decode":
            rid = m.request_id
            scheduled = self.decode_scheduled.pop(rid, 0)
            recomputed = max(scheduled - m.num_output_tokens, 0)  # every token past one per output
            self.decode_cached_tokens += m.num_cached_tokens
            self.decode_recomputed_tokens += recomputed
            if recomputed:
                self.decode_recomputed_requests += 1
                self.decode_recomputed[rid] = recomputed
            self.source_of.pop(rid, None)
            self.handed_at.pop(rid, None)  # a prompt found whole in the local cache moved nothing
            self.done.append(_join(self.prefill_part.pop(rid), m))
        else:
            self.done.append(m)

    # ---- P/D -------------------------------------------------------------------------

    def _prefilled(self, rep: Replica, m: RequestMetrics) -> None:
        """A prefill ended: its decode half goes to the least-loaded decode replica, whose
        scheduler loads the KV through its connector (or the request ends here)."""
        rid = m.request_id
        trace = self.trace_of.pop(rid)
        if m.finish_reason not in ("stop", "length") or trace.max_tokens <= 1:
            self.done.append(m)
            return
        self.prefill_part[rid] = m
        dest = min(self.decoders, key=lambda r: r.outstanding)
        tokens = m.num_prompt_tokens + trace.max_tokens - 1
        dest.outstanding += tokens
        dest.tokens_of[rid] = tokens
        self.source_of[rid] = rep
        self.handed_at[rid] = (self.clock.now, dest.num_steps)
        connector = dest.sched.kv_connector
        connector.expect(rid, m.num_prompt_tokens)
        if not self.loop.add_request(dest, dest.build.decode_half(trace)):
            connector.forget(rid)
            return
        if not dest.busy:  # it may be idle: let it schedule (at this same instant)
            self.loop.at(self.clock.now, _same, dest)

    def transfer_starter(self, index: int):
        """The callback decode replica ``index``'s connector calls when its scheduler has allocated
        blocks for ``num_tokens`` transferred tokens: the KV crosses the source's link (first come,
        first served) and lands at the decode replica."""

        def start(request_id: str, num_tokens: int) -> None:
            dest = self.reps[index]
            src = self.source_of[request_id]
            now = self.clock.now
            handed, steps_then = self.handed_at.pop(request_id, (now, dest.num_steps))
            # The first schedule() after the hand-off comes at most one step end later; a transfer
            # that starts after more was passed over (no memory, behind the queue, no budget).
            if dest.num_steps - steps_then > 1:
                self.num_kv_waits += 1
            self.kv_wait_s += now - handed
            begin = max(now, src.link_free)
            src.link_free = begin + self.pd.transfer_s(num_tokens, self.bytes_per_token)  # type: ignore[union-attr]
            self.transferred_tokens += num_tokens
            self.num_transfers += 1
            self.loop.at(src.link_free, _landed, (dest, request_id))

        return start

    def counting(self, time_of):
        """``time_of`` that also counts the tokens each request is scheduled (decode replicas: what
        they recompute is every scheduled token past one per output token)."""
        counts = self.decode_scheduled

        def timed(out) -> float:
            for rid, n in out.num_scheduled_tokens.items():
                counts[rid] = counts.get(rid, 0) + n
            return time_of(out)

        return timed


def _same(rep: Replica) -> Replica:
    return rep


def _landed(arg: tuple[Replica, str]) -> Replica:
    """A transfer landed: its decode replica hears it at its next step end (or now, if idle)."""
    dest, request_id = arg
    dest.landed.add(request_id)
    return dest


def _state(rep: Replica, request: RouteRequest) -> ReplicaState:
    sched = rep.sched
    return ReplicaState(rep.index, rep.num_waiting, len(sched.running), rep.outstanding, rep.kv.usage,
                        sched.running, rep.kv_index, request)


def _join(prefill: RequestMetrics, decode: RequestMetrics) -> RequestMetrics:
    """One request's metrics from its prefill and decode halves (cached tokens: the prefill's)."""
    return RequestMetrics(
        prefill.request_id, prefill.client_id, prefill.priority, decode.finish_reason, prefill.num_prompt_tokens,
        prefill.num_output_tokens + decode.num_output_tokens, prefill.num_cached_tokens,
        prefill.num_preemptions + decode.num_preemptions, 0, 0, prefill.arrival_time, prefill.first_scheduled_time,
        prefill.first_token_time, decode.finish_time, list(prefill.token_times) + list(decode.token_times))


def _result(cluster: _Cluster, router: str | Router, router_obj: Router, policy: str, pd: PD | None,
            ttft_slo_s: float, tpot_slo_s: float, wall: float, num_blocks: int, block_size: int) -> ClusterResult:
    name = router if isinstance(router, str) else getattr(router_obj, "name", type(router_obj).__name__)
    reps = cluster.reps
    per = [SimulationResult(f"{policy}@{r.index}", r.finished, r.num_steps, r.sched.num_preemptions,
                            np.asarray(r.kv_times), np.asarray(r.kv_usage), wall, ttft_slo_s, tpot_slo_s)
           for r in reps]
    kv_times = np.concatenate([p.kv_times for p in per]) if per else np.array([])
    kv_usage = np.concatenate([p.kv_usage for p in per]) if per else np.array([])
    whole = SimulationResult(policy, cluster.done, sum(p.num_steps for p in per),
                             sum(p.num_preemptions for p in per), kv_times, kv_usage, wall, ttft_slo_s,
                             tpot_slo_s, extra={"num_blocks": num_blocks, "block_size": block_size})
    imbalance = cluster.imbalance_sum / cluster.imbalance_n if cluster.imbalance_n else 1.0
    pd_fields: dict[str, Any] = {} if pd is None else {
        "prefill": pd.prefill_replicas, "decode": pd.decode_replicas, "bandwidth_gbps": pd.kv_bandwidth_gbps,
        "latency_s": pd.kv_latency_s, "bytes_per_token": cluster.bytes_per_token, "kv_waits": cluster.num_kv_waits,
        "kv_wait_s_mean": cluster.kv_wait_s / max(cluster.num_transfers, 1), "transfers": cluster.num_transfers,
        "transferred_tokens": cluster.transferred_tokens, "decode_cached_tokens": cluster.decode_cached_tokens,
        "decode_recomputed_tokens": cluster.decode_recomputed_tokens,
        "decode_recomputed_requests": cluster.decode_recomputed_requests,
        "released_loads": sum(r.sched.num_released_loads for r in cluster.decoders)}
    return ClusterResult(name, whole, per, imbalance, [r.routed for r in reps], [r.role for r in reps],
                         pd_fields, wall, cluster.decode_recomputed)
