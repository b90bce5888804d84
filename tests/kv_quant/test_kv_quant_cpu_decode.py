"""The C decode kernel over quantized pages (``servelab.attention.cpu_decode_quant``) against the
float64 dequantize-then-attend oracle: pure decode steps, every format and granularity, both page
layouts, GQA, sliding windows; and that the ``"sdpa"`` backend routes a decode step to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.attention import cpu_decode_quant, cpu_kernel_build, get_attention_backend

from tests.kv_quant.cases import FORMATS, GRANULARITIES, build_case, oracle

pytestmark = pytest.mark.skipif(cpu_decode_quant._library() is None, reason="the C CPU kernels are unavailable")


@st.composite
def decode_cases(draw):
    """Head sizes of both paths (8: rows; 16, 64, 128, 256: tiles of 16 positions), odd lengths and
    ones across tile (16), prefetch (32) and block boundaries."""
    num_seqs = draw(st.integers(1, 4))
    head_size = draw(st.sampled_from((8, 16, 64, 128, 256)))
    longest = 70 if head_size <= 64 else 40  # fewer positions for the big heads: the oracle's cost
    lens = [draw(st.one_of(st.integers(1, longest), st.sampled_from((15, 16, 17, 31, 32, 33, 47, 65)),
                           st.integers(100, 200))) for _ in range(num_seqs)]
    return build_case(draw(st.sampled_from(FORMATS)), draw(st.sampled_from(GRANULARITIES)),
                      draw(st.sampled_from(("layer_outermost", "block_outermost"))), draw(st.sampled_from((1, 2))),
                      draw(st.sampled_from((1, 3, 4))), head_size, draw(st.sampled_from((1, 4, 16, 64))), lens,
                      [1] * num_seqs, draw(st.sampled_from((0.1, 1.0, 8.0))), draw(st.integers(0, 2**16)))


def _check(case, window, got):
    kwargs = {} if window is None else {"sliding_window": window}
    want = oracle(case, **kwargs)
    # float32 sums over up to 200 positions of values up to ~30: a few float32 ulps of the largest value
    tolerance = 1e-5 * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=tolerance)


@settings(max_examples=80, deadline=None)
@given(case=decode_cases(), window=st.sampled_from((None, 1, 5, 33)))
def test_c_kernel_matches_float64_oracle(case, window):
    assert cpu_decode_quant.usable(case.query, case.key_cache, case.value_cache)
    got = cpu_decode_quant.paged_decode(case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale,
                                        case.block_table, case.seq_lens, case.query.shape[-1] ** -0.5, window)
    _check(case, window, got)


_SECOND_BUILD = """
import sys, torch
from servelab.attention import cpu_kernel_build, cpu_decode_quant
cpu_kernel_build.FLAG_SETS = (tuple(sys.argv[3].split()),)
args = torch.load(sys.argv[1])
assert cpu_kernel_build.load().flags == cpu_kernel_build.FLAG_SETS[0]
torch.save([cpu_decode_quant.paged_decode(*a) for a in args], sys.argv[2])
"""

#: name -> (flags, CPU features they need): builds beside the loaded library, each taking the paths its
#: instructions have (the loaded library takes this CPU's best).
_SECOND_BUILDS = {
    "plain": ("-O3", set()),  # no vector extensions beyond SSE2: convert_row, score_tile, the 16-lane values
    "avx2": ("-O3 -march=haswell", {"avx2", "fma"}),  # AVX2: keys transposed 32 columns at a time, 8-lane values
}


def _cpu_features() -> set[str]:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(flags.split(":", 1)[1].split())


@pytest.mark.parametrize("build", sorted(_SECOND_BUILDS))
def test_second_build_matches_float64_oracle(tmp_path, build):
    """The library built with other flags (plain -O3; AVX2 without AVX-512) against the oracle: the
    transposing and row-converting key paths (head sizes 64 / 128 and 48 / 16), the 8-lane and 16-lane
    value paths, query-head groups of 1 to 5 (every block of heads), every format, a sliding window."""
    flags, needs = _SECOND_BUILDS[build]
    features = _cpu_features()
    if not needs <= features:
        pytest.skip(f"this CPU lacks {sorted(needs - features)} for the {build} build")
    if build == "avx2" and "avx512f" not in features and "-march=native" in cpu_kernel_build.load().flags:
        pytest.skip("the loaded library is this CPU's AVX2 build: the oracle tests above run it")
    cases = [(build_case(fmt, granularity, "layer_outermost", 2, group, head_size, 16, [37, 5, 130], [1, 1, 1], 1.0,
                         seed), window)
             for seed, (fmt, granularity, group, head_size, window) in enumerate(
                 [("int8", "token_head", 3, 64, None), ("fp8_e4m3", "head", 3, 128, 33),
                  ("fp8_e5m2", "token_head", 1, 16, 5), ("int8", "tensor", 3, 8, None),
                  ("int8", "token_head", 4, 64, 5), ("int8", "head", 5, 48, None),
                  ("fp8_e4m3", "token_head", 2, 256, None), ("fp8_e5m2", "token_head", 1, 64, None)])]
    # copies: the pages and scales are views of one buffer, which torch.save refuses to store twice
    args = [(*(t.clone() for t in (c.query, c.key_cache, c.value_cache, c.k_scale, c.v_scale, c.block_table,
                                   c.seq_lens)), c.query.shape[-1] ** -0.5, w) for c, w in cases]
    torch.save(args, tmp_path / "args.pt")
    env = {**os.environ, "SERVELAB_KERNEL_CACHE": str(tmp_path / "kernels")}
    subprocess.run([sys.executable, "-c", _SECOND_BUILD, str(tmp_path / "args.pt"), str(tmp_path / "out.pt"), flags],
                   env=env, check=True, timeout=300, cwd=Path(__file__).parents[2])
    for (case, window), got in zip(cases, torch.load(tmp_path / "out.pt")):
        _check(case, window, got)


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


@pytest.mark.parametrize("head_size", [64, 8])
def test_every_thread_count_and_work_unit_gives_the_same_bits(head_size):
    """One thread takes whole rows (every KV head tile by tile); two threads over five rows too; two
    threads over one row, and three over five, take (row, KV head) pairs. Same bits every way."""
    threads = torch.get_num_threads()
    results = []
    try:
        for rows, lens in ((1, [150]), (5, [150, 3, 40, 17, 90])):
            case = build_case("int8", "token_head", "block_outermost", 3, 3, head_size, 16, lens, [1] * rows, 1.0, 7)
            for num_threads in (1, 2, 3):
                torch.set_num_threads(num_threads)
                results.append((rows, cpu_decode_quant.paged_decode(
                    case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale, case.block_table,
                    case.seq_lens, head_size ** -0.5, None)))
            _check(case, None, results[-1][1])
    finally:
        torch.set_num_threads(threads)
    for rows, got in results:
        first = next(out for r, out in results if r == rows)
        assert torch.equal(got, first), rows
