"""Reference expert-placement policy: replicate the heaviest experts, pack replicas onto ranks (plain Python).

Same signature and return as ``servelab.moe.eplb_policy.rebalance_experts``::

    phy2log, log2phy, logcnt = rebalance_experts(weight [L, E], num_replicas, num_groups, num_nodes, num_ranks)

The spec, per layer (``weight[l, e]``: logical expert ``e``'s recorded load):

1. Hierarchical when ``num_groups % num_nodes == 0`` (else one group and one
   node): the ``num_groups`` contiguous expert groups are packed onto nodes
   (:func:`balanced_packing`: heaviest group first, each into the lightest node
   that still has room, equal counts per node); each node's experts are then
   numbered node-major.
2. Within each node, ``num_replicas / num_nodes`` physical slots: every
   expert gets one; each further slot goes to the expert whose load per
   replica is the largest (ties: the lower index) — :func:`replicate`.
3. Within each node, the physical replicas (load ``weight / count`` each) are
   packed onto its ranks with :func:`balanced_packing`; a rank's slots are
   numbered in packing order.

``phy2log`` int64 ``[L, num_replicas]``, ``log2phy`` int64 ``[L, E, max_count]``
(``-1`` where an expert has fewer replicas; replicas in increasing replica
rank), ``logcnt`` int64 ``[L, E]``. Loads are read as float32, a group's load
summed in float32, per-replica loads and pack sums kept in float64, ties to
the lower index: the numerics of vLLM's default policy, so the result is the
one it computes for the same input (up to the order of equal items).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["balanced_packing", "rebalance_experts", "replicate"]


def balanced_packing(weights: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """Items (by weight) onto ``num_packs`` packs of ``len(weights) / num_packs`` items each:
    heaviest item first (stable), into the lightest pack with room (ties: the lower pack).
    Returns (pack of each item, its position inside the pack)."""
    per_pack = len(weights) // num_packs
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    load = [0.0] * num_packs
    count = [0] * num_packs
    pack, rank = [0] * len(weights), [0] * len(weights)
    for item in order:
        choice = min((p for p in range(num_packs) if count[p] < per_pack), key=lambda p: (load[p], p))
        pack[item], rank[item] = choice, count[choice]
        load[choice] += weights[item]
        count[choice] += 1
    return pack, rank


def replicate(weights: list[float], num_slots: int) -> tuple[list[int], list[int], list[int]]:
    """``num_slots >= len(weights)`` replicas: one per expert, each further one to the expert with
    the largest load per replica (ties: the lower expert). Returns (expert of each slot,
    replica rank of each slot, replica count of each expert)."""
    slots = list(range(len(weights)))
    ranks = [0] * len(weights)
    counts = [1] * len(weights)
    for _ in range(num_slots - len(weights)):
        per_replica = [weights[e] / counts[e] for e in range(len(weights))]
        best = max(range(len(weights)), key=lambda e: (per_replica[e], -e))
        slots.append(best)
        ranks.append(counts[best])
        counts[best] += 1
    return slots, ranks, counts


def _layer(weights: list[float], num_replicas: int, num_groups: int, num_nodes: int,
           num_ranks: int) -> tuple[list[int], list[int], list[int]]:
    """One layer: (expert of each physical slot, replica rank of each slot, count per expert)."""
    num_experts = len(weights)
    group_size = num_experts // num_groups
    group_load = [float(np.float32(sum(np.float32(w) for w in weights[g * group_size:(g + 1) * group_size])))
                  for g in range(num_groups)]
    group_node, group_pos = balanced_packing(group_load, num_nodes)
    groups_per_node = num_groups // num_nodes
    node_experts: list[list[int]] = [[] for _ in range(num_nodes)]  # node-major numbering of experts
    for g in sorted(range(num_groups), key=lambda g: (group_node[g], group_pos[g])):
        node_experts[group_node[g]] += list(range(g * group_size, (g + 1) * group_size))
    assert all(len(n) == groups_per_node * group_size for n in node_experts)
    slots_per_node, ranks_per_node = num_replicas // num_nodes, num_ranks // num_nodes
    per_rank = num_replicas // num_ranks
    phy2log, phyrank, counts = [0] * num_replicas, [0] * num_replicas, [0] * num_experts
    for node, experts in enumerate(node_experts):
        local = [weights[e] for e in experts]
        slot_expert, slot_rank, local_counts = replicate(local, slots_per_node)
        slot_load = [local[e] / local_counts[e] for e in slot_expert]
        pack, pos = balanced_packing(slot_load, ranks_per_node)
        for slot, e in enumerate(slot_expert):
            physical = node * slots_per_node + pack[slot] * per_rank + pos[slot]
            phy2log[physical], phyrank[physical] = experts[e], slot_rank[slot]
        for e, count in enumerate(local_counts):
            counts[experts[e]] = count
    return phy2log, phyrank, counts


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The placement of every layer (see the module docstring)."""
    num_layers, num_experts = weight.shape
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    rows = [_layer(weight[l].float().tolist(), num_replicas, num_groups, num_nodes, num_ranks)
            for l in range(num_layers)]
    max_count = num_replicas - num_experts + 1  # as vLLM: room for every redundant slot on one expert
    phy2log = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    logcnt = torch.tensor([r[2] for r in rows], dtype=torch.int64)
    log2phy = torch.full((num_layers, num_experts, max_count), -1, dtype=torch.int64)
    for l, (experts, ranks, _) in enumerate(rows):
        for physical, (e, r) in enumerate(zip(experts, ranks)):
            log2phy[l, e, r] = physical
    return phy2log, log2phy, logcnt
