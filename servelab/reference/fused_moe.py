"""Mixture-of-experts references: routing, token permutation and the experts, as plain loops.

These are the spec the fast paths (:mod:`servelab.moe`, :mod:`servelab.kernels.fused_moe`)
are held to. Same names and signatures as the fast twins:

- :func:`topk_softmax`: softmax over the router logits in float32, then top-k,
  optionally renormalized so each token's k weights sum to 1 (Mixtral always,
  Qwen-MoE / OLMoE when ``norm_topk_prob``).
- :func:`grouped_topk`: experts in ``num_expert_group`` equal groups; a token
  first keeps the ``topk_group`` groups with the highest best-expert score,
  then takes its top-k among their experts (DeepSeek-style routing).
- :func:`moe_align_block_size`: the token permutation the grouped GEMM
  consumes: every (token, slot) pair sorted by expert, each expert's run
  padded to a multiple of the kernel's block with a sentinel.
- :func:`fused_experts`: ``sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))``
  with ``e = ids[t, j]``, one expert at a time (the per-expert loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_experts", "grouped_topk", "moe_align_block_size", "route", "topk_softmax"]


def route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool, num_expert_group: int | None = None,
          topk_group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's signature (:class:`servelab.moe.Router`): :func:`grouped_topk` when groups are
    given, else :func:`topk_softmax`."""
    if num_expert_group is not None and topk_group is not None:
        return grouped_topk(router_logits, top_k, renormalize=renormalize, num_expert_group=num_expert_group,
                            topk_group=topk_group)
    return topk_softmax(router_logits, top_k, renormalize=renormalize)


def topk_softmax(router_logits: torch.Tensor, top_k: int, *, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: ``router_logits`` ``[T, E]`` (any float dtype) ->
    (weights float32 ``[T, top_k]``, expert ids int64 ``[T, top_k]``), best first.

    Ties are broken as ``torch.topk`` breaks them (what transformers does too)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(router_logits: torch.Tensor, top_k: int, *, renormalize: bool, num_expert_group: int,
                 topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped softmax routing, token by token: ``[T, E]`` -> (float32 ``[T, top_k]``, int64 ``[T, top_k]``).

    A group's score is its best expert's probability; the ``topk_group`` best
    groups are kept (ties: the lower group index), the other experts masked to
    zero, and the top-k taken among the rest."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    num_tokens, num_experts = probs.shape
    per_group = num_experts // num_expert_group
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for t in range(num_tokens):
        scores = [max(probs[t, g * per_group:(g + 1) * per_group].tolist()) for g in range(num_expert_group)]
        kept = sorted(range(num_expert_group), key=lambda g: (-scores[g], g))[:topk_group]
        masked = torch.zeros(num_experts, dtype=torch.float32)
        for g in kept:
            masked[g * per_group:(g + 1) * per_group] = probs[t, g * per_group:(g + 1) * per_group]
        w, i = torch.topk(masked, top_k)
        weights[t], ids[t] = w, i
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sort the flat (token, slot) pairs of ``topk_ids`` ``[T, k]`` by expert, padded per expert.

    Returns:
        sorted_ids: int64 ``[padded]``: flat pair indices ``t * k + j`` (pairs of id ``-1`` left out), expert 0's
            first (in increasing pair order), each expert's run padded with the
            sentinel ``T * k`` to a multiple of ``block_size``; experts with no
            pair get no block.
        block_expert: int64 ``[padded // block_size]``: the expert of each block.
        padded: total length (a multiple of ``block_size``).
    """
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    sorted_ids: list[int] = []
    block_expert: list[int] = []
    for expert in range(num_experts):
        pairs = [p for p, e in enumerate(flat) if e == expert]
        if not pairs:
            continue
        blocks = -(-len(pairs) // block_size)
        sorted_ids += pairs + [sentinel] * (blocks * block_size - len(pairs))
        block_expert += [expert] * blocks
    return (torch.tensor(sorted_ids, dtype=torch.int64), torch.tensor(block_expert, dtype=torch.int64),
            len(sorted_ids))


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """The experts of a MoE layer, one expert at a time.

    Args:
        hidden_states: ``[T, H]`` (float dtype).
        w13: ``[E, 2 * I, H]``: rows ``[:I]`` the gate projection, ``[I:]`` the up projection.
        w2: ``[E, H, I]``: the down projection.
        topk_weights: float ``[T, k]`` routing weights.
        topk_ids: int ``[T, k]`` expert of each slot (``0 <= id < E``; ``-1``: no expert, adds nothing).
        activation: ``"silu"`` (SwiGLU) or ``"gelu"`` (GeGLU, tanh approximation).

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype; a token's slots are added in that dtype,
        expert by expert in increasing id (the order transformers adds them).
    """
    act = F.silu if activation == "silu" else (lambda v: F.gelu(v, approximate="tanh"))
    out = torch.zeros_like(hidden_states)
    inter = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        x = hidden_states[token]
        gate_up = F.linear(x, w13[expert])
        y = F.linear(act(gate_up[:, :inter]) * gate_up[:, inter:], w2[expert])
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
