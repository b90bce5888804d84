"""Reference paged attention: the spec for :func:`servelab.kernels.paged_attention`.

For each sequence: gather its blocks into a dense K/V, build the mask
explicitly from absolute positions, softmax in float32 (float64 when the
inputs are float64). No tiling, no online softmax, no tricks.
"""

from __future__ import annotations

import torch

from servelab._internal.attention_checks import check_paged_attention_args


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

    Returns:
        ``out`` (``query``'s shape and dtype), or ``(out, lse)`` with ``return_lse``.
    """
    scale = check_paged_attention_args(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
        out=out, num_splits=num_splits, check_values=check_inputs,
    )
    compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    num_tokens, num_q_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    result = torch.empty(query.shape, dtype=compute_dtype, device=query.device)
    lse = torch.empty((num_tokens, num_q_heads), dtype=compute_dtype, device=query.device)

    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_begin
        if query_len == 0:
            continue
        context_len = seq_len - query_len
        # Gather: the blocks this sequence uses, flattened to token order.
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].to(compute_dtype)
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].to(compute_dtype)
        # GQA: query head h reads KV head h // group.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        q = query[q_begin:q_end].to(compute_dtype)

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(context_len, seq_len, device=query.device)[:, None]
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        visible = torch.ones(query_len, seq_len, dtype=torch.bool, device=query.device)
        if causal:
            visible &= key_pos <= query_pos
        if sliding_window is not None:
            visible &= query_pos - key_pos < sliding_window
        # Every row sees at least its own position, so no row is fully masked.
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v)
        lse[q_begin:q_end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)

    if out is None:
        out = torch.empty_like(query)
    out.copy_(result)
    if return_lse:
        lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        return out, lse.to(lse_dtype)
    return out
