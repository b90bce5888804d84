"""reshape_and_cache: Triton kernel vs reference, and both vs a direct per-token check."""

import pytest
import torch
from attention_cases import CACHE_LAYOUTS, make_cache_pair
from hypothesis import given, note, settings
from hypothesis import strategies as st

from servelab.kernels import reshape_and_cache as kernel_write
from servelab.reference import reshape_and_cache as reference_write

pytestmark = pytest.mark.interpreter


@st.composite
def write_problems(draw):
    block_size = draw(st.sampled_from([1, 8, 16, 32]))
    num_blocks = draw(st.integers(1, 6))
    num_kv_heads = draw(st.sampled_from([1, 2, 3, 8]))
    head_size = draw(st.sampled_from([16, 40, 64, 80]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    num_slots = num_blocks * block_size
    num_tokens = draw(st.integers(0, min(12, num_slots + 3)))
    num_real = draw(st.integers(0, min(num_tokens, num_slots)))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:num_real]
    padded = torch.cat([slots, torch.full((num_tokens - num_real,), -1, dtype=torch.long)])
    padded = padded[torch.randperm(num_tokens, generator=gen)]  # -1 anywhere, not just at the end
    # slot_mapping may be shorter than key: the extra key rows are padding.
    used_len = draw(st.integers(0, num_tokens)) if draw(st.booleans()) else num_tokens
    slot_mapping = padded[:used_len].to(draw(st.sampled_from([torch.int32, torch.int64])))
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    layout = draw(st.sampled_from(CACHE_LAYOUTS))
    return key, value, slot_mapping, (num_blocks, block_size, num_kv_heads, head_size, dtype, layout)


@settings(max_examples=40)
@given(problem=write_problems())
def test_kernel_matches_reference_and_writes_only_its_slots(problem):
    key, value, slot_mapping, cache_spec = problem
    note(f"slots={slot_mapping.tolist()} cache={cache_spec}")
    kernel_k, kernel_v = make_cache_pair(*cache_spec)   # NaN-filled: unwritten slots stay NaN
    ref_k, ref_v = make_cache_pair(*cache_spec)
    kernel_write(key, value, kernel_k, kernel_v, slot_mapping)
    reference_write(key, value, ref_k, ref_v, slot_mapping)
    # A copy is exact: compare bit for bit, NaN (never written) included.
    torch.testing.assert_close(kernel_k, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(kernel_v, ref_v, rtol=0, atol=0, equal_nan=True)

    # Independent check: each real slot holds its token, nothing else was touched.
    block_size = cache_spec[1]
    written = torch.zeros(kernel_k.shape[:2], dtype=torch.bool)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        assert torch.equal(kernel_k[block, offset], key[token])
        assert torch.equal(kernel_v[block, offset], value[token])
        written[block, offset] = True
    assert torch.isnan(kernel_k[~written]).all() and torch.isnan(kernel_v[~written]).all()


def test_writes_through_fused_vllm_layout_buffer():
    # K and V are views of one [blocks, heads, block_size, 2 * head] buffer.
    buffer = torch.zeros(3, 2, 4, 2 * 16)
    key_cache, value_cache = buffer.transpose(1, 2).split(16, dim=-1)
    key, value = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    kernel_write(key, value, key_cache, value_cache, torch.tensor([5, -1], dtype=torch.int64))
    torch.testing.assert_close(buffer[1, :, 1, :16], key[0], rtol=0, atol=0)
    torch.testing.assert_close(buffer[1, :, 1, 16:], value[0], rtol=0, atol=0)
    assert torch.count_nonzero(buffer) == 2 * 2 * 16  # only one token landed
