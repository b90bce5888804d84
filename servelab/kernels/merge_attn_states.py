"""Triton merge of two partial attentions by log-sum-exp.

Same signature and semantics as :func:`servelab.reference.merge_attn_states`:
``w_x = exp(lse_x - max(lse_a, lse_b))``, ``out = (w_a out_a + w_b out_b) /
(w_a + w_b)``, ``lse = max + log(w_a + w_b)``. ``-inf`` marks an empty
partial; two empty partials give 0 and ``-inf``, never NaN. One program
merges ``BLOCK_H`` heads of one token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._triton_utils import is_interpreted, require_launchable
from servelab._internal.attention_checks import check_merge_attn_states_args

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _merge_attn_states_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_ptr, lse_ptr, num_heads,
    stride_at, stride_ah, stride_ad, stride_la_t, stride_la_h,
    stride_bt, stride_bh, stride_bd, stride_lb_t, stride_lb_h,
    stride_ot, stride_oh, stride_od, stride_lo_t, stride_lo_h,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_PAD)
    head_valid = heads < num_heads
    mask = head_valid[:, None] & (dims < HEAD_SIZE)[None, :]
    lse_a = tl.load(lse_a_ptr + token * stride_la_t + heads * stride_la_h, mask=head_valid, other=0.0)
    lse_b = tl.load(lse_b_ptr + token * stride_lb_t + heads * stride_lb_h, mask=head_valid, other=0.0)
    peak = tl.maximum(lse_a, lse_b)
    peak = tl.where(peak == float("-inf"), 0.0, peak)  # both empty: avoid -inf - -inf
    weight_a = tl.exp(lse_a - peak)
    weight_b = tl.exp(lse_b - peak)
    total = weight_a + weight_b
    a = tl.load(out_a_ptr + token * stride_at + heads[:, None] * stride_ah + dims[None, :] * stride_ad,
                mask=mask, other=0.0).to(tl.float32)
    b = tl.load(out_b_ptr + token * stride_bt + heads[:, None] * stride_bh + dims[None, :] * stride_bd,
                mask=mask, other=0.0).to(tl.float32)
    # An empty partial is never read into the result, even if it holds garbage.
    part_a = tl.where(weight_a[:, None] > 0, weight_a[:, None] * a, 0.0)
    part_b = tl.where(weight_b[:, None] > 0, weight_b[:, None] * b, 0.0)
    merged = (part_a + part_b) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
             merged.to(out_ptr.dtype.element_ty), mask=mask)
    merged_lse = tl.where(total > 0, peak + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + token * stride_lo_t + heads * stride_lo_h, merged_lse, mask=head_valid)


INTERPRETED = is_interpreted(_merge_attn_states_kernel)


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions; returns ``(out, lse)``.

    ``out_a``/``out_b``: ``[num_tokens, num_heads, head_size]`` float16/bfloat16/float32;
    ``lse_a``/``lse_b``: float32 ``[num_tokens, num_heads]`` natural-log, ``-inf`` = empty.
    Result: ``out`` in ``out_a``'s dtype (written in place if given) and float32 ``lse``.
    """
    check_merge_attn_states_args(out_a, lse_a, out_b, lse_b, out=out, check_values=check_inputs)
    if out_a.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"out_a dtype {out_a.dtype} is not supported by the Triton kernel (float16, bfloat16, float32)"
        )
    require_launchable("out_a", out_a, _merge_attn_states_kernel)
    num_tokens, num_heads, head_size = out_a.shape
    if out is None:
        out = torch.empty_like(out_a)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=out_a.device)
    if num_tokens == 0 or num_heads == 0:
        return out, lse
    head_pad = triton.next_power_of_2(head_size)
    # Heads per program: enough for ~1-2K elements per program on a GPU; all
    # heads under the interpreter, where each program costs milliseconds.
    block_h = triton.next_power_of_2(num_heads)
    if not INTERPRETED:
        block_h = min(block_h, max(2, 2048 // head_pad))
    block_h = max(2, block_h)  # no size-1 tile dims; masks cover the padding
    _merge_attn_states_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        out_a, lse_a, out_b, lse_b, out, lse, num_heads,
        *out_a.stride(), *lse_a.stride(), *out_b.stride(), *lse_b.stride(),
        *out.stride(), *lse.stride(),
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_H=block_h, num_warps=4,
    )
    return out, lse


__all__ = ["merge_attn_states"]
