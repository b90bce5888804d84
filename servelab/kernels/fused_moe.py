"""Triton fused experts: a grouped GEMM over the (token, slot) pairs permuted by expert.

Same signature as ``servelab.reference.fused_moe.fused_experts`` (the per-expert
loop) and the other experts kernels (:mod:`servelab.moe.experts`)::

    out = fused_experts(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k])

How (vLLM's ``fused_moe`` structure, two launches):

1. :func:`~servelab.moe.experts.moe_align_block_size` sorts the ``T * k`` pairs
   by expert and pads each expert's run to a multiple of ``BLOCK_M``, so every
   block of ``BLOCK_M`` sorted pairs belongs to one expert (``block_expert``);
   padding rows hold the sentinel ``T * k`` and are masked.
2. ``_gate_up_kernel``: per (pair block, column block of I), gathers the
   pairs' token rows of ``hidden``, multiplies them by the expert's gate and up
   rows of ``w13`` in the same K loop (two accumulators), applies
   ``act(gate) * up`` and writes ``[T * k, I]`` rows at the pairs' flat index.
3. ``_down_kernel``: per (pair block, column block of H), multiplies those rows
   by the expert's ``w2``, scales by the pair's routing weight and writes
   ``[T * k, H]``; the host sums each token's k rows (float32).

An expert with no pair gets no block: its weights are never read. Float32
dots use ``input_precision="ieee"`` (no TF32), so float32 results stay within
rounding of the reference. Runs on CUDA, and on CPU tensors under
``TRITON_INTERPRET=1`` (slow; tests use tiny shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._triton_utils import dot_in_fp32, is_interpreted, require_launchable
from servelab.moe.experts import check_experts_args, moe_align_block_size

__all__ = ["fused_experts", "BLOCK_M"]

BLOCK_M = 16  # pairs per block: tl.dot needs >= 16; the padding is at most BLOCK_M - 1 rows per expert


@triton.jit
def _act(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # silu
        return x / (1.0 + tl.exp(-x))
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # gelu, tanh approximation
    return 0.5 * x * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, hidden, inter,
                    stride_xt, stride_we, stride_wn, stride_ot, TOP_K: tl.constexpr, ACTIVATION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                    UPCAST: tl.constexpr = False):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = tl.where(valid, pairs // TOP_K, 0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w13_ptr + expert * stride_we
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_base + (cols[None, :] + inter) * stride_wn + ks[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong: dot in float32 there
            x, wg, wu = x.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        if IEEE:
            gate += tl.dot(x, wg, input_precision="ieee")
            up += tl.dot(x, wu, input_precision="ieee")
        else:
            gate += tl.dot(x, wg)
            up += tl.dot(x, wu)
    y = _act(gate, ACTIVATION) * up
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w2_ptr, weights_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, hidden, inter,
                 stride_at, stride_we, stride_wn, stride_ot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr = False):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs, 0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w2_ptr + expert * stride_we
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(a_ptr + rows[:, None] * stride_at + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    scale = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    acc = acc * scale[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + cols[None, :], acc, mask=valid[:, None] & col_ok[None, :])


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, activation: str = "silu") -> torch.Tensor:
    """The ``"triton"`` experts kernel (shapes: the module docstring); ``[T, H]`` in the hidden dtype."""
    check_experts_args(hidden_states, w13, w2, topk_weights, topk_ids, activation)
    require_launchable("hidden_states", hidden_states, _gate_up_kernel)
    num_tokens, hidden = hidden_states.shape
    top_k, inter = topk_ids.shape[1], w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or not bool((topk_ids >= 0).any()):
        return hidden_states.new_zeros(num_tokens, hidden)
    x, w13c, w2c = hidden_states.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_ids, block_expert, padded = moe_align_block_size(topk_ids, BLOCK_M, w13.shape[0])
    num_blocks = padded // BLOCK_M
    ieee = x.dtype == torch.float32
    upcast = dot_in_fp32(x.dtype, is_interpreted(_gate_up_kernel))
    act = hidden_states.new_empty(num_pairs, inter)
    block_n, block_k = _block(inter, 64), _block(hidden, 64)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13c, act, sorted_ids, block_expert, num_pairs, hidden, inter, x.stride(0), w13c.stride(0),
        w13c.stride(1), act.stride(0), TOP_K=top_k, ACTIVATION=0 if activation == "silu" else 1,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, UPCAST=upcast)
    pairs_out = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)  # -1 pairs: no block
    weights = topk_weights.reshape(-1).float().contiguous()
    block_n, block_k = _block(hidden, 64), _block(inter, 64)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, w2c, weights, pairs_out, sorted_ids, block_expert, num_pairs, hidden, inter, act.stride(0),
        w2c.stride(0), w2c.stride(1), pairs_out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=ieee, UPCAST=upcast)
    return pairs_out.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
