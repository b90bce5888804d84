"""Builders, strategies and an independent float64 oracle for the attention tests.

A case is built from *dense* per-sequence K/V; the paged cache is then filled
by plain indexing (not by ``reshape_and_cache``, which is under test
elsewhere). Every cache slot no sequence uses, and every unused block-table
entry, is poisoned (NaN / an out-of-range block id), so a kernel that reads
what it should not produces NaN or faults instead of passing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

# Kernels run on CPU tensors only through the interpreter (tests/conftest.py turns it on).
INTERPRETER_ON = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")

# (rtol, atol) for kernel vs reference, both fed the same dtype-rounded inputs.
# The reference computes in float32 and rounds once; the kernel rounds its
# float32 result once too, plus (fp16) the probabilities before P @ V: a few
# ulps of the output dtype at most.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (4e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 8e-3),
}

CACHE_LAYOUTS = ("separate", "kv_split_last", "vllm_hnd", "kv_first", "dim_strided")


def make_cache_pair(num_blocks, block_size, num_kv_heads, head_size, dtype, layout, fill=float("nan")):
    """K and V caches ``[num_blocks, block_size, num_kv_heads, head_size]``, filled with ``fill``.

    Layouts other than "separate" are views of one buffer with the strides
    real engines produce (vLLM's fused ``[blocks, heads, block_size, 2*head]``
    included) plus one with a non-unit head-dim stride.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if layout == "separate":
        return torch.full(shape, fill, dtype=dtype), torch.full(shape, fill, dtype=dtype)
    if layout == "kv_split_last":
        buf = torch.full((num_blocks, block_size, num_kv_heads, 2 * head_size), fill, dtype=dtype)
        return buf[..., :head_size], buf[..., head_size:]
    if layout == "vllm_hnd":
        buf = torch.full((num_blocks, num_kv_heads, block_size, 2 * head_size), fill, dtype=dtype)
        k, v = buf.transpose(1, 2).split(head_size, dim=-1)
        return k, v
    if layout == "kv_first":
        buf = torch.full((2, *shape), fill, dtype=dtype)
        return buf[0], buf[1]
    if layout == "dim_strided":
        buf = torch.full((2, num_blocks, block_size, head_size, num_kv_heads), fill, dtype=dtype)
        return buf[0].transpose(2, 3), buf[1].transpose(2, 3)
    raise ValueError(layout)


@dataclass
class AttentionCase:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]    # dense per-sequence K, [seq_len, num_kv_heads, head_size]
    values: list[torch.Tensor]

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_table,
                self.seq_lens, self.query_start_loc)

    def describe(self) -> str:
        q_lens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()
        return (f"q_lens={q_lens} seq_lens={self.seq_lens.tolist()} "
                f"heads={self.query.shape[1]}/{self.key_cache.shape[2]} head={self.query.shape[2]} "
                f"block={self.key_cache.shape[1]} dtype={self.query.dtype} "
                f"kv_strides={self.key_cache.stride()}")


def build_case(query_lens, seq_lens, *, num_q_heads, num_kv_heads, head_size, block_size,
               dtype, layout="separate", seed=0, spare_blocks=2, table_padding=1,
               value_scale=1.0):
    """A paged batch with randomly placed (non-contiguous) blocks and poisoned leftovers."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    key_cache, value_cache = make_cache_pair(num_blocks, block_size, num_kv_heads, head_size, dtype, layout)
    width = max(blocks_per_seq, default=0) + table_padding
    # Unused table entries point far outside the cache: reading them would fault.
    block_table = torch.full((len(seq_lens), max(width, 1)), num_blocks + 1000, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen)
    keys, values, used = [], [], 0
    for i, seq_len in enumerate(seq_lens):
        ids = order[used: used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        block_table[i, : len(ids)] = ids.to(torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = (value_scale * torch.randn(seq_len, num_kv_heads, head_size, generator=gen)).to(dtype)
        pos = torch.arange(seq_len)
        key_cache[ids[pos // block_size].long(), pos % block_size] = k
        value_cache[ids[pos // block_size].long(), pos % block_size] = v
        keys.append(k)
        values.append(v)
    total = sum(query_lens)
    query = torch.randn(total, num_q_heads, head_size, generator=gen).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionCase(query, key_cache, value_cache, block_table,
                         torch.tensor(seq_lens, dtype=torch.int32),
                         torch.tensor(starts, dtype=torch.int32), keys, values)


def dense_attention_float64(case, *, scale=None, causal=True, sliding_window=None, softcap=None):
    """Oracle from the dense per-sequence K/V, in float64, masks built with tril/triu.

    Returns ``(out, lse)``: ``[num_tokens, num_q_heads, head_size]`` and
    ``[num_tokens, num_q_heads]``.
    """
    query = case.query.double()
    num_tokens, num_q_heads, head_size = query.shape
    scale = 1.0 / math.sqrt(head_size) if scale is None else scale
    out = torch.zeros(num_tokens, num_q_heads, head_size, dtype=torch.float64)
    lse = torch.zeros(num_tokens, num_q_heads, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(case.keys, case.values)):
        q = query[starts[i]: starts[i + 1]]
        q_len, seq_len = q.shape[0], k.shape[0]
        if q_len == 0:
            continue
        group = num_q_heads // k.shape[1]
        kh = k.double().repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_size]
        vh = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kh) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        # Row t is absolute position seq_len - q_len + t: the diagonal offset.
        allow = torch.ones(q_len, seq_len, dtype=torch.bool)
        if causal:
            allow = torch.tril(allow, diagonal=seq_len - q_len)
        if sliding_window is not None:
            allow &= torch.triu(torch.ones(q_len, seq_len, dtype=torch.bool),
                                diagonal=seq_len - q_len - sliding_window + 1)
        s = torch.where(allow, s, torch.tensor(-math.inf, dtype=torch.float64))
        row_max = s.max(dim=-1, keepdim=True).values
        e = torch.exp(s - row_max)
        total = e.sum(dim=-1, keepdim=True)
        out[starts[i]: starts[i + 1]] = torch.einsum("hqk,khd->qhd", e / total, vh)
        lse[starts[i]: starts[i + 1]] = (row_max + torch.log(total))[..., 0].transpose(0, 1)
    return out, lse


def as_float64(case):
    """The same case with every float tensor in float64 (values unchanged)."""
    return AttentionCase(case.query.double(), case.key_cache.double(), case.value_cache.double(),
                         case.block_table, case.seq_lens, case.query_start_loc,
                         [k.double() for k in case.keys], [v.double() for v in case.values])


@st.composite
def sequence_shapes(draw, block_size, max_seqs=4, max_blocks=4):
    """(query_lens, seq_lens) mixing decodes, chunked prefills and fresh prefills.

    Lengths cluster at block boundaries (k * block_size + {-1, 0, 1}).
    """
    num_seqs = draw(st.integers(1, max_seqs))
    query_lens, seq_lens = [], []
    for _ in range(num_seqs):
        kind = draw(st.sampled_from(["decode", "chunked", "prefill"]))
        near_boundary = st.builds(lambda k, d: max(1, k * block_size + d),
                                  st.integers(1, max_blocks), st.sampled_from([-1, 0, 1]))
        seq_len = draw(st.one_of(near_boundary, st.integers(1, max_blocks * block_size)))
        if kind == "decode":
            q_len = 1
        elif kind == "prefill":
            q_len = seq_len
        else:
            q_len = draw(st.integers(1, seq_len))
        query_lens.append(q_len)
        seq_lens.append(seq_len)
    return query_lens, seq_lens
