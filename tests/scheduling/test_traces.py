"""Real traces: ``load_trace`` (Mooncake hash ids -> tokens, Azure wall clock -> arrivals) and their replay."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.scheduling import SchedulerConfig
from servelab.scheduling.simulator import BlockTokens, StepCostModel, TraceRequest, load_trace, simulate
from servelab.scheduling.simulator.traces import MOONCAKE_BLOCK_TOKENS, shipped_trace_path

BS = MOONCAKE_BLOCK_TOKENS


def _reference_tokens(hash_ids, length):
    """The plain definition: block h is the 512 tokens h*512 .. h*512+511; keep the first ``length``."""
    out = []
    for h in hash_ids:
        out += [h * BS + j for j in range(BS)]
    return out[:length]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=4), st.data())
def test_block_tokens_match_the_plain_definition(hash_ids, data):
    length = data.draw(st.integers((len(hash_ids) - 1) * BS + 1, len(hash_ids) * BS))
    tokens = BlockTokens(hash_ids, length)
    ref = _reference_tokens(hash_ids, length)
    assert list(tokens) == ref and len(tokens) == length
    i = data.draw(st.integers(-length, length - 1))
    assert tokens[i] == ref[i]
    assert tokens[3:length:7] == ref[3:length:7]


def test_same_ids_same_tokens_different_ids_differ_from_the_first_token():
    a, b, c = BlockTokens([5, 9], 700), BlockTokens([5, 9, 11], 1100), BlockTokens([5, 10], 700)
    assert list(a) == list(b)[:700]
    assert list(a)[:BS] == list(c)[:BS] and a[BS] != c[BS]
    with pytest.raises(ValueError, match="length"):
        BlockTokens([1], BS + 1)


def test_mooncake_loads_with_its_published_shape():
    trace = load_trace("mooncake_conversation")
    assert len(trace) == 12031 and trace.format == "mooncake" and trace.num_clipped == 0
    mean_in = sum(len(r.prompt_token_ids) for r in trace) / len(trace)
    mean_out = sum(r.max_tokens for r in trace) / len(trace)
    assert 11_900 < mean_in < 12_100 and 330 < mean_out < 355  # ~12k input, ~343 output (the trace's README)
    arrivals = [r.arrival_time for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0 and 3500 < arrivals[-1] <= 3600  # one hour
    fast = load_trace(shipped_trace_path("mooncake_conversation"), "mooncake", time_scale=0.5)
    assert fast[-1].arrival_time == pytest.approx(arrivals[-1] / 2)


def test_max_model_len_clips_and_counts_keeping_the_prefix():
    trace = load_trace("mooncake_conversation", max_model_len=8192)
    full = load_trace("mooncake_conversation")
    expected = sum(len(r.prompt_token_ids) + r.max_tokens > 8192 for r in full)
    assert trace.num_clipped == expected > 0
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 8192 and r.max_tokens >= 1 for r in trace)
    long = next(i for i, r in enumerate(full) if len(r.prompt_token_ids) > 9000)
    assert list(trace[long].prompt_token_ids) == list(full[long].prompt_token_ids)[:8191]


def test_azure_wall_clock_becomes_relative_arrivals():
    trace = load_trace("azure_conv")
    assert len(trace) == 19366 and trace[0].arrival_time == 0.0
    assert trace[1].arrival_time == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)  # rows 1 and 2 of the file
    assert len(trace[0].prompt_token_ids) == 374 and trace[0].max_tokens == 44
    assert 3500 < trace[-1].arrival_time < 3600
    firsts = {r.prompt_token_ids[0] for r in trace[:500]}
    assert len(firsts) == 500  # no prefix information: no two prompts share a first token


@pytest.mark.parametrize(("content", "match"), [
    ('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1]}\n', "needs 2 hash_ids"),
    ('{"timestamp": -1, "input_length": 6, "output_length": 3, "hash_ids": [1]}\n', "timestamp"),
    ('{"timestamp": 0, "input_length": 6, "output_length": 0, "hash_ids": [1]}\n', "output_length"),
    ("not json\n", "line 2: not JSON"),
])
def test_malformed_mooncake_rows_name_the_line_and_field(tmp_path, content, match):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 6, "output_length": 3, "hash_ids": [1]}\n' + content)
    with pytest.raises(ValueError, match=match):
        load_trace(path, "mooncake")


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="format='parquet'"):
        load_trace("mooncake_conversation_x", "parquet")
    with pytest.raises(ValueError, match="not a file nor a shipped trace"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="time_scale"):
        load_trace("azure_conv", time_scale=0)
    with pytest.raises(ValueError, match="max_model_len"):
        load_trace("azure_conv", max_model_len=1)
    bad = tmp_path / "a.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,x\n")
    with pytest.raises(ValueError, match="line 2: GeneratedTokens"):
        load_trace(bad, "azure")


def _reusable_prefix_tokens(rows, block_size):
    """Per request, the prompt tokens an unbounded prefix cache can serve, from the trace's hash ids alone:
    the longest token prefix shared with any earlier prompt (k common hash ids cover min(512k, both
    lengths) tokens), at most prompt - 1 (one token is always computed), floored to whole blocks."""
    covered: dict[tuple, int] = {}
    out = []
    for ids, n_in in rows:
        best = 0
        for k in range(1, len(ids) + 1):
            seen = covered.get(tuple(ids[:k]))
            if seen is None:
                break
            best = max(best, min(seen, BS * k, n_in))
        out.append(min(best, n_in - 1) // block_size * block_size)
        for k in range(1, len(ids) + 1):
            key = tuple(ids[:k])
            covered[key] = max(covered.get(key, 0), min(n_in, BS * k))
    return out


def _conversation_subset(n):
    """Indices of the first ``n`` requests (of the trace's first 1,000) whose first two blocks another of them
    shares: follow-up turns of conversations, so the subset reuses prefixes well beyond the system prompt."""
    with open(shipped_trace_path("mooncake_conversation")) as f:
        rows = [json.loads(next(f)) for _ in range(1000)]
    count: dict[tuple, int] = {}
    for row in rows:
        count[tuple(row["hash_ids"][:2])] = count.get(tuple(row["hash_ids"][:2]), 0) + 1
    keep = [i for i, row in enumerate(rows) if count[tuple(row["hash_ids"][:2])] > 1][:n]
    return keep, [rows[i] for i in keep]


@pytest.mark.parametrize("block_size", [16, 128])
def test_prefix_cache_hits_equal_the_traces_reusable_prefixes(block_size):
    """Unbounded pool, arrivals spread so each request finishes before the next: the simulator's hit tokens
    are exactly the reusable prefixes the hash ids describe."""
    keep, rows = _conversation_subset(100)
    trace = load_trace("mooncake_conversation")
    subset = [trace[i] for i in keep]
    assert [len(r.prompt_token_ids) for r in subset] == [row["input_length"] for row in rows]
    spread = [TraceRequest(r.request_id, 1000.0 * i, r.prompt_token_ids, min(r.max_tokens, 8))
              for i, r in enumerate(subset)]
    expected = _reusable_prefix_tokens([(row["hash_ids"], row["input_length"]) for row in rows], block_size)
    assert sum(e > 4 * BS for e in expected) >= 10  # multi-turn reuse, beyond the shared first block
    total = sum(row["input_length"] + 8 for row in rows)
    config = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=8, max_model_len=140_000)
    result = simulate(spread, "fcfs", scheduler_config=config, num_blocks=total // block_size + 64,
                      block_size=block_size, cost_model=StepCostModel(1e-3, 1e-6, 0.0))
    by_id = {m.request_id: m for m in result.requests}
    metrics = [by_id[r.request_id] for r in spread]
    assert all(m.finish_time < 1000.0 * (i + 1) for i, m in enumerate(metrics))  # one at a time
    assert [m.num_cached_tokens for m in metrics] == expected
