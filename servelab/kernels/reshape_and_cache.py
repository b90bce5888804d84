"""Triton KV-cache write: scatter new K/V rows into the paged cache by slot.

Same signature and semantics as :func:`servelab.reference.reshape_and_cache`.
One program per token copies that token's ``[num_kv_heads, head_size]`` K and
V rows to ``block = slot // block_size``, ``offset = slot % block_size``;
``slot == -1`` (padding) returns without writing. Every access goes through
strides, so the caches may be views of one fused buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._triton_utils import is_interpreted, require_launchable
from servelab._internal.attention_checks import check_reshape_and_cache_args

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_kv_heads,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: nothing to write
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_SIZE)[None, :]
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
                  mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
                    mask=mask)
    k_dst = block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :] * stride_kcd
    v_dst = block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :] * stride_vcd
    tl.store(key_cache_ptr + k_dst, key, mask=mask)
    tl.store(value_cache_ptr + v_dst, value, mask=mask)


INTERPRETED = is_interpreted(_reshape_and_cache_kernel)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_inputs: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the
    caches ``[num_blocks, block_size, num_kv_heads, head_size]`` at
    ``slot_mapping`` (int32/int64 ``[n]``, ``n <= num_tokens``; ``-1`` skips).

    Kernel limits: float16/bfloat16/float32. ``check_inputs`` checks slot
    values (one host sync). Returns nothing; the caches are updated in place.
    A quantized cache (``k_scale`` / ``v_scale``, :mod:`servelab.blocks.kv_quant`) is written by
    the vectorised torch write (:func:`servelab.attention.ops.reshape_and_cache`: each row
    quantized with its own or the static scale); no Triton quantizing write yet.
    """
    check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, check_values=check_inputs,
                                 k_scale=k_scale, v_scale=v_scale)
    if k_scale is not None or v_scale is not None:
        from servelab.attention.ops import reshape_and_cache as torch_write

        torch_write(key, value, key_cache, value_cache, slot_mapping, check_inputs=False, k_scale=k_scale,
                    v_scale=v_scale)
        return
    if key.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"key dtype {key.dtype} is not supported by the Triton kernel (float16, bfloat16, float32)"
        )
    require_launchable("key", key, _reshape_and_cache_kernel)
    num_tokens = slot_mapping.shape[0]  # rows of key past this are padding
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_size = key_cache.shape
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(),
        num_kv_heads,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        HEAD_SIZE=head_size, HEADS_PAD=max(2, triton.next_power_of_2(num_kv_heads)),  # no size-1 tile dims
        HEAD_PAD=triton.next_power_of_2(head_size), PAGE_SIZE=block_size,
        num_warps=4,
    )


__all__ = ["reshape_and_cache"]
