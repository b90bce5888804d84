"""Decode attention straight over quantized KV pages on a CPU: the C kernel
``servelab_paged_decode_quant`` (``csrc/decode_attention_quant.c``, in the one CPU-kernel library
of :mod:`servelab.attention.cpu_kernel_build`).

The ``"sdpa"`` backend calls it for a pure decode step (one query row per sequence) over int8 /
float8 pages (:mod:`servelab.blocks.kv_quant`): each head reads its positions from the pages
through the block table (1 byte per element plus one float32 scale per token and head), converts
them to float32 16 positions at a time (int8 by a cast, float8 by integer field moves: fp8 -> fp32
in C), in registers where the CPU allows (keys transposed as bytes with AVX-512 BW or AVX2, values
read in place with AVX2), else through a float32 tile in L1 (head sizes that are not a multiple of
16: one row at a time), and never makes a dequantized copy of the cache; the carried dense K/V of :mod:`servelab.attention.decode_kv`
is not used over quantized pages (it would be a float32 copy of the context, the very read the
quantization removes). Other steps (prompts, chunks, trees) take the gathered path of
:mod:`servelab.attention.sdpa`, dequantizing each group's gathered K/V.

Scope: CPU, float32 query, head size <= 512, K/V pages with unit element stride; any block /
token / head strides (both layouts, static scales included). Reference: the float64
dequantize-then-attend reference (:func:`servelab.reference.paged_attention` with
``k_scale`` / ``v_scale``); tests hold the kernel to it (``tests/kv_quant``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from servelab.attention import cpu_decode, ops
from servelab.blocks import kv_quant

__all__ = ["FORMATS", "DecodeStep", "paged_decode", "usable"]

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
    return DecodeStep(block_table, seq_lens, sliding_window).attend(query, key_cache, value_cache, k_scale, v_scale,
                                                                    scale)


class Int8Step(NamedTuple):
    """:meth:`DecodeStep.int8_step`: the arguments of ``servelab_write_decode_int8`` that come from the
    step (addresses as integers)."""

    static_scales: int  # 1: one static scale per layer for K and for V; 0: per token and head in the pages
    cache_strides: int  # int64 [6]: the K and V pages' byte strides (block, offset, head)
    scale_strides: int  # int64 [6]: the scales' strides, in floats
    block_table: int  # int32 [rows, table_stride]
    table_stride: int
    seq_lens: int  # int32 [rows]
    width: int  # the longest context
    scores: int  # the kernel's float32 workspace, one slot per thread


class DecodeStep:
    """What every layer's kernel call of one pure decode step shares, prepared once per step.

    Made by the model's per-step attention (:class:`servelab.models.step_attention.StepAttention`)
    from the step's ``block_table`` int32 ``[S, max_blocks]`` and ``seq_lens`` int32 ``[S]`` (one
    query row per sequence, checked by the caller): the table and lengths as the kernel reads them,
    the longest context, the scores workspace, and, per layout of the tensors a layer passes (dtypes,
    shapes, strides), whether the kernel and the C int8 write take them and the stride arrays they
    read. A layer is then the write and the kernel call: on SmolLM2's batch-16 decode step the
    per-layer Python around them was ~60 us (the arguments rebuilt, the pure-decode check on the
    query offsets, the backend's dispatch), a fifth of the attention's time at 2 threads.
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, sliding_window: int | None) -> None:
        self.table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
        self.lens = seq_lens.contiguous()
        self.rows = self.lens.shape[0]
        self.width = int(self.lens.max()) if self.rows else 0
        self.window = int(sliding_window or 0)
        self._layouts: dict[tuple, Any] = {}  # layout key -> _layout()'s answer
        self._scores: torch.Tensor | None = None  # the kernel's workspace, reused by every layer
        self._retired: list[torch.Tensor] = []  # outgrown workspaces (see _workspace)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor,
               v_scale: torch.Tensor, scale: float) -> torch.Tensor:
        """:func:`paged_decode` of this step's rows (the caller checked :func:`usable`)."""
        rows, num_q_heads, head_size = query.shape
        num_kv_heads = key_cache.shape[2]
        group = num_q_heads // num_kv_heads
        out = torch.empty((rows, num_q_heads, head_size), dtype=torch.float32)
        if rows == 0:
            return out
        threads = torch.get_num_threads()
        scores = self._workspace(max(1, threads) * num_kv_heads * group * self.width)
        cache_strides = cpu_decode.int64s((*key_cache.stride()[:3], *value_cache.stride()[:3]))
        scale_strides = cpu_decode.int64s((*k_scale.stride(), *v_scale.stride()))
        code = _library().servelab_paged_decode_quant(
            query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), cache_strides.data_ptr(),
            k_scale.data_ptr(), v_scale.data_ptr(), scale_strides.data_ptr(), self.table.data_ptr(),
            self.table.stride(0), self.lens.data_ptr(), rows, num_kv_heads, group, head_size, key_cache.shape[1],
            self.window, FORMATS[key_cache.dtype], float(scale), scores.data_ptr(), self.width, out.data_ptr(),
            threads)
        if code != 0:
            raise ValueError(f"servelab_paged_decode_quant refused head_size={head_size} / {key_cache.dtype}")
        return out

    def write_and_attend(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor,
                         scale: float) -> torch.Tensor | None:
        """Write this step's ``key`` / ``value`` float32 ``[S, Hk, D]`` at ``slots`` int64 ``[S]`` (one
        per row, none padding: the caller's prepared slots) and attend ``query`` float32 ``[S, Hq, D]``
        over the pages (int8: one C call); ``None`` (nothing written) when the kernel or the C int8
        write does not take this layer's tensors (then the public ops do both). Float8 pages are
        written by :func:`servelab.attention.ops.write_prepared` (torch), then attended here."""
        layout = self._layout_of(key, value, query, key_cache, value_cache, k_scale, v_scale, slots)
        if layout is None:
            return None
        if layout[0]:  # int8: the write and the kernel in one C call (the same bits as the two)
            out = torch.empty(query.shape, dtype=torch.float32)
            code = _library().servelab_write_decode_int8(*self._int8_args(
                layout, key, value, query, key_cache, value_cache, k_scale, v_scale, slots, scale, out))
            if code != 0:
                raise ValueError(f"servelab_write_decode_int8 refused head_size={query.shape[2]}")
            return out
        ops.write_prepared(key, value, key_cache, value_cache, slots, None, k_scale=k_scale, v_scale=v_scale)
        return self.attend(query, key_cache, value_cache, k_scale, v_scale, scale)

    def int8_step(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor,
                  num_threads: int) -> Int8Step | None:
        """This step's side of the one C call :meth:`write_and_attend` makes on int8 pages for tensors
        laid out as these (any layer whose tensors share their dtypes, shapes and strides), for a
        caller that makes the calls itself with ``num_threads`` threads
        (:mod:`servelab.models.quantized_decode_layers`); ``None`` when it would not make that call.
        The addresses stay valid while this step lives."""
        layout = self._layout_of(key, value, query, key_cache, value_cache, k_scale, v_scale, slots)
        return None if layout is None or not layout[0] else self._step_side(layout, num_threads)

    def _step_side(self, layout: tuple, num_threads: int) -> Int8Step:
        """:meth:`int8_step` for a layout :meth:`_layout` accepted for int8 (the workspace sized for
        ``num_threads``: one slot per thread)."""
        _, static, cache_strides, scale_strides, kv_heads, group, _, _, _ = layout
        scores = self._workspace(max(1, num_threads) * kv_heads * group * self.width)
        return Int8Step(static, cache_strides, scale_strides, self.table.data_ptr(), self.table.stride(0),
                        self.lens.data_ptr(), self.width, scores.data_ptr())

    def _int8_args(self, layout: tuple, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   slots: torch.Tensor, scale: float, out: torch.Tensor) -> tuple:
        """``servelab_write_decode_int8``'s arguments for a layout :meth:`_layout` accepted for int8."""
        kv_heads, group, head_size, block_size = layout[4:8]
        threads = torch.get_num_threads()
        step = self._step_side(layout, threads)
        return (key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(), step.static_scales,
                query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), step.cache_strides,
                k_scale.data_ptr(), v_scale.data_ptr(), step.scale_strides, step.block_table, step.table_stride,
                step.seq_lens, self.rows, kv_heads, group, head_size, block_size, self.window, float(scale),
                step.scores, step.width, out.data_ptr(), threads)

    def _layout_of(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                   slots: torch.Tensor) -> tuple | None:
        """:meth:`_layout` of these tensors, asked once per layout and step."""
        layout_key = self._layout_key(key, value, query, key_cache, value_cache, k_scale, v_scale)
        layout: Any = self._layouts.get(layout_key, _UNSEEN)
        if layout is _UNSEEN:
            layout = self._layouts[layout_key] = self._layout(key, value, query, key_cache, value_cache, k_scale,
                                                              v_scale, slots)
        return layout

    @staticmethod
    def _layout_key(key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> tuple:
        return (query.dtype, query.shape, query.stride(), key.dtype, key.shape, key.stride(), value.dtype,
                value.stride(), key_cache.dtype, value_cache.dtype, key_cache.shape, key_cache.stride(),
                value_cache.stride(), k_scale.stride(), v_scale.stride(), query.device, key_cache.device)

    def _layout(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                slots: torch.Tensor) -> tuple | None:
        """What the int8 call reads beside the tensors (whether the C int8 write takes these, its static
        flag, the stride arrays' addresses, the head counts and sizes), or ``None`` when the kernel
        does not take them, its refusal of the head size included, or the rows are not the step's
        (asked once per layout and step)."""
        if not (usable(query, key_cache, value_cache) and query.shape[0] == self.rows == slots.shape[0]
                and key.shape[0] == value.shape[0] == self.rows and slots.dtype is torch.int64):
            return None
        num_kv_heads = key_cache.shape[2]
        cache_strides = cpu_decode.int64s((*key_cache.stride()[:3], *value_cache.stride()[:3]))
        scale_strides = cpu_decode.int64s((*k_scale.stride(), *v_scale.stride()))
        return (ops.int8_write_takes(key, value, key_cache, value_cache, slots, k_scale, v_scale),
                int(kv_quant.is_static_scale(k_scale)), cache_strides.data_ptr(), scale_strides.data_ptr(),
                num_kv_heads, query.shape[1] // num_kv_heads, query.shape[2], key_cache.shape[1],
                (cache_strides, scale_strides))  # held: the addresses stay theirs

    def _workspace(self, numel: int) -> torch.Tensor:
        """The scores workspace, grown when a call needs more; a grown one's predecessor is kept
        while this step lives (an :meth:`int8_step` asked earlier gave its address)."""
        scores = self._scores
        if scores is None or scores.numel() < numel:
            if scores is not None:
                self._retired.append(scores)
            scores = self._scores = torch.empty(numel, dtype=torch.float32)
        return scores


_UNSEEN = object()
