"""The C kernel's AVX-512 path (``csrc/quant_gemm.c``) on the shapes its structure splits: widths
that cross its 16-block scale segments (one gather of 16 blocks' float16 scales), weight-row
counts that leave a partial group of 4, every x-row tile (1-4 rows decode into registers; 5-32
decode each segment once into a buffer shared by the tiles), held to the float64 reference
(:func:`servelab.reference.quant_linear.quant_linear`), and a row's bits equal in any batch (the
two paths perform the same operations). On a build without that path these run the portable C."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from servelab.quantization import cpu_kernels, get_quant_method
from servelab.quantization.layer import QuantizedLinear
from servelab.reference.quant_linear import dequantize, quant_linear
from test_formats import random_blocks  # noqa: E402

needs_kernel = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the kernels")
METHODS = [("Q4_1", None), ("Q4_0", None), ("Q8_0", None), ("int8", None), ("w4a16", 32), ("w4a16", 64)]


def _layer(method: str, group: int | None, out: int, width: int, seed: int, bias: bool,
           stored: bool) -> QuantizedLinear:
    """Weights quantized from normal values, or (``stored``, GGUF kinds) random block bytes: any
    float16 scale and min, as a file may hold."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(out, generator=g) if bias else None
    if stored and method.startswith("Q"):
        return QuantizedLinear(method, {"blocks": random_blocks(method, out, width // 32, seed)}, width, out, b)
    weight = torch.randn(out, width, generator=g, dtype=torch.float64)
    return QuantizedLinear(method, get_quant_method(method).quantize(weight, group), width, out, b, group_size=group)


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 rounding of a K-term sum (each weight rounded once, then one fma per product)."""
    k = x.shape[1]
    return 2 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T) + 1e-6


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(METHODS), out=st.integers(1, 13), blocks=st.sampled_from([1, 2, 15, 16, 17, 31, 33]),
       rows=st.integers(1, 32), bias=st.booleans(), stored=st.booleans(), seed=st.integers(0, 9999))
@example(case=("Q4_1", None), out=5, blocks=17, rows=5, bias=True, stored=True, seed=0)
@example(case=("Q8_0", None), out=9, blocks=33, rows=32, bias=False, stored=True, seed=1)
@example(case=("w4a16", 64), out=4, blocks=16, rows=4, bias=False, stored=False, seed=2)
def test_segments_and_tiles_match_the_reference(case, out, blocks, rows, bias, stored, seed):
    method, group = case
    width = 32 * blocks
    if group and width % group:
        width = group * max(1, width // group)
    layer = _layer(method, group, out, width, seed, bias, stored)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed + 1))
    got = layer(x)
    tensors = layer.tensors()
    want = quant_linear(x.double(), method, tensors, width, layer.bias)
    assert got.dtype is torch.float32 and got.shape == (rows, out)
    assert torch.all((got.double() - want).abs() <= _bound(x, dequantize(method, tensors, width))), \
        (got.double() - want).abs().max()


@needs_kernel
@pytest.mark.parametrize("method", ["Q4_1", "Q8_0", "w4a16"])
def test_a_row_has_the_same_bits_in_the_register_and_the_buffered_path(method):
    layer = _layer(method, 32 if method == "w4a16" else None, 11, 32 * 19, 3, True, True)
    x = torch.randn(32, 32 * 19, generator=torch.Generator().manual_seed(4))
    whole = layer(x)
    for start, rows in ((0, 1), (3, 2), (5, 3), (8, 4), (0, 5), (7, 9), (1, 31)):
        assert torch.equal(layer(x[start:start + rows]), whole[start:start + rows]), (start, rows)


@needs_kernel
def test_a_strided_x_and_the_last_weight_rows_are_read_right():
    layer = _layer("Q4_1", None, 6, 32 * 17, 5, False, True)
    wide = torch.randn(7, 32 * 17 + 8, generator=torch.Generator().manual_seed(6))
    x = wide[:, 3:3 + 32 * 17]  # a row stride past K: the kernel reads x's rows by its stride
    want = quant_linear(x.double(), "Q4_1", layer.tensors(), 32 * 17)
    for rows in (1, 4, 7):
        got = layer(x[:rows])
        assert torch.all((got.double() - want[:rows]).abs() <= _bound(x[:rows], layer.dense_weight()))


@needs_kernel
def test_the_remembered_kernel_call_gives_the_checked_paths_bits_and_follows_the_stored_tensors():
    layer = _layer("w4a16", 32, 9, 96, 7, True, False)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(8))
    first = layer(x)  # the checked path, which remembers the call
    assert layer._kernel_call is not None
    assert torch.equal(layer(x), first)  # the remembered call
    assert torch.equal(layer(x[:1]), first[:1])
    with pytest.raises(ValueError, match="in_features=96"):  # not the fast path's: the checked path refuses it
        layer(torch.randn(2, 64))
    other = _layer("w4a16", 32, 9, 96, 9, True, False)
    layer.qweight, layer.scales, layer.zeros = other.qweight, other.scales, other.zeros  # replaced: not reused
    want = quant_linear(x.double(), "w4a16", layer.tensors(), 96, layer.bias)
    got = layer(x)
    assert not torch.equal(got, first)
    assert torch.all((got.double() - want).abs() <= _bound(x, layer.dense_weight()))
    assert layer._kernel_call.tensors[0] is other.qweight
    layer.to(torch.float32)  # _apply: the remembered call (and its references) dropped
    assert layer._kernel_call is None
