"""Scheduler behaviour, one rule per test: budgets, chunked prefill, prefix hits,
preemption, failure, stop conditions, speculative decoding, aborts, outputs."""

from __future__ import annotations

import pytest
from sched_helpers import EOS, TOKEN, RunnerMirror, fake_output, make_scheduler, req, run_to_end, step

from servelab.samplers.params import SamplingParams
from servelab.scheduling import ModelRunnerOutput, RequestStatus


def test_chunked_prefill_splits_a_prompt_under_the_budget_and_samples_only_at_its_end():
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(req("a", 100, max_tokens=2))
    chunks, tokens = [], []
    while s.has_unfinished_requests():
        out, results = step(s)
        chunks.append(out.num_scheduled_tokens["a"])
        tokens.append([t for o in results for t in o.new_token_ids])
    assert chunks == [32, 32, 32, 4, 1]
    assert tokens == [[], [], [], [TOKEN], [TOKEN]]


def test_running_requests_are_scheduled_before_waiting_ones_and_budget_is_shared():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(req("a", 8, max_tokens=5))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 8}
    s.add_request(req("b", 20, max_tokens=5, start=500))
    out, _ = step(s)
    # a decodes (1 token) first; b gets what is left of the budget.
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert out.total_num_scheduled_tokens == 10
    assert [d.req_id for d in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_cached_reqs.req_ids == ["a"]


def test_long_prefill_token_threshold_caps_each_request_per_step():
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    s.add_request(req("a", 40))
    s.add_request(req("b", 40, start=300))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 16, "b": 16}


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    s.add_request(req("a", 40))
    s.add_request(req("b", 40, start=300))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 40}, "b does not fit the 24 tokens left and must not be chunked"
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 40}


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 4, start=10 * i))
    out, _ = step(s)
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_prefix_hit_on_admission_is_capped_at_num_tokens_minus_one():
    s = make_scheduler(block_size=4)
    prompt = list(range(100, 112))  # 3 full blocks
    s.add_request(req("a", prompt, max_tokens=1))
    run_to_end(s)
    s.add_request(req("b", prompt, max_tokens=1))
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    # All 12 tokens are cached, but the last one is recomputed for its logits:
    # the hit stops at the block boundary below 11 tokens, i.e. 8.
    assert new.num_computed_tokens == 8
    assert out.num_scheduled_tokens["b"] == 4
    s.add_request(req("c", prompt[:8] + [999, 998, 997], max_tokens=1))
    out, _ = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert s.kv_cache_manager.prefix_cache_stats.hit_tokens >= 16


def test_preemption_frees_the_victim_resets_it_and_resumes_it_later():
    # 6 usable blocks of 4 tokens; two requests of 8-token prompts growing to 16.
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8, start=300))
    mirror = RunnerMirror()
    seen_preempt = None
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        mirror.apply(out)
        for rid in out.num_scheduled_tokens:
            assert mirror.rows[rid] == s.kv_cache_manager.get_block_ids(rid)
        if out.preempted_req_ids and seen_preempt is None:
            (victim,) = out.preempted_req_ids
            seen_preempt = victim
            v = s.requests[victim]
            assert v.status is RequestStatus.PREEMPTED and v.num_computed_tokens == 0
            assert s.kv_cache_manager.get_block_ids(victim) == ([],)
            assert victim == "b", "FCFS preempts the latest arrival"
            assert not out.scheduled_new_reqs, "nothing is admitted in a step that preempted"
        c = out.scheduled_cached_reqs
        if seen_preempt in c.req_ids and c.resumed[c.req_ids.index(seen_preempt)]:
            assert c.resumed_token_ids[seen_preempt][:8] == list(range(300, 308))
        s.update_from_output(out, fake_output(s, out))
    assert seen_preempt == "b"
    assert not s.has_unfinished_requests()
    assert s.requests == {} and s.num_preemptions >= 1
    assert s.kv_cache_manager.num_free_blocks == 6


def test_a_request_that_cannot_fit_even_alone_fails_and_the_others_finish():
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)  # 4 usable blocks = 16 tokens
    s.add_request(req("small", 4, max_tokens=3))
    s.add_request(req("huge", 30, max_tokens=3, start=200))
    s.add_request(req("grows", 8, max_tokens=20, start=400))  # prompt fits, output cannot
    final = run_to_end(s)
    assert final["small"].finish_reason == "length" and final["small"].metrics.num_output_tokens == 3
    assert final["huge"].finish_reason == "error"
    assert "cannot fit in the KV cache even alone" in final["huge"].error
    assert final["grows"].finish_reason == "error" and final["grows"].metrics.num_output_tokens > 0
    assert s.kv_cache_manager.num_free_blocks == 4


@pytest.mark.parametrize(
    ("params", "outputs", "reason", "n_out", "stop_reason"),
    [
        (SamplingParams(max_tokens=10), [5, EOS, 5], "stop", 2, EOS),
        (SamplingParams(max_tokens=4, ignore_eos=True), [5, EOS, 5, 5], "length", 4, None),
        (SamplingParams(max_tokens=4), [5] * 4, "length", 4, None),
        (SamplingParams(max_tokens=10, stop_token_ids=[9]), [5, 9], "stop", 2, 9),
        (SamplingParams(max_tokens=10, min_tokens=3), [EOS, EOS, EOS], "stop", 3, EOS),
    ],
)
def test_stop_conditions(params, outputs, reason, n_out, stop_reason):
    s = make_scheduler()
    s.add_request(req("a", 4, params=params))
    feed = iter(outputs + [5] * 20)
    final = run_to_end(s, token=lambda r: [next(feed)])
    out = final["a"]
    assert (out.finish_reason, out.metrics.num_output_tokens, out.stop_reason) == (reason, n_out, stop_reason)


def test_max_model_len_ends_output_with_length():
    s = make_scheduler(max_model_len=10)
    s.add_request(req("a", 7, max_tokens=None))
    final = run_to_end(s)
    assert final["a"].finish_reason == "length" and final["a"].metrics.num_output_tokens == 3


def test_speculative_drafts_are_verified_and_rejected_ones_roll_back():
    s = make_scheduler(num_speculative_tokens=3, block_size=4)
    s.add_request(req("a", 6, max_tokens=20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 6}
    # Lookahead slots for the drafter: 6 tokens + 3 drafts need 3 blocks.
    assert len(s.kv_cache_manager.get_block_ids("a")[0]) == 3
    s.update_from_output(out, ModelRunnerOutput(["a"], [[50]], spec_token_ids=[[51, 52, 53]]))
    r = s.requests["a"]
    assert r.num_tokens == 7 and r.num_tokens_with_spec == 10 and r.num_computed_tokens == 6

    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert r.num_computed_tokens == 10
    # 7 tokens + 3 drafts in flight + 3 lookahead slots for the next drafts: 13 slots, 4 blocks.
    assert len(s.kv_cache_manager.get_block_ids("a")[0]) == 4
    # One draft accepted (51), then a correction (60): drafts 52, 53 rejected.
    results = s.update_from_output(out, ModelRunnerOutput(["a"], [[51, 60]], spec_token_ids=[[61, 62, 63]]))
    assert results[0].new_token_ids == [51, 60]
    assert r.output_token_ids == [50, 51, 60]
    assert r.num_tokens == 9 and r.num_computed_tokens == 8, "rolled back to num_tokens - 1"
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (3, 1)

    with pytest.raises(ValueError, match="at most drafts \\+ 1"):
        out = s.schedule()
        s.update_from_output(out, ModelRunnerOutput(["a"], [[1, 2, 3, 4, 5]]))
    assert r.num_tokens == 9, "a rejected output changes nothing"
    # All drafts rejected: only the correction token.
    s.update_from_output(out, ModelRunnerOutput(["a"], [[70]]))
    assert r.num_tokens == 10 and r.num_computed_tokens == 9 and r.spec_token_ids == []


def test_a_stop_token_among_accepted_drafts_truncates_the_output():
    s = make_scheduler(num_speculative_tokens=3)
    s.add_request(req("a", 4, max_tokens=20))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[50]], spec_token_ids=[[51, EOS, 53]]))
    out = s.schedule()
    (res,) = s.update_from_output(out, ModelRunnerOutput(["a"], [[51, EOS, 53]]))
    assert res.finished and res.finish_reason == "stop" and res.new_token_ids == [51, EOS]
    assert s.kv_cache_manager.num_free_blocks == 63


def test_drafts_are_trimmed_to_the_budget():
    s = make_scheduler(num_speculative_tokens=4, max_num_batched_tokens=3)
    s.add_request(req("a", 2, max_tokens=20))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[50]], spec_token_ids=[[1, 2, 3, 4]]))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 3} and out.scheduled_spec_decode_tokens == {"a": [1, 2]}


def test_abort_in_every_state_frees_blocks_and_reports_once():
    s = make_scheduler(max_num_seqs=1)
    for name in "abc":
        s.add_request(req(name, 6, max_tokens=10, start=ord(name) * 10))
    step(s)
    assert s.abort_request("a") is True  # running
    assert s.abort_request("c") is True  # waiting
    assert s.abort_request("c") is False and s.abort_request("nope") is False
    out = s.schedule()
    assert out.finished_req_ids == {"a", "c"}
    assert s.abort_request("b") is True  # scheduled, before its result
    results = s.update_from_output(out, fake_output(s, out))
    reasons = {o.request_id: o.finish_reason for o in results if o.finished}
    assert reasons == {"a": "abort", "b": "abort", "c": "abort"}
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_free_blocks == 63


def test_bad_input_is_rejected_clearly_and_the_others_keep_going():
    s = make_scheduler(max_model_len=32)
    s.add_request(req("ok", 8, max_tokens=3))
    with pytest.raises(ValueError, match="duplicate request id 'ok'"):
        s.add_request(req("ok", 4))
    with pytest.raises(ValueError, match="longer than max_model_len=32"):
        s.add_request(req("long", 33))
    with pytest.raises(ValueError, match="empty prompt"):
        req("empty", [])
    with pytest.raises(ValueError, match="non-negative ints"):
        req("neg", [1, -2])
    out = s.schedule()
    with pytest.raises(ValueError, match="not scheduled"):
        s.update_from_output(out, ModelRunnerOutput(["ghost"], [[1]]))
    s.update_from_output(out, fake_output(s, out))
    while s.has_unfinished_requests():
        step(s)
    with pytest.raises(ValueError, match="just finished"):
        s.add_request(req("ok", 4))  # the runner has not been told "ok" ended yet
    assert s.schedule().finished_req_ids == {"ok"}
    s.add_request(req("ok", 4))  # now the id is free again


def test_a_request_without_output_recomputes_its_last_position():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=2))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput([], []))
    r = s.requests["a"]
    assert r.num_computed_tokens == 4 and r.num_output_tokens == 0
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    s.update_from_output(out, fake_output(s, out))
    assert r.num_output_tokens == 1


def test_timestamps_come_from_the_clock():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(req("a", 6, max_tokens=3, arrival_time=0.0))
    final = run_to_end(s)  # each step advances the clock by 1 after update
    m = final["a"].metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finish_time) == (0.0, 0.0, 1.0, 3.0)
    assert m.token_times == [1.0, 2.0, 3.0] and m.ttft == 1.0 and m.tpot == 1.0 and m.itl == [1.0, 1.0]


def test_runner_mirror_rebuilds_every_block_table_from_outputs_alone():
    s = make_scheduler(num_blocks=12, block_size=2, max_num_batched_tokens=8)
    for i in range(6):
        s.add_request(req(f"r{i}", 3 + i, max_tokens=6, start=50 * i))
    mirror = RunnerMirror()
    while s.has_unfinished_requests():
        out = s.schedule()
        mirror.apply(out)
        for rid, computed, n in out.iter_scheduled():
            assert mirror.rows[rid] == s.kv_cache_manager.get_block_ids(rid)
            assert len(mirror.rows[rid][0]) * 2 >= computed + n
        s.update_from_output(out, fake_output(s, out))
    assert s.num_preemptions > 0, "the pool is sized to force preemption"


def test_finish_request_ends_a_request_by_a_stop_string():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=10))
    step(s)
    assert s.finish_request("a", RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    (out,) = s.update_from_output(s.schedule(), ModelRunnerOutput([], []))
    assert (out.finish_reason, out.stop_reason, out.finished) == ("stop", "\n\n", True)
    with pytest.raises(ValueError, match="status="):
        s.finish_request("a", RequestStatus.RUNNING)
    assert s.kv_cache_manager.num_free_blocks == 63
