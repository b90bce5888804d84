"""Vectorised torch versions of the KV-cache write and the attention-state merge.

The defaults of :class:`~servelab.attention.backends.AttentionBackend` (so
the ``"sdpa"`` backend and any researcher's backend get them for free). Same
signatures, checks and results as the references
(:mod:`servelab.reference.reshape_and_cache`,
:mod:`servelab.reference.merge_attn_states`), which the tests hold them to;
the difference is the hot path: with ``check_inputs=False`` and no skipped
slot the write is two ``index_copy_`` calls, or on a CPU in float32 one C call
(``servelab_write_kv`` in ``csrc/decode_attention.c``, a plain row copy: the
same result), which a decode step's few rows wanted: one row of K and V per layer
took 15.3 us through the two ``index_copy_`` calls and 9.2 us through the C call
(checks included; a SmolLM2 batch-16 decode step 1.4% faster).
"""

from __future__ import annotations

import torch

from servelab._internal.attention_checks import check_merge_attn_states_args, check_reshape_and_cache_args
from servelab.attention import cpu_decode
from servelab.blocks import kv_quant

_library = cpu_decode.LibraryOnce()  # the C write's library (None: torch only)


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
    """Scatter ``key`` / ``value`` ``[T, Hk, D]`` into the caches ``[N, B, Hk, D]``
    at ``slot_mapping`` int32/int64 ``[n <= T]`` (``-1`` skips a row), in place.

    ``check_inputs=False`` skips every check, shapes included (unlike the
    reference): the model passes it for layers after the first, whose
    identical call was checked. ``k_scale`` / ``v_scale``: a quantized cache's
    scales, as the reference's (each row quantized as it is written)."""
    if check_inputs:
        check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping, check_values=True,
                                     k_scale=k_scale, v_scale=v_scale)
    if slot_mapping.shape[0] == 0:
        return
    write_prepared(key, value, key_cache, value_cache, *prepare_slots(slot_mapping), k_scale=k_scale,
                   v_scale=v_scale)


def write_prepared(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slots: torch.Tensor, rows: torch.Tensor | None, top: int = -1, *,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """The write of :func:`reshape_and_cache` with the slots of :func:`prepare_slots` (no checks):
    the model prepares them once per step and writes every layer with this. ``top``: the
    largest slot (:func:`prepare_slots`'s third value), which lets the C write bound-check once."""
    if k_scale is None and rows is None and top >= 0 and _write_in_c(key, value, key_cache, value_cache, slots,
                                                                     top):
        return
    if rows is None:
        key, value = key[: slots.shape[0]], value[: slots.shape[0]]
    else:  # padding rows skipped
        key, value = key[rows], value[rows]
    if k_scale is not None and v_scale is not None:
        _write_quantized(key, value, key_cache, value_cache, slots, k_scale, v_scale)
        return
    for src, cache in ((key, key_cache), (value, value_cache)):
        num_blocks, block_size = cache.shape[:2]
        if num_blocks < 2 or cache.stride(0) == block_size * cache.stride(1):
            # A flattenable cache (every layout but "block_outermost"): one
            # index_copy_ over [N * B, Hk, D] rows, no block/offset split.
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src)  # view: never a silent copy
        else:
            cache.index_put_((slots // block_size, slots % block_size), src)


def _scatter_rows(cache: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """``cache[slot // B, slot % B] = src`` for ``cache`` ``[N, B, ...]`` (float8 moved as its bytes:
    CPU torch has no float8 ``index_copy_``)."""
    if cache.dtype.is_floating_point and cache.element_size() == 1:
        cache, src = cache.view(torch.uint8), src.view(torch.uint8)
    num_blocks, block_size = cache.shape[:2]
    if num_blocks < 2 or cache.stride(0) == block_size * cache.stride(1):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src)
    else:
        cache.index_put_((slots // block_size, slots % block_size), src)


def _write_quantized(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slots: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Quantize each row (its own scale, stored beside it; or the static scale) and scatter it."""
    if _write_int8_in_c(key, value, key_cache, value_cache, slots, k_scale, v_scale):
        return
    fmt = kv_quant.format_of_dtype(key_cache.dtype)
    if fmt is None:
        raise ValueError(f"key_cache dtype {key_cache.dtype} is not a registered KV-cache format")
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        static = kv_quant.is_static_scale(scale)
        data, row_scale = kv_quant.quantize_rows(src, fmt, scale[0, 0] if static else None)
        _scatter_rows(cache, slots, data)
        if not static:
            _scatter_rows(scale, slots, row_scale)


def int8_write_takes(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slots: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> bool:
    """Whether ``servelab_write_kv_int8`` takes these: float32 CPU rows ``[n, Hk, D]`` with heads and
    dimensions contiguous, int8 pages with unit element stride, contiguous int64 ``slots`` (at most
    one per row), both scales static or both in the pages, and the library built."""
    n = slots.shape[0]
    if not (key_cache.dtype is torch.int8 and value_cache.dtype is torch.int8 and key.dtype is torch.float32
            and value.dtype is torch.float32 and key.is_cpu and key_cache.is_cpu and slots.dtype is torch.int64
            and slots.is_contiguous() and kv_quant.is_static_scale(k_scale) == kv_quant.is_static_scale(v_scale)
            and n <= key.shape[0] and n <= value.shape[0] and key_cache.stride(3) == 1
            and value_cache.stride(3) == 1):
        return False
    d = key.shape[2]
    for src in (key, value):
        if src.dim() != 3 or src.stride(2) != 1 or src.stride(1) != d:
            return False
    return _library() is not None


def _write_int8_in_c(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slots: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> bool:
    """The int8 quantizing write in one C call (``servelab_write_kv_int8``: the same float32 operations
    as :func:`kv_quant.quantize_rows` and the scatter, so the same bits) when it takes these
    (:func:`int8_write_takes`). True when it wrote."""
    if not int8_write_takes(key, value, key_cache, value_cache, slots, k_scale, v_scale):
        return False
    cache_strides = cpu_decode.int64s((*key_cache.stride()[:3], *value_cache.stride()[:3]))
    scale_strides = cpu_decode.int64s((*k_scale.stride(), *v_scale.stride()))
    _library().servelab_write_kv_int8(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                        key_cache.data_ptr(), value_cache.data_ptr(), cache_strides.data_ptr(),
                                        k_scale.data_ptr(), v_scale.data_ptr(), scale_strides.data_ptr(),
                                        int(kv_quant.is_static_scale(k_scale)), slots.data_ptr(), slots.shape[0],
                                        key.shape[1], key.shape[2], key_cache.shape[1])
    return True


def prepare_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """int64 slots without the ``-1`` rows, the kept row indices (``None``: all kept), and the
    largest slot (``-1`` when there is none or the slots are not on a CPU)."""
    slots, rows = slot_mapping.long(), None
    if bool((slots < 0).any()):  # padding rows (one host read; free for CPU tensors)
        rows = torch.nonzero(slots >= 0).flatten()
        slots = slots[rows]
    top = int(slots.max()) if slots.is_cpu and slots.numel() else -1
    return slots.contiguous(), rows, top


def _write_in_c(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slots: torch.Tensor, top: int) -> bool:
    """Write with ``servelab_write_kv`` when it takes these (float32 CPU tensors; caches
    contiguous ``[N, B, Hk, D]``; ``key`` / ``value`` rows ``[n >= len(slots), Hk, D]`` each
    contiguous; every slot ``< N * B``); True when it wrote."""
    n = slots.shape[0]
    if key.shape[1:] != value.shape[1:]:
        return False
    for src, cache in ((key, key_cache), (value, value_cache)):
        if not (src.dtype is torch.float32 and cache.dtype is torch.float32 and src.is_cpu and cache.is_cpu
                and src.dim() == 3 and cache.dim() == 4 and src.shape[1:] == cache.shape[2:]
                and src.shape[0] >= n and src.stride(2) == 1 and src.stride(1) == src.shape[2]
                and cache.is_contiguous() and top < cache.shape[0] * cache.shape[1]):
            return False
    lib = _library()
    if lib is None:
        return False
    lib.servelab_write_kv(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), key_cache.data_ptr(),
                          value_cache.data_ptr(), slots.data_ptr(), n, key.shape[1] * key.shape[2])
    return True


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions ``[T, H, D]`` by their LSEs ``[T, H]`` (float32,
    float64 with float64 outputs; ``-inf`` = empty partial). Returns
    ``(out, lse)``; two empty partials give 0 and ``-inf``, never NaN."""
    check_merge_attn_states_args(out_a, lse_a, out_b, lse_b, out=out, check_values=check_inputs)
    compute = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    lse_a, lse_b = lse_a.to(compute), lse_b.to(compute)
    peak = torch.maximum(lse_a, lse_b)
    peak = torch.where(torch.isinf(peak), 0.0, peak)  # both empty: exp(-inf - 0) = 0, not NaN
    weight_a, weight_b = torch.exp(lse_a - peak), torch.exp(lse_b - peak)
    total = weight_a + weight_b
    # An empty partial's output is never read (it may hold garbage).
    part_a = torch.where(weight_a[..., None] > 0, weight_a[..., None] * out_a.to(compute), 0.0)
    part_b = torch.where(weight_b[..., None] > 0, weight_b[..., None] * out_b.to(compute), 0.0)
    merged = (part_a + part_b) / torch.where(total > 0, total, 1.0)[..., None]
    if out is None:
        out = torch.empty_like(out_a)
    out.copy_(merged)
    return out, peak + torch.log(total)
