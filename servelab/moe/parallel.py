"""Expert parallelism: each rank of the expert-parallel group keeps ``E / ep`` whole experts.

The step ``enable_expert_parallel`` of :data:`servelab.pipeline.setup.MODEL_STEPS`
(after tensor parallelism shards attention and dense MLPs, inside each worker of
the multiproc executor). The expert-parallel group is the tensor-parallel group
of a stage (:mod:`servelab.executor.parallel_state`): rank ``r`` keeps logical
experts ``[r * E / ep, (r + 1) * E / ep)`` of every sparse layer and drops the
others' weights.

Dispatch and combine — which collective, and why: inside a TP group every rank
holds the *same* activations (the row-parallel o_proj all-reduces them), so
every rank already has every token: **dispatch needs no communication**. Each
rank routes all tokens (the router is replicated, so every rank picks the same
experts), runs its local experts on the pairs routed to them (the others'
pairs are marked ``-1``: the experts kernels skip them), and the partial
outputs are **combined with one all-reduce** of ``[T, H]`` — the volume of a
dense TP MLP's row-parallel all-reduce, i.e. all-gather + reduce-scatter
fused. An all-to-all would send each token only to the ranks of its experts,
which pays off when ranks hold *different* tokens (data-parallel attention);
this executor has none, so all-to-all would only add a gather.

The shared expert (Qwen2-MoE), the router and dense layers stay replicated.
Outputs equal one process's up to the order of the float additions (the
partial sums of the ranks are added by the all-reduce), which keeps greedy
tokens identical on the test models.
"""

from __future__ import annotations

from typing import Any

import torch

from servelab.moe.model import moe_blocks

__all__ = ["check_expert_parallel", "check_model_expert_parallel", "shard_experts"]


def check_expert_parallel(num_experts: int, ep_size: int) -> None:
    """``ValueError`` when ``ep_size`` ranks cannot hold equal whole-expert shares of ``num_experts``."""
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"expert-parallel size {ep_size} (tensor_parallel_size with enable_expert_parallel) does "
                         f"not divide the model's {num_experts} experts; valid: a divisor of {num_experts}")


def check_model_expert_parallel(model_config: Any, ep_size: int) -> None:
    """The driver's check (before any worker starts): ``model_config`` (a
    :class:`~servelab.models.ModelConfig`) is a MoE model whose experts ``ep_size`` divides."""
    from servelab.moe.config import MOE_MODEL_TYPES, MoEConfig

    if model_config.arch not in MOE_MODEL_TYPES:
        raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model ({', '.join(MOE_MODEL_TYPES)}); "
                         f"this one is {model_config.arch!r}")
    check_expert_parallel(MoEConfig.from_hf(model_config.hf_config).num_experts, ep_size)


@torch.no_grad()
def shard_experts(model: Any, config: Any, *, parallel_state: Any = None, **context: Any) -> Any:
    """Keep this rank's experts of every sparse layer (in place) and set the EP group on them.

    Raises:
        ValueError: not a MoE model, the EP size does not divide the experts, or EPLB already enabled
            (its slots would have to move across ranks, which is not implemented).
    """
    from servelab.executor.parallel_state import get_parallel_state

    state = parallel_state if parallel_state is not None else get_parallel_state()
    ep = state.ep
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"enable_expert_parallel is set but {type(model).__name__} has no MoE layer")
    if getattr(model, "eplb_state", None) is not None:
        raise ValueError("enable_expert_parallel with EPLB enabled is not supported (slots would cross ranks)")
    num_experts = blocks[0][1].experts.num_experts
    check_expert_parallel(num_experts, ep.size)
    per_rank = num_experts // ep.size
    start = ep.rank_in_group * per_rank
    for _, block in blocks:
        experts = block.experts
        experts.gate_up_proj.data = experts.gate_up_proj.data[start:start + per_rank].clone()
        experts.down_proj.data = experts.down_proj.data[start:start + per_rank].clone()
        experts.ep_group, experts.ep_range = ep, (start, per_rank)
    return model
