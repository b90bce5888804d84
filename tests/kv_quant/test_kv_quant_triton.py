"""The Triton paged attention over quantized pages (dequantization fused in the K/V loads) against
the float64 dequantize-then-attend oracle, under the interpreter with tiny shapes: split-KV,
sliding window, soft-capping and token trees included; the Triton backend's write."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention.backends import triton_device_problem
from servelab._internal.tree_mask import TreeMask

from tests.kv_quant.cases import build_case, oracle, quant_cases

pytestmark = pytest.mark.skipif(triton_device_problem("cpu") is not None,
                                reason=str(triton_device_problem("cpu")))


@settings(max_examples=12, deadline=None)
@given(case=quant_cases(max_seqs=2, head_sizes=(16,), block_sizes=(4, 8)),
       window=st.sampled_from((None, 5)), softcap=st.sampled_from((None, 3.0)), splits=st.sampled_from((1, 3)))
def test_triton_quantized_pages_match_float64_oracle(case, window, softcap, splits):
    from servelab.kernels.paged_attention import paged_attention

    kwargs = {k: v for k, v in (("sliding_window", window), ("softcap", softcap)) if v is not None}
    want = oracle(case, **kwargs)
    got = paged_attention(*case.args(), k_scale=case.k_scale, v_scale=case.v_scale, num_splits=splits, **kwargs)
    tolerance = 5e-5 * max(1.0, float(want.abs().max()))  # float32 tiles: ulps of the largest value
    torch.testing.assert_close(got.double(), want, rtol=5e-5, atol=tolerance)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_triton_tree_mask_and_lse_on_quantized_pages(fmt):
    from servelab.kernels.paged_attention import paged_attention

    case = build_case(fmt, "token_head", "block_outermost", 1, 2, 16, 4, [9, 7], [3, 3], 1.0, 11)
    tree = TreeMask(ancestors=torch.tensor([1, 3, 5, 1, 3, 5], dtype=torch.int64),
                    tree_lens=torch.tensor([3, 3], dtype=torch.int32))
    want, want_lse = oracle(case, tree_mask=tree, return_lse=True)
    got, lse = paged_attention(*case.args(), k_scale=case.k_scale, v_scale=case.v_scale, tree_mask=tree,
                               return_lse=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-4)


def test_triton_backend_writes_and_reads_quantized_pages():
    from servelab.attention import get_attention_backend
    from servelab.reference.reshape_and_cache import reshape_and_cache as ref_write

    backend = get_attention_backend("triton")
    case = build_case("int8", "token_head", "layer_outermost", 2, 1, 16, 4, [6], [1], 1.0, 2)
    key, value = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    slots = torch.tensor([int(case.block_table[0, 1]) * 4 + 2, int(case.block_table[0, 1]) * 4 + 3])
    copies = [(case.key_cache.clone(), case.value_cache.clone(), case.k_scale.clone(), case.v_scale.clone())
              for _ in range(2)]
    backend.reshape_and_cache(key, value, copies[0][0], copies[0][1], slots, k_scale=copies[0][2],
                              v_scale=copies[0][3])
    ref_write(key, value, *copies[1][:2], slots, k_scale=copies[1][2], v_scale=copies[1][3])
    assert torch.equal(copies[0][2], copies[1][2])
    assert int((copies[0][0].int() - copies[1][0].int()).abs().max()) <= 1


def _write_both(fmt, granularity, layout, num_kv_heads, head_size, block_size, dtype, magnitude, slots, seed):
    """The Triton quantizing write and the torch write (``servelab.attention.ops``) of the same random
    rows into copies of one quantized cache; returns both copies (caches as bytes, scales)."""
    from servelab.attention.ops import reshape_and_cache as torch_write
    from servelab.kernels.reshape_and_cache import reshape_and_cache as triton_write

    case = build_case(fmt, granularity, layout, num_kv_heads, 1, head_size, block_size, [2 * block_size],
                      [1], 1.0, seed)
    gen = torch.Generator().manual_seed(seed)
    rows = len(slots) + 1  # one row past the slots: padding the write must not read
    key, value = ((torch.randn((rows, num_kv_heads, head_size), generator=gen) * magnitude).to(dtype)
                  for _ in range(2))
    key[0, 0] = 0.0  # an all-zero head: scale 1
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    outs = []
    for write in (triton_write, torch_write):
        pages = (case.key_cache.clone(), case.value_cache.clone())
        scales = [s.clone() if s.stride(0) else s for s in (case.k_scale, case.v_scale)]  # static: shared, read-only
        write(key, value, *pages, slot_mapping, k_scale=scales[0], v_scale=scales[1])
        outs.append([t.view(torch.uint8) if t.element_size() == 1 else t for t in (*pages, *scales)])
    return outs


@settings(max_examples=10, deadline=None)
@given(fmt=st.sampled_from(("int8", "fp8_e4m3", "fp8_e5m2")),
       granularity=st.sampled_from(("token_head", "head", "tensor")),
       layout=st.sampled_from(("layer_outermost", "block_outermost")), num_kv_heads=st.sampled_from((1, 3)),
       head_size=st.sampled_from((8, 24)), block_size=st.sampled_from((1, 4)),
       dtype=st.sampled_from((torch.float32, torch.bfloat16, torch.float16)),
       magnitude=st.sampled_from((1e-3, 1.0, 300.0)), data=st.data())
def test_triton_quantizing_write_equals_torch_write(fmt, granularity, layout, num_kv_heads, head_size, block_size,
                                                     dtype, magnitude, data):
    """Bit for bit: the same float32 scale, division, clamp and rounding; slot -1 rows skipped."""
    capacity = 2 * block_size  # the case's sequence owns its blocks; slots anywhere in the cache
    slots = data.draw(st.lists(st.one_of(st.just(-1), st.integers(block_size, 3 * block_size + capacity - 1)),
                               min_size=1, max_size=5, unique_by=lambda s: s if s >= 0 else object()))
    got, want = _write_both(fmt, granularity, layout, num_kv_heads, head_size, block_size, dtype,
                            magnitude, slots, data.draw(st.integers(0, 2**16)))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_triton_quantizing_write_rounds_ties_like_the_format(fmt):
    """Static scale 1, halves and values past the range: int8 rounds half to even and clamps at
    127, float8 e4m3 casts (round to nearest even) after clamping at 448."""
    from servelab.kernels.reshape_and_cache import reshape_and_cache as triton_write

    case = build_case(fmt, "tensor", "layer_outermost", 1, 1, 8, 4, [4], [1], 1.0, 0)
    ones = torch.ones((1,), dtype=torch.float32).expand(case.k_scale.shape)
    x = torch.tensor([[[0.5, 1.5, 2.5, -2.5, 126.5, 300.0, -1000.0, 17.0625]]])
    triton_write(x, x, case.key_cache, case.value_cache, torch.tensor([0]), k_scale=ones, v_scale=ones)
    stored = case.key_cache[0, 0, 0].float()
    want = ([0, 2, 2, -2, 126, 127, -127, 17] if fmt == "int8"
            else x[0, 0].clamp(-448, 448).to(torch.float8_e4m3fn).float().tolist())
    assert stored.tolist() == want
