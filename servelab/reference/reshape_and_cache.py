"""Reference KV-cache write: the spec for :func:`servelab.kernels.reshape_and_cache`."""

from __future__ import annotations

import torch

from servelab._internal.attention_checks import check_reshape_and_cache_args
from servelab.blocks.kv_quant import format_of_dtype, is_static_scale
from servelab.reference import kv_quant


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
    """Scatter this step's new K/V rows into the paged cache, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the caches' dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``;
            may be strided views of one buffer (writes go through the views).
        slot_mapping: int32/int64 ``[n]`` with ``n <= num_tokens``. Row ``t`` goes
            to block ``slot // block_size``, offset ``slot % block_size``. Slot
            ``-1`` is padding and is skipped; rows ``t >= n`` are padding too.
        check_inputs: check slot values (range, no slot written twice); needs a
            host copy of ``slot_mapping``.
        k_scale, v_scale: for a quantized cache (int8 / fp8 storage), float32
            ``[num_blocks, block_size, num_kv_heads]`` (see :mod:`servelab.blocks.kv_quant`):
            a row is quantized with the static scale when the view's block and token
            strides are 0, else with its own scale (:func:`servelab.reference.kv_quant.row_scales`),
            stored at its slot. ``key`` / ``value`` are then float.
    """
    check_reshape_and_cache_args(
        key, value, key_cache, value_cache, slot_mapping, check_values=check_inputs,
        k_scale=k_scale, v_scale=v_scale,
    )
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    rows = torch.nonzero(slots >= 0).flatten()
    slots = slots[rows]
    blocks, offsets = slots // block_size, slots % block_size
    if k_scale is None or v_scale is None:
        key_cache[blocks, offsets] = key[rows]
        value_cache[blocks, offsets] = value[rows]
        return
    for src, cache, scale in ((key[rows], key_cache, k_scale), (value[rows], value_cache, v_scale)):
        fmt = format_of_dtype(cache.dtype)
        assert fmt is not None  # checked above
        static = is_static_scale(scale)
        row_scale = scale[blocks, offsets] if static else kv_quant.row_scales(src, fmt.max_value)
        cache[blocks, offsets] = kv_quant.quantize(src, row_scale, fmt.max_value, fmt.storage_dtype)
        if not static:
            scale[blocks, offsets] = row_scale
