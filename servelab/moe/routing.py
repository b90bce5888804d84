"""Routing: which experts each token goes to, with what weight; a registry of routers.

A router is any callable with :class:`Router`'s signature::

    weights, ids = router(router_logits, top_k, renormalize=True, num_expert_group=None, topk_group=None)

``router_logits`` ``[T, E]`` are the gate projection's output; ``weights``
float32 ``[T, top_k]`` and ``ids`` int64 ``[T, top_k]`` come back best first.
Registered names (:func:`register_moe_router`, :func:`get_moe_router`,
:func:`available_moe_routers`):

- ``"softmax"`` (default): :func:`route` — softmax in float32, top-k,
  renormalized if asked (Mixtral always renormalizes; Qwen2/3-MoE and OLMoE
  follow ``norm_topk_prob``); grouped top-k when both group arguments are set.
- ``"reference"``: the token-by-token loops of ``servelab.reference.fused_moe``.

Why float32 softmax then ``torch.topk``: it is what transformers does for all
four registered MoE architectures, so ties and rounding pick the same experts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from servelab._internal.registry import Registry

__all__ = ["Router", "available_moe_routers", "get_moe_router", "grouped_topk", "register_moe_router", "route",
           "topk_softmax"]


@runtime_checkable
class Router(Protocol):
    """``(router_logits [T, E], top_k, *, renormalize, num_expert_group, topk_group)
    -> (weights float32 [T, top_k], ids int64 [T, top_k])``."""

    def __call__(self, router_logits: torch.Tensor, top_k: int, *, renormalize: bool,
                 num_expert_group: int | None = None,
                 topk_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def _check(router_logits: torch.Tensor, top_k: int, num_expert_group: int | None, topk_group: int | None) -> None:
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2 or not router_logits.is_floating_point():
        shape = tuple(router_logits.shape) if isinstance(router_logits, torch.Tensor) else type(router_logits).__name__
        raise ValueError(f"router_logits must be a float tensor [T, num_experts], got {shape}")
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an int in [1, num_experts={num_experts}]")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(f"num_expert_group={num_expert_group!r} and topk_group={topk_group!r} must be given together")
    if num_expert_group is not None and topk_group is not None:
        if not (isinstance(num_expert_group, int) and num_expert_group > 0 and num_experts % num_expert_group == 0):
            raise ValueError(f"num_expert_group={num_expert_group!r} must be a positive divisor of "
                             f"num_experts={num_experts}")
        per_group = num_experts // num_expert_group
        if not (isinstance(topk_group, int) and 1 <= topk_group <= num_expert_group
                and topk_group * per_group >= top_k):
            raise ValueError(f"topk_group={topk_group!r} must be in [1, {num_expert_group}] and keep at least "
                             f"top_k={top_k} experts ({per_group} per group)")


def topk_softmax(router_logits: torch.Tensor, top_k: int, *, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) then top-k: ``[T, E]`` -> (float32 ``[T, k]``, int64 ``[T, k]``)."""
    _check(router_logits, top_k, None, None)
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(router_logits: torch.Tensor, top_k: int, *, renormalize: bool, num_expert_group: int,
                 topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k, vectorized: keep each token's ``topk_group`` groups with the best
    best-expert probability, then top-k among their experts (see the reference)."""
    _check(router_logits, top_k, num_expert_group, topk_group)
    probs = torch.softmax(router_logits.float(), dim=-1)
    num_tokens, num_experts = probs.shape
    group_scores = probs.view(num_tokens, num_expert_group, -1).amax(dim=-1)  # [T, G]
    # Stable sort by descending score: equal scores keep the lower group first, as the reference does.
    kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0)
    expert_mask = group_mask.repeat_interleave(num_experts // num_expert_group, dim=1)
    weights, ids = torch.topk(probs * expert_mask, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool, num_expert_group: int | None = None,
          topk_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The default router (``"softmax"``): :func:`grouped_topk` when groups are given, else :func:`topk_softmax`."""
    if num_expert_group is not None or topk_group is not None:
        _check(router_logits, top_k, num_expert_group, topk_group)
        assert num_expert_group is not None and topk_group is not None
        return grouped_topk(router_logits, top_k, renormalize=renormalize, num_expert_group=num_expert_group,
                            topk_group=topk_group)
    return topk_softmax(router_logits, top_k, renormalize=renormalize)


def _check_router(obj: object) -> None:
    if not callable(obj):
        raise TypeError(f"a MoE router must be callable with Router's signature, got {type(obj).__name__}")


_ROUTERS: Registry[Router] = Registry("MoE router", check=_check_router)
_ROUTERS.register("softmax", "servelab.moe.routing:route")
_ROUTERS.register("reference", "servelab.reference.fused_moe:route")


def register_moe_router(name: str, router: Router | str, *, override: bool = False) -> None:
    """Register ``router`` (a callable or a lazy ``"module:attr"``) under ``name``."""
    _ROUTERS.register(name, router, override=override)


def get_moe_router(name_or_router: str | Router) -> Router:
    """The router registered as ``name`` (``ValueError`` listing the known names), or the callable itself."""
    return _ROUTERS.get(name_or_router)


def available_moe_routers() -> list[str]:
    """Registered router names, sorted."""
    return _ROUTERS.available()
