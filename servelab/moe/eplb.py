"""EPLB: expert-parallel load balancing of a MoE model while it serves.

:class:`EplbModelState` holds, for the model's ``L`` sparse layers, ``E``
logical experts and ``P = E + num_redundant_experts`` physical slots
(``P / num_ranks`` per rank, rank-major):

- ``physical_to_logical_map`` int64 ``[L, P]``;
- ``logical_to_physical_map`` int64 ``[L, E, P - E + 1]`` (``-1`` for absent replicas);
- ``logical_replica_count`` int64 ``[L, E]``;
- ``expert_load_pass`` int64 ``[L, P]``: pairs routed to each slot by the current step;
- ``expert_load_window`` int64 ``[window, L, P]``: the last ``window`` steps' loads (a ring);
  both on the experts' device (counted without a host sync), the maps on the host.

Every ``rearrange_interval`` steps (:meth:`step`) the window's physical load
is mapped back to logical experts, summed across ranks (``all_reduce`` over
``group`` when one is given: every rank then computes the same placement),
handed to the policy's ``rebalance_experts(weight, num_replicas, num_groups,
num_nodes, num_ranks)`` on the host, and the new placement is **skipped** when
its max/mean rank load (each expert's load split evenly over its replicas) is
not better than the current one's by at least ``skip_threshold`` (relative).
Otherwise the weights are moved first (each new slot copies its logical
expert from one of its current slots), then the new maps are committed to
the state and to every :class:`~servelab.moe.layer.MoEExperts`. Any replica
holds the same weights, so greedy outputs do not change.

Attach to a model with :func:`enable_eplb` (``pipe.model`` for a pipeline): a
forward hook on the model calls :meth:`step` after every forward, so each
pipeline step (one forward) is one EPLB step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from servelab.moe.eplb_policy import EplbPolicy, check_policy_args, get_eplb_policy
from servelab.moe.layer import MoEExperts
from servelab.moe.model import moe_blocks

__all__ = ["EplbModelState", "check_placement", "enable_eplb", "rank_load_balance"]


def check_placement(phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, num_experts: int) -> None:
    """``ValueError`` when the three maps disagree or lose an expert: every logical expert needs a
    replica, ``log2phy`` must list exactly each expert's slots (``-1`` after them), counts must add up."""
    layers, slots = phy2log.shape
    if int(phy2log.min()) < 0 or int(phy2log.max()) >= num_experts:
        raise ValueError(f"physical_to_logical_map holds an expert outside [0, {num_experts})")
    counts = torch.stack([torch.bincount(row, minlength=num_experts) for row in phy2log])
    lost = (counts == 0).nonzero()
    if lost.numel():
        layer, expert = (int(v) for v in lost[0])
        raise ValueError(f"physical_to_logical_map loses logical expert {expert} in layer {layer}: it has no replica")
    if not torch.equal(counts, logcnt.to(counts.dtype)):
        raise ValueError("logical_replica_count does not match physical_to_logical_map's replica counts")
    if int(logcnt.sum(dim=1).min()) != slots or int(logcnt.sum(dim=1).max()) != slots:
        raise ValueError(f"logical_replica_count must add up to the {slots} physical slots in every layer")
    for layer in range(layers):
        for expert in range(num_experts):
            listed = log2phy[layer, expert]
            n = int(logcnt[layer, expert])
            real, pad = listed[:n], listed[n:]
            if bool((pad != -1).any()) or bool((real < 0).any()) or not bool((phy2log[layer, real] == expert).all()):
                raise ValueError(f"logical_to_physical_map[{layer}, {expert}] = {listed.tolist()} does not list "
                                 f"the {n} slot(s) of expert {expert} followed by -1")


def rank_load_balance(logical_load: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor,
                      num_ranks: int) -> torch.Tensor:
    """Per layer, max / mean rank load ``[L]`` (float64) of a placement, each logical expert's load
    (``[L, E]``) split evenly over its replicas; 1.0 for a layer with no load."""
    per_slot = (logical_load.double() / logcnt.double()).gather(1, phy2log)
    ranks = per_slot.view(phy2log.shape[0], num_ranks, -1).sum(-1)
    mean = ranks.mean(-1)
    return torch.where(mean > 0, ranks.max(-1).values / mean.clamp_min(1e-300), torch.ones_like(mean))


@dataclass
class EplbModelState:
    """The placement and load window of one model (see the module docstring).

    Build with :func:`enable_eplb`. ``history`` records one dict per rearrangement
    considered: ``{"step", "balance_before", "balance_after", "applied"}`` (mean over layers).
    """

    physical_to_logical_map: torch.Tensor
    logical_to_physical_map: torch.Tensor
    logical_replica_count: torch.Tensor
    expert_load_pass: torch.Tensor
    expert_load_window: torch.Tensor
    num_ranks: int
    rearrange_interval: int
    skip_threshold: float
    policy: Any = "default"
    num_groups: int = 1
    num_nodes: int = 1
    group: Any = None
    experts: list[MoEExperts] = field(default_factory=list)
    window_step: int = 0
    steps_since_rearrangement: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def num_physical_experts(self) -> int:
        return int(self.physical_to_logical_map.shape[1])

    @property
    def num_logical_experts(self) -> int:
        return int(self.logical_replica_count.shape[1])

    def step(self) -> None:
        """End of one forward: the pass's load into the window; rearrange every ``rearrange_interval`` steps."""
        self.expert_load_window[self.window_step % self.expert_load_window.shape[0]].copy_(self.expert_load_pass)
        self.expert_load_pass.zero_()
        self.window_step += 1
        self.steps_since_rearrangement += 1
        if self.steps_since_rearrangement >= self.rearrange_interval:
            self.steps_since_rearrangement = 0
            self.rearrange()

    def logical_load(self) -> torch.Tensor:
        """int64 ``[L, E]``: the window's load per logical expert (summed over ranks when a group is set)."""
        physical = self.expert_load_window.sum(dim=0).cpu()  # the window lives on the experts' device
        logical = torch.zeros(physical.shape[0], self.num_logical_experts, dtype=torch.int64)
        logical.scatter_add_(1, self.physical_to_logical_map, physical)
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(logical, group=self.group)
        return logical

    def rearrange(self, *, force: bool = False) -> bool:
        """Run the policy on the window's load; apply it unless the gain is under ``skip_threshold``
        (``force`` applies it anyway). Returns whether the placement changed."""
        load = self.logical_load()
        if int(load.sum()) == 0 and not force:
            return False
        policy = get_eplb_policy(self.policy)
        phy2log, log2phy, logcnt = policy(load.float(), self.num_physical_experts, self.num_groups, self.num_nodes,
                                          self.num_ranks)
        check_placement(phy2log, log2phy, logcnt, self.num_logical_experts)
        before = rank_load_balance(load, self.physical_to_logical_map, self.logical_replica_count, self.num_ranks)
        after = rank_load_balance(load, phy2log, logcnt, self.num_ranks)
        gain = float((before.mean() - after.mean()) / before.mean())
        applied = force or gain >= self.skip_threshold
        self.history.append({"step": self.window_step, "balance_before": float(before.mean()),
                             "balance_after": float(after.mean()), "applied": applied})
        if applied:
            self.apply(phy2log, log2phy, logcnt)
        return applied

    @torch.no_grad()
    def apply(self, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor) -> None:
        """Move every layer's expert weights to the new slots, then commit the maps (checked first)."""
        check_placement(phy2log, log2phy, logcnt, self.num_logical_experts)
        if tuple(phy2log.shape) != tuple(self.physical_to_logical_map.shape):
            raise ValueError(f"physical_to_logical_map must keep shape {tuple(self.physical_to_logical_map.shape)}, "
                             f"got {tuple(phy2log.shape)}")
        for layer, experts in enumerate(self.experts):
            source = self.logical_to_physical_map[layer, :, 0][phy2log[layer]]  # a current slot of each new slot
            index = source.to(experts.gate_up_proj.device)
            experts.gate_up_proj.data = experts.gate_up_proj.data[index].contiguous()
            experts.down_proj.data = experts.down_proj.data[index].contiguous()
        self.physical_to_logical_map = phy2log.clone()
        self.logical_to_physical_map = log2phy.clone()
        self.logical_replica_count = logcnt.clone()
        self._commit()

    def _commit(self) -> None:
        for layer, experts in enumerate(self.experts):
            device = experts.gate_up_proj.device
            experts.logical_to_physical = self.logical_to_physical_map[layer].to(device)
            experts.replica_count = self.logical_replica_count[layer].to(device)
            experts.load = self.expert_load_pass[layer]


def _initial_placement(layers: int, experts: int, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot ``p`` holds expert ``p mod E`` (vLLM's initial placement)."""
    phy2log = (torch.arange(slots) % experts).expand(layers, slots).clone()
    logcnt = torch.stack([torch.bincount(row, minlength=experts) for row in phy2log])
    width = slots - experts + 1
    log2phy = torch.full((layers, experts, width), -1, dtype=torch.int64)
    for p in range(slots):
        log2phy[:, p % experts, p // experts] = p
    return phy2log, log2phy, logcnt


@torch.no_grad()
def enable_eplb(model: torch.nn.Module, *, num_redundant_experts: int = 0, num_ranks: int = 1,
                window_size: int = 32, rearrange_interval: int = 64, skip_threshold: float = 0.05,
                policy: str | EplbPolicy = "default", num_groups: int = 1, num_nodes: int = 1,
                group: Any = None) -> EplbModelState:
    """Give ``model``'s MoE layers ``E + num_redundant_experts`` physical slots and rebalance them while it runs.

    Args:
        model: a MoE decoder (``moe_blocks(model)`` non-empty), e.g. ``pipe.model``.
        num_redundant_experts: extra physical slots per layer (replicas of heavy experts).
        num_ranks: expert-parallel ranks the slots are split over (balance is per rank).
        window_size: steps of load kept; rearrange_interval: steps between rearrangements.
        skip_threshold: minimum relative improvement of max/mean rank load to apply one.
        policy: a registered EPLB policy name or a callable like ``rebalance_experts``.
        num_groups, num_nodes: hierarchical placement (see the policy).
        group: a ``torch.distributed`` process group whose ranks' loads are summed, or ``None``.

    Raises:
        ValueError: no MoE layer, EPLB already enabled, a negative redundancy, slots not divisible by
            ``num_ranks``, a non-positive window / interval, a threshold outside ``[0, 1)``, an unknown policy.
    """
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE layer to balance")
    if getattr(model, "eplb_state", None) is not None:
        raise ValueError("EPLB is already enabled on this model (model.eplb_state)")
    if blocks[0][1].experts.ep_range is not None:
        raise ValueError("EPLB on an expert-parallel model is not supported (slots would move across ranks)")
    experts = blocks[0][1].experts.num_experts
    redundant = num_redundant_experts
    if isinstance(redundant, bool) or not isinstance(redundant, int) or redundant < 0:
        raise ValueError(f"num_redundant_experts={num_redundant_experts!r} must be an int >= 0")
    slots = experts + num_redundant_experts
    check_policy_args(torch.zeros(len(blocks), experts), slots, num_groups, num_nodes, num_ranks)
    for name, value in (("window_size", window_size), ("rearrange_interval", rearrange_interval)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if not (isinstance(skip_threshold, (int, float)) and 0 <= skip_threshold < 1):
        raise ValueError(f"skip_threshold={skip_threshold!r} must be in [0, 1)")
    get_eplb_policy(policy)
    phy2log, log2phy, logcnt = _initial_placement(len(blocks), experts, slots)
    device = blocks[0][1].experts.gate_up_proj.device  # loads are counted where the routing runs: no sync
    state = EplbModelState(phy2log, log2phy, logcnt, torch.zeros(len(blocks), slots, dtype=torch.int64, device=device),
                           torch.zeros(window_size, len(blocks), slots, dtype=torch.int64, device=device), num_ranks,
                           rearrange_interval, float(skip_threshold), policy, num_groups, num_nodes, group,
                           [block.experts for _, block in blocks])
    for layer, ex in enumerate(state.experts):  # physical storage: slot p holds expert p mod E
        index = phy2log[layer].to(ex.gate_up_proj.device)
        ex.gate_up_proj.data = ex.gate_up_proj.data[index].contiguous()
        ex.down_proj.data = ex.down_proj.data[index].contiguous()
    state._commit()
    model.eplb_state = state  # type: ignore[assignment]
    model.register_forward_hook(lambda module, args, output: state.step())
    return state
