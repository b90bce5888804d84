"""What a cluster simulation produced: the cluster's metrics, each replica's, and the load balance."""

from __future__ import annotations

from dataclasses import dataclass, field

from servelab.scheduling.simulator.metrics import SimulationResult

__all__ = ["ClusterResult"]


@dataclass
class ClusterResult:
    """Metrics of one :func:`~servelab.cluster.simulate_cluster` run.

    Attributes:
        router: the router's name.
        cluster: every request end to end (TTFT from its arrival at the
            cluster to its first token, wherever produced; with P/D the TPOT
            includes the KV transfer).
        replicas: one result per replica (the requests, or with P/D the
            request halves, that it served; its steps and KV usage).
        imbalance: mean over routing decisions of max / mean outstanding
            tokens across the replicas the router chose from (1.0 = perfect).
        routed: requests sent to each replica by the router.
        roles: ``"both"``, or ``"prefill"`` / ``"decode"`` with P/D.
        pd: the P/D option as a dict (empty when colocated), and what the
            decode side did: ``transfers``, ``kv_waits`` (transfers a decode
            replica's scheduler passed over at least once: no memory, behind
            its queue or out of budget), ``kv_wait_s_mean`` (hand-off to
            transfer start), ``transferred_tokens``, ``decode_cached_tokens`` (prompt
            tokens the decode halves were admitted with: transferred or local
            hits), ``decode_recomputed_tokens`` / ``decode_recomputed_requests``
            (tokens scheduled on a decode replica past one per output token:
            recompute after a preemption), ``released_loads``.
        decode_recomputed: per request, the tokens its decode half recomputed
            (only requests that recomputed some).

    ``cluster.latency(name)`` carries the failed count beside the figures
    (failed requests have no latency), and :meth:`summary` leads with it.
    """

    router: str
    cluster: SimulationResult
    replicas: list[SimulationResult]
    imbalance: float
    routed: list[int]
    roles: list[str]
    pd: dict = field(default_factory=dict)
    wall_s: float = 0.0
    decode_recomputed: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cluster.prefix_hit_rate

    def summary(self) -> dict[str, float | str]:
        """The failed count first, then the cluster's flat metrics plus router, replica count, imbalance and P/D fields."""
        row: dict[str, float | str] = {"failed": self.cluster.num_failed, "router": self.router,
                                       "replicas": len(self.replicas)}
        row.update(self.cluster.summary())
        row.pop("policy", None)
        row["policy"] = self.cluster.policy
        row["imbalance"] = self.imbalance
        row["wall_s"] = self.wall_s
        row["steps"] = sum(r.num_steps for r in self.replicas)
        for key, value in self.pd.items():
            row[f"pd_{key}"] = value
        return row

    def per_replica(self) -> list[dict[str, float | str]]:
        """One flat row per replica (its role and routed count included)."""
        rows = []
        for i, (res, role) in enumerate(zip(self.replicas, self.roles)):
            row = {"replica": i, "role": role, "routed": self.routed[i]}
            row.update(res.summary())
            rows.append(row)
        return rows
