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
   and vLLM's default policy do), then **improved by swaps**: while swapping a
   replica of the heaviest rank with a lighter one of the lightest rank lowers
   the heaviest rank without lifting the lightest above it, the best such swap
   is made (at most ``_MAX_SWAPS``; a packing within ``_GOOD_ENOUGH`` of the
   lower bound max(mean rank, heaviest replica) stops). Every (layer, node)
   packing is improved in one batch of array operations. Without redundancy
   on one node, a packing heavier than the in-order one (slot ``i`` to rank
   ``i // per_rank``: the identity placement) is also tried from the in-order
   start and the lighter kept. So the heaviest rank is never heavier than the
   reference's (same steps 1-2, step 3 only lowers it) nor, with one node and
   no redundant slot, than the identity placement's.

Numerics as the reference's (and vLLM's): loads read as float32, group sums
in float32, per-replica loads and rank sums in float64, ties to the lower
index. Why swaps with the lightest rank only, not all ranks or an exact
solver: the placement runs on the host between steps; searching every rank
gained 0.0006 of max/mean on random loads at 1.4x the time, and the
lightest-rank swaps already beat vLLM's packing on every recorded and random
load of the study (``bench/eplb.py``) in less host time.
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
_MAX_SWAPS = 16  # per packing; each lowers the heaviest rank (on recorded and random loads 16 = 64 in quality)
_GOOD_ENOUGH = 1e-3  # a row stops swapping within 0.1% of the lower bound on its heaviest rank


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
    item, its position in the pack's packing order). Plain lists and a heap: the sizes are small."""
    per_pack = loads.size // num_packs
    values = loads.tolist()
    pack, position = [0] * len(values), [0] * len(values)
    heap = [(0.0, p) for p in range(num_packs)]
    count = [0] * num_packs
    for item in np.argsort(-loads, kind="stable").tolist():
        load, p = heapq.heappop(heap)
        pack[item], position[item] = p, count[p]
        count[p] += 1
        if count[p] < per_pack:
            heapq.heappush(heap, (load + values[item], p))
    return np.asarray(pack, dtype=np.int64), np.asarray(position, dtype=np.int64)


def _improve(loads: np.ndarray, pack: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Best swaps that lower each row's heaviest pack (see the module docstring), every row of the batch
    at once: ``loads`` float64 ``[B, S]``, ``pack`` ``[B, S]`` (``S / num_packs`` items per pack) ->
    (new ``pack`` ``[B, S]``, heaviest pack load ``[B]``). One swap per row and iteration; a row stops
    at the lower bound max(mean pack, heaviest item) or when no swap lowers its heaviest pack."""
    rows_n, size = loads.shape
    per_pack = size // num_packs
    rows = np.arange(rows_n)
    members = np.argsort(pack, axis=1, kind="stable").reshape(rows_n, num_packs, per_pack)  # items by pack
    values = np.take_along_axis(loads, members.reshape(rows_n, size), axis=1).reshape(rows_n, num_packs, per_pack)
    totals = values.sum(axis=2)
    bound = np.maximum(loads.sum(axis=1) / num_packs, loads.max(axis=1)) * (1 + _GOOD_ENOUGH)
    active = np.ones(rows_n, dtype=bool)
    for _ in range(_MAX_SWAPS):
        heavy = totals.argmax(axis=1)
        top = totals[rows, heavy]
        active &= top > bound
        if not active.any():
            break
        light = totals.argmin(axis=1)
        delta = values[rows, heavy][:, :, None] - values[rows, light][:, None, :]  # [B, m, m]: moved off heavy
        worst = np.maximum(top[:, None, None] - delta, totals[rows, light][:, None, None] + delta)
        worst = np.where(delta > 0, worst, np.inf)
        flat = worst.reshape(rows_n, -1).argmin(axis=1)
        ok = active & (worst.reshape(rows_n, -1)[rows, flat] < top * (1 - 1e-9))
        active &= ok
        if not ok.any():
            break
        r, h, q = rows[ok], heavy[ok], light[ok]
        i, j = np.unravel_index(flat[ok], (per_pack, per_pack))
        d = delta.reshape(rows_n, -1)[r, flat[ok]]
        members[r, h, i], members[r, q, j] = members[r, q, j], members[r, h, i].copy()
        values[r, h, i], values[r, q, j] = values[r, q, j], values[r, h, i].copy()
        totals[r, h] -= d
        totals[r, q] += d
    out = np.empty((rows_n, size), dtype=np.int64)
    out[rows[:, None], members.reshape(rows_n, size)] = np.repeat(np.arange(num_packs), per_pack)[None, :]
    return out, totals.max(axis=1)


def _pack(loads: np.ndarray, num_packs: int, natural: np.ndarray | None) -> np.ndarray:
    """Pack every row of ``loads`` ``[B, S]``: the improved LPT packing; when ``natural`` (``[B, S]``, the
    items' identity order) is given, rows whose result is heavier than the in-order packing's also try
    the improved in-order packing, and keep the lighter."""
    per_pack = loads.shape[1] // num_packs
    best, heaviest = _improve(loads, np.stack([_lpt(row, num_packs)[0] for row in loads]), num_packs)
    if natural is None:
        return best
    rows = np.arange(loads.shape[0])[:, None]
    in_order = np.empty_like(best)
    in_order[rows, natural] = np.arange(loads.shape[1])[None, :] // per_pack
    plain = np.take_along_axis(loads, natural, axis=1).reshape(len(loads), num_packs, -1).sum(axis=2).max(axis=1)
    retry = np.flatnonzero(heaviest > plain)  # rare
    if retry.size:
        other, other_heaviest = _improve(loads[retry], in_order[retry], num_packs)
        better = other_heaviest < heaviest[retry]
        best[retry[better]] = other[better]
    return best


def _replicate(loads: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Heap replication -> (expert of each slot, replica rank of each slot, count per expert)."""
    values = loads.tolist()
    experts = len(values)
    counts = [1] * experts
    slot_expert = list(range(experts))
    slot_rank = [0] * experts
    heap = [(-values[e], e) for e in range(experts)]
    heapq.heapify(heap)
    for _ in range(num_slots - experts):
        _, e = heapq.heappop(heap)
        slot_expert.append(e)
        slot_rank.append(counts[e])
        counts[e] += 1
        heapq.heappush(heap, (-values[e] / counts[e], e))
    return np.asarray(slot_expert), np.asarray(slot_rank), np.asarray(counts, dtype=np.int64)


def _node_experts(loads: np.ndarray, num_groups: int, num_nodes: int) -> np.ndarray:
    """``[nodes, E / nodes]``: the logical experts of each node, node-major (groups packed onto nodes)."""
    group_size = loads.size // num_groups
    if num_groups == 1:  # nothing to pack
        order = np.arange(1)
    else:
        group_loads = loads.reshape(num_groups, group_size).sum(axis=1, dtype=np.float32)
        group_node, group_position = _lpt(group_loads, num_nodes)
        order = np.lexsort((group_position, group_node))  # node-major, groups in packing order inside a node
    return (order[:, None] * group_size + np.arange(group_size)).reshape(num_nodes, -1)


def _place(loads: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
           num_ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every layer of ``loads`` ``[L, E]`` -> (phy2log ``[L, P]``, replica rank of each slot ``[L, P]``,
    logcnt ``[L, E]``): replication per (layer, node), then one batched packing of all of them."""
    num_layers, experts = loads.shape
    slots_per_node, ranks_per_node = num_replicas // num_nodes, num_ranks // num_nodes
    per_rank = num_replicas // num_ranks
    slot_logical, slot_rank, slot_loads = [], [], []
    logcnt = np.empty((num_layers, experts), dtype=np.int64)
    for layer in range(num_layers):
        for local_experts in _node_experts(loads[layer], num_groups, num_nodes):
            local = loads[layer, local_experts]
            expert, rank, counts = _replicate(local, slots_per_node)
            slot_logical.append(local_experts[expert])
            slot_rank.append(rank)
            slot_loads.append(local[expert].astype(np.float64) / counts[expert])
            logcnt[layer, local_experts] = counts
    logical, ranks = np.stack(slot_logical), np.stack(slot_rank)
    identity = num_nodes == 1 and num_replicas == experts
    natural = np.argsort(logical * num_replicas + ranks, axis=1, kind="stable") if identity else None
    pack = _pack(np.stack(slot_loads), ranks_per_node, natural)
    by_rank = np.argsort(pack, axis=1, kind="stable")  # each rank's slots in item order
    position = np.empty_like(pack)
    np.put_along_axis(position, by_rank, np.arange(slots_per_node)[None, :] % per_rank, axis=1)
    node = np.tile(np.arange(num_nodes), num_layers)[:, None]
    physical = (node * slots_per_node + pack * per_rank + position).reshape(num_layers, num_replicas)
    phy2log = np.empty((num_layers, num_replicas), dtype=np.int64)
    phyrank = np.empty_like(phy2log)
    layer_rows = np.arange(num_layers)[:, None]
    phy2log[layer_rows, physical] = logical.reshape(num_layers, num_replicas)
    phyrank[layer_rows, physical] = ranks.reshape(num_layers, num_replicas)
    return phy2log, phyrank, logcnt


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
    phy2log, phyrank, logcnt = _place(loads, num_replicas, num_groups, num_nodes, num_ranks)
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
