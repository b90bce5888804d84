"""Launch planning for :mod:`servelab.kernels.paged_attention`: tile shape, split-KV count,
constexprs and grids, from shapes and options only (no tensor data, no host sync).

Pure Python (no kernel here, so no reference of its own: the kernel's reference is
:func:`servelab.reference.paged_attention`), so the offline GPU-compile test and the tile/split
tests read exactly what the host code would launch. A private helper of the kernel module, as
``_triton_utils`` is; :mod:`servelab.kernels.paged_attention` re-exports its public names. The
split-KV knobs are module attributes of this module, read at every launch: an experiment changes
them here (``servelab.kernels._paged_attention_plan.SPLIT_MAX = 8``; assigning the re-exported
name in ``paged_attention`` would change nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from servelab.kernels._triton_utils import dot_in_fp32, head_size_padded

__all__ = ["AttentionTiles", "LaunchPlan", "SPLIT_MAX", "SPLIT_MIN_TOKENS", "SPLIT_TARGET_PROGRAMS_PER_SM",
           "choose_num_splits", "choose_tiles", "plan_launch"]


@dataclass(frozen=True)
class AttentionTiles:
    """Launch shape: rows per program, KV positions per tile, warps, pipeline stages."""

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2


def choose_tiles(num_tokens: int, num_seqs: int, group: int, head_pad: int, interpreted: bool,
                 element_size: int = 2) -> AttentionTiles:
    """Tile shape for a batch, from shapes only (no host sync).

    Decode-like batches (at most one query token per sequence on average)
    get the smallest row block that holds one token's GQA group: decode is
    memory-bound and wider rows would only be padding. Batches with prefills
    get 128 rows (64 for head sizes above 128) for tensor-core reuse. 4-byte
    dtypes halve the tiles so shared memory stays under ~100 KB (consumer
    GPUs included). Under the interpreter tiles are kept small so short test
    sequences still exercise several query blocks and KV tiles per program.
    """
    group_rows = max(16, triton.next_power_of_2(group))
    if interpreted:
        return AttentionTiles(block_m=group_rows, tile_n=16)
    shrink = 2 if element_size >= 4 else 1
    tile_n = max(16, (64 if head_pad <= 128 else 32) // shrink)
    if num_tokens <= num_seqs:
        return AttentionTiles(block_m=group_rows, tile_n=tile_n, num_warps=4, num_stages=3)
    block_m = max(group_rows, (128 if head_pad <= 128 else 64) // shrink)
    return AttentionTiles(block_m=block_m, tile_n=tile_n, num_warps=8, num_stages=2)


# Split-KV heuristic knobs (module-level so experiments can change them).
SPLIT_TARGET_PROGRAMS_PER_SM = 4
SPLIT_MIN_TOKENS = 256
SPLIT_MAX = 16


def choose_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many programs share one (query block, KV head)'s KV range.

    Splitting pays when the batch alone would leave the GPU idle: few
    sequences x KV heads, long contexts, decode only. Rule:

    * any prefill in the batch (``num_tokens > num_seqs``) -> 1: prefill
      programs are plentiful and compute-bound;
    * otherwise aim for ``SPLIT_TARGET_PROGRAMS_PER_SM * num_sms`` programs:
      ``S = cdiv(target, num_seqs * num_kv_heads)``, capped so each split
      keeps at least ``SPLIT_MIN_TOKENS`` of the longest possible context
      (``max_context``, the block table's capacity) and at ``SPLIT_MAX``.

    Each program then cuts *its own* sequence's KV range into ``S`` parts, so
    shorter sequences in the batch get shorter parts, not idle ones.
    """
    if num_seqs == 0 or num_tokens > num_seqs:
        return 1
    programs = num_seqs * num_kv_heads
    target = SPLIT_TARGET_PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    splits = min(-(-target // programs), max_context // SPLIT_MIN_TOKENS, SPLIT_MAX)
    return max(1, splits)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything about a launch that depends on shapes and options, not on data.

    ``attention_constants`` / ``combine_constants`` are the constexpr kernel
    arguments (also used by the offline GPU-compile test); ``grid`` is the
    attention kernel's grid; ``combine_grid`` is ``None`` without split-KV.
    """

    tiles: AttentionTiles
    num_splits: int
    grid: tuple[int, int, int]
    combine_grid: tuple[int, int] | None
    attention_constants: dict
    combine_constants: dict


def plan_launch(
    *, num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_size: int,
    block_size: int, max_context: int, dtype: torch.dtype, causal: bool, sliding_window: int | None,
    softcap: float | None, return_lse: bool, num_splits: int | None, interpreted: bool, num_sms: int,
    tree: bool = False, kv_format: int = 0,
) -> LaunchPlan:
    """Pick tiles and split count and derive the kernels' constexprs and grids."""
    group = num_q_heads // num_kv_heads
    head_pad = head_size_padded(head_size)
    element_size = torch.empty((), dtype=dtype).element_size()
    tiles = choose_tiles(num_tokens, num_seqs, group, head_pad, interpreted, element_size)
    block_q = max(1, tiles.block_m // group)
    if num_splits is None:
        num_splits = choose_num_splits(num_tokens, num_seqs, num_kv_heads, max_context, num_sms)
    attention = dict(
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, PAGE_SIZE=block_size,
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n,
        NUM_SPLITS=num_splits, CAUSAL=causal, USE_WINDOW=sliding_window is not None,
        USE_SOFTCAP=softcap is not None, STORE_LSE=num_splits > 1 or return_lse,
        DOT_IN_FP32=dot_in_fp32(dtype, interpreted), FP32_IEEE=dtype == torch.float32, USE_TREE=tree,
        KV_FORMAT=kv_format,
    )
    # A few heads per combine program on a GPU (plenty of programs); all heads
    # of a token under the interpreter, where each program costs milliseconds.
    block_h = triton.next_power_of_2(num_q_heads)
    if not interpreted:
        block_h = min(block_h, 4)
    block_h = max(2, block_h)  # no size-1 tile dimensions; masks cover the padding
    combine = dict(
        NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), BLOCK_H=block_h,
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, STORE_LSE=return_lse,
    )
    return LaunchPlan(
        tiles=tiles, num_splits=num_splits,
        grid=(num_tokens // block_q + num_seqs, num_kv_heads, num_splits),
        combine_grid=(num_tokens, triton.cdiv(num_q_heads, block_h)) if num_splits > 1 else None,
        attention_constants=attention, combine_constants=combine,
    )
