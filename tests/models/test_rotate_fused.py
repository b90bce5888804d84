"""``llama.rotate`` with the step's RoPE tables is bit-identical to ``layers.apply_rotary``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.models import AttentionMetadata
from servelab.models.layers import apply_rotary
from servelab.models.llama import StepAttention, rotate


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 9), heads=st.integers(1, 6), half=st.integers(1, 16), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
def test_rotate_bit_identical(tokens, heads, half, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    dim = 2 * half
    x = (torch.randn(tokens, heads, dim, generator=gen) * 10).to(dtype)
    angles = torch.randn(tokens, dim, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    empty = torch.zeros(0, dtype=torch.int32)
    step = StepAttention(object(), AttentionMetadata(empty.long(), empty[:, None], empty, empty), 1)
    got = rotate(x, *step.rope_tables(cos, sin))
    assert got.dtype == x.dtype
    assert torch.equal(got, apply_rotary(x, cos, sin))
    first = step.rope_tables(cos, sin)[1]
    assert step.rope_tables(cos, sin)[1] is first  # built once per step, reused by later layers
    assert step.rope_tables(cos, sin.clone())[1] is not first  # other inputs: new tables
