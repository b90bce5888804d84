"""Expert-placement policies: ``rebalance_experts`` and a registry of them.

A policy is a callable::

    phy2log, log2phy, logcnt = policy(weight [L, E], num_replicas, num_groups, num_nodes, num_ranks)

``weight`` float ``[layers, logical experts]`` is the recorded load; the
result places ``num_replicas`` physical expert slots (``num_replicas /
num_ranks`` per rank, rank-major): ``phy2log`` int64 ``[L, num_replicas]``
(the logical expert of each slot), ``log2phy`` int64 ``[L, E, num_replicas - E
+ 1]`` (each expert's slots, ``-1`` padded), ``logcnt`` int64 ``[L, E]``
(replicas per expert, each ``>= 1``). Registered (:func:`register_eplb_policy`,
:func:`get_eplb_policy`, :func:`available_eplb_policies`): ``"default"``
(:func:`rebalance_experts`) and ``"reference"`` (``servelab.reference.eplb``).

The default policy, per layer:

1. Hierarchical when ``num_groups % num_nodes == 0``: expert groups packed
   onto nodes (heaviest first into the lightest node with room), experts
   renumbered node-major; else one group, one node.
2. Replication inside a node: every expert one slot, each further slot to the
   expert with the largest load per replica (a heap; optimal for the largest
   per-replica load).
3. Packing inside a node: the replicas (load / count each) onto the node's
   ranks, heaviest first into the lightest rank with room (what the reference
   and vLLM's default policy do), then **improved by swaps**: while some swap
   of a replica on the heaviest rank with a lighter replica elsewhere lowers
   the heaviest rank's load without lifting the other above it, the best such
   swap is made. The in-order packing (slot ``i`` to rank ``i // per_rank``:
   the identity placement when there is no redundancy) is also improved the
   same way, and the lighter of the two kept. So the heaviest rank is never
   heavier than the reference's (same steps 1-2, step 3 only lowers it) nor,
   with one node and no redundant slot, than the identity placement's.

Loads are compared in float32 with ties to the lower index, as the reference.
Why not an exact solver: the placement runs on the host between steps; the
greedy plus swaps is within a few percent of the mean on recorded loads (the
study, ``bench/eplb.py``), in well under a millisecond per layer.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np
import torch

from servelab._internal.registry import Registry

__all__ = ["EplbPolicy", "available_eplb_policies", "check_policy_args", "get_eplb_policy", "rebalance_experts",
           "register_eplb_policy"]

EplbPolicy = Callable[[torch.Tensor, int, int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
_MAX_SWAPS = 64  # per packing; each lowers the heaviest rank (a bound, rarely reached)


def check_policy_args(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_ranks: int) -> None:
    """``ValueError`` naming the first argument that does not fit: ``weight`` must be
    ``[L, E]`` finite and non-negative; ``num_replicas >= E`` and divisible by ``num_ranks``;
    ``num_groups`` divides ``E``; ``num_nodes`` divides ``num_ranks``."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] == 0:
        raise ValueError(f"weight must be a tensor [layers, logical experts], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
        raise ValueError("weight must hold finite, non-negative loads")
    experts = weight.shape[1]
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_ranks", num_ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if num_replicas < experts:
        raise ValueError(f"num_replicas={num_replicas} is smaller than the {experts} logical experts: "
                         "every expert needs at least one replica")
    if num_replicas % num_ranks:
        raise ValueError(f"num_replicas={num_replicas} must be divisible by num_ranks={num_ranks}")
    if experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the {experts} logical experts")
    if num_ranks % num_nodes:
        raise ValueError(f"num_nodes={num_nodes} must divide num_ranks={num_ranks}")
    if num_groups % num_nodes == 0 and num_replicas % num_nodes:
        raise ValueError(f"num_replicas={num_replicas} must be divisible by num_nodes={num_nodes}")


def _lpt(loads: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Heaviest first (stable) into the lightest pack with room (ties: lower pack) -> (pack of each
    item, its position in the pack's packing order)."""
    per_pack = loads.size // num_packs
    pack = np.empty(loads.size, dtype=np.int64)
    position = np.empty(loads.size, dtype=np.int64)
    heap = [(np.float32(0.0), p) for p in range(num_packs)]
    count = [0] * num_packs
    for item in np.argsort(-loads, kind="stable").tolist():
        load, p = heapq.heappop(heap)
        pack[item], position[item] = p, count[p]
        count[p] += 1
        if count[p] < per_pack:
            heapq.heappush(heap, (np.float32(load + loads[item]), p))
    return pack, position


def _improve(loads: np.ndarray, pack: np.ndarray, num_packs: int) -> np.ndarray:
    """Best swaps that lower the heaviest pack (see the module docstring); returns a new assignment."""
    pack = pack.copy()
    totals = np.zeros(num_packs, dtype=np.float64)
    np.add.at(totals, pack, loads.astype(np.float64))
    for _ in range(_MAX_SWAPS):
        heavy = int(np.argmax(totals))
        mine = np.flatnonzero(pack == heavy)
        others = np.flatnonzero(pack != heavy)
        if mine.size == 0 or others.size == 0:
            break
        delta = loads[mine, None].astype(np.float64) - loads[None, others]  # moved off the heavy pack
        worst = np.maximum(totals[heavy] - delta, totals[pack[others]][None, :] + delta)
        worst[delta <= 0] = np.inf
        best = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if not worst[best] < totals[heavy] * (1 - 1e-9):
            break
        a, b = int(mine[best[0]]), int(others[best[1]])
        d = float(delta[best])
        totals[heavy] -= d
        totals[pack[b]] += d
        pack[a], pack[b] = pack[b], heavy
    return pack


def _pack(loads: np.ndarray, num_packs: int, natural: np.ndarray) -> np.ndarray:
    """The lighter (heaviest pack) of the improved LPT packing and the improved in-order packing
    (items in ``natural`` order, ``per_pack`` at a time: the identity placement without redundancy)."""
    per_pack = loads.size // num_packs
    in_order = np.empty(loads.size, dtype=np.int64)
    in_order[natural] = np.arange(loads.size) // per_pack
    candidates = [_improve(loads, _lpt(loads, num_packs)[0], num_packs), _improve(loads, in_order, num_packs)]
    heaviest = [np.bincount(c, weights=loads.astype(np.float64), minlength=num_packs).max() for c in candidates]
    return candidates[int(np.argmin(heaviest))]


def _replicate(loads: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Heap replication -> (expert of each slot, replica rank of each slot, count per expert)."""
    experts = loads.size
    counts = np.ones(experts, dtype=np.int64)
    slot_expert = list(range(experts))
    slot_rank = [0] * experts
    heap = [(-loads[e], e) for e in range(experts)]
    heapq.heapify(heap)
    for _ in range(num_slots - experts):
        _, e = heapq.heappop(heap)
        slot_expert.append(e)
        slot_rank.append(int(counts[e]))
        counts[e] += 1
        heapq.heappush(heap, (-np.float32(loads[e] / np.float32(counts[e])), e))
    return np.asarray(slot_expert), np.asarray(slot_rank), counts


def _layer(loads: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
           num_ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    experts = loads.size
    group_size = experts // num_groups
    group_loads = loads.reshape(num_groups, group_size).sum(axis=1, dtype=np.float32)
    group_node, group_position = _lpt(group_loads, num_nodes)
    groups_per_node = num_groups // num_nodes
    order = np.lexsort((group_position, group_node))  # node-major, groups in packing order inside a node
    node_experts = (order[:, None] * group_size + np.arange(group_size)).reshape(num_nodes, -1)
    slots_per_node, ranks_per_node = num_replicas // num_nodes, num_ranks // num_nodes
    per_rank = num_replicas // num_ranks
    phy2log = np.empty(num_replicas, dtype=np.int64)
    phyrank = np.empty(num_replicas, dtype=np.int64)
    counts = np.empty(experts, dtype=np.int64)
    for node in range(num_nodes):
        local_experts = node_experts[node]
        local = loads[local_experts]
        slot_expert, slot_rank, local_counts = _replicate(local, slots_per_node)
        slot_loads = (local[slot_expert] / local_counts[slot_expert].astype(np.float32)).astype(np.float32)
        natural = np.lexsort((slot_rank, local_experts[slot_expert]))  # by logical expert, then replica
        pack = _pack(slot_loads, ranks_per_node, natural)
        position = np.empty_like(pack)
        for p in range(ranks_per_node):
            mine = np.flatnonzero(pack == p)
            position[mine] = np.arange(mine.size)
        physical = node * slots_per_node + pack * per_rank + position
        phy2log[physical] = local_experts[slot_expert]
        phyrank[physical] = slot_rank
        counts[local_experts] = local_counts
    assert groups_per_node * group_size * num_nodes == experts
    return phy2log, phyrank, counts


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The default policy (module docstring): ``(phy2log [L, R], log2phy [L, E, R - E + 1], logcnt [L, E])``.

    Raises:
        ValueError: a replica budget below the expert count, counts that do not divide
            (``check_policy_args``), or a negative / non-finite load.
    """
    check_policy_args(weight, num_replicas, num_groups, num_nodes, num_ranks)
    num_layers, experts = weight.shape
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    loads = weight.detach().to("cpu", torch.float32).numpy()
    phy2log = np.empty((num_layers, num_replicas), dtype=np.int64)
    phyrank = np.empty((num_layers, num_replicas), dtype=np.int64)
    logcnt = np.empty((num_layers, experts), dtype=np.int64)
    for layer in range(num_layers):
        phy2log[layer], phyrank[layer], logcnt[layer] = _layer(loads[layer], num_replicas, num_groups, num_nodes,
                                                               num_ranks)
    width = num_replicas - experts + 1
    log2phy = np.full((num_layers, experts * width), -1, dtype=np.int64)
    rows = np.repeat(np.arange(num_layers), num_replicas)
    log2phy[rows, (phy2log * width + phyrank).reshape(-1)] = np.tile(np.arange(num_replicas), num_layers)
    return (torch.from_numpy(phy2log), torch.from_numpy(log2phy.reshape(num_layers, experts, width)),
            torch.from_numpy(logcnt))


def _check_policy(obj: object) -> None:
    if not callable(obj):
        raise TypeError(f"an EPLB policy must be callable like rebalance_experts, got {type(obj).__name__}")


_POLICIES: Registry[EplbPolicy] = Registry("EPLB policy", check=_check_policy)
_POLICIES.register("default", "servelab.moe.eplb_policy:rebalance_experts")
_POLICIES.register("reference", "servelab.reference.eplb:rebalance_experts")


def register_eplb_policy(name: str, policy: EplbPolicy | str, *, override: bool = False) -> None:
    """Register ``policy`` (a callable like :func:`rebalance_experts`, or a lazy ``"module:attr"``)."""
    _POLICIES.register(name, policy, override=override)


def get_eplb_policy(name_or_policy: str | EplbPolicy) -> EplbPolicy:
    """The policy registered as ``name`` (``ValueError`` listing the known names), or the callable itself."""
    return _POLICIES.get(name_or_policy)


def available_eplb_policies() -> list[str]:
    """Registered EPLB policy names, sorted."""
    return _POLICIES.available()
