"""The Triton W8A16 / W4A16 GEMM (servelab.kernels.quant_gemm) against the reference, under the
interpreter on tiny shapes: odd M / N / K, group boundaries (32, 64), bias, partial tiles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.quantization import get_quant_method
from servelab.reference.quant_linear import dequantize, quant_linear

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@settings(max_examples=6)
@given(method=st.sampled_from([("int8", None), ("w4a16", 32), ("w4a16", 64)]), m=st.integers(1, 20),
       n=st.integers(1, 40), k_units=st.integers(1, 3), bias=st.booleans(), seed=st.integers(0, 99))
def test_triton_quant_gemm_matches_the_reference(method, m, n, k_units, bias, seed):
    from servelab.kernels.quant_gemm import quant_gemm

    name, group = method
    k = k_units * (group or 32) + (7 if name == "int8" else 0)  # int8: a partial K tile
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g, dtype=torch.float64)
    tensors = get_quant_method(name).quantize(weight, group)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    got = quant_gemm(x, name, tensors, k, b)
    from servelab.reference.quant_gemm import quant_gemm as reference_quant_gemm

    want = reference_quant_gemm(x.double(), name, tensors, k, b)
    bound = 2 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ dequantize(name, tensors, k).abs().T) + 1e-5
    assert got.shape == (m, n) and got.dtype is torch.float32
    assert torch.all((got.double() - want).abs() <= bound)


def test_triton_refusals():
    from servelab.kernels.quant_gemm import quant_gemm

    tensors = get_quant_method("w4a16").quantize(torch.randn(4, 48), 16)
    with pytest.raises(ValueError, match="group size 16 must be a multiple of 32"):
        quant_gemm(torch.randn(2, 48), "w4a16", tensors, 48)
    with pytest.raises(ValueError, match="method='Q4_K' has no Triton kernel"):
        quant_gemm(torch.randn(2, 48), "Q4_K", tensors, 48)
