"""Triton paged attention: one launch for a mixed batch of decodes and (chunked) prefills.

Same signature and semantics as :func:`servelab.reference.paged_attention`.

How it works
------------
* **Grid** ``(query blocks, KV heads, splits)``. A program owns ``BLOCK_Q``
  consecutive query tokens of one sequence and *all* query heads that share
  one KV head (GQA packing): its ``BLOCK_M = BLOCK_Q * group`` rows (padded to
  a power of two) read each K/V tile once. Sequence ``i`` owns the query blocks
  starting at ``query_start_loc[i] // BLOCK_Q + i``; that numbering gives every
  sequence at least ``cdiv(query_len, BLOCK_Q)`` blocks without a host sync,
  and a program finds its sequence by binary search. Surplus programs exit.
* **KV loop** over tiles of ``TILE_N`` positions, decoupled from the cache's
  block size: each position looks up its block in ``block_table``, so any
  block size works and K/V may be arbitrarily strided views. The loop stops
  at the last position a causal row can see and starts at the first tile the
  sliding window reaches. Online softmax in base 2, float32 statistics.
* **Token trees** (``USE_TREE``, a :class:`~servelab.attention.TreeMask`): each
  query row carries an int64 ancestor bitmap; a key among its sequence's last
  ``tree_lens[seq]`` positions is visible only if its bit is set. The causal
  bound still limits the loop (a node's ancestors precede it).
* **Split-KV (flash-decoding)**: with ``num_splits = S > 1`` each program
  handles ``1/S`` of its KV tiles and writes a normalised float32 partial and
  its log-sum-exp; a second small kernel merges the ``S`` partials exactly.
  :func:`choose_num_splits` decides ``S`` (documented there); pass
  ``num_splits`` to override.
* Head sizes that are not powers of two are padded to the next one with
  masked loads. Under ``TRITON_INTERPRET=1`` bf16 dots run in fp32
  (``DOT_IN_FP32``), see :func:`servelab.kernels._triton_utils.dot_in_fp32`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._triton_utils import is_interpreted, require_launchable, sm_count
from servelab.kernels._paged_attention_plan import (  # noqa: F401  (re-exported: the planning's public names)
    SPLIT_MIN_TOKENS,
    AttentionTiles,
    LaunchPlan,
    choose_num_splits,
    choose_tiles,
    plan_launch,
)
from servelab._internal.attention_checks import check_paged_attention_args
from servelab._internal.tree_mask import TreeMask, check_tree_mask

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_SIZE = 256
LOG2_E = tl.constexpr(1.4426950408889634)  # kernels may only read constexpr globals


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1) is right for large |x| but cancels near 0, where the series
    # x - x^3/3 + 2x^5/15 is accurate to ~1e-8 for |x| < 0.1. Large softcaps
    # put every score near 0, so both halves matter.
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0)))
    saturated = tl.minimum(tl.maximum(x, -15.0), 15.0)  # tanh(15) == 1 in fp32; keeps exp finite
    closed = 1.0 - 2.0 / (tl.exp(2.0 * saturated) + 1.0)
    return tl.where(tl.abs(x) < 0.1, series, closed)


@triton.jit
def _stored_values(data, KV_FORMAT: tl.constexpr):
    """Stored page values -> float32 (float8 pages arrive as their bytes: bitcast first)."""
    if KV_FORMAT == 2:
        return data.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if KV_FORMAT == 3:
        return data.to(tl.float8e5, bitcast=True).to(tl.float32)
    return data.to(tl.float32)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Index of the sequence whose query blocks contain ``q_block`` (upper-bound search)."""
    # Annotated so both start as int32 tensors: a loop may not reassign a
    # constexpr (and num_seqs == 1 arrives specialised as one).
    low: tl.int32 = 0
    high: tl.int32 = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_block <= q_block
        low = tl.where(go_right, mid + 1, low)
        high = tl.where(go_right, high, mid)
    return low - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, tree_ancestors_ptr, tree_lens_ptr,
    k_scale_ptr, v_scale_ptr,
    num_seqs, scale, softcap, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ksb, stride_kss, stride_ksh,
    stride_vsb, stride_vss, stride_vsh,
    stride_os, stride_ot, stride_oh, stride_od,
    stride_ls, stride_lt, stride_lh,
    stride_bt_seq, stride_bt_col,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, STORE_LSE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, FP32_IEEE: tl.constexpr, USE_TREE: tl.constexpr,
    KV_FORMAT: tl.constexpr = 0,
):
    # KV_FORMAT: 0 the query's dtype; quantized pages (servelab.blocks.kv_quant), dequantized in the
    # loads as data * scale[block, token, head]: 1 int8, 2 float8 e4m3, 3 float8 e5m2 (fp8 pages are
    # passed as their bytes, uint8, and bitcast here).
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    first_token = (q_block - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if first_token >= query_len:
        return  # surplus program: this sequence has fewer query blocks
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Rows: BLOCK_Q tokens x GROUP query heads, token-major.
    rows = tl.arange(0, BLOCK_M)
    row_token = first_token + rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (row_token < query_len)
    row_pos = context_len + row_token
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE
    if USE_TREE:  # this sequence's tree keys start here; each row's bitmap of visible nodes
        tree_start = seq_len - tl.load(tree_lens_ptr + seq)
        row_bits = tl.load(tree_ancestors_ptr + q_begin + row_token, mask=row_valid, other=0)

    q_offsets = (q_begin + row_token)[:, None] * stride_qt + row_head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offsets + dims[None, :] * stride_qd,
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    # KV positions this program may need: causal rows stop at their own
    # position; the window starts at the first row's reach.
    last_token = tl.minimum(first_token + BLOCK_Q, query_len) - 1
    if CAUSAL:
        kv_end = context_len + last_token + 1
    else:
        kv_end = seq_len
    kv_begin = 0
    if USE_WINDOW:
        kv_begin = tl.maximum(context_len + first_token - window + 1, 0)
    kv_begin = (kv_begin // TILE_N) * TILE_N
    num_tiles = tl.cdiv(kv_end - kv_begin, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    block_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile in range(tile_lo, tile_hi):
        kv_pos = kv_begin + tile * TILE_N + tl.arange(0, TILE_N)
        kv_valid = kv_pos < kv_end
        block_ids = tl.load(block_row + (kv_pos // PAGE_SIZE) * stride_bt_col, mask=kv_valid, other=0)
        block_ids = block_ids.to(tl.int64)
        in_block = kv_pos % PAGE_SIZE
        k_rows = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_rows = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh
        # K is loaded transposed, [HEAD_PAD, TILE_N], ready for q @ k.
        k = tl.load(k_cache_ptr + k_rows[None, :] + dims[:, None] * stride_kd,
                    mask=dim_valid[:, None] & kv_valid[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + dims[None, :] * stride_vd,
                    mask=kv_valid[:, None] & dim_valid[None, :], other=0.0)
        if KV_FORMAT != 0:  # dequantize in the loads: stored value * its (block, token, head) scale
            k_scales = tl.load(k_scale_ptr + block_ids * stride_ksb + in_block * stride_kss + kv_head * stride_ksh,
                               mask=kv_valid, other=0.0)
            v_scales = tl.load(v_scale_ptr + block_ids * stride_vsb + in_block * stride_vss + kv_head * stride_vsh,
                               mask=kv_valid, other=0.0)
            k = (_stored_values(k, KV_FORMAT) * k_scales[None, :]).to(q.dtype)
            v = (_stored_values(v, KV_FORMAT) * v_scales[:, None]).to(q.dtype)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if FP32_IEEE:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * scale
        if USE_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        scores = scores * LOG2_E  # base-2 softmax from here on

        visible = row_valid[:, None] & kv_valid[None, :]
        if CAUSAL:
            visible = visible & (kv_pos[None, :] <= row_pos[:, None])
        if USE_WINDOW:
            visible = visible & (row_pos[:, None] - kv_pos[None, :] < window)
        if USE_TREE:
            node = kv_pos - tree_start
            bit = (row_bits[:, None] >> tl.maximum(node, 0).to(tl.int64)[None, :]) & 1
            visible = visible & ((node < 0)[None, :] | (bit != 0))
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen nothing yet keeps m = -inf; shift it by 0 so the
        # exponentials below are exp2(-inf) = 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(scores - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if FP32_IEEE:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Rows that saw no key (an empty split) store 0 and lse = -inf.
    has_keys = l_i > 0
    result = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    token = q_begin + row_token
    out_offsets = split * stride_os + token[:, None] * stride_ot + row_head[:, None] * stride_oh
    tl.store(out_ptr + out_offsets + dims[None, :] * stride_od,
             result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    if STORE_LSE:
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) / LOG2_E, float("-inf"))
        tl.store(lse_ptr + split * stride_ls + token * stride_lt + row_head * stride_lh, lse, mask=row_valid)


@triton.jit
def _combine_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, lse_ptr, num_heads,
    stride_ps, stride_pt, stride_ph, stride_pd,
    stride_qs, stride_qt, stride_qh,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """out[t, h] = sum_s w_s * partial[s, t, h] / sum_s w_s, w_s = exp(lse_s - max_s lse_s).

    One program merges ``BLOCK_H`` heads of one token; tiles are
    ``[splits, heads, dims]``.
    """
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    lse_mask = (splits < NUM_SPLITS)[:, None] & (heads < num_heads)[None, :]
    lse = tl.load(partial_lse_ptr + splits[:, None] * stride_qs + token * stride_qt
                  + heads[None, :] * stride_qh, mask=lse_mask, other=float("-inf"))
    peak = tl.max(lse, 0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    weights = tl.exp(lse - peak[None, :])  # [splits, heads]; empty splits weigh 0
    total = tl.sum(weights, 0)
    out_mask = lse_mask[:, :, None] & (dims < HEAD_SIZE)[None, None, :]
    partial = tl.load(
        partial_out_ptr + splits[:, None, None] * stride_ps + token * stride_pt
        + heads[None, :, None] * stride_ph + dims[None, None, :] * stride_pd,
        mask=out_mask, other=0.0)
    # The stored output of an empty split is never mixed in.
    weighted = tl.where(weights[:, :, None] > 0, weights[:, :, None] * partial, 0.0)
    merged = tl.sum(weighted, 0) / tl.where(total > 0, total, 1.0)[:, None]
    store_mask = (heads < num_heads)[:, None] & (dims < HEAD_SIZE)[None, :]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
             merged.to(out_ptr.dtype.element_ty), mask=store_mask)
    if STORE_LSE:
        merged_lse = tl.where(total > 0, peak + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + heads * stride_lh, merged_lse, mask=heads < num_heads)


INTERPRETED = is_interpreted(_paged_attention_kernel)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    check_inputs: bool = True,
    tree_mask: TreeMask | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention of a mixed batch in one Triton launch (two with split-KV).

    Quantized pages (int8, float8 e4m3 / e5m2 with ``k_scale`` / ``v_scale`` float32
    ``[num_blocks, block_size, num_kv_heads]``, any strides, :mod:`servelab.blocks.kv_quant`)
    are dequantized inside the K/V loads: no dequantized copy of the cache.

    Arguments, result and semantics as :func:`servelab.reference.paged_attention`
    (shapes: ``query`` ``[num_tokens, num_q_heads, head_size]``, caches
    ``[num_blocks, block_size, num_kv_heads, head_size]``, int32 tables).
    Kernel limits: float16/bfloat16/float32, ``head_size <= 256``.

    Args:
        num_splits: ``None`` lets :func:`choose_num_splits` decide; ``1``
            disables split-KV; ``S > 1`` forces ``S`` splits.
        return_lse: also return the float32 ``[num_tokens, num_q_heads]``
            natural-log log-sum-exp of the scores.
        check_inputs: run the checks that read tensor contents (one host sync).
        tree_mask: token trees at the end of the sequences, as in the reference
            (:class:`~servelab.attention.TreeMask`; causal, no window).
    """
    scale = check_paged_attention_args(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
        out=out, num_splits=num_splits, check_values=check_inputs, k_scale=k_scale, v_scale=v_scale,
    )
    kv_format = _kernel_kv_format(query, key_cache, k_scale)
    num_tokens, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if tree_mask is not None:
        check_tree_mask(tree_mask, num_tokens, seq_lens, query_start_loc, sliding_window=sliding_window,
                        check_values=check_inputs)

    if out is None:
        out = torch.empty_like(query)
    lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=query.device) if return_lse else None
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return (out, lse) if return_lse else out

    max_context = block_table.shape[1] * block_size
    plan = plan_launch(
        num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, max_context=max_context,
        dtype=query.dtype, causal=causal, sliding_window=sliding_window, softcap=softcap,
        return_lse=return_lse, num_splits=num_splits, interpreted=INTERPRETED,
        num_sms=sm_count(query.device), tree=tree_mask is not None, kv_format=kv_format,
    )
    if kv_format in (2, 3):  # float8 pages travel as their bytes (bitcast in the kernel)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    kv_scales = (k_scale, v_scale) if k_scale is not None and v_scale is not None else None
    _launch(plan, query, key_cache, value_cache, block_table, seq_lens.contiguous(), query_start_loc.contiguous(),
            out, lse, scale, softcap, sliding_window, max_context, tree_mask, kv_scales)
    return (out, lse) if return_lse else out


#: Quantized page formats the kernel dequantizes in its loads (KV_FORMAT constexpr values).
KV_FORMATS = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}


def _kernel_kv_format(query: torch.Tensor, key_cache: torch.Tensor, k_scale: torch.Tensor | None) -> int:
    """The kernel's own limits beyond the reference's checks (dtype, head size, a launchable device,
    a page format it reads); returns the ``KV_FORMAT`` constexpr (0: unquantized pages)."""
    kv_format = KV_FORMATS.get(key_cache.dtype, 0) if k_scale is not None else 0
    if k_scale is not None and kv_format == 0:
        raise ValueError(f"key_cache dtype {key_cache.dtype} is not a page format the Triton kernel reads "
                         f"({', '.join(str(d) for d in KV_FORMATS)})")
    if query.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"query dtype {query.dtype} is not supported by the Triton kernel "
            "(float16, bfloat16, float32); the torch reference takes float64"
        )
    if query.shape[-1] > MAX_HEAD_SIZE:
        raise ValueError(f"query head_size {query.shape[-1]} exceeds the kernel's maximum {MAX_HEAD_SIZE}")
    require_launchable("query", query, _paged_attention_kernel)
    return kv_format

__all__ = ["AttentionTiles", "LaunchPlan", "choose_num_splits", "choose_tiles", "paged_attention", "plan_launch"]


def _launch(plan, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, out, lse, scale,
            softcap, sliding_window, max_context, tree_mask=None, kv_scales=None) -> None:
    """Run :func:`paged_attention`'s planned launch: the attention kernel into ``out`` / ``lse``
    (``lse`` may be ``None``), or with split-KV into float32 workspaces merged by the combine kernel."""
    num_tokens, num_q_heads, head_size = query.shape
    splits = plan.num_splits
    if splits > 1:  # partials go to float32 workspaces, merged below
        target = torch.empty((splits, num_tokens, num_q_heads, head_size), dtype=torch.float32, device=query.device)
        target_lse = torch.empty((splits, num_tokens, num_q_heads), dtype=torch.float32, device=query.device)
        out_strides, lse_strides = target.stride(), target_lse.stride()
    else:
        target, target_lse = out, lse if lse is not None else out  # lse pointer unused without it
        out_strides = (0, *out.stride())
        lse_strides = (0, *lse.stride()) if lse is not None else (0, 0, 0)

    # Without a tree the two pointers are never read (USE_TREE=False): any int tensors do.
    tree_ancestors, tree_lens = (tree_mask.ancestors.contiguous(), tree_mask.tree_lens.contiguous()) \
        if tree_mask is not None else (seq_lens, seq_lens)
    # Unquantized pages: the scale pointers are never read (KV_FORMAT=0), any float tensor does.
    k_scale, v_scale = kv_scales if kv_scales is not None else (out, out)
    scale_strides = (*k_scale.stride(), *v_scale.stride()) if kv_scales is not None else (0,) * 6
    _paged_attention_kernel[plan.grid](
        query, key_cache, value_cache, target, target_lse,
        block_table, seq_lens, query_start_loc, tree_ancestors, tree_lens, k_scale, v_scale,
        # A window wider than anything the table can address changes nothing;
        # clamping keeps it an int32.
        seq_lens.shape[0], scale, float(softcap or 1.0), min(int(sliding_window or 1), max_context + 1),
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *scale_strides,
        *out_strides, *lse_strides, *block_table.stride(),
        **plan.attention_constants, num_warps=plan.tiles.num_warps, num_stages=plan.tiles.num_stages,
    )
    if plan.combine_grid is not None:
        _combine_splits_kernel[plan.combine_grid](
            target, target_lse, out, lse if lse is not None else target_lse, num_q_heads,
            *target.stride(), *target_lse.stride(), *out.stride(),
            *(lse.stride() if lse is not None else (0, 0)),
            **plan.combine_constants, num_warps=4 if head_size > 64 else 1,
        )
