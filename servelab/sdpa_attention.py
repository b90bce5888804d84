"""Paged attention for CPUs (and any torch device) through one batched
``scaled_dot_product_attention`` call: the ``"sdpa"`` backend.

The reference (:mod:`servelab.reference.paged_attention`) loops over
sequences, which is what makes it readable and what makes it slow in a
serving loop: on the tiny CPU model it is ~65% of a pipeline step. Here the
whole mixed batch becomes one padded problem instead:

1. gather every sequence's blocks at once: ``key_cache[block_table]`` gives
   ``[num_seqs, max_blocks * block_size, num_kv_heads, head_size]``;
2. scatter the ragged query rows into ``[num_seqs, max_query_len, ...]``;
3. build one boolean mask from absolute positions (length, causal, window);
4. one SDPA call in float32 (float64 for float64 input), then gather the
   real rows back.

Padding costs memory proportional to ``num_seqs x max_seq_len``, fine at
research scale on a CPU, wasteful on a GPU (use ``"triton"`` there). Positions
past a sequence's end are zeroed before the call so that whatever a cache slot
holds (stale data, NaN) never reaches the output. Not supported, and refused by
the backend's capability check: ``softcap`` (SDPA applies no function to the
scores) and ``return_lse``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab.reference._attention_checks import check_paged_attention_args


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
) -> torch.Tensor:
    """Same signature and semantics as :func:`servelab.reference.paged_attention`
    (shapes and dtypes there), without ``softcap`` and ``return_lse``."""
    if softcap is not None:
        raise ValueError(f"softcap={softcap!r}: the sdpa backend cannot cap scores; use 'torch' or 'triton'")
    if return_lse:
        raise ValueError("return_lse=True: the sdpa backend does not compute the log-sum-exp; use 'torch' or 'triton'")
    scale = check_paged_attention_args(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale=scale, causal=causal, sliding_window=sliding_window, softcap=None,
        out=out, num_splits=num_splits, check_values=check_inputs,
    )
    result = out if out is not None else torch.empty_like(query)
    num_tokens, num_q_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return result
    device = query.device
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]

    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    starts = query_start_loc.to(device=device, dtype=torch.long)
    q_lens = starts[1:] - starts[:-1]
    max_q, max_kv = int(q_lens.max()), int(seq_lens.max())
    num_blocks = -(-max_kv // block_size)

    # 1. K/V of every sequence, padded to max_kv. Table entries past a
    # sequence's last block may hold anything: read block 0 there instead.
    kv_pos = torch.arange(num_blocks * block_size, device=device)
    blocks_needed = (seq_lens + block_size - 1) // block_size
    table = block_table[:, :num_blocks].to(torch.long)
    table = torch.where(torch.arange(num_blocks, device=device) < blocks_needed[:, None], table, 0)
    in_seq = (kv_pos[None, :] < seq_lens[:, None])[:, :max_kv]  # [S, max_kv]
    keys = key_cache[table].flatten(1, 2)[:, :max_kv].to(compute)  # [S, max_kv, Hk, D]
    values = value_cache[table].flatten(1, 2)[:, :max_kv].to(compute)
    keys = keys.masked_fill(~in_seq[:, :, None, None], 0.0)
    values = values.masked_fill(~in_seq[:, :, None, None], 0.0)

    # 2. Ragged query rows -> [S, max_q, Hq, D].
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)
    row_in_seq = torch.arange(num_tokens, device=device) - starts[seq_of_row]
    queries = torch.zeros(num_seqs, max_q, num_q_heads, head_size, dtype=compute, device=device)
    queries[seq_of_row, row_in_seq] = query.to(compute)

    # 3. Query row t of sequence i sits at absolute position seq_len - q_len + t.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]  # [S, max_q]
    k_pos = kv_pos[:max_kv]
    mask = in_seq[:, None, :].expand(num_seqs, max_q, max_kv)
    if causal:
        mask = mask & (k_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        mask = mask & (q_pos[:, :, None] - k_pos[None, None, :] < sliding_window)
    # Padding query rows may see nothing: give them one key so SDPA's softmax
    # stays finite; their output is dropped below.
    mask = mask | (~mask.any(-1, keepdim=True) & (k_pos == 0))

    # 4. One call; GQA by repeating each KV head over its query-head group.
    group = num_q_heads // num_kv_heads
    attn = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.repeat_interleave(group, dim=2).transpose(1, 2),
        values.repeat_interleave(group, dim=2).transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
    )  # [S, Hq, max_q, D]
    result.copy_(attn.transpose(1, 2)[seq_of_row, row_in_seq].to(result.dtype))
    return result
