"""The sparse MoE block of a decoder layer: router, experts, optional shared expert.

Parameter names are transformers' (5.x) so checkpoints load unchanged:
``mlp.gate.weight`` ``[E, H]`` (the router), ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` (rows ``[:I]`` gate, ``[I:]`` up), ``mlp.experts.down_proj``
``[E, H, I]``, and for Qwen2-MoE ``mlp.shared_expert.{gate,up,down}_proj.weight``
and ``mlp.shared_expert_gate.weight`` ``[1, H]``. Per-expert checkpoints
(``experts.3.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.3.w1.weight``)
are stacked into these by :func:`servelab.moe.checkpoint.convert_checkpoint_tensors`.

The router and the experts kernel are looked up by name on every call
(``block.router = "reference"``, ``block.experts.kernel = "triton"`` swaps
them; see :mod:`servelab.moe.routing` and :mod:`servelab.moe.experts`).

Expert placement (EPLB, :mod:`servelab.moe.eplb`): when
``experts.logical_to_physical`` is set, the weights are stored per *physical*
expert slot (``[P, 2I, H]``, replicas of a logical expert hold the same
weights), routed ids are mapped to a replica (pair ``p`` of a token batch goes
to replica ``p mod count`` of its expert: a deterministic spread), and the
number of pairs per physical slot is added into ``experts.load`` (int64
``[P]``) when it is not ``None``. Any replica computes the same thing, so the
outputs do not depend on the placement.

Expert parallelism (:mod:`servelab.moe.parallel`): ``experts.ep_range`` =
``(first, count)`` of the experts this rank holds; pairs routed elsewhere
become ``-1`` (skipped by the kernels) and ``experts.ep_group.all_reduce``
sums the ranks' partial outputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelab.models.linear import Linear
from servelab.moe.config import MoEConfig
from servelab.moe.experts import default_experts_kernel, get_experts_kernel
from servelab.moe.routing import get_moe_router

__all__ = ["MoEExperts", "SharedExpertMLP", "SparseMoeBlock"]


class MoEExperts(nn.Module):
    """The routed experts' weights and the call into the experts kernel.

    Attributes:
        gate_up_proj: ``[P, 2I, H]`` (``P`` = physical slots; ``= E`` without a placement).
        down_proj: ``[P, H, I]``.
        kernel: experts-kernel name or callable (``"auto"``: by device).
        logical_to_physical: int64 ``[E, max_replicas]`` (``-1`` where a logical expert has
            fewer replicas) or ``None`` (identity).
        replica_count: int64 ``[E]`` or ``None``.
        load: int64 ``[P]`` pair counts added by every forward, or ``None`` (not recorded).
    """

    def __init__(self, config: MoEConfig, hidden_size: int, *, dtype=None, device=None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        experts, inter = config.num_experts, config.intermediate_size
        self.num_experts, self.intermediate_size, self.activation = experts, inter, config.activation
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden_size, inter, **kw), requires_grad=False)
        self.kernel: object = "auto"
        self.logical_to_physical: torch.Tensor | None = None
        self.replica_count: torch.Tensor | None = None
        self.load: torch.Tensor | None = None
        self.ep_group: Any = None  # expert parallelism (servelab.moe.parallel): the group and
        self.ep_range: tuple[int, int] | None = None  # (first expert, count) held by this rank

    def physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical ids ``[T, k]`` -> physical slots ``[T, k]`` (identity without a placement)."""
        if self.logical_to_physical is None or self.replica_count is None:
            return topk_ids
        ids = topk_ids.long()
        pair = torch.arange(ids.numel(), device=ids.device).view_as(ids)
        return self.logical_to_physical[ids, pair % self.replica_count[ids]]

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``[T, H]``, float32 ``[T, k]``, int64 logical ``[T, k]`` -> ``[T, H]``."""
        ids = self.physical_ids(topk_ids)
        if self.load is not None:
            self.load += torch.bincount(ids.reshape(-1), minlength=self.load.numel()).to(self.load.device)
        if self.ep_range is not None:  # this rank's experts only; the others' pairs add nothing here
            start, count = self.ep_range
            ids = torch.where((ids >= start) & (ids < start + count), ids - start, -1)
        name = self.kernel
        if name == "auto":
            name = default_experts_kernel(hidden_states.device)
        kernel = get_experts_kernel(name)  # type: ignore[arg-type]
        out = kernel(hidden_states, self.gate_up_proj, self.down_proj, topk_weights, ids, activation=self.activation)
        if self.ep_group is not None:  # combine: every rank holds every token, one all-reduce of [T, H]
            out = self.ep_group.all_reduce(out)
        return out


class SharedExpertMLP(nn.Module):
    """Qwen2-MoE's shared expert: ``down(silu(gate(x)) * up(x))`` with HF's three module names."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype=None, device=None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """``x [T, H] -> [T, H]``: route (``gate`` then the router), run the experts, add the
    sigmoid-gated shared expert when the config has one (Qwen2-MoE's order: routed + shared)."""

    def __init__(self, config: MoEConfig, hidden_size: int, *, dtype=None, device=None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.moe_config = config
        self.router: object = "softmax"
        self.gate = Linear(hidden_size, config.num_experts, bias=False, **kw)
        self.experts = MoEExperts(config, hidden_size, **kw)
        self.shared_expert: SharedExpertMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpertMLP(hidden_size, config.shared_expert_intermediate_size, **kw)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False, **kw)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, H]`` -> (float32 weights ``[T, k]``, int64 logical expert ids ``[T, k]``)."""
        cfg = self.moe_config
        router = get_moe_router(self.router)  # type: ignore[arg-type]
        return router(self.gate(hidden_states), cfg.top_k, renormalize=cfg.renormalize,
                      num_expert_group=cfg.num_expert_group, topk_group=cfg.topk_group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden_states)
        out = self.experts(hidden_states, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return out
