"""Decode attention straight over quantized KV pages on a CPU: the C kernel
``servelab_paged_decode_quant`` (``csrc/decode_attention_quant.c``, in the one CPU-kernel library
of :mod:`servelab.attention.cpu_kernel_build`).

The ``"sdpa"`` backend calls it for a pure decode step (one query row per sequence) over int8 /
float8 pages (:mod:`servelab.blocks.kv_quant`): each head reads its positions from the pages
through the block table (1 byte per element plus one float32 scale per token and head), converts
16 rows at a time into a float32 tile in L1 (int8 by a cast, float8 by integer field moves: fp8 ->
fp32 in C; head sizes that are not a multiple of 16: one row at a time) and never makes a
dequantized copy of the cache; the carried dense K/V of :mod:`servelab.attention.decode_kv`
is not used over quantized pages (it would be a float32 copy of the context, the very read the
quantization removes). Other steps (prompts, chunks, trees) take the gathered path of
:mod:`servelab.attention.sdpa`, dequantizing each group's gathered K/V.

Scope: CPU, float32 query, head size <= 512, K/V pages with unit element stride; any block /
token / head strides (both layouts, static scales included). Reference: the float64
dequantize-then-attend reference (:func:`servelab.reference.paged_attention` with
``k_scale`` / ``v_scale``); tests hold the kernel to it (``tests/kv_quant``).
"""

from __future__ import annotations

import torch

from servelab.attention import cpu_decode

__all__ = ["FORMATS", "paged_decode", "usable"]

#: storage dtype -> the kernel's format code
FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
MAX_HEAD_SIZE = 512

_library = cpu_decode.LibraryOnce()


def usable(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these (and the library is built and enabled)."""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and key_cache.dtype in FORMATS
            and value_cache.dtype == key_cache.dtype and key_cache.device.type == "cpu"
            and query.shape[-1] <= MAX_HEAD_SIZE and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
            and query.stride(2) == 1 and query.stride(1) == query.shape[2] and _library() is not None)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one query row per sequence (row ``i`` at position ``seq_lens[i] - 1``) over
    quantized pages: ``query`` float32 ``[S, Hq, D]``; caches ``[N, B, Hk, D]`` int8 / float8;
    scales float32 ``[N, B, Hk]`` (stride 0 for static ones); ``block_table`` int32 ``[S, max_blocks]``;
    ``seq_lens`` int32 ``[S]``. Returns float32 ``[S, Hq, D]``. Unchecked (the caller checked the
    step's arguments and :func:`usable`)."""
    rows, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    lens = seq_lens.contiguous()
    width = int(lens.max()) if rows else 0
    out = torch.empty((rows, num_q_heads, head_size), dtype=torch.float32)
    if rows == 0:
        return out
    scores = torch.empty((rows * num_kv_heads, group, width), dtype=torch.float32)
    cache_strides = torch.tensor([*key_cache.stride()[:3], *value_cache.stride()[:3]], dtype=torch.int64)
    scale_strides = torch.tensor([*k_scale.stride(), *v_scale.stride()], dtype=torch.int64)
    code = _library().servelab_paged_decode_quant(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), cache_strides.data_ptr(),
        k_scale.data_ptr(), v_scale.data_ptr(), scale_strides.data_ptr(), table.data_ptr(), table.stride(0),
        lens.data_ptr(), rows, num_kv_heads, group, head_size, key_cache.shape[1], int(sliding_window or 0),
        FORMATS[key_cache.dtype], float(scale), scores.data_ptr(), width, out.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise ValueError(f"servelab_paged_decode_quant refused head_size={head_size} / {key_cache.dtype}")
    return out
