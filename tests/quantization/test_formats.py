"""Packed formats: the fast torch dequantizers (servelab.quantization.formats) against the
reference (servelab.reference.quant_linear, written from ggml's loops) and the ``gguf``
package's own dequantizer/quantizer, on random blocks of every GGUF type servelab runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.quantization import formats
from servelab.reference.quant_linear import dequantize as ref_dequantize
from servelab.reference.quant_linear import dequantize_gguf_block_rows

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "F16", "F32"]
# byte offsets of each block's float16 fields: overwritten with finite, moderate values so the
# comparison is not about inf/NaN scales
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, blocks_per_row: int, seed: int) -> torch.Tensor:
    fmt = formats.GGUF_FORMATS[kind]
    rng = np.random.default_rng(seed)
    if kind in ("F16", "F32"):
        values = rng.standard_normal((rows, blocks_per_row)).astype(np.float16 if kind == "F16" else np.float32)
        return torch.from_numpy(values.view(np.uint8).reshape(rows, -1).copy())
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, fmt.block_bytes), dtype=np.uint8)
    for start in HALF_FIELDS[kind]:
        halves = rng.uniform(-2.0, 2.0, size=rows * blocks_per_row).astype(np.float16)
        raw[:, start:start + 2] = halves.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


@settings(max_examples=25)
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 5), blocks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_fast_dequantizer_matches_reference_and_gguf(kind, rows, blocks, seed):
    data = random_blocks(kind, rows, blocks, seed)
    width = blocks * formats.GGUF_FORMATS[kind].block_elems
    fast = formats.dequantize_gguf(kind, data, width)
    reference = dequantize_gguf_block_rows(kind, data, width)
    oracle = torch.from_numpy(quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[kind]).astype(np.float64))
    assert fast.shape == reference.shape == (rows, width)
    torch.testing.assert_close(fast.double(), reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reference.reshape(oracle.shape), oracle, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "F16", "F32"])
def test_online_gguf_quantizers_are_llama_cpps(kind):
    weight = torch.randn(6, 96, generator=torch.Generator().manual_seed(3))
    weight[0] = 0.0  # an all-zero block
    ours = formats.quantize_gguf(kind, weight)
    theirs = quants.quantize(weight.numpy(), gguf.GGMLQuantizationType[kind])
    theirs = np.ascontiguousarray(theirs).view(np.uint8)
    assert np.array_equal(ours.numpy(), theirs.reshape(ours.shape))


@settings(max_examples=20)
@given(out=st.integers(1, 9), groups=st.integers(1, 3), group=st.sampled_from([32, 128]), seed=st.integers(0, 999))
def test_online_formats_round_trip_within_half_a_step(out, groups, group, seed):
    weight = torch.randn(out, groups * group, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q8 = formats.quantize_int8(weight)
    deq8 = formats.dequantize_int8(q8["qweight"], q8["scales"]).double()
    assert torch.all((deq8 - weight).abs() <= q8["scales"].double()[:, None] / 2 + 1e-6)
    torch.testing.assert_close(deq8, ref_dequantize("int8", q8, weight.shape[1]), rtol=1e-6, atol=1e-7)
    q4 = formats.quantize_w4a16(weight, group)
    deq4 = formats.dequantize_w4a16(q4["qweight"], q4["scales"], q4["zeros"]).double()
    step = q4["scales"].double().repeat_interleave(group, dim=1)
    assert torch.all((deq4 - weight).abs() <= step / 2 + 1e-5 + step * 0.51)  # zero-point rounding: < 1 step
    torch.testing.assert_close(deq4, ref_dequantize("w4a16", q4, weight.shape[1]), rtol=1e-6, atol=1e-6)


def test_bad_widths_and_types_are_refused():
    with pytest.raises(ValueError, match="group_size=48 does not divide in_features=64"):
        formats.quantize_w4a16(torch.zeros(2, 64), 48)
    with pytest.raises(ValueError, match="not a multiple of Q4_K's block of 256"):
        formats.gguf_row_bytes("Q4_K", 300)
    with pytest.raises(ValueError, match="'IQ2_XS' has no dequantizer"):
        formats.dequantize_gguf("IQ2_XS", torch.zeros(1, 8, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="no online quantizer for GGUF type 'Q4_K'"):
        formats.quantize_gguf("Q4_K", torch.zeros(1, 256))
