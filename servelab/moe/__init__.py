"""Mixture of experts: routing, token permutation, the experts kernels, the MoE block, and EPLB.

Pieces (each with a registry and a reference in ``servelab.reference``):

- routers (:mod:`.routing`): ``register_moe_router`` / ``get_moe_router`` /
  ``available_moe_routers`` (``"softmax"``: softmax then top-k, renormalized or
  not, grouped top-k when asked; ``"reference"``).
- experts kernels (:mod:`.experts`): ``register_experts_kernel`` /
  ``get_experts_kernel`` / ``available_experts_kernels`` (``"cpu"``,
  ``"triton"``, ``"reference"``); ``moe_align_block_size`` permutes tokens by
  expert, padded to the kernel's block.
- the sparse block (:mod:`.layer`) the MoE decoders (Mixtral, Qwen2-MoE,
  Qwen3-MoE, OLMoE in ``servelab.models``) put in their sparse layers.
- expert-parallel load balancing (:mod:`.eplb`): ``EplbModelState`` and the
  balancing policies ``register_eplb_policy`` / ``get_eplb_policy``
  (``"default"``: :func:`rebalance_experts`).
"""

from servelab.moe.config import MOE_MODEL_TYPES, MoEConfig
from servelab.moe.eplb import EplbModelState, check_placement, enable_eplb, rank_load_balance
from servelab.moe.eplb_policy import (
    available_eplb_policies,
    get_eplb_policy,
    rebalance_experts,
    register_eplb_policy,
)
from servelab.moe.experts import (
    ExpertsKernel,
    available_experts_kernels,
    fused_experts_cpu,
    get_experts_kernel,
    moe_align_block_size,
    register_experts_kernel,
)
from servelab.moe.layer import MoEExperts, SparseMoeBlock
from servelab.moe.model import moe_blocks
from servelab.moe.routing import (
    Router,
    available_moe_routers,
    get_moe_router,
    grouped_topk,
    register_moe_router,
    topk_softmax,
)

__all__ = [
    "EplbModelState", "available_eplb_policies", "check_placement", "enable_eplb", "get_eplb_policy",
    "rank_load_balance", "rebalance_experts", "register_eplb_policy",
    "ExpertsKernel", "MOE_MODEL_TYPES", "MoEConfig", "MoEExperts", "Router", "SparseMoeBlock",
    "available_experts_kernels", "available_moe_routers", "fused_experts_cpu", "get_experts_kernel",
    "get_moe_router", "grouped_topk", "moe_align_block_size", "moe_blocks", "register_experts_kernel",
    "register_moe_router", "topk_softmax",
]
