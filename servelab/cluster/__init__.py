"""Beyond one replica: routers, a cluster simulator, prefill/decode disaggregation, sweeps.

- :mod:`~servelab.cluster.router`: the ``Router`` seam (``choose(request,
  replicas) -> int`` over each replica's public ``ReplicaState``) and its
  registry (``register_router`` / ``get_router`` / ``available_routers``).
- :mod:`~servelab.cluster.routers`: ``round_robin``, ``least_loaded``,
  ``prefix_affinity`` (longest prefix in the replica's KV-event index),
  ``consistent_hash`` (prefix-hash ring).
- :mod:`~servelab.cluster.simulator`: ``simulate_cluster`` — N real
  schedulers and KV caches on one virtual clock, the router in front.
- :mod:`~servelab.cluster.pd`: ``PD`` (prefill/decode split, KV link) and
  ``kv_bytes_per_token``.
- :mod:`~servelab.cluster.sweep`: grids of cluster simulations, in local
  processes or on Ray (``servelab sweep SPEC.toml``).

Example::

    from servelab.cluster import simulate_cluster
    from servelab.scheduling.simulator import WorkloadSpec
    res = simulate_cluster(WorkloadSpec(num_requests=500, rate=20, num_prefix_groups=8, prefix_len=256),
                           replicas=4, router="prefix_affinity")
    print(res.summary()["prefix_hit_rate"], res.imbalance)
"""

from servelab.cluster.pd import PD, kv_bytes_per_token
from servelab.cluster.result import ClusterResult
from servelab.cluster.router import (
    ReplicaState,
    RouteRequest,
    Router,
    available_routers,
    get_router,
    register_router,
)
from servelab.cluster.routers import ConsistentHashRouter, LeastLoadedRouter, PrefixAffinityRouter, RoundRobinRouter
from servelab.cluster.simulator import simulate_cluster

__all__ = [
    "PD", "ClusterResult", "ConsistentHashRouter", "LeastLoadedRouter", "PrefixAffinityRouter", "ReplicaState",
    "RoundRobinRouter", "RouteRequest", "Router", "available_routers", "get_router", "kv_bytes_per_token",
    "register_router", "simulate_cluster",
]
