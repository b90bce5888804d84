"""The C RoPE (``servelab.models.cpu_rope``) against ``llama.rotate``'s torch form, bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.models import cpu_rope
from servelab.models.layers import apply_rotary
from servelab.models.llama import rotate


@pytest.fixture(scope="module")
def kernel(kernel_library):
    """The library loaded (conftest's ``kernel_library``)."""


def tables(tokens, head_size, gen):
    """cos and signed sin ``[T, 1, D]`` as ``StepAttention.rope_tables`` makes them."""
    angles = torch.rand(tokens, head_size // 2, generator=gen, dtype=torch.float64) * 1e4
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().float(), angles.sin().float()
    half = head_size // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos, sin, cos[:, None, :], signed[:, None, :]


@settings(max_examples=80, deadline=None)
@given(tokens=st.integers(0, 300), heads=st.integers(1, 12), half=st.integers(1, 80),
       extra=st.integers(0, 40), threads=st.sampled_from([1, 2, 3]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=st.integers(0, 2**16))
def test_c_rope_equals_the_torch_forms_bit_for_bit(kernel, tokens, heads, half, extra, threads, scale, seed):
    """Queries and keys are a slice of a fused QKV output (``extra`` more columns per token)."""
    head_size = 2 * half
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, heads * head_size + extra, generator=gen) * scale
    x = fused[:, :heads * head_size].view(tokens, heads, head_size)
    cos, sin, cos3, signed3 = tables(tokens, head_size, gen)
    assert cpu_rope.usable(x, cos3, signed3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # tokens are split over threads from T * heads * D >= 32768 on
    try:
        got = cpu_rope.rope(x, cos3, signed3)
    finally:
        torch.set_num_threads(before)
    rolled = x.roll(half, dims=-1).mul_(signed3)
    assert torch.equal(got, rolled.add_(x * cos3))             # rotate's torch form
    assert torch.equal(got, apply_rotary(x, cos, sin))         # and the textbook form it is held to
    assert got.is_contiguous() and got.shape == x.shape


def test_rotate_takes_the_c_path_only_where_it_may(kernel, monkeypatch):
    calls = []
    real = cpu_rope._rope
    monkeypatch.setattr(cpu_rope, "_rope", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(0)
    cos, sin, cos3, signed3 = tables(5, 16, gen)
    x = torch.randn(5, 3, 16, generator=gen)
    with torch.no_grad():
        rotate(x, cos3, signed3)
        rotate(x.double(), cos3.double(), signed3.double())          # float64: torch
        rotate(x.transpose(0, 1).contiguous().transpose(0, 1), cos3, signed3)  # heads not contiguous: torch
    assert len(calls) == 1
    y = rotate(x.requires_grad_(), cos3, signed3)                    # autograd records: torch
    y.sum().backward()
    assert len(calls) == 1 and x.grad is not None


def test_bad_input_is_refused_naming_the_arguments(kernel):
    gen = torch.Generator().manual_seed(1)
    _, _, cos3, signed3 = tables(4, 16, gen)
    x = torch.randn(4, 2, 16, generator=gen)
    with pytest.raises(TypeError, match="signed_sin must be a tensor"):
        cpu_rope.rope(x, cos3, None)
    for bad in (x.double(), x[:, :, :15], torch.randn(4, 32)):
        with pytest.raises(ValueError, match=r"x \(shape"):
            cpu_rope.rope(bad, cos3, signed3)
