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
