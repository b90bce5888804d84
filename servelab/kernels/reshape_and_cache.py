"""Triton KV-cache write: scatter new K/V rows into the paged cache by slot.

Same signature and semantics as :func:`servelab.reference.reshape_and_cache`.
One program per token copies that token's ``[num_kv_heads, head_size]`` K and
V rows to ``block = slot // block_size``, ``offset = slot % block_size``;
``slot == -1`` (padding) returns without writing. Every access goes through
strides, so the caches may be views of one fused buffer.

Quantized caches (int8 / float8 pages with float32 scales, :mod:`servelab.blocks.kv_quant`) take
``_quantized_write_kernel``: per token and KV head the scale is ``amax(|x|) / max_value`` (1 for an
all-zero head), stored in the scale page, or the static scale read from it (block and token strides
0); then ``x / scale`` clamped to ``±max_value`` and rounded as the format does (int8: half to even;
float8: to nearest even, as the cast; done with integer ops), scattered like the float write. The same float32
operations as the torch write (:func:`servelab.blocks.kv_quant.quantize_rows`): divisions are
``div_rn`` (a GPU's ``/`` is an approximate division), so the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.attention.backends import triton_device_problem
from servelab.blocks import kv_quant
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


ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + M) - M rounds |y| < 2^22 half to even in float32 arithmetic


@triton.jit
def _float8_bits(y, MANTISSA: tl.constexpr, REBIAS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                 SUBNORMAL_STEPS: tl.constexpr):
    """The float8 byte of finite float32 ``y`` (already within the format's range), rounded to
    nearest even as torch's cast: in integer ops, because the interpreter's float8 cast was off
    (128.0 became 64.0 as e4m3) and integer ops give the same bits everywhere. A normal value
    keeps the top MANTISSA bits of float32's mantissa (round half to even on the dropped bits) and
    moves its exponent by REBIAS (127 - the format's bias); a subnormal is round(|y| *
    SUBNORMAL_STEPS) steps of the smallest subnormal (the magic-number rounding above)."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MANTISSA
    rounded = (magnitude + ((1 << (drop - 1)) - 1) + ((magnitude >> drop) & 1)) >> drop
    normal = rounded - (REBIAS << MANTISSA)
    subnormal = ((tl.abs(y) * SUBNORMAL_STEPS + ROUND_MAGIC) - ROUND_MAGIC).to(tl.uint32)
    return (sign | tl.where(tl.abs(y) >= MIN_NORMAL, normal, subnormal)).to(tl.uint8)


@triton.jit
def _quantize_heads(src_ptr, stride_t, stride_h, stride_d, token, cache_ptr, stride_cb, stride_cs, stride_ch,
                    stride_cd, scale_ptr, stride_sb, stride_ss, stride_sh, block, offset, num_kv_heads, max_value,
                    HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
                    STATIC: tl.constexpr, KV_FORMAT: tl.constexpr):
    """One token's ``[num_kv_heads, HEAD_SIZE]`` row: scale per head (computed and stored, or the
    static one read), quantized (KV_FORMAT 1 int8, 2 float8 e4m3fn, 3 float8 e5m2: pages as bytes),
    stored."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    head_ok = heads < num_kv_heads
    mask = head_ok[:, None] & (dims < HEAD_SIZE)[None, :]
    x = tl.load(src_ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :] * stride_d, mask=mask,
                other=0.0).to(tl.float32)
    scale_at = scale_ptr + block * stride_sb + offset * stride_ss + heads * stride_sh
    if STATIC:
        scale = tl.load(scale_at, mask=head_ok, other=1.0)
    else:
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, max_value, tl.float32)), 1.0)
        tl.store(scale_at, scale, mask=head_ok)
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    y = tl.minimum(tl.maximum(y, -max_value), max_value)
    if KV_FORMAT == 1:
        q = ((y + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int8)
    elif KV_FORMAT == 2:
        q = _float8_bits(y, 3, 120, 0.015625, 512.0)  # e4m3fn: bias 7, smallest normal 2^-6, subnormals k * 2^-9
    else:
        q = _float8_bits(y, 2, 112, 6.103515625e-05, 65536.0)  # e5m2: bias 15, 2^-14, k * 2^-16
    tl.store(cache_ptr + block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch
             + dims[None, :] * stride_cd, q, mask=mask)


@triton.jit
def _quantized_write_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    num_kv_heads, max_value,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_ksb, stride_kss, stride_ksh,
    stride_vsb, stride_vss, stride_vsh,
    HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    STATIC_K: tl.constexpr, STATIC_V: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: nothing to write
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    _quantize_heads(key_ptr, stride_kt, stride_kh, stride_kd, token, key_cache_ptr, stride_kcb, stride_kcs,
                    stride_kch, stride_kcd, k_scale_ptr, stride_ksb, stride_kss, stride_ksh, block, offset,
                    num_kv_heads, max_value, HEAD_SIZE, HEADS_PAD, HEAD_PAD, STATIC_K, KV_FORMAT)
    _quantize_heads(value_ptr, stride_vt, stride_vh, stride_vd, token, value_cache_ptr, stride_vcb, stride_vcs,
                    stride_vch, stride_vcd, v_scale_ptr, stride_vsb, stride_vss, stride_vsh, block, offset,
                    num_kv_heads, max_value, HEAD_SIZE, HEADS_PAD, HEAD_PAD, STATIC_V, KV_FORMAT)


INTERPRETED = is_interpreted(_reshape_and_cache_kernel)
#: storage dtype -> the quantized write's KV_FORMAT (the attention kernel's codes)
QUANT_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


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
    A quantized cache (``k_scale`` / ``v_scale`` float32 ``[num_blocks, block_size, num_kv_heads]``,
    static ones with block and token strides 0; :mod:`servelab.blocks.kv_quant`) is written by
    ``_quantized_write_kernel`` (the bits of the torch write) when its format is a registered
    :class:`~servelab.blocks.kv_quant.ScaledFormat` over int8 / float8 pages; any other format by
    the torch write (:func:`servelab.attention.ops.reshape_and_cache`).
    """
    check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, check_values=check_inputs,
                                 k_scale=k_scale, v_scale=v_scale)
    if k_scale is not None or v_scale is not None:
        # (one scale without the other falls to the torch write, which refuses it)
        if not (k_scale is not None and v_scale is not None
                and _quantized_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)):
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


def _quantized_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> bool:
    """The quantizing write by ``_quantized_write_kernel`` when it takes these (float16 / bfloat16 /
    float32 rows; a :class:`~servelab.blocks.kv_quant.ScaledFormat` over int8 / float8 pages;
    a device Triton launches on); True when it wrote (or there was nothing to write)."""
    fmt = kv_quant.format_of_dtype(key_cache.dtype)
    if not (isinstance(fmt, kv_quant.ScaledFormat) and key_cache.dtype in QUANT_FORMATS
            and key.dtype in KERNEL_DTYPES and value.dtype in KERNEL_DTYPES
            and triton_device_problem(key.device, interpreted=INTERPRETED) is None):
        return False
    num_tokens = slot_mapping.shape[0]  # rows of key past this are padding
    if num_tokens == 0:
        return True
    _, block_size, num_kv_heads, head_size = key_cache.shape
    # float8 pages as bytes: the kernel casts, then bitcasts (Triton takes no float8 CPU tensors)
    k_pages, v_pages = (key_cache, value_cache) if key_cache.dtype is torch.int8 else (
        key_cache.view(torch.uint8), value_cache.view(torch.uint8))
    _quantized_write_kernel[(num_tokens,)](
        key, value, k_pages, v_pages, k_scale, v_scale, slot_mapping.contiguous(), num_kv_heads,
        float(fmt.max_value), *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        *k_scale.stride(), *v_scale.stride(),
        HEAD_SIZE=head_size, HEADS_PAD=max(2, triton.next_power_of_2(num_kv_heads)),
        HEAD_PAD=triton.next_power_of_2(head_size), PAGE_SIZE=block_size,
        STATIC_K=kv_quant.is_static_scale(k_scale), STATIC_V=kv_quant.is_static_scale(v_scale),
        KV_FORMAT=QUANT_FORMATS[key_cache.dtype], num_warps=4,
    )
    return True


__all__ = ["reshape_and_cache"]
