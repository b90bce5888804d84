"""Paged attention: Triton kernel vs reference, and reference vs a dense float64 oracle."""

import importlib
import math

import pytest
import torch
from attention_cases import (
    CACHE_LAYOUTS,
    TOLERANCES,
    as_float64,
    build_case,
    dense_attention_float64,
    sequence_shapes,
)
from hypothesis import given, note, settings
from hypothesis import strategies as st

from servelab.kernels import paged_attention as kernel_attention
from servelab.kernels.paged_attention import (
    SPLIT_MIN_TOKENS,
    AttentionTiles,
    choose_num_splits,
    choose_tiles,
)
from servelab.reference import paged_attention as reference_attention

HEAD_LAYOUTS = [(1, 1), (2, 2), (4, 2), (6, 2), (8, 1), (5, 1), (6, 3), (8, 8), (3, 3), (16, 2)]


@st.composite
def attention_problems(draw, dtypes=(torch.float32, torch.float16, torch.bfloat16), max_seqs=4):
    block_size = draw(st.sampled_from([8, 16, 32]))
    query_lens, seq_lens = draw(sequence_shapes(block_size, max_seqs=max_seqs, max_blocks=3))
    num_q_heads, num_kv_heads = draw(st.sampled_from(HEAD_LAYOUTS))
    head_size = draw(st.sampled_from([16, 32, 48, 64, 80, 96]))
    longest = max(seq_lens)
    window = draw(st.sampled_from([None, None, 1, block_size, longest - 1, longest + 5]))
    options = dict(
        causal=draw(st.sampled_from([True, True, False])),
        sliding_window=None if window is not None and window < 1 else window,
        softcap=draw(st.sampled_from([None, None, 1.5, 30.0])),
        scale=draw(st.sampled_from([None, 0.3])),
    )
    case = build_case(
        query_lens, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block_size, dtype=draw(st.sampled_from(dtypes)),
        layout=draw(st.sampled_from(CACHE_LAYOUTS)), seed=draw(st.integers(0, 2**16)),
        table_padding=draw(st.integers(0, 2)),
    )
    return case, options


def run_poisoned(fn, case, **options):
    """Run ``fn`` into a NaN-filled ``out`` so any element it fails to write shows up."""
    out = torch.full_like(case.query, float("nan"))
    result, lse = fn(*case.args(), out=out, return_lse=True, **options)
    assert result is out
    return out, lse


def assert_matches(actual, expected, dtype, what):
    rtol, atol = TOLERANCES[dtype]
    assert not torch.isnan(actual).any(), f"{what}: NaN in output (unwritten or poisoned read)"
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.interpreter
@settings(max_examples=80)
@given(problem=attention_problems(), num_splits=st.sampled_from([None, 1, 2, 3, 7]))
def test_kernel_matches_reference(problem, num_splits):
    case, options = problem
    note(case.describe())
    note(str(options))
    expected, expected_lse = reference_attention(*case.args(), return_lse=True, **options)
    actual, actual_lse = run_poisoned(kernel_attention, case, num_splits=num_splits, **options)
    assert_matches(actual, expected, case.query.dtype, "output")
    torch.testing.assert_close(actual_lse, expected_lse, rtol=1e-5, atol=1e-4)


@settings(max_examples=80)
@given(problem=attention_problems(dtypes=(torch.float32,), max_seqs=5))
def test_reference_matches_dense_float64(problem):
    case, options = problem
    note(case.describe())
    case64 = as_float64(case)
    expected, expected_lse = dense_attention_float64(case64, **options)
    actual, actual_lse = reference_attention(*case64.args(), return_lse=True, **options)
    assert actual.dtype == torch.float64 and actual_lse.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(actual_lse, expected_lse, rtol=1e-10, atol=1e-10)
    # The float32 path (what users run) agrees to float32 precision.
    out32 = reference_attention(*case.args(), **options)
    torch.testing.assert_close(out32.double(), expected, rtol=1e-4, atol=1e-5)


def test_oracle_is_sensitive_to_masks():
    # Guard against a vacuous comparison: dropping causality or the window
    # must change the oracle's answer on a prefill.
    case = as_float64(build_case([12], [12], num_q_heads=2, num_kv_heads=1, head_size=16,
                                 block_size=8, dtype=torch.float32))
    causal, _ = dense_attention_float64(case)
    full, _ = dense_attention_float64(case, causal=False)
    windowed, _ = dense_attention_float64(case, sliding_window=3)
    assert (causal - full).abs().max() > 1e-2
    assert (causal - windowed).abs().max() > 1e-2
    reference = reference_attention(*case.args())
    assert (reference - full).abs().max() > 1e-2


@pytest.mark.interpreter
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_required_head_sizes(head_size, dtype):
    case = build_case([1, 5, 9], [17, 21, 9], num_q_heads=4, num_kv_heads=2, head_size=head_size,
                      block_size=16, dtype=dtype, layout="vllm_hnd", seed=head_size)
    expected = reference_attention(*case.args())
    actual, _ = run_poisoned(kernel_attention, case)
    assert_matches(actual, expected, dtype, f"head_size={head_size}")


@pytest.mark.interpreter
@pytest.mark.parametrize("block_size", [8, 64, 128])
def test_block_size_range(block_size):
    case = build_case([1, 3, 1], [block_size + 1, 2 * block_size, block_size - 1], num_q_heads=4,
                      num_kv_heads=1, head_size=32, block_size=block_size, dtype=torch.float16,
                      layout="kv_split_last", seed=block_size)
    expected = reference_attention(*case.args(), sliding_window=block_size)
    actual, _ = run_poisoned(kernel_attention, case, sliding_window=block_size)
    assert_matches(actual, expected, torch.float16, f"block_size={block_size}")


@pytest.mark.interpreter
def test_split_kv_long_decode_matches_unsplit():
    # Long decodes across many splits: forced splits agree with no split and with the reference.
    case = build_case([1, 1, 1], [300, 97, 16], num_q_heads=8, num_kv_heads=2, head_size=64,
                      block_size=16, dtype=torch.float32, seed=3)
    expected = reference_attention(*case.args())
    unsplit, _ = run_poisoned(kernel_attention, case, num_splits=1)
    split, split_lse = run_poisoned(kernel_attention, case, num_splits=5)
    assert_matches(unsplit, expected, torch.float32, "unsplit")
    assert_matches(split, expected, torch.float32, "split")
    _, expected_lse = reference_attention(*case.args(), return_lse=True)
    torch.testing.assert_close(split_lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_more_splits_than_tiles_leaves_no_hole():
    # 9 splits over a 3-token sequence: most splits are empty and must weigh 0.
    case = build_case([1, 2], [3, 40], num_q_heads=2, num_kv_heads=2, head_size=16,
                      block_size=8, dtype=torch.bfloat16, seed=4)
    expected = reference_attention(*case.args())
    actual, _ = run_poisoned(kernel_attention, case, num_splits=9)
    assert_matches(actual, expected, torch.bfloat16, "empty splits")


@pytest.mark.interpreter
@pytest.mark.parametrize("tiles", [AttentionTiles(16, 32), AttentionTiles(32, 16), AttentionTiles(64, 64)])
def test_other_tile_shapes(monkeypatch, tiles):
    # The GPU picks wider tiles than the interpreter default; run those shapes too.
    # (the package attribute of that name is the function, so go through importlib)
    module = importlib.import_module("servelab.kernels._paged_attention_plan")  # plan_launch reads it there
    monkeypatch.setattr(module, "choose_tiles", lambda *args: tiles)
    case = build_case([1, 40, 7], [70, 40, 30], num_q_heads=6, num_kv_heads=2, head_size=48,
                      block_size=16, dtype=torch.float16, layout="dim_strided", seed=5)
    for options in ({}, {"sliding_window": 17, "softcap": 5.0}, {"causal": False}):
        expected = reference_attention(*case.args(), **options)
        actual, _ = run_poisoned(kernel_attention, case, num_splits=2, **options)
        assert_matches(actual, expected, torch.float16, f"{tiles} {options}")


@pytest.mark.interpreter
def test_strided_query_and_out():
    # query is a slice of a fused QKV projection; out is a strided view too.
    case = build_case([3, 1], [10, 6], num_q_heads=4, num_kv_heads=2, head_size=32,
                      block_size=8, dtype=torch.float32, seed=6)
    qkv = torch.randn(case.query.shape[0], 8, 32)
    qkv[:, :4] = case.query
    query = qkv[:, :4]
    out_buffer = torch.full((case.query.shape[0], 4, 64), float("nan"))
    out = out_buffer[:, :, ::2]
    args = (query, *case.args()[1:])
    kernel_attention(*args, out=out)
    torch.testing.assert_close(out, reference_attention(*case.args()), rtol=1e-5, atol=1e-5)
    assert torch.isnan(out_buffer[:, :, 1::2]).all(), "wrote outside the out view"


@pytest.mark.interpreter
def test_empty_batch_and_zero_length_query():
    case = build_case([0, 2], [5, 2], num_q_heads=2, num_kv_heads=1, head_size=16,
                      block_size=8, dtype=torch.float32)
    torch.testing.assert_close(kernel_attention(*case.args()), reference_attention(*case.args()))
    empty = build_case([], [], num_q_heads=2, num_kv_heads=1, head_size=16, block_size=8,
                       dtype=torch.float32)
    assert kernel_attention(*empty.args()).shape == (0, 2, 16)
    assert reference_attention(*empty.args()).shape == (0, 2, 16)


def test_choose_num_splits_rule():
    # Prefill present: never split.
    assert choose_num_splits(num_tokens=100, num_seqs=4, num_kv_heads=8, max_context=32768, num_sms=132) == 1
    # Enough programs already: no split.
    assert choose_num_splits(256, 256, 8, 32768, 132) == 1
    # One long decode: split up to the cap.
    assert choose_num_splits(1, 1, 8, 32768, 132) == 16
    # Short contexts limit the split so each part keeps SPLIT_MIN_TOKENS.
    assert choose_num_splits(1, 1, 8, 3 * SPLIT_MIN_TOKENS, 132) == 3
    assert choose_num_splits(1, 1, 8, SPLIT_MIN_TOKENS - 1, 132) == 1
    # Batch 64 x 8 KV heads on 132 SMs: 512 programs < 528 -> 2 splits.
    assert choose_num_splits(64, 64, 8, 4096, 132) == 2


def test_choose_tiles_rows_hold_one_gqa_group():
    for group in (1, 3, 8, 32):
        for interpreted in (True, False):
            for tokens, seqs in ((8, 8), (500, 8)):
                tiles = choose_tiles(tokens, seqs, group, 128, interpreted)
                assert tiles.block_m >= max(16, group) and tiles.block_m & (tiles.block_m - 1) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("options", [dict(softcap=1e4), dict(softcap=0.05), dict(sliding_window=2**40)])
def test_extreme_softcap_and_window(options):
    # A huge softcap puts every capped score near 0 (tanh's cancellation-prone
    # range); a tiny one saturates it; a huge window means no window.
    case = build_case([1, 6], [40, 6], num_q_heads=4, num_kv_heads=2, head_size=32, block_size=8,
                      dtype=torch.float32, seed=8)
    expected = reference_attention(*case.args(), **options)
    actual, _ = run_poisoned(kernel_attention, case, **options)
    assert_matches(actual, expected, torch.float32, str(options))


@pytest.mark.interpreter
def test_default_scale_is_inverse_sqrt_head_size():
    case = build_case([2], [4], num_q_heads=1, num_kv_heads=1, head_size=16, block_size=8,
                      dtype=torch.float32)
    default = kernel_attention(*case.args())
    explicit = kernel_attention(*case.args(), scale=1 / math.sqrt(16))
    torch.testing.assert_close(default, explicit)
