"""Quantized paged caches for the tests: random sequences written through the reference
write into a real page layout (:func:`servelab.blocks.allocate_kv_cache`, scales in the pages
or static), and the float64 oracle: dequantize the whole cache, then attend in float64."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from servelab.blocks import allocate_kv_cache
from servelab.blocks.kv_quant import get_kv_cache_dtype
from servelab.blocks.specs import FullAttentionSpec
from servelab.reference import kv_quant as ref_quant
from servelab.reference.paged_attention import paged_attention as ref_paged_attention
from servelab.reference.reshape_and_cache import reshape_and_cache as ref_reshape_and_cache

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
GRANULARITIES = ("token_head", "head", "tensor")


@dataclass
class QuantCase:
    query: torch.Tensor  # float32 [T, Hq, D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens,
                self.query_start_loc)


@st.composite
def quant_cases(draw, max_seqs: int = 3, head_sizes=(8, 16, 32), block_sizes=(1, 4, 8, 16)):
    fmt = draw(st.sampled_from(FORMATS))
    granularity = draw(st.sampled_from(GRANULARITIES))
    layout = draw(st.sampled_from(("layer_outermost", "block_outermost")))
    num_kv_heads = draw(st.sampled_from((1, 2)))
    group = draw(st.sampled_from((1, 2, 3)))
    head_size = draw(st.sampled_from(head_sizes))
    block_size = draw(st.sampled_from(block_sizes))
    num_seqs = draw(st.integers(1, max_seqs))
    seq_lens = [draw(st.integers(1, 40)) for _ in range(num_seqs)]
    q_lens = [draw(st.integers(1, n)) for n in seq_lens]
    magnitude = draw(st.sampled_from((0.1, 1.0, 8.0)))
    seed = draw(st.integers(0, 2**16))
    return build_case(fmt, granularity, layout, num_kv_heads, group, head_size, block_size, seq_lens, q_lens,
                      magnitude, seed)


def build_case(fmt_name: str, granularity: str, layout: str, num_kv_heads: int, group: int, head_size: int,
               block_size: int, seq_lens: list[int], q_lens: list[int], magnitude: float, seed: int) -> QuantCase:
    gen = torch.Generator().manual_seed(seed)
    fmt = get_kv_cache_dtype(fmt_name)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2  # null block, the sequences', two never used
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=fmt.storage_dtype, kv_scale=granularity)
    buffers = allocate_kv_cache(spec, 2, num_blocks, layout=layout)  # layer 1 is the one under test
    key_cache, value_cache, k_scale, v_scale = buffers.views[1]
    if buffers.static_scales is not None:  # a calibrated static scale per head (or one per tensor)
        static = torch.rand((2, num_kv_heads), generator=gen) * magnitude / fmt.max_value * 2 + 1e-4
        if granularity == "tensor":
            static[:] = static.amax(dim=1, keepdim=True)
        buffers.static_scales[1].copy_(static)
    order = torch.randperm(num_blocks - 1, generator=gen)[: sum(blocks_per_seq)] + 1  # shuffled blocks
    table = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = order[cursor:cursor + n].to(torch.int32)
        cursor += n
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([int(table[i, p // block_size]) * block_size + p % block_size for p in range(n)])
        k = torch.randn((n, num_kv_heads, head_size), generator=gen) * magnitude
        v = torch.randn((n, num_kv_heads, head_size), generator=gen) * magnitude
        ref_reshape_and_cache(k, v, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale)
    total_q = sum(q_lens)
    query = torch.randn((total_q, num_kv_heads * group, head_size), generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return QuantCase(query, key_cache, value_cache, k_scale, v_scale, table,
                     torch.tensor(seq_lens, dtype=torch.int32), qsl)


def oracle(case: QuantCase, **kwargs) -> torch.Tensor:
    """float64 dequantize-then-attend: the whole cache dequantized (unused slots read as 0), then
    the reference attention over float64 caches."""
    k = ref_quant.dequantize(case.key_cache, case.k_scale).nan_to_num(0.0)
    v = ref_quant.dequantize(case.value_cache, case.v_scale).nan_to_num(0.0)
    return ref_paged_attention(case.query.double(), k, v, case.block_table, case.seq_lens, case.query_start_loc,
                               **kwargs)
