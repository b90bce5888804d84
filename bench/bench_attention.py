"""CPU microbenchmarks of the attention references (what CPU users run).

    pytest bench/bench_attention.py --benchmark-only
    pytest bench/bench_attention.py --benchmark-only --benchmark-group-by=group

The references are timed at serving-like shapes (32 query / 8 KV heads, head
128, block 16). The Triton kernels appear only at a tiny shape under
``TRITON_INTERPRET=1``: the interpreter's timings say nothing about a GPU and
are there to show relative cost (e.g. split-KV's extra launch). GPU timings
come from ``bench/gpu/run_all.py``.
"""

from __future__ import annotations

import os

# Kernels are decorated at import: choose the interpreter before importing them.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from servelab import reference  # noqa: E402

# Rows appended to bench/results/results.csv by bench/conftest.py.
RESULTS_COMPONENT, RESULTS_IMPLEMENTATION = "attention", "reference"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16


def make_batch(query_lens, seq_lens, *, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
               head_size=HEAD_SIZE, block_size=BLOCK_SIZE, dtype=torch.float32, seed=0):
    """Random paged batch: ``(query, key_cache, value_cache, block_table, seq_lens, query_start_loc)``.

    Blocks are handed out in a random order so the gather is not a slice.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[used: used + n]
        used += n
    query = torch.randn(sum(query_lens), num_q_heads, head_size, generator=gen).to(dtype)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(query_lens).cumsum(0)
    return query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32), starts


REFERENCE_SHAPES = {
    "decode_b8_ctx1024": ([1] * 8, [1024] * 8),
    "decode_b32_ctx256": ([1] * 32, [256] * 32),
    "prefill_1x512": ([512], [512]),
    "chunked_256_after_768": ([256], [1024]),
    "mixed_4dec_1pre": ([1, 1, 1, 1, 128], [700, 300, 1500, 64, 128]),
}


@pytest.mark.parametrize("shape", REFERENCE_SHAPES)
def test_reference_paged_attention(benchmark, shape):
    benchmark.group = "reference paged_attention (cpu, fp32)"
    args = make_batch(*REFERENCE_SHAPES[shape])
    out = torch.empty_like(args[0])
    benchmark(reference.paged_attention, *args, out=out, check_inputs=False)


def test_reference_paged_attention_sliding_window(benchmark):
    benchmark.group = "reference paged_attention (cpu, fp32)"
    args = make_batch([256], [1024])
    benchmark(reference.paged_attention, *args, sliding_window=128, check_inputs=False)


@pytest.mark.parametrize("num_tokens", [16, 512])
def test_reference_reshape_and_cache(benchmark, num_tokens):
    benchmark.group = "reference reshape_and_cache (cpu)"
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    cache_k = torch.zeros(num_tokens // BLOCK_SIZE + 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    cache_v = torch.zeros_like(cache_k)
    slots = torch.randperm(cache_k.shape[0] * BLOCK_SIZE, generator=gen)[:num_tokens]
    benchmark(reference.reshape_and_cache, key, key, cache_k, cache_v, slots, check_inputs=False)


@pytest.mark.parametrize("num_tokens", [16, 512])
def test_reference_merge_attn_states(benchmark, num_tokens):
    benchmark.group = "reference merge_attn_states (cpu)"
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(num_tokens, NUM_Q_HEADS, HEAD_SIZE, generator=gen) for _ in range(2)]
    lses = [torch.randn(num_tokens, NUM_Q_HEADS, generator=gen) for _ in range(2)]
    benchmark(reference.merge_attn_states, outs[0], lses[0], outs[1], lses[1], check_inputs=False)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_interpreted_kernel_tiny(benchmark, num_splits):
    """Kernel under the interpreter at a tiny shape: relative cost only."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 (or run on a GPU with bench/gpu/run_all.py)")
    from servelab import kernels

    benchmark.group = "triton kernel under TRITON_INTERPRET=1 (tiny)"
    benchmark.extra_info["implementation"] = "triton-interpreter"
    args = make_batch([1, 1, 4], [40, 70, 20], num_q_heads=4, num_kv_heads=2, head_size=32)
    benchmark.pedantic(kernels.paged_attention, args=args,
                       kwargs=dict(num_splits=num_splits, check_inputs=False), rounds=3, iterations=1)
