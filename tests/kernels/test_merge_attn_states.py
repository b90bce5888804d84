"""merge_attn_states: kernel vs reference, and merging attention over a key split
reproduces attention over all keys (independent float64 oracle)."""

import math

import pytest
import torch
from attention_cases import TOLERANCES, build_case, dense_attention_float64
from hypothesis import given, note, settings
from hypothesis import strategies as st

from servelab.kernels import merge_attn_states as kernel_merge
from servelab.reference import merge_attn_states as reference_merge

pytestmark = pytest.mark.interpreter


def partial_attention(q, k, v, scale):
    """Dense float64 attention of q [t, h, d] over k/v [n, h, d]; empty n -> (NaN garbage, -inf)."""
    if k.shape[0] == 0:
        return torch.full_like(q, float("nan")), torch.full(q.shape[:2], -math.inf, dtype=q.dtype)
    scores = torch.einsum("thd,nhd->thn", q, k) * scale
    return torch.einsum("thn,nhd->thd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


@settings(max_examples=30)
@given(
    num_tokens=st.integers(1, 5), num_heads=st.integers(1, 5), head_size=st.sampled_from([8, 40, 64]),
    num_keys=st.integers(0, 12), data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_merge_of_a_key_split_equals_full_attention(num_tokens, num_heads, head_size, num_keys, data, dtype):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q = torch.randn(num_tokens, num_heads, head_size, generator=gen, dtype=torch.float64)
    k = torch.randn(num_keys, num_heads, head_size, generator=gen, dtype=torch.float64)
    v = torch.randn(num_keys, num_heads, head_size, generator=gen, dtype=torch.float64)
    cut = data.draw(st.integers(0, num_keys))  # 0 or num_keys: one side empty (-inf, garbage out)
    note(f"cut={cut}")
    scale = head_size ** -0.5
    out_a, lse_a = partial_attention(q, k[:cut], v[:cut], scale)
    out_b, lse_b = partial_attention(q, k[cut:], v[cut:], scale)

    merged, merged_lse = kernel_merge(out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float())
    expected_ref, expected_ref_lse = reference_merge(out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float())
    assert not torch.isnan(merged).any() and not torch.isnan(merged_lse).any()
    torch.testing.assert_close(merged, expected_ref, rtol=TOLERANCES[dtype][0], atol=TOLERANCES[dtype][1])
    torch.testing.assert_close(merged_lse, expected_ref_lse, rtol=1e-6, atol=1e-5)

    if num_keys == 0:  # both empty: zeros and -inf, no NaN
        assert torch.all(merged == 0) and torch.all(merged_lse == -math.inf)
        return
    full_out, full_lse = partial_attention(q, k, v, scale)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(merged.double(), full_out, rtol=2 * rtol, atol=2 * atol)
    torch.testing.assert_close(merged_lse.double(), full_lse, rtol=1e-5, atol=1e-5)
    # The float64 reference is exact to float64 precision.
    exact, exact_lse = reference_merge(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(exact, full_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(exact_lse, full_lse, rtol=1e-12, atol=1e-12)


@settings(max_examples=20)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_kernel_matches_reference_with_scattered_empty_partials(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    shape = (7, 3, 24)
    out_a = torch.randn(shape, generator=gen).to(dtype)
    out_b = torch.randn(shape, generator=gen).to(dtype)
    lse_a = 5 * torch.randn(shape[:2], generator=gen)
    lse_b = 5 * torch.randn(shape[:2], generator=gen)
    empty_a = torch.rand(shape[:2], generator=gen) < 0.3
    empty_b = torch.rand(shape[:2], generator=gen) < 0.3
    lse_a[empty_a] = -math.inf
    lse_b[empty_b] = -math.inf
    out_a[empty_a] = float("nan")  # an empty partial's output is garbage and must be ignored
    out_b[empty_b] = float("nan")
    poisoned = torch.full_like(out_a, float("nan"))
    merged, lse = kernel_merge(out_a, lse_a, out_b, lse_b, out=poisoned)
    assert merged is poisoned
    expected, expected_lse = reference_merge(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(merged).any()
    torch.testing.assert_close(merged, expected, rtol=TOLERANCES[dtype][0], atol=TOLERANCES[dtype][1])
    torch.testing.assert_close(lse, expected_lse, rtol=1e-6, atol=1e-6)
    both = empty_a & empty_b
    assert torch.all(merged[both] == 0) and torch.all(lse[both] == -math.inf)


def test_merge_chains_associatively():
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(4, 2, 16, generator=gen) for _ in range(3)]
    lses = [torch.randn(4, 2, generator=gen) for _ in range(3)]
    left = kernel_merge(*kernel_merge(outs[0], lses[0], outs[1], lses[1]), outs[2], lses[2])
    right = kernel_merge(outs[0], lses[0], *kernel_merge(outs[1], lses[1], outs[2], lses[2]))
    torch.testing.assert_close(left[0], right[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(left[1], right[1], rtol=1e-5, atol=1e-6)


def test_paged_attention_lse_merges_into_full_attention():
    # Cascade-style: attention over a prefix and over a suffix, merged by LSE,
    # equals attention over everything (here via the paged kernels' return_lse).
    from servelab.kernels import paged_attention

    case = build_case([1, 1], [20, 33], num_q_heads=4, num_kv_heads=2, head_size=32,
                      block_size=8, dtype=torch.float32, seed=7)
    full, _ = dense_attention_float64(case)
    # Prefix part: the first 16 tokens (two blocks), seen non-causally by the decode token.
    prefix_lens = torch.tensor([16, 16], dtype=torch.int32)
    out_p, lse_p = paged_attention(case.query, case.key_cache, case.value_cache, case.block_table,
                                   prefix_lens, case.query_start_loc, causal=False, return_lse=True)
    # Suffix part: a table holding only the remaining blocks.
    suffix_table = case.block_table[:, 2:].contiguous()
    suffix_lens = case.seq_lens - 16
    out_s, lse_s = paged_attention(case.query, case.key_cache, case.value_cache, suffix_table,
                                   suffix_lens, case.query_start_loc, return_lse=True)
    merged, _ = kernel_merge(out_p, lse_p, out_s, lse_s)
    torch.testing.assert_close(merged.double(), full, rtol=1e-5, atol=1e-5)
