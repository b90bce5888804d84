"""Faults touch only their own requests; every public scheduler operation
applies fully or leaves no trace.

Reproductions of issue 10 (item 3: a policy whose ``key()`` raises left a
zombie or orphans; item 8: metrics that lied) and the commit-after-compute
contract: ``rollback_step``, ``fail_requests``, ``ModelRunnerOutput.errors``,
stop strings via ``finish_request``, unverified drafts, prefix-cache stats.
"""

from __future__ import annotations

import pytest
from sched_helpers import TOKEN, RunnerMirror, StepClock, fake_output, make_scheduler, req, run_to_end, step

from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.samplers.params import SamplingParams
from servelab.scheduling import (
    FCFSPolicy,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerInterface,
    WaitingQueue,
)


class Raising(FCFSPolicy):
    """FCFS that raises ``exc`` from ``hook`` for requests whose id is in ``ids``
    (``select_victim``: when the victim would be one of them)."""

    def __init__(self, hook: str, ids=("bad",), exc: type[BaseException] = RuntimeError) -> None:
        self.hook, self.ids, self.exc, self.calls = hook, set(ids), exc, 0

    def _maybe(self, hook: str, request) -> None:
        if hook == self.hook and request.request_id in self.ids:
            self.calls += 1
            raise self.exc(f"{hook} broke for {request.request_id}")

    def key(self, request):
        self._maybe("key", request)
        return request.arrival_time

    def select_victim(self, running):
        victim = max(running, key=lambda r: r.arrival_order)  # FCFS's victim, without calling key()
        self._maybe("select_victim", victim)
        return victim

    def on_request_added(self, request):
        self._maybe("on_request_added", request)

    def on_tokens_scheduled(self, request, num_new_tokens):
        self._maybe("on_tokens_scheduled", request)

    def on_request_finished(self, request):
        self._maybe("on_request_finished", request)


def assert_clean(s) -> None:
    """Nothing unfinished, nothing held, nothing queued."""
    assert not s.has_unfinished_requests() and s.requests == {}
    assert not s.running and len(s.waiting) == 0
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1, "blocks leaked"


def test_scheduler_implements_the_interface():
    assert isinstance(make_scheduler(), SchedulerInterface)


# ---- issue 10 item 3: a raising policy leaves no zombie, no orphan ---------------------


@pytest.mark.parametrize("hook", ["key", "on_request_added"])
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_a_policy_raising_in_add_request_leaves_no_trace_and_no_zombie(hook, exc):
    s = make_scheduler(policy=Raising(hook, exc=exc))
    s.add_request(req("a", 6))
    bad = req("bad", 6, start=300)
    with pytest.raises(exc, match=f"{hook} broke for bad"):
        s.add_request(bad)
    assert "bad" not in s.requests and len(s.waiting) == 1 and s.get_num_unfinished_requests() == 1
    assert bad.arrival_order == -1 and bad.arrival_time is None, "the request is untouched"
    final = run_to_end(s)
    assert set(final) == {"a"} and final["a"].finish_reason == "length"
    assert_clean(s)  # has_unfinished_requests() is False: no zombie


@pytest.mark.parametrize("mode", ["raises", "stranger"])
def test_select_victim_failing_fails_only_the_request_asking_for_memory(mode):
    class BadVictim(FCFSPolicy):
        def select_victim(self, running):
            if mode == "raises":
                raise RuntimeError("no victim today")
            return Request("stranger", [1, 2])

    # 6 usable blocks of 4 tokens: three requests growing to 16 tokens cannot all fit.
    s = make_scheduler(policy=BadVictim(), num_blocks=7, block_size=4)
    for i, name in enumerate("abc"):
        s.add_request(req(name, 6, max_tokens=10, start=100 * i))
    final = run_to_end(s)
    assert set(final) == {"a", "b", "c"}, "every request ended exactly once (no orphans)"
    failed = {r: o.error for r, o in final.items() if o.finish_reason == "error"}
    assert failed and all("select_victim" in e for e in failed.values())
    assert any(o.finish_reason == "length" for o in final.values()), "the others were served"
    assert_clean(s)


def test_key_raising_when_a_preempted_request_is_requeued_fails_that_request_only():
    s = make_scheduler(policy=Raising("key", ids=()), num_blocks=7, block_size=4)
    for i, name in enumerate("abc"):
        s.add_request(req(name, 6, max_tokens=10, start=100 * i))
    s.policy.ids = {"c"}  # c is the FCFS victim; re-queueing it calls key() again
    final = run_to_end(s)
    assert final["c"].finish_reason == "error" and "could not queue preempted request 'c'" in final["c"].error
    assert final["a"].finish_reason == final["b"].finish_reason == "length"
    assert_clean(s)


def test_on_tokens_scheduled_raising_fails_that_request_and_gives_its_budget_back():
    s = make_scheduler(policy=Raising("on_tokens_scheduled", ids=()), max_num_batched_tokens=16)
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("bad", 4, max_tokens=5, start=300))
    step(s)
    s.policy.ids = {"bad"}  # raises while "bad" runs
    s.add_request(req("late", 12, max_tokens=2, start=500))
    out, results = step(s)
    assert "bad" not in out.num_scheduled_tokens
    assert out.num_scheduled_tokens == {"a": 1, "late": 12}, "bad's share went to the next request"
    (bad,) = [o for o in results if o.request_id == "bad"]
    assert bad.finish_reason == "error" and "on_tokens_scheduled raised RuntimeError" in bad.error
    s.add_request(req("bad", 4, max_tokens=1, start=700))  # fails at admission this time
    final = run_to_end(s)
    assert final["bad"].finish_reason == "error" and final["a"].finish_reason == "length"
    assert_clean(s)


def test_on_request_finished_raising_reports_an_error_once_and_frees_everything():
    s = make_scheduler(policy=Raising("on_request_finished"))
    s.add_request(req("a", 4, max_tokens=3))
    s.add_request(req("bad", 4, max_tokens=3, start=300))
    final = run_to_end(s)
    assert final["a"].finish_reason == "length"
    assert final["bad"].finish_reason == "error" and "on_request_finished raised" in final["bad"].error
    assert final["bad"].metrics.finish_reason == "error" and final["bad"].metrics.num_output_tokens == 3
    assert (s.num_finished, s.num_failed, s.num_aborted) == (2, 1, 0)
    assert_clean(s)


def test_an_interrupt_inside_schedule_rolls_the_partial_step_back():
    s = make_scheduler(policy=Raising("on_tokens_scheduled", ids=(), exc=KeyboardInterrupt))
    mirror = RunnerMirror()
    for i, name in enumerate(["a", "b", "bad"]):
        s.add_request(req(name, 6, max_tokens=4, start=100 * i))
    out = s.schedule()
    mirror.apply(out)
    s.update_from_output(out, fake_output(s, out))
    s.policy.ids = {"bad"}
    with pytest.raises(KeyboardInterrupt):
        s.schedule()  # a (and b) were scheduled before bad's hook raised
    assert all(r.status is RequestStatus.PREEMPTED for r in s.requests.values())
    assert not s.running and s.kv_cache_manager.num_free_blocks == 63
    s.policy.ids = set()
    out = s.schedule()
    assert out.preempted_req_ids == {"a", "b", "bad"}, "the runner is told to drop what it held"
    assert out.scheduled_cached_reqs.resumed == [True, True, True]
    mirror.apply(out)
    for rid, _, _ in out.iter_scheduled():
        assert mirror.rows[rid] == s.kv_cache_manager.get_block_ids(rid)
    s.update_from_output(out, fake_output(s, out))
    assert {o.finish_reason for o in run_to_end(s).values()} == {"length"}
    assert_clean(s)


def test_an_interrupt_inside_update_keeps_applied_outputs_for_the_next_call():
    s = make_scheduler(policy=Raising("on_request_finished", exc=KeyboardInterrupt))
    s.add_request(req("a", 4, max_tokens=3))
    s.add_request(req("bad", 4, max_tokens=1, start=300))
    s.add_request(req("c", 4, max_tokens=3, start=500))
    out = s.schedule()
    with pytest.raises(KeyboardInterrupt):
        s.update_from_output(out, fake_output(s, out))  # a applied; bad ends, its hook is interrupted
    c = s.requests["c"]
    # c was not reached: its sampled token never landed, so it is rolled back (resumed from its
    # known tokens next step; a runner may already hold the lost token) and says so to the runner.
    assert c.num_computed_tokens == 0 and c.num_output_tokens == 0 and c.status is RequestStatus.PREEMPTED
    streamed = {"a": [], "bad": [], "c": []}
    ends = []
    while s.has_unfinished_requests() or not ends:
        _, results = step(s)
        for o in results:
            streamed[o.request_id] += o.new_token_ids
            ends += [o.request_id] * o.finished
    assert streamed == {"a": [TOKEN] * 3, "bad": [TOKEN], "c": [TOKEN] * 3}, "no token lost, none twice"
    assert sorted(ends) == ["a", "bad", "c"]
    assert_clean(s)


def test_a_waiting_queue_that_raises_fails_its_requests_and_is_replaced():
    class BrokenOnce(WaitingQueue):
        broken = True

        def peek(self):
            if BrokenOnce.broken:
                BrokenOnce.broken = False
                raise RuntimeError("queue corrupted")
            return super().peek()

    class Policy(FCFSPolicy):
        def make_waiting_queue(self):
            return BrokenOnce(self.key)

    s = make_scheduler(policy=Policy(), max_num_seqs=1)
    s.add_request(req("a", 4, max_tokens=3))
    s.add_request(req("b", 4, max_tokens=3, start=300))
    final = run_to_end(s)
    assert final["a"].finish_reason == final["b"].finish_reason == "error"
    assert "queue corrupted" in final["a"].error
    s.add_request(req("c", 4, max_tokens=3, start=500))
    assert run_to_end(s)["c"].finish_reason == "length", "the replacement queue serves new requests"
    assert_clean(s)


# ---- contract A.5: rollback_step ----------------------------------------------------------


def test_rollback_step_puts_the_step_back_and_the_rerun_matches_a_clean_run():
    prompts = {"a": 10, "b": 7}

    def run(fail_at: set[int]):
        s = make_scheduler(max_num_batched_tokens=8)
        mirror = RunnerMirror()
        for name, n in prompts.items():
            s.add_request(req(name, n, max_tokens=4, start=100 * len(name) + n))
        tokens = {name: [] for name in prompts}
        for i in range(100):
            if not s.has_unfinished_requests():
                break
            out = s.schedule()
            mirror.apply(out)
            for rid, _, _ in out.iter_scheduled():
                assert mirror.rows[rid] == s.kv_cache_manager.get_block_ids(rid)
            if i in fail_at:
                preemptions = s.num_preemptions
                s.rollback_step(out)
                assert s.num_preemptions == preemptions, "a rollback is not a preemption"
                for rid in out.num_scheduled_tokens:
                    r = s.requests[rid]
                    assert r.num_computed_tokens == 0 and s.kv_cache_manager.get_block_ids(rid) == ([],)
                    assert r in s.waiting and r not in s.running
                continue
            for o in s.update_from_output(out, fake_output(s, out, lambda r: [len(r.all_token_ids)])):
                tokens[o.request_id] += o.new_token_ids
        assert_clean(s)
        return tokens, s

    clean, _ = run(set())
    for fail_at in ({0}, {1}, {0, 1, 2}, {3, 5}):
        assert run(fail_at)[0] == clean, fail_at


def test_rollback_of_a_first_step_resends_the_request_as_new_and_indexes_nothing():
    s = make_scheduler(block_size=4)
    prompt = list(range(100, 109))
    s.add_request(req("a", prompt, max_tokens=2))
    out = s.schedule()
    s.rollback_step(out)
    probe = Request("probe", prompt + [1])
    probe.init_block_hasher(4)
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 0, "no uncomputed block is findable"
    assert s.requests["a"].status is RequestStatus.WAITING and s.requests["a"].first_scheduled_time is None
    out2 = s.schedule()
    assert [d.req_id for d in out2.scheduled_new_reqs] == ["a"] and out2.preempted_req_ids == {"a"}
    s.update_from_output(out2, fake_output(s, out2))
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 8, "computed blocks are committed after the step"
    assert run_to_end(s)["a"].finish_reason == "length"
    assert_clean(s)


# ---- contract A.3: commit after compute -----------------------------------------------------


def test_blocks_become_findable_only_after_the_step_that_computed_them():
    s = make_scheduler(block_size=4, max_num_batched_tokens=6)
    prompt = list(range(100, 113))
    s.add_request(req("a", prompt, max_tokens=2))
    probe = Request("probe", prompt)
    probe.init_block_hasher(4)
    hits = []
    for _ in range(3):
        out = s.schedule()
        hits.append(s.kv_cache_manager.get_computed_blocks(probe)[1])
        s.update_from_output(out, fake_output(s, out))
        hits.append(s.kv_cache_manager.get_computed_blocks(probe)[1])
    # Chunks of 6, 6, 1 tokens: 1, 3, 3 full blocks computed, each findable only after its step.
    assert hits == [0, 4, 4, 12, 12, 12]


class SpyKV(KVCacheManager):
    """Records every cache_blocks call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def cache_blocks(self, request, num_computed_tokens):
        self.calls.append((request.request_id, num_computed_tokens))
        super().cache_blocks(request, num_computed_tokens)


class VictimB(FCFSPolicy):
    """FCFS admission; always preempts "b" when it runs."""

    def select_victim(self, running):
        return next((r for r in running if r.request_id == "b"), running[-1])


def test_a_request_preempted_in_the_step_that_scheduled_it_leaves_nothing_indexed():
    # 5 usable blocks of 4 tokens; 4-token chunks. Step 2: a and b get a block each,
    # c (scheduled after b) does not fit, and b is the victim: b's new block was never computed.
    kv = SpyKV(FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32"), 6)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                                  long_prefill_token_threshold=4), kv, VictimB(), clock=StepClock())
    for name in "abc":
        s.add_request(req(name, 8, max_tokens=4, start=100 * ord(name)))
    step(s)
    assert sorted(kv.calls) == [("a", 4), ("b", 4), ("c", 4)]
    kv.calls.clear()
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 4, "c": 4} and out.preempted_req_ids == {"b"}
    assert sorted(kv.calls) == [("a", 8), ("c", 8)], "b's uncomputed block was never committed"
    probe = Request("probe", list(range(100 * ord("b"), 100 * ord("b") + 8)) + [1])
    probe.init_block_hasher(4)
    assert kv.get_computed_blocks(probe)[1] <= 4, "only b's computed first block may be findable"
    run_to_end(s)
    assert_clean(s)


# ---- contract A.6 / A.7: failing requests from outside --------------------------------------


def test_fail_requests_ends_them_once_and_ignores_unknown_ids():
    policy = Raising("none")
    finished = []
    policy.on_request_finished = finished.append
    s = make_scheduler(policy=policy, max_num_seqs=1)
    for name in "abc":
        s.add_request(req(name, 4, max_tokens=5, start=ord(name) * 10))
    step(s)  # a runs, b and c wait
    with pytest.raises(TypeError, match="error must be a str"):
        s.fail_requests(["a"], 3)
    with pytest.raises(TypeError, match="not one str"):
        s.fail_requests("a", "boom")
    with pytest.raises(TypeError, match="str ids"):
        s.fail_requests(["a", 7], "boom")
    assert s.get_num_unfinished_requests() == 3, "bad arguments change nothing"
    outs = s.fail_requests(["a", "c", "nope", "a"], "boom")
    assert [(o.request_id, o.finish_reason, o.error, o.finished) for o in outs] == [
        ("a", "error", "boom", True), ("c", "error", "boom", True)]
    assert [r.request_id for r in finished] == ["a", "c"]
    assert s.fail_requests(["a"], "again") == []
    final = run_to_end(s)
    assert set(final) == {"b"}, "failed requests do not come again from update_from_output"
    assert s.num_failed == 2
    assert_clean(s)


def test_model_runner_errors_end_those_requests_and_the_step_goes_on():
    s = make_scheduler(num_speculative_tokens=2)
    s.add_request(req("a", 4, max_tokens=5))
    s.add_request(req("bad", 4, max_tokens=5, start=300))
    out = s.schedule()
    with pytest.raises(ValueError, match="errors names requests not scheduled"):
        s.update_from_output(out, ModelRunnerOutput(["a"], [[5]], errors={"ghost": "x"}))
    with pytest.raises(TypeError, match="errors must map"):
        ModelRunnerOutput(["a"], [[5]], errors={"a": 3})
    assert s.requests["a"].num_output_tokens == 0, "rejected outputs change nothing"
    results = s.update_from_output(out, ModelRunnerOutput(["a", "bad"], [[5], [6]], spec_token_ids=[[1, 2], [3]],
                                                          errors={"bad": "row 1: every token masked"}))
    by_id = {o.request_id: o for o in results}
    assert by_id["a"].new_token_ids == [5] and not by_id["a"].finished
    assert by_id["bad"].finish_reason == "error" and by_id["bad"].error == "row 1: every token masked"
    assert by_id["bad"].new_token_ids == [] and by_id["bad"].metrics.num_output_tokens == 0
    assert run_to_end(s)["a"].finish_reason == "length"
    assert_clean(s)


# ---- issue 10 item 8 / contract A.4, A.8, A.9: metrics that lied ------------------------------


def test_a_stop_string_ends_the_request_as_stopped_not_aborted():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=10))
    s.add_request(req("b", 4, max_tokens=10, start=300))
    step(s)
    assert s.finish_request("a", RequestStatus.FINISHED_STOPPED, stop_reason="\n\n")
    assert s.abort_request("b")
    stats = s.get_stats()
    assert (stats.num_aborted, stats.num_finished, stats.num_failed) == (1, 2, 0)


def test_drafts_that_came_back_without_verified_tokens_are_not_counted():
    s = make_scheduler(num_speculative_tokens=3)
    s.add_request(req("a", 4, max_tokens=20))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[50]], spec_token_ids=[[51, 52, 53]]))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    s.update_from_output(out, ModelRunnerOutput([], []))  # the runner lost a: nothing verified
    r = s.requests["a"]
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (0, 0)
    assert r.num_computed_tokens == r.num_tokens - 1 and r.spec_token_ids == []
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[60]], spec_token_ids=[[61, 62]]))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[61, 70]]))
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (2, 1)


def test_prefix_cache_stats_count_a_request_once_while_it_waits_for_memory():
    # 4 usable blocks: "big" (12 tokens + growth) waits several steps behind "a".
    s = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)
    s.add_request(req("a", 8, max_tokens=6))
    step(s)
    s.add_request(req("big", 12, max_tokens=2, start=300))
    waited = 0
    while s.requests["big"].status is not RequestStatus.RUNNING:
        step(s)
        waited += 1
    assert waited >= 2, "big must wait for memory over several schedule() calls"
    stats = s.kv_cache_manager.prefix_cache_stats
    assert stats.requests == 2 and stats.queried_tokens == 8 + 12
    run_to_end(s)


# ---- atomic pieces ---------------------------------------------------------------------------


def test_waiting_queue_add_is_atomic_when_keys_do_not_compare():
    keys = {"a": 1.0, "b": 2.0, "c": "oops"}
    q = WaitingQueue(lambda r: keys[r.request_id])
    ra, rb, rc = (Request(n, [1]) for n in "abc")
    for i, r in enumerate((ra, rb, rc)):
        r.arrival_order = i
    q.add(rb)
    q.add(ra)
    with pytest.raises(TypeError):
        q.add(rc)
    assert len(q) == 2 and rc not in q and list(q) == [ra, rb]
    with pytest.raises(ValueError, match="already in the waiting queue"):
        q.add(ra)
    q.remove(ra)
    q.remove(ra)  # no-op
    assert q.pop() is rb and q.peek() is None and len(q) == 0


def test_update_with_bad_output_changes_nothing():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=3))
    out = s.schedule()
    before = (s.requests["a"].num_computed_tokens, s.kv_cache_manager.get_block_ids("a"))
    for bad in (ModelRunnerOutput(["a", "a"], [[1], [1]]), ModelRunnerOutput(["z"], [[1]])):
        with pytest.raises(ValueError):
            s.update_from_output(out, bad)
    with pytest.raises(TypeError, match="model_output"):
        s.update_from_output(out, {"a": [1]})
    assert (s.requests["a"].num_computed_tokens, s.kv_cache_manager.get_block_ids("a")) == before
    s.update_from_output(out, fake_output(s, out))
    assert run_to_end(s)["a"].finish_reason == "length"


def test_sampling_params_are_used_once_per_request():
    # Regression guard for the helpers above: a request object is single-use.
    s = make_scheduler()
    r = req("a", 4, params=SamplingParams(max_tokens=1))
    s.add_request(r)
    run_to_end(s)
    with pytest.raises(ValueError, match="already scheduled"):
        s.add_request(r)
