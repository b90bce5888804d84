"""Reference paged attention: the spec for :func:`servelab.kernels.paged_attention`.

For each sequence: gather its blocks into a dense K/V, build the mask
explicitly from absolute positions, softmax in float32 (float64 when the
inputs are float64). No tiling, no online softmax, no tricks.
"""

from __future__ import annotations

import torch

from servelab._internal.attention_checks import check_paged_attention_args
from servelab._internal.tree_mask import TreeMask, check_tree_mask, tree_visible
from servelab.reference.kv_quant import dequantize


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
    """Attention of a mixed batch (decodes, chunked and fresh prefills) over a paged KV cache.

    Args:
        query: ``[num_tokens, num_q_heads, head_size]``, float16/bfloat16/float32
            (float64 for float64 math). Sequence ``i`` owns rows
            ``query_start_loc[i]:query_start_loc[i+1]``.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``
            ("NHD"), same dtype as ``query``; may be strided views of one buffer.
        block_table: int32 ``[num_seqs, max_blocks_per_seq]``; token ``j`` of
            sequence ``i`` lives in block ``block_table[i, j // block_size]`` at
            offset ``j % block_size``.
        seq_lens: int32 ``[num_seqs]``, cached tokens *including* this step's.
            The query rows are the last ``query_len`` positions: row ``t`` sits at
            absolute position ``seq_len - query_len + t``.
        query_start_loc: int32 ``[num_seqs + 1]``, cumulative query lengths.
        scale: score multiplier, default ``1 / sqrt(head_size)``.
        causal: position ``p`` sees keys ``j <= p``; if False it sees the whole sequence.
        sliding_window: ``w`` additionally restricts ``p`` to keys with ``p - j < w``.
        softcap: ``c`` maps scores to ``c * tanh(score / c)`` before the softmax.
        out: optional ``[num_tokens, num_q_heads, head_size]`` tensor written in place.
        num_splits: split-KV knob of the Triton kernel; validated and ignored
            here (splitting does not change the result).
        return_lse: also return the log-sum-exp of the scaled (and capped) scores,
            natural log, ``[num_tokens, num_q_heads]`` in float32 (float64 for
            float64 input), for merging partial attentions.
        check_inputs: run the checks that read tensor contents (block ids in
            range, ``seq_lens >= query_len``...). Shape/dtype checks always run.
        tree_mask: None, or a :class:`~servelab.attention.TreeMask`: token trees
            at the end of the sequences (the last ``tree_lens[i]`` keys of
            sequence ``i``); a query row sees a tree key only if its
            ``ancestors`` bitmap has the key's bit (see
            :mod:`servelab._internal.tree_mask`). Causal only, no window.
        k_scale, v_scale: a quantized cache's float32 scales ``[num_blocks, block_size,
            num_kv_heads]`` (:mod:`servelab.blocks.kv_quant`): the caches then hold int8 / fp8
            data, read as ``data * scale`` in the compute dtype (dequantize, then attend).

    Returns:
        ``out`` (``query``'s shape and dtype), or ``(out, lse)`` with ``return_lse``.
    """
    scale = check_paged_attention_args(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
        out=out, num_splits=num_splits, check_values=check_inputs, k_scale=k_scale, v_scale=v_scale,
    )
    tree_lens = None
    if tree_mask is not None:
        check_tree_mask(tree_mask, query.shape[0], seq_lens, query_start_loc, sliding_window=sliding_window,
                        check_values=check_inputs)
        tree_lens = tree_mask.tree_lens.tolist()
    kv_scales = None if k_scale is None or v_scale is None else (k_scale, v_scale)
    result, lse = _attend_all(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                              causal, sliding_window, softcap, tree_mask, tree_lens, kv_scales)

    if out is None:
        out = torch.empty_like(query)
    out.copy_(result)
    if return_lse:
        lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        return out, lse.to(lse_dtype)
    return out



def _attend_all(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, causal,
                sliding_window, softcap, tree_mask, tree_lens, kv_scales=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's rows, one sequence at a time: ``(result [T, Hq, D], lse [T, Hq])`` in the
    compute dtype (float64 for float64 input, else float32)."""
    compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    num_tokens, num_q_heads, _ = query.shape
    group = num_q_heads // key_cache.shape[2]
    result = torch.empty(query.shape, dtype=compute_dtype, device=query.device)
    lse = torch.empty((num_tokens, num_q_heads), dtype=compute_dtype, device=query.device)

    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[i], starts[i + 1]
        if q_end == q_begin:
            continue
        k, v = _gather_sequence(key_cache, value_cache, block_table[i], seq_len, group, compute_dtype, kv_scales)
        q = query[q_begin:q_end].to(compute_dtype)
        tree = None if tree_mask is None or tree_lens is None else (tree_mask.ancestors[q_begin:q_end],
                                                                     seq_len - tree_lens[i])
        result[q_begin:q_end], lse[q_begin:q_end] = _attend_sequence(
            q, k, v, seq_len - (q_end - q_begin), scale, causal, sliding_window, softcap, tree)
    return result, lse

def _gather_sequence(key_cache: torch.Tensor, value_cache: torch.Tensor, blocks_row: torch.Tensor, seq_len: int,
                     group: int, compute_dtype: torch.dtype,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V ``[seq_len, num_q_heads, head_size]`` in token order, each KV
    head repeated for the ``group`` query heads that read it (query head ``h`` -> KV head ``h // group``).
    ``kv_scales``: a quantized cache's ``(k_scale, v_scale)`` ``[N, B, Hk]``: dequantized here (float64)."""
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    blocks = blocks_row[: -(-seq_len // block_size)].long()
    k = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
    v = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len]
    if kv_scales is not None:
        k = dequantize(k, kv_scales[0][blocks].reshape(-1, num_kv_heads)[:seq_len])
        v = dequantize(v, kv_scales[1][blocks].reshape(-1, num_kv_heads)[:seq_len])
    k, v = k.to(compute_dtype), v.to(compute_dtype)
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float,
                     causal: bool, sliding_window: int | None, softcap: float | None,
                     tree: tuple[torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[query_len, H, D]`` at positions ``context_len + t`` over ``k`` / ``v``
    ``[seq_len, H, D]``: ``(out [query_len, H, D], lse [query_len, H])``, mask built explicitly.
    ``tree``: the rows' ancestor bitmaps int64 ``[query_len]`` and the first tree key position."""
    query_len, seq_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(context_len, seq_len, device=q.device)[:, None]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]
    visible = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device)
    if causal:
        visible &= key_pos <= query_pos
    if sliding_window is not None:
        visible &= query_pos - key_pos < sliding_window
    if tree is not None:
        visible &= tree_visible(tree[0].to(q.device), key_pos[0], tree[1])
    # Every row sees at least its own position, so no row is fully masked.
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v), torch.logsumexp(scores, dim=-1).transpose(0, 1)
