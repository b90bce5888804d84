"""Reference KV-cache write: the spec for :func:`servelab.kernels.reshape_and_cache`."""

from __future__ import annotations

import torch

from servelab._internal.attention_checks import check_reshape_and_cache_args


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_inputs: bool = True,
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
    """
    check_reshape_and_cache_args(
        key, value, key_cache, value_cache, slot_mapping, check_values=check_inputs
    )
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    rows = torch.nonzero(slots >= 0).flatten()
    slots = slots[rows]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[rows]
    value_cache[blocks, offsets] = value[rows]
