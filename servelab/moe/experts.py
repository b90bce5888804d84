"""The experts piece: token permutation by expert and the fused-experts computation, with a registry.

An experts kernel is any callable with :class:`ExpertsKernel`'s signature::

    out = kernel(hidden_states [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k],
                 activation="silu")   # -> [T, H]

computing ``sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` with
``e = topk_ids[t, j]`` (``w13`` rows ``[:I]`` gate, ``[I:]`` up: the layout of
transformers' ``experts.gate_up_proj``). An id of ``-1`` means "no expert here"
(the pair adds nothing): expert parallelism marks the pairs of experts that
live on other ranks so. Registered names
(:func:`register_experts_kernel`, :func:`get_experts_kernel`, :func:`available_experts_kernels`):

- ``"cpu"``: :func:`fused_experts_cpu` — the (token, slot) pairs gathered once in
  expert order (:func:`sort_by_expert`), one GEMM pair per expert on a contiguous
  run, the k slots of a token summed in float32.
- ``"triton"``: :func:`servelab.kernels.fused_moe.fused_experts` — a grouped GEMM
  over the pairs padded per expert to the kernel's block (:func:`moe_align_block_size`).
- ``"reference"``: the per-expert loop (``servelab.reference.fused_moe``).

``"auto"`` (:func:`default_experts_kernel`) is ``"triton"`` on CUDA and ``"cpu"`` elsewhere.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from servelab._internal.registry import Registry

__all__ = ["ACTIVATIONS", "ExpertsKernel", "available_experts_kernels", "check_experts_args",
           "default_experts_kernel", "fused_experts_cpu", "get_experts_kernel", "moe_align_block_size",
           "register_experts_kernel", "sort_by_expert"]

ACTIVATIONS = ("silu", "gelu")


@runtime_checkable
class ExpertsKernel(Protocol):
    """``(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k], *,
    activation) -> [T, H]`` in the hidden dtype."""

    def __call__(self, hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, activation: str = "silu") -> torch.Tensor: ...


def check_experts_args(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, activation: str) -> None:
    """``ValueError`` naming the first argument whose shape, dtype or value does not fit the others."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    num_tokens, hidden = hidden_states.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2*I, H={hidden}], got shape {tuple(w13.shape)}")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"w2 must be [E={experts}, H={hidden}, I={inter}], got shape {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32/int64 [T={num_tokens}, k], got shape {tuple(topk_ids.shape)} "
                         f"dtype {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape "
                         f"{tuple(topk_ids.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; valid: {', '.join(ACTIVATIONS)}")
    if topk_ids.numel():
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < -1 or high >= experts:
            raise ValueError(f"topk_ids holds expert {low if low < -1 else high}, outside [0, {experts}) "
                             "(or -1: no expert)")


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat (token, slot) pairs ``t * k + j`` of ``topk_ids`` ``[T, k]`` in expert order (stable: a
    pair's order inside its expert is increasing; pairs of id ``-1`` last), and int64
    ``[num_experts]`` pairs per expert (the ``-1`` pairs not counted)."""
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, num_experts, flat)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts + 1)[:num_experts]


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`sort_by_expert` with each expert's run padded to a multiple of ``block_size``.

    Returns ``(sorted_ids int64 [padded], block_expert int64 [padded // block_size], padded)``:
    flat pair indices in expert order, the sentinel ``T * k`` in the padding, each block's expert;
    an expert with no pair has no block. Same result as the reference's loop."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive int")
    order, counts = sort_by_expert(topk_ids, num_experts)
    order = order[:int(counts.sum())]  # the -1 pairs (sorted last) take no slot
    device = topk_ids.device
    padded_counts = (counts + block_size - 1) // block_size * block_size
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    starts = torch.cumsum(counts, 0) - counts
    expert_of_sorted = topk_ids.reshape(-1).long()[order]
    dest = padded_starts[expert_of_sorted] + torch.arange(order.numel(), device=device) - starts[expert_of_sorted]
    total = int(padded_counts.sum())
    sorted_ids = torch.full((total,), topk_ids.numel(), dtype=torch.int64, device=device)
    sorted_ids[dest] = order
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=device), padded_counts // block_size)
    return sorted_ids, block_expert, total


def _activation(name: str):
    return F.silu if name == "silu" else (lambda v: F.gelu(v, approximate="tanh"))


def fused_experts_cpu(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """The ``"cpu"`` experts kernel (shapes in the module docstring): one gather of the pairs in
    expert order, two GEMMs per expert that has pairs, one scatter back, a float32 weighted sum
    over the k slots (float64 for float64 inputs). No per-expert ``torch.where`` (the reference's cost
    grows with E x T)."""
    check_experts_args(hidden_states, w13, w2, topk_weights, topk_ids, activation)
    num_tokens, top_k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    x = hidden_states[order // top_k]  # [T*k, H], expert-major (the -1 pairs last)
    out = torch.zeros_like(x)  # the -1 pairs' rows stay zero
    inter, act = w13.shape[1] // 2, _activation(activation)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        gate_up = torch.mm(x[start:start + count], w13[expert].t())
        torch.mm(act(gate_up[:, :inter]) * gate_up[:, inter:], w2[expert].t(), out=out[start:start + count])
        start += count
    pairs = torch.empty_like(out)
    pairs[order] = out
    acc = torch.promote_types(hidden_states.dtype, torch.float32)  # float32, or float64 for float64 inputs
    weighted = pairs.view(num_tokens, top_k, hidden_states.shape[1]).to(acc) * topk_weights.to(acc).unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def _check_kernel(obj: object) -> None:
    if not callable(obj):
        raise TypeError(f"an experts kernel must be callable with ExpertsKernel's signature, got {type(obj).__name__}")


_KERNELS: Registry[ExpertsKernel] = Registry("experts kernel", check=_check_kernel)
_KERNELS.register("cpu", "servelab.moe.experts:fused_experts_cpu")
_KERNELS.register("triton", "servelab.kernels.fused_moe:fused_experts")
_KERNELS.register("reference", "servelab.reference.fused_moe:fused_experts")


def default_experts_kernel(device: torch.device | str) -> str:
    """``"triton"`` on CUDA, ``"cpu"`` elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "cpu"


def register_experts_kernel(name: str, kernel: ExpertsKernel | str, *, override: bool = False) -> None:
    """Register ``kernel`` (a callable or a lazy ``"module:attr"``) under ``name``."""
    _KERNELS.register(name, kernel, override=override)


def get_experts_kernel(name_or_kernel: str | ExpertsKernel) -> ExpertsKernel:
    """The kernel registered as ``name`` (``ValueError`` listing the known names), or the callable itself."""
    return _KERNELS.get(name_or_kernel)


def available_experts_kernels() -> list[str]:
    """Registered experts-kernel names, sorted."""
    return _KERNELS.available()
