"""Fast paths of the decoder's building blocks against their plain forms."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.models.layers import RMSNorm


def unfused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm, op by op."""
    x32 = x.float() if x.dtype != torch.float64 else x
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@settings(max_examples=40, deadline=None)
@given(shape=st.sampled_from([(1, 64), (7, 256), (16, 576), (3, 5, 64), (2, 17)]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       eps=st.sampled_from([1e-5, 1e-6]), scale=st.sampled_from([1e-3, 1.0, 50.0]),
       seed=st.integers(0, 2**16))
def test_rms_norm_is_bit_exact_with_the_unfused_form(shape, dtype, eps, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * scale).to(dtype)
    norm = RMSNorm(shape[-1], eps, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen).to(dtype))
        got = norm(x)
    expected = unfused_rms_norm(x, norm.weight.detach(), eps)
    assert got.dtype == dtype
    assert torch.equal(got, expected)
