"""QuantizedLinear against its reference (dequantize in float64, then the matmul): the C kernel
(1-32 rows), the transient-dequantize path (more rows), batch invariance, and the fallback to the
reference with one warning for a method without a fast path."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from servelab.quantization import QuantMethod, cpu_kernels, formats, get_quant_method, register_quant_method
from servelab.quantization.layer import QuantizedEmbedding, QuantizedLinear
from servelab.reference.quant_linear import dequantize, quant_linear
from test_formats import random_blocks  # noqa: E402

needs_kernel = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the kernels")
ONLINE = [("int8", None), ("w4a16", 32), ("w4a16", 128), ("Q8_0", None), ("Q4_0", None), ("Q4_1", None)]
FILE_ONLY = ["Q5_0", "Q4_K", "Q6_K"]


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 rounding bound of a K-term dot product, per output."""
    k = x.shape[1]
    return 2 * k * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T) + 1e-6


def _layer(method: str, group: int | None, out: int, width: int, seed: int, bias: bool) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(out, generator=g) if bias else None
    if method in FILE_ONLY:
        blocks = random_blocks(method, out, width // get_quant_method(method).block_elems, seed)
        return QuantizedLinear(method, {"blocks": blocks}, width, out, b)
    weight = torch.randn(out, width, generator=g, dtype=torch.float64)
    return QuantizedLinear(method, get_quant_method(method).quantize(weight, group), width, out, b,
                           group_size=group)


@needs_kernel
@settings(max_examples=30)
@given(case=st.sampled_from(ONLINE + [(k, None) for k in FILE_ONLY]), out=st.integers(1, 70),
       blocks=st.integers(1, 3), rows=st.integers(0, 40), bias=st.booleans(), seed=st.integers(0, 999))
@example(case=("int8", None), out=5, blocks=1, rows=1, bias=False, seed=0)
@example(case=("Q4_K", None), out=65, blocks=2, rows=32, bias=True, seed=1)
def test_fast_paths_match_the_reference(case, out, blocks, rows, bias, seed):
    method, group = case
    unit = group or max(get_quant_method(method).block_elems, 32)
    width = blocks * unit + (5 if method == "int8" else 0)  # int8: an odd width (a partial 32-chunk)
    layer = _layer(method, group, out, width, seed, bias)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed + 1))
    got = layer(x)
    tensors = layer.tensors()
    want = quant_linear(x.double(), method, tensors, width, layer.bias)
    assert got.dtype is torch.float32 and got.shape == (rows, out)
    assert torch.all((got.double() - want).abs() <= _bound(x, dequantize(method, tensors, width))), \
        (got.double() - want).abs().max()
    torch.testing.assert_close(layer.dense_weight().double(), dequantize(method, tensors, width), rtol=1e-6,
                               atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("case", ONLINE + [(k, None) for k in FILE_ONLY])
def test_every_format_on_every_kernel_path(case):
    """Each format at 1, 2 and 4 rows (register tiles), 5, 16 and 32 (the buffered path), an output
    count that is not a multiple of the 4-row weight chunk: the sampled test above may draw a
    format only a few times, so a path-specific decoding bug could hide from it."""
    method, group = case
    width = 2 * (group or max(get_quant_method(method).block_elems, 32))
    layer = _layer(method, group, 37, width, 5, True)
    tensors = layer.tensors()
    bound_weight = dequantize(method, tensors, width)
    for rows in (1, 2, 4, 5, 16, 32):
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
        error = (layer(x).double() - quant_linear(x.double(), method, tensors, width, layer.bias)).abs()
        assert torch.all(error <= _bound(x, bound_weight)), (rows, error.max())


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch():
    layer = _layer("Q4_1", None, 48, 96, 0, True)
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(2))
    whole = layer(x)
    for rows in (1, 7, 32):
        assert torch.equal(layer(x[:rows]), whole[:rows])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(layer(x), whole)
    finally:
        torch.set_num_threads(before)


def test_a_method_without_fast_path_runs_its_reference_with_one_warning():
    base = get_quant_method("int8")
    register_quant_method("test-int8-nokernel", QuantMethod("test-int8-nokernel", base.quantize, base.dequantize),
                          override=True)
    weight = torch.randn(8, 40)
    layer = QuantizedLinear("test-int8-nokernel", base.quantize(weight), 40, 8)
    x = torch.randn(3, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = layer(x), layer(x)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "test-int8-nokernel" in messages[0] and "reference" in messages[0]
    torch.testing.assert_close(first, x @ base.dequantize(layer.tensors(), 40).T)
    assert torch.equal(first, second)
    assert not any(isinstance(m, torch.nn.Parameter) for m in layer.parameters())  # no float weight kept


@needs_kernel
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_embedding_reads_only_its_rows_and_ties_the_head(kind):
    blocks = random_blocks(kind, 50, 1, 4)
    width = get_quant_method(kind).block_elems
    table = QuantizedEmbedding(kind, blocks, width)
    ids = torch.tensor([[3, 49], [0, 3]])
    full = dequantize(kind, {"blocks": blocks}, width).float()
    assert torch.equal(table(ids), full[ids])
    head = table.tied_head()
    assert head.blocks.data_ptr() == table.blocks.data_ptr()  # one copy
    hidden = torch.randn(2, width)
    assert torch.all((head(hidden).double() - hidden.double() @ full.double().T).abs() <= _bound(hidden, full))
    with pytest.raises(IndexError, match="out of range"):
        table(torch.tensor([50]))


@needs_kernel
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_prefill_decodes_the_table_in_c_to_the_same_bits(kind, monkeypatch):
    """More rows than the C kernel takes: the C row decoder, bit-equal to the torch dequantizer."""
    layer = _layer(kind, None, 37, 2 * get_quant_method(kind).block_elems, 3, bias=True)
    full = dequantize(kind, layer.tensors(), layer.in_features).float()
    monkeypatch.setattr(formats, "dequantize_gguf", lambda *a: pytest.fail("the torch dequantizer ran"))
    x = torch.randn(cpu_kernels.MAX_ROWS + 3, layer.in_features)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, full, layer.bias))


def test_unknown_method_and_bad_width_are_refused():
    with pytest.raises(ValueError, match="unknown quantization method 'nope'"):
        QuantizedLinear("nope", {}, 32, 1)
    with pytest.raises(ValueError, match="in_features=40 is not a multiple of Q4_K's block of 256"):
        QuantizedLinear("Q4_K", {"blocks": torch.zeros(1, 144, dtype=torch.uint8)}, 40, 1)
