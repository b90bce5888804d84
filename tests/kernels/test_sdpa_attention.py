"""The "sdpa" backend (one batched SDPA call) against the reference."""

import pytest
import torch
from attention_cases import CACHE_LAYOUTS, TOLERANCES, as_float64, build_case, sequence_shapes
from hypothesis import given, note, settings
from hypothesis import strategies as st

from servelab.attention.backends import UnsupportedInputError, get_attention_backend
from servelab.reference import paged_attention as reference_attention
from servelab.attention.sdpa import paged_attention as sdpa_attention

HEAD_LAYOUTS = [(1, 1), (4, 2), (6, 3), (8, 1), (5, 1), (16, 2)]


@st.composite
def problems(draw, dtypes=(torch.float32, torch.float16, torch.bfloat16)):
    block_size = draw(st.sampled_from([1, 4, 8, 16]))
    query_lens, seq_lens = draw(sequence_shapes(block_size, max_seqs=5, max_blocks=4))
    num_q_heads, num_kv_heads = draw(st.sampled_from(HEAD_LAYOUTS))
    longest = max(seq_lens)
    window = draw(st.sampled_from([None, None, 1, 2, block_size, longest - 1, longest + 5]))
    options = dict(causal=draw(st.sampled_from([True, True, False])),
                   sliding_window=None if window is not None and window < 1 else window,
                   scale=draw(st.sampled_from([None, 0.3])))
    case = build_case(query_lens, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                      head_size=draw(st.sampled_from([8, 16, 80])), block_size=block_size,
                      dtype=draw(st.sampled_from(dtypes)), layout=draw(st.sampled_from(CACHE_LAYOUTS)),
                      seed=draw(st.integers(0, 2**16)), table_padding=draw(st.integers(0, 2)))
    return case, options


@settings(max_examples=150)
@given(problem=problems())
def test_sdpa_matches_reference(problem):
    case, options = problem
    note(case.describe())
    note(str(options))
    expected = reference_attention(*case.args(), **options)
    out = torch.full_like(case.query, float("nan"))  # poisoned: every row must be written
    actual = sdpa_attention(*case.args(), out=out, **options)
    assert actual is out and not torch.isnan(actual).any()
    rtol, atol = TOLERANCES[case.query.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@settings(max_examples=40)
@given(problem=problems(dtypes=(torch.float32,)))
def test_sdpa_matches_reference_in_float64(problem):
    case, options = problem
    case64 = as_float64(case)
    expected = reference_attention(*case64.args(), **options)
    actual = sdpa_attention(*case64.args(), **options)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_sdpa_backend_declares_what_it_cannot_do():
    backend = get_attention_backend("sdpa")
    case = build_case([3], [7], num_q_heads=2, num_kv_heads=1, head_size=8, block_size=4, dtype=torch.float32)
    assert backend.supports(case.query, case.key_cache, softcap=5.0) == "backend 'sdpa' does not implement softcap"
    assert backend.supports(case.query, case.key_cache, sliding_window=3) is None
    with pytest.raises(UnsupportedInputError, match="softcap"):
        backend.paged_attention(*case.args(), softcap=5.0)
    with pytest.raises(UnsupportedInputError, match="return_lse"):
        backend.paged_attention(*case.args(), return_lse=True)
    with pytest.raises(ValueError, match="softcap"):
        sdpa_attention(*case.args(), softcap=5.0)
    empty = build_case([0], [0], num_q_heads=2, num_kv_heads=1, head_size=8, block_size=4, dtype=torch.float32)
    assert sdpa_attention(*empty.args()).shape == (0, 2, 8)


@settings(max_examples=40)
@given(problem=problems(dtypes=(torch.float32,)))
def test_gqa_fallback_and_shared_plan_match_reference(problem):
    """The pre-2.5 query-folding GQA path, and one plan reused across calls (as the
    model does across layers), give the reference's result."""
    import servelab.attention.sdpa as sdpa

    case, options = problem
    expected = reference_attention(*case.args(), **options)
    plan = sdpa.plan_attention(case.block_table, case.seq_lens, case.query_start_loc,
                               block_size=case.key_cache.shape[1], causal=options["causal"],
                               sliding_window=options["sliding_window"])
    native = sdpa.GQA_NATIVE
    try:
        for flag in (True, False):
            sdpa.GQA_NATIVE = flag
            for _ in range(2):
                actual = sdpa_attention(*case.args(), plan=plan, **options)
                torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    finally:
        sdpa.GQA_NATIVE = native


def test_plan_splits_decodes_from_prefills_and_refuses_other_metadata():
    from servelab.attention.sdpa import plan_attention

    case = build_case([1, 5, 1, 0, 3], [9, 5, 2, 4, 12], num_q_heads=4, num_kv_heads=2, head_size=8,
                      block_size=4, dtype=torch.float32)
    plan = plan_attention(case.block_table, case.seq_lens, case.query_start_loc, block_size=4)
    decode, prefill = plan.groups
    assert decode.q_index.shape == (2, 1) and decode.kv_blocks.shape == (2, 9)  # no padding to the prompts
    assert prefill.q_index.shape == (2, 5) and prefill.kv_blocks.shape == (2, 12)
    assert sorted(torch.cat([decode.out_dst, prefill.out_dst]).tolist()) == list(range(10))
    torch.testing.assert_close(sdpa_attention(*case.args(), plan=plan), reference_attention(*case.args()),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="plan was made for"):
        sdpa_attention(*case.args(), plan=plan, sliding_window=3)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(2, 40), st.integers(0, 40)), min_size=1, max_size=7),
       overhead=st.sampled_from([0, 50, 400, 10**6]))
def test_bucket_sequences_is_the_cheapest_partition_of_the_sorted_order(lens, overhead):
    """The dynamic program against every cut of the sorted sequences (brute force)."""
    import itertools

    from servelab.attention.sdpa import bucket_sequences

    q_lens = [q for q, _ in lens]
    kv_lens = [q + extra for q, extra in lens]

    def cost(buckets):
        return sum(overhead + len(b) * max(q_lens[i] for i in b) * max(kv_lens[i] for i in b) for b in buckets)

    buckets = bucket_sequences(q_lens, kv_lens, overhead=overhead)
    assert sorted(i for b in buckets for i in b) == list(range(len(lens)))
    order = sorted(range(len(lens)), key=lambda i: (kv_lens[i], q_lens[i]))
    best = min(cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))])
               for r in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), r))
    assert cost(buckets) == best
    if overhead == 0:
        assert all(len({(q_lens[i], kv_lens[i]) for i in b}) == 1 for b in buckets)  # no padding left
    if overhead == 10**6:
        assert len(buckets) == 1


def _unpruned_buckets(q_lens, kv_lens, overhead, max_bucket):
    """The dynamic program without its early stop (the reference for the pruned one)."""
    import math

    order = sorted(range(len(q_lens)), key=lambda i: (kv_lens[i], q_lens[i]))
    n = len(order)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        max_q, max_kv = 0, kv_lens[order[j - 1]]
        for i in range(j - 1, max(-1, j - 1 - max_bucket), -1):
            max_q = max(max_q, q_lens[order[i]])
            cost = best[i] + overhead + (j - i) * max_q * max_kv
            if cost < best[j]:
                best[j], cut[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


@settings(max_examples=80, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 3000)), min_size=1, max_size=150),
       overhead=st.sampled_from([0, 1, 512, 4096, 10**7]))
def test_bucket_sequences_early_stop_gives_the_full_search_s_buckets(lens, overhead):
    from servelab.attention.buckets import MAX_BUCKET, bucket_sequences

    q_lens = [q for q, _ in lens]
    kv_lens = [q + extra for q, extra in lens]
    assert bucket_sequences(q_lens, kv_lens, overhead=overhead) == _unpruned_buckets(q_lens, kv_lens, overhead,
                                                                                     MAX_BUCKET)


@settings(max_examples=60, deadline=None)
@given(problem=problems(), overhead=st.sampled_from([0, 30]))
def test_prefill_buckets_causal_groups_and_decode_steps_match_reference(problem, overhead):
    """Many small buckets (overheads 0: one per distinct length, decodes too),
    including the mask-free ``is_causal`` groups of fresh prompts, and the
    gather-free path of a pure decode step, give the reference's result."""
    import servelab.attention.sdpa as sdpa

    case, options = problem
    expected = reference_attention(*case.args(), **options)
    saved = sdpa.BUCKET_OVERHEAD, sdpa.DECODE_BUCKET_OVERHEAD
    try:
        sdpa.BUCKET_OVERHEAD = sdpa.DECODE_BUCKET_OVERHEAD = overhead
        out = torch.full_like(case.query, float("nan"))
        actual = sdpa_attention(*case.args(), out=out, **options)
    finally:
        sdpa.BUCKET_OVERHEAD, sdpa.DECODE_BUCKET_OVERHEAD = saved
    assert actual is out and not torch.isnan(actual).any()
    rtol, atol = TOLERANCES[case.query.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def test_fresh_prompts_use_is_causal_and_pure_decode_skips_the_gather():
    from servelab.attention.sdpa import plan_attention

    fresh = build_case([3, 9, 4], [3, 9, 4], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                       dtype=torch.float32)
    plan = plan_attention(fresh.block_table, fresh.seq_lens, fresh.query_start_loc, block_size=4)
    assert all(g.is_causal and g.mask(torch.float32) is None for g in plan.groups)
    windowed = plan_attention(fresh.block_table, fresh.seq_lens, fresh.query_start_loc, block_size=4,
                              sliding_window=2)
    assert not any(g.is_causal for g in windowed.groups)
    chunk = build_case([3, 9], [5, 9], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                       dtype=torch.float32)
    mixed = plan_attention(chunk.block_table, chunk.seq_lens, chunk.query_start_loc, block_size=4)
    assert [g.is_causal for g in mixed.groups] in ([False], [False, True])
    decode = build_case([1, 1, 1], [7, 2, 12], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4,
                        dtype=torch.float64)
    plan = plan_attention(decode.block_table, decode.seq_lens, decode.query_start_loc, block_size=4)
    assert len(plan.groups) == 1 and plan.groups[0].identity
    torch.testing.assert_close(sdpa_attention(*decode.args(), plan=plan), reference_attention(*decode.args()),
                               rtol=1e-12, atol=1e-12)
