"""Policy semantics: admission order, preemption victims, fair-share bounds, and
a user-defined policy plugged in without touching the scheduler."""

from __future__ import annotations

import pytest
from sched_helpers import make_scheduler, req, run_to_end, step

from servelab.scheduling import (
    FairSharePolicy,
    FCFSPolicy,
    PriorityPolicy,
    RequestQueue,
    SchedulingPolicy,
    ShortestPromptFirstPolicy,
    available_policies,
    get_policy,
    policy_names,
    register_policy,
)


@pytest.fixture(autouse=True)
def _restore_policy_registry():
    """Policies registered by a test do not outlive it (the registry is process-wide)."""
    from servelab.scheduling import policies

    saved = dict(policies._POLICIES._entries)
    yield
    policies._POLICIES._entries.clear()
    policies._POLICIES._entries.update(saved)


def admission_order(policy, requests) -> list[str]:
    """Serve one request at a time and record who got in, in order."""
    s = make_scheduler(policy=policy, max_num_seqs=1)
    for r in requests:
        s.add_request(r)
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += [d.req_id for d in out.scheduled_new_reqs]
    return order


def test_fcfs_admits_by_arrival_time_then_by_order_added():
    reqs = [req("late", 4, arrival_time=5.0), req("early", 4, arrival_time=1.0, start=200),
            req("tie1", 4, arrival_time=3.0, start=300), req("tie2", 4, arrival_time=3.0, start=400)]
    assert admission_order("fcfs", reqs) == ["early", "tie1", "tie2", "late"]


def test_priority_admits_lower_value_first_and_ties_by_arrival():
    reqs = [req("p2", 4, priority=2, arrival_time=0.0), req("p0b", 4, priority=0, arrival_time=2.0, start=200),
            req("p1", 4, priority=1, arrival_time=1.0, start=300),
            req("p0a", 4, priority=0, arrival_time=1.5, start=400)]
    assert admission_order(PriorityPolicy(), reqs) == ["p0a", "p0b", "p1", "p2"]


def test_shortest_prompt_first():
    reqs = [req("long", 12, arrival_time=0.0), req("short", 2, arrival_time=1.0, start=200),
            req("mid", 6, arrival_time=2.0, start=300)]
    assert admission_order(ShortestPromptFirstPolicy(), reqs) == ["short", "mid", "long"]


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "a"), ("sjf", "b")])
def test_victims(policy, victim):
    s = make_scheduler(policy=policy)
    specs = {"a": (4, 9, 0.0), "b": (8, 0, 1.0), "c": (4, 0, 2.0)}  # prompt, priority, arrival
    for i, (name, (n, prio, t)) in enumerate(specs.items()):
        s.add_request(req(name, n, priority=prio, arrival_time=t, start=100 * i))
    step(s)
    assert s.policy.select_victim(s.running).request_id == victim


def service_gaps(policy: SchedulingPolicy, num_each: int = 60, max_num_seqs: int = 4) -> list[float]:
    """Run two clients, A (long requests, all sent first) and B (short ones);
    return |W_A - W_B| after every step in which both had requests waiting."""
    s = make_scheduler(policy=policy, max_num_seqs=max_num_seqs, num_blocks=256, max_num_batched_tokens=64)
    for i in range(num_each):
        s.add_request(req(f"A{i}", 32, max_tokens=16, client_id="A", arrival_time=0.0, start=1000 + 40 * i))
    for i in range(num_each):
        s.add_request(req(f"B{i}", 4, max_tokens=2, client_id="B", arrival_time=0.0, start=9000 + 8 * i))
    gaps = []
    while s.has_unfinished_requests():
        step(s)
        clients = {r.client_id for r in s.waiting}
        if clients == {"A", "B"}:
            gaps.append(abs(policy.counters["A"] - policy.counters["B"]))
    return gaps


class CountingFCFS(FairSharePolicy):
    """FCFS order with the VTC service counters, to measure FCFS's gap."""

    def make_waiting_queue(self):
        return SchedulingPolicy.make_waiting_queue(self)


def test_vtc_keeps_the_service_gap_between_backlogged_clients_bounded():
    # Bound (FairSharePolicy docstring): max_num_seqs * (w_p * P_max + w_q * O_max)
    # = 4 * (1 * 32 + 2 * 16) = 256 service units.
    vtc_gaps = service_gaps(FairSharePolicy())
    assert len(vtc_gaps) > 20, "both clients must stay backlogged for a while"
    assert max(vtc_gaps) <= 4 * (32 + 2 * 16)
    # Without fair share the gap grows with the backlog (A sent first).
    fcfs_gaps = service_gaps(CountingFCFS())
    assert max(fcfs_gaps) > 4 * max(vtc_gaps)


def test_vtc_does_not_bank_idle_time_as_credit():
    policy = FairSharePolicy()
    s = make_scheduler(policy=policy, max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"A{i}", 8, max_tokens=4, client_id="A", start=100 * i))
    for _ in range(6):
        step(s)
    served = policy.counters["A"]
    assert served > 0
    s.add_request(req("B0", 8, max_tokens=4, client_id="B", start=900))
    assert policy.counters["B"] == pytest.approx(served), "a newcomer starts level with the active clients"
    run_to_end(s)


class LongestPromptFirst(SchedulingPolicy):
    """A user-defined policy: longest prompt first; preempts whoever has the
    fewest computed tokens (cheapest to redo)."""

    name = "lpf"

    def key(self, request):
        return -request.num_prompt_tokens

    def select_victim(self, running):
        return min(running, key=lambda r: (r.num_computed_tokens, -r.arrival_order))


def test_a_user_defined_policy_plugs_in_without_touching_the_scheduler():
    reqs = [req("s", 2), req("l", 12, start=200), req("m", 6, start=300)]
    assert admission_order(LongestPromptFirst(), reqs) == ["l", "m", "s"]
    register_policy("lpf", LongestPromptFirst)
    assert "lpf" in policy_names() and isinstance(get_policy("lpf"), LongestPromptFirst)
    # Its victim rule is used under memory pressure, and everything still ends.
    s = make_scheduler(policy="lpf", num_blocks=7, block_size=4)
    for i in range(5):
        s.add_request(req(f"r{i}", 4 + 2 * i, max_tokens=6, start=100 * i))
    final = run_to_end(s)
    assert s.num_preemptions > 0 and all(o.finish_reason in ("length", "error") for o in final.values())
    assert s.kv_cache_manager.num_free_blocks == 6


def test_a_user_policy_plugs_in_through_the_public_api_in_30_lines():
    # --- the user's code: only public names (the README's "how to swap it" example) ---
    from servelab.blocks import FullAttentionSpec, KVCacheManager
    from servelab.scheduling import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SchedulingPolicy
    from servelab.scheduling import register_policy as register

    class DeadlineFirst(SchedulingPolicy):
        """Earliest deadline (a per-client SLO) first."""

        name = "edf"

        def __init__(self, slo_s: dict[str, float] | None = None):
            self.slo_s = slo_s or {}

        def key(self, request):
            return request.arrival_time + self.slo_s.get(request.client_id, 10.0)

    register("edf", DeadlineFirst)
    kv = KVCacheManager(FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32"), 64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1), kv, "edf")
    for rid, client in [("batch", "offline"), ("chat", "interactive")]:
        sched.add_request(Request(rid, [1, 2, 3], client_id=client, arrival_time=0.0))
    sched.policy.slo_s.update(interactive=0.5)  # only read for requests added later
    sched.add_request(Request("chat2", [4, 5], client_id="interactive", arrival_time=0.0))
    order = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        order += [d.req_id for d in out.scheduled_new_reqs]
        sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), [[9]] * out.num_reqs))
    # --- end of the user's code (27 lines) ---
    assert order == ["chat2", "batch", "chat"]
    assert isinstance(get_policy("edf", slo_s={"x": 1.0}), DeadlineFirst)


def test_registry_semantics():
    assert available_policies() == policy_names() and {"fcfs", "priority", "sjf", "vtc"} <= set(available_policies())
    with pytest.raises(ValueError, match="'fcfs' is already registered; pass override=True"):
        register_policy("fcfs", PriorityPolicy)
    with pytest.raises(ValueError, match="name=' x' is invalid"):
        register_policy(" x", PriorityPolicy)
    with pytest.raises(TypeError, match="callable that returns a SchedulingPolicy"):
        register_policy("obj", PriorityPolicy())
    register_policy("weird", lambda: object())
    with pytest.raises(TypeError, match="SchedulingPolicy subclass instance"):
        get_policy("weird")
    with pytest.raises(TypeError, match="options"):
        get_policy(FCFSPolicy(), output_weight=2.0)
    assert get_policy("vtc", output_weight=4.0).output_weight == 4.0
    assert isinstance(get_policy("fcfs").make_waiting_queue(), RequestQueue)
    with pytest.raises(TypeError, match="abstract"):
        SchedulingPolicy()


def test_get_policy_errors():
    with pytest.raises(ValueError, match="unknown scheduling policy 'nope'; known: .*'fcfs'"):
        get_policy("nope")
    with pytest.raises(ValueError, match="prompt_weight"):
        FairSharePolicy(prompt_weight=-1)
    p = PriorityPolicy()
    assert get_policy(p) is p
