"""An interrupt while a step is being rolled back must still roll back *every*
request of that step.

Regression for the stateful test's "scheduler did not drain" (its shrunk
example: 1-token requests on a 4-block pool, a failed step whose
``rollback_step`` met a policy ``key`` raising ``KeyboardInterrupt`` while the
first request was re-queued). The rollback stopped at that request, and the
repair that followed kept the requests not yet reached in ``running`` with the
failed step's tokens counted as computed: nothing was left to schedule for
them, so they never ended and never freed their blocks (the waiting requests
behind them starved too). The same loop ran when ``schedule()`` or
``update_from_output`` was interrupted. Each test below drives one of those
three paths with an explicit sequence, then checks the queues and drains.
"""

from __future__ import annotations

import pytest
from sched_helpers import TOKEN, fake_output, make_scheduler, req, run_to_end, step

from servelab.scheduling import FCFSPolicy, RequestStatus


class Interrupting(FCFSPolicy):
    """FCFS that raises the armed ``faults`` in order, each once: (hook, exception type, request id
    or None for any request)."""

    def __init__(self) -> None:
        self.faults: list[tuple[str, type[BaseException], str | None]] = []

    def _hit(self, hook: str, request) -> None:
        if self.faults:
            armed_hook, exc, rid = self.faults[0]
            if armed_hook == hook and rid in (None, request.request_id):
                self.faults.pop(0)
                raise exc(f"injected {exc.__name__} in {hook} for {request.request_id}")

    def key(self, request):
        self._hit("key", request)
        return request.arrival_time

    def on_tokens_scheduled(self, request, num_new_tokens):
        self._hit("on_tokens_scheduled", request)

    def on_request_finished(self, request):
        self._hit("on_request_finished", request)


def assert_all_waiting(s, ids, status: RequestStatus) -> None:
    """``ids`` are back in the waiting queue with nothing computed and no blocks; the queues
    partition the unfinished requests and the pool's reference counts match what requests hold."""
    kv = s.kv_cache_manager
    waiting = {r.request_id for r in s.waiting}
    for rid in ids:
        r = s.requests[rid]
        assert r.status is status and rid in waiting, r
        assert r.num_computed_tokens == 0 and kv.get_block_ids(rid) == ([],), r
    assert all(r.status is RequestStatus.RUNNING for r in s.running)
    assert {r.request_id for r in s.running} | waiting == set(s.requests)
    assert not {r.request_id for r in s.running} & waiting
    assert sum(len(b) for b in kv.req_to_blocks.values()) == sum(b.ref_cnt for b in kv.block_pool.blocks[1:])


def assert_drains(s, earlier, expected_ends: dict[str, str]) -> None:
    """Run to the end: with the ``earlier`` outputs, each of ``expected_ends`` ends once with its
    finish reason; nothing is left queued and no block leaks."""
    final = run_to_end(s)
    ends = [o.request_id for o in earlier if o.finished] + list(final)
    assert sorted(ends) == sorted(expected_ends), "a request ended twice or never"
    reasons = {o.request_id: o.finish_reason for o in [*earlier, *final.values()] if o.finished}
    assert reasons == expected_ends
    assert not s.running and len(s.waiting) == 0
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.block_pool.num_blocks - 1, "blocks leaked"


@pytest.mark.parametrize("interrupted", ["r0", "r1", "r3"])
def test_rollback_step_interrupted_while_requeueing_still_rolls_back_the_whole_step(interrupted):
    # The stateful test's example, reduced: one-token prompts, 4 usable one-token blocks, no caching.
    s = make_scheduler(policy=Interrupting(), num_blocks=5, block_size=1, enable_caching=False,
                       max_num_batched_tokens=12, max_num_seqs=5, max_model_len=12)
    for i in range(6):
        s.add_request(req(f"r{i}", 1, max_tokens=1, start=100 * i))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]  # the pool holds four
    s.policy.faults = [("key", KeyboardInterrupt, interrupted)]
    with pytest.raises(KeyboardInterrupt):
        s.rollback_step(out)
    assert not s.policy.faults
    assert_all_waiting(s, ["r0", "r1", "r2", "r3"], RequestStatus.WAITING)  # first steps: new again
    assert not s.running and s.kv_cache_manager.num_free_blocks == 4
    nxt = s.schedule()
    assert {"r0", "r1", "r2", "r3"} <= nxt.preempted_req_ids, "the runner is told to drop the step"
    assert [d.req_id for d in nxt.scheduled_new_reqs] == ["r0", "r1", "r2", "r3"]  # resent as new
    earlier = s.update_from_output(nxt, fake_output(s, nxt))
    assert_drains(s, earlier, {f"r{i}": "length" for i in range(6)})


def test_update_interrupted_then_interrupted_again_while_requeueing_rolls_back_every_unreached_request():
    s = make_scheduler(policy=Interrupting())
    s.add_request(req("bad", 4, max_tokens=1))
    for i, rid in enumerate(["c", "d", "e"]):
        s.add_request(req(rid, 4, max_tokens=3, start=200 + 100 * i))
    out = s.schedule()
    # bad ends first and its hook is interrupted; then c's re-queue is interrupted too.
    s.policy.faults = [("on_request_finished", KeyboardInterrupt, "bad"), ("key", KeyboardInterrupt, "c")]
    with pytest.raises(KeyboardInterrupt):
        s.update_from_output(out, fake_output(s, out))
    assert not s.policy.faults
    assert_all_waiting(s, ["c", "d", "e"], RequestStatus.PREEMPTED)
    streamed: dict[str, list[int]] = {"bad": [], "c": [], "d": [], "e": []}
    ends = []
    while s.has_unfinished_requests() or not ends:
        _, results = step(s)
        for o in results:
            streamed[o.request_id] += o.new_token_ids
            ends += [o.request_id] * o.finished
    assert streamed == {"bad": [TOKEN], "c": [TOKEN] * 3, "d": [TOKEN] * 3, "e": [TOKEN] * 3}
    assert sorted(ends) == ["bad", "c", "d", "e"]
    assert_drains(s, [], {})


def test_schedule_interrupted_after_running_requests_advanced_rolls_all_of_them_back():
    s = make_scheduler(policy=Interrupting())
    for i, rid in enumerate(["a", "b", "c"]):
        s.add_request(req(rid, 4, max_tokens=3, start=100 * i))
    step(s)  # prompts computed, one token each: the next step advances them past their prompts
    s.add_request(req("bad", 4, max_tokens=3, start=900))
    # bad's accounting hook fails it (an Exception: only bad fails), its end is interrupted, and
    # the undo's first re-queue (a) is interrupted as well: b and c must still be rolled back.
    s.policy.faults = [("on_tokens_scheduled", ValueError, "bad"), ("on_request_finished", KeyboardInterrupt, "bad"),
                       ("key", KeyboardInterrupt, "a")]
    with pytest.raises(KeyboardInterrupt):
        s.schedule()
    assert not s.policy.faults and "bad" not in s.requests
    assert_all_waiting(s, ["a", "b", "c"], RequestStatus.PREEMPTED)
    out = s.schedule()
    assert out.preempted_req_ids == {"a", "b", "c"} and out.scheduled_cached_reqs.resumed == [True] * 3
    earlier = s.update_from_output(out, fake_output(s, out))
    bad = next(o for o in earlier if o.request_id == "bad")
    assert bad.finish_reason == "error" and "on_tokens_scheduled" in bad.error
    assert_drains(s, earlier, {"a": "length", "b": "length", "c": "length", "bad": "error"})
