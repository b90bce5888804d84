"""Quantized KV pages: the write (fast torch vs its float64 reference), every torch attention path
(the ``"sdpa"`` backend, the ``"torch"`` reference) against the float64 dequantize-then-attend
oracle, the page bytes, and the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import get_attention_backend
from servelab.attention.ops import reshape_and_cache as fast_reshape_and_cache
from servelab.blocks import allocate_kv_cache
from servelab.blocks.kv_quant import (available_kv_cache_dtypes, get_kv_cache_dtype, kv_cache_storage,
                                      quantize_rows, register_kv_cache_dtype, ScaledFormat)
from servelab.blocks.specs import FullAttentionSpec
from servelab.reference import kv_quant as ref_quant
from servelab.reference.paged_attention import paged_attention as ref_paged_attention
from servelab.reference.reshape_and_cache import reshape_and_cache as ref_reshape_and_cache

from tests.kv_quant.cases import FORMATS, GRANULARITIES, build_case, oracle, quant_cases


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), rows=st.integers(1, 6), heads=st.integers(1, 3),
       head_size=st.sampled_from((4, 8, 16)), magnitude=st.sampled_from((1e-3, 1.0, 300.0)),
       seed=st.integers(0, 2**16), zero_row=st.booleans())
def test_quantize_rows_matches_float64_reference(fmt, rows, heads, head_size, magnitude, seed, zero_row):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, heads, head_size), generator=gen) * magnitude
    if zero_row:
        x[0] = 0.0
    f = get_kv_cache_dtype(fmt)
    data, scales = quantize_rows(x, f)
    want_scales = ref_quant.row_scales(x, f.max_value)
    assert torch.equal(scales, want_scales)
    want = ref_quant.quantize(x, want_scales, f.max_value, f.storage_dtype)
    # float32 vs float64 division may land on the other side of a rounding tie: one step at most
    assert _within_one_step(ref_quant.dequantize(data, scales), ref_quant.dequantize(want, scales), scales, fmt)
    # dequantized error: within half a quantization step of the input (int8) / relative (fp8)
    err = (ref_quant.dequantize(data, scales) - x.double()).abs()
    if fmt == "int8":
        assert bool((err <= scales.double()[..., None] * 0.5 + 1e-6 * magnitude).all())
    else:
        rel = 2.0 ** -4 if fmt == "fp8_e4m3" else 2.0 ** -3  # half an ulp of 3 / 2 mantissa bits
        bound = rel * x.abs().double() + scales.double()[..., None] * 2.0 ** -9
        assert bool((err <= bound + 1e-12).all())
    if zero_row:
        assert bool((scales[0] == 1.0).all()) and bool((data[0].float() == 0).all())


@settings(max_examples=40, deadline=None)
@given(case=quant_cases(), seed=st.integers(0, 2**16))
def test_fast_write_matches_reference_write(case, seed):
    """Write a fresh batch of rows with the fast torch write and with the reference into two copies."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc = case.key_cache, case.value_cache
    n, heads, d = 5, kc.shape[2], kc.shape[3]
    num_slots = kc.shape[0] * kc.shape[1]
    slots = torch.randperm(num_slots - kc.shape[1], generator=gen)[:n] + kc.shape[1]
    slots[0] = -1  # a padding row is skipped
    key, value = torch.randn((n, heads, d), generator=gen) * 3, torch.randn((n, heads, d), generator=gen)
    copies = []
    for write in (fast_reshape_and_cache, ref_reshape_and_cache):
        k2, v2 = kc.clone(), vc.clone()
        ks = case.k_scale if case.k_scale.stride(0) == 0 else case.k_scale.clone()
        vs = case.v_scale if case.v_scale.stride(0) == 0 else case.v_scale.clone()
        write(key, value, k2, v2, slots, k_scale=ks, v_scale=vs)
        copies.append((k2, v2, ks, vs))
    (fk, fv, fks, fvs), (rk, rv, rks, rvs) = copies
    assert torch.equal(fks, rks) and torch.equal(fvs, rvs)
    fmt = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}[fk.dtype]
    for fast, ref, scale in ((fk, rk, rks), (fv, rv, rvs)):
        assert _within_one_step(ref_quant.dequantize(fast, scale), ref_quant.dequantize(ref, scale), scale, fmt)
    assert not torch.equal(fks, case.k_scale) or fks.stride(0) == 0  # the write stored new scales


def _within_one_step(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, fmt: str) -> bool:
    """Dequantized ``a`` and ``b`` differ by at most one quantization step of their format."""
    scale = scale.double()[..., None].expand_as(a)
    if fmt == "int8":
        bound = scale
    else:
        rel = 2.0 ** -3 if fmt == "fp8_e4m3" else 2.0 ** -2
        bound = rel * torch.maximum(a.abs(), b.abs()) + scale * 2.0 ** -16
    return bool(((a - b).abs() <= bound * 1.0001 + 1e-30).all())


@settings(max_examples=40, deadline=None)
@given(case=quant_cases(), window=st.sampled_from((None, 3, 17)), backend=st.sampled_from(("sdpa", "torch")))
def test_attention_paths_match_float64_oracle(case, window, backend):
    kwargs = {} if window is None else {"sliding_window": window}
    want = oracle(case, **kwargs)
    got = get_attention_backend(backend).paged_attention(*case.args(), k_scale=case.k_scale, v_scale=case.v_scale,
                                                         **kwargs)
    tolerance = 1e-5 * max(1.0, float(want.abs().max()))  # float32 sums: ulps of the largest value
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=tolerance)


def test_reference_float64_query_is_the_oracle():
    case = build_case("int8", "token_head", "block_outermost", 2, 2, 16, 4, [9, 13], [1, 5], 1.0, 3)
    got = ref_paged_attention(case.query.double(), *case.args()[1:], k_scale=case.k_scale, v_scale=case.v_scale)
    torch.testing.assert_close(got, oracle(case), rtol=1e-12, atol=1e-12)


def test_attention_differs_from_unscaled_read():
    """A test that can fail: reading the data without its scales gives another answer."""
    case = build_case("int8", "token_head", "layer_outermost", 1, 2, 16, 4, [12], [3], 0.1, 5)
    wrong = ref_paged_attention(case.query, case.key_cache.float(), case.value_cache.float(), *case.args()[3:])
    right = oracle(case)
    assert not torch.allclose(wrong.double(), right, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
def test_page_bytes_count_data_and_scales(fmt):
    storage, _ = kv_cache_storage(fmt, None, torch.float32)
    common = dict(block_size=16, num_kv_heads=3, head_size=64)
    full = FullAttentionSpec(dtype=torch.float32, **common).page_size_bytes
    token_head = FullAttentionSpec(dtype=storage, kv_scale="token_head", **common)
    static = FullAttentionSpec(dtype=storage, kv_scale="head", **common)
    assert token_head.page_size_bytes == 2 * 16 * 3 * (64 + 4)
    assert static.page_size_bytes == 2 * 16 * 3 * 64
    assert full / token_head.page_size_bytes >= 3.5  # the capacity target at head size 64
    buffers = allocate_kv_cache(token_head, 3, 5, layout="block_outermost")
    assert buffers.buffer.numel() == 3 * 5 * token_head.page_size_bytes
    k, v, ks, vs = buffers.views[2]
    ks.fill_(7.0)  # scale views do not overlap the data
    assert bool((k.view(torch.uint8) == 0).all()) and bool((v.view(torch.uint8) == 0).all())


def test_settings_and_refusals():
    assert {"int8", "fp8", "fp8_e4m3", "fp8_e5m2"} <= set(available_kv_cache_dtypes())
    assert kv_cache_storage("fp8", None, torch.float32) == (torch.float8_e4m3fn, "token_head")
    assert kv_cache_storage("auto", None, torch.bfloat16) == (torch.bfloat16, None)
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*valid"):
        kv_cache_storage("int4", None, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_scale='channel'"):
        kv_cache_storage("int8", "channel", torch.float32)
    with pytest.raises(ValueError, match="kv_scale="):
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32, kv_scale="head")
    case = build_case("int8", "token_head", "layer_outermost", 1, 1, 8, 4, [5], [1], 1.0, 0)
    with pytest.raises(ValueError, match="pass k_scale and v_scale"):
        ref_paged_attention(*case.args())
    with pytest.raises(ValueError, match="k_scale shape"):
        ref_paged_attention(*case.args(), k_scale=case.k_scale[:1], v_scale=case.v_scale)
    with pytest.raises(ValueError, match="k_scale dtype"):
        ref_paged_attention(*case.args(), k_scale=case.k_scale.double(), v_scale=case.v_scale)


def test_triton_backend_refuses_what_it_cannot_read():
    backend = get_attention_backend("triton")
    query = torch.zeros((1, 2, 8))
    for dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        reason = backend.kv_cache_dtype_problem(dtype)
        supported = backend.capabilities.supported_kv_cache_dtypes
        if reason is not None:
            assert "cannot read kv_cache_dtype" in reason and repr(supported[0]) in reason
            assert backend.supports(query, torch.zeros((1, 4, 1, 8), dtype=dtype)) == reason
    assert get_attention_backend("sdpa").kv_cache_dtype_problem(torch.int8) is None


def test_a_registered_format_is_read_by_the_torch_paths():
    register_kv_cache_dtype("int8_narrow", ScaledFormat("int8_narrow", torch.int8, 63.0), override=True)
    try:
        assert "int8_narrow" in available_kv_cache_dtypes()
        assert kv_cache_storage("int8_narrow", None, torch.float32)[0] == torch.int8
    finally:
        from servelab.blocks import kv_quant

        kv_quant._REGISTRY._entries.pop("int8_narrow", None)


@settings(max_examples=20, deadline=None)
@given(case=quant_cases(), seed=st.integers(0, 2**16))
def test_c_int8_write_equals_the_torch_write_bit_for_bit(case, seed):
    """``servelab_write_kv_int8`` (taken for float32 rows into int8 pages) against the torch write it
    replaces (the C library switched off), both layouts, static and in-page scales."""
    from servelab.attention import ops

    if case.key_cache.dtype != torch.int8 or ops._library() is None:
        return
    gen = torch.Generator().manual_seed(seed)
    kc = case.key_cache
    n = 4
    slots = torch.randperm(kc.shape[0] * kc.shape[1] - kc.shape[1], generator=gen)[:n] + kc.shape[1]
    key, value = torch.randn((n, kc.shape[2], kc.shape[3]), generator=gen), torch.randn((n, kc.shape[2], kc.shape[3]))
    copies = []
    for use_c in (True, False):
        k2, v2 = kc.clone(), case.value_cache.clone()
        ks = case.k_scale if case.k_scale.stride(0) == 0 else case.k_scale.clone()
        vs = case.v_scale if case.v_scale.stride(0) == 0 else case.v_scale.clone()
        saved = ops._library.lib, ops._library.checked
        if not use_c:
            ops._library.lib, ops._library.checked = None, True
        try:
            assert ops._write_int8_in_c(key, value, k2, v2, slots, ks, vs) == use_c or not use_c
            if not use_c:
                ops.reshape_and_cache(key, value, k2, v2, slots, k_scale=ks, v_scale=vs)
        finally:
            ops._library.lib, ops._library.checked = saved
        copies.append((k2, v2, ks, vs))
    for a, b in zip(*copies):
        assert torch.equal(a, b)
