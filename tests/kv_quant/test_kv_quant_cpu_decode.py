"""The C decode kernel over quantized pages (``servelab.attention.cpu_decode_quant``) against the
float64 dequantize-then-attend oracle: pure decode steps, every format and granularity, both page
layouts, GQA, sliding windows; and that the ``"sdpa"`` backend routes a decode step to it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode_quant, get_attention_backend

from tests.kv_quant.cases import FORMATS, GRANULARITIES, build_case, oracle

pytestmark = pytest.mark.skipif(cpu_decode_quant._library() is None, reason="the C CPU kernels are unavailable")


@st.composite
def decode_cases(draw):
    num_seqs = draw(st.integers(1, 4))
    return build_case(draw(st.sampled_from(FORMATS)), draw(st.sampled_from(GRANULARITIES)),
                      draw(st.sampled_from(("layer_outermost", "block_outermost"))), draw(st.sampled_from((1, 2))),
                      draw(st.sampled_from((1, 3, 4))), draw(st.sampled_from((8, 16, 64))),
                      draw(st.sampled_from((1, 4, 16))), [draw(st.integers(1, 70)) for _ in range(num_seqs)],
                      [1] * num_seqs, draw(st.sampled_from((0.1, 1.0, 8.0))), draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None)
@given(case=decode_cases(), window=st.sampled_from((None, 1, 5, 33)))
def test_c_kernel_matches_float64_oracle(case, window):
    kwargs = {} if window is None else {"sliding_window": window}
    assert cpu_decode_quant.usable(case.query, case.key_cache, case.value_cache)
    got = cpu_decode_quant.paged_decode(case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale,
                                        case.block_table, case.seq_lens, case.query.shape[-1] ** -0.5, window)
    want = oracle(case, **kwargs)
    # float32 sums over up to 70 positions of values up to ~30: a few float32 ulps of the largest value
    tolerance = 1e-5 * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=tolerance)


def test_sdpa_decode_step_uses_the_kernel(monkeypatch):
    case = build_case("int8", "token_head", "layer_outermost", 2, 3, 16, 4, [9, 30, 1], [1, 1, 1], 1.0, 4)
    calls = []
    real = cpu_decode_quant.paged_decode
    monkeypatch.setattr(cpu_decode_quant, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = get_attention_backend("sdpa").paged_attention(*case.args(), k_scale=case.k_scale, v_scale=case.v_scale)
    assert calls == [1]
    torch.testing.assert_close(got.double(), oracle(case), rtol=2e-5, atol=2e-5)
    prefill = build_case("int8", "token_head", "layer_outermost", 2, 3, 16, 4, [9, 30], [2, 1], 1.0, 4)
    got = get_attention_backend("sdpa").paged_attention(*prefill.args(), k_scale=prefill.k_scale,
                                                        v_scale=prefill.v_scale)
    assert calls == [1]  # a prompt row: the gathered path
    torch.testing.assert_close(got.double(), oracle(prefill), rtol=2e-5, atol=2e-5)


def test_float8_tables_equal_torch_conversion():
    """Every byte of both float8 formats (NaNs aside) decodes in C as torch converts it."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        values = codes.view(dtype).float()
        keep = ~values.isnan() & ~values.isinf()
        n = int(keep.sum())
        pages = torch.zeros((n + 1, 1, 1, 16), dtype=torch.uint8)
        pages[1:, 0, 0, 0] = codes[keep]
        pages = pages.view(dtype)
        ones = torch.ones((n + 1, 1, 1), dtype=torch.float32)
        query = torch.zeros((n, 1, 16))  # uniform weights over one position: out = its value
        table = torch.arange(1, n + 1, dtype=torch.int32)[:, None]
        out = cpu_decode_quant.paged_decode(query, pages, pages, ones, ones, table,
                                            torch.ones(n, dtype=torch.int32), 0.25)
        assert torch.equal(out[:, 0, 0], values[keep])
