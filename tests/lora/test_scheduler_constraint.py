"""The scheduler's max_loras constraint (servelab.scheduling.lora_slots): at most max_loras
distinct adapters among running requests (so in every step), a waiting request admitted
only when its adapter runs or a slot can be freed, passed-over requests keep their place,
no starvation, and a policy sees the constraint."""

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[1] / "scheduling"))
from sched_helpers import fake_output, make_scheduler, req  # noqa: E402

from servelab.scheduling import SchedulerConfig  # noqa: E402
from servelab.scheduling.lora_slots import STARVATION_STEPS, LoRASlots  # noqa: E402
from servelab.scheduling.policies import FCFSPolicy  # noqa: E402


def run(sched, max_steps=500):
    """Step to the end; returns each step's set of distinct adapters and admission order."""
    per_step, admitted = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        names = {sched.requests[rid].lora_name for rid in out.num_scheduled_tokens} - {None}
        per_step.append(names)
        admitted += [n.req_id for n in out.scheduled_new_reqs]
        sched.update_from_output(out, fake_output(sched, out))
    assert not sched.has_unfinished_requests()
    return per_step, admitted


def test_a_waiting_request_of_a_third_adapter_waits_for_a_free_slot():
    sched = make_scheduler(max_loras=2)
    sched.add_request(req("a", 4, max_tokens=6, lora_name="A"))
    sched.add_request(req("b", 4, max_tokens=2, lora_name="B"))
    sched.add_request(req("c", 4, max_tokens=2, lora_name="C"))
    sched.add_request(req("base", 4, max_tokens=2))  # the base model is always admissible
    sched.add_request(req("a2", 4, max_tokens=2, lora_name="A"))  # its adapter runs: admitted
    out = sched.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a", "b", "base", "a2"]
    assert sched.lora_slots.passed_over == {"c": 1}
    assert [r.request_id for r in sched.waiting] == ["c"]  # it kept its place
    sched.update_from_output(out, fake_output(sched, out))
    per_step, admitted = run(sched)
    assert all(len(names) <= 2 for names in per_step)
    assert "c" in admitted  # once b finished, c got B's slot
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.block_pool.num_blocks - 1


@settings(max_examples=30)
@given(names=st.lists(st.sampled_from(["A", "B", "C", "D", None]), min_size=1, max_size=14),
       max_loras=st.integers(1, 3), lens=st.lists(st.integers(1, 9), min_size=14, max_size=14),
       budget=st.sampled_from([5, 16, 64]), seqs=st.sampled_from([2, 8]))
def test_never_more_than_max_loras_adapters_in_a_step_and_everyone_finishes(names, max_loras, lens, budget, seqs):
    sched = make_scheduler(max_loras=max_loras, max_num_batched_tokens=budget, max_num_seqs=seqs, num_blocks=20)
    for i, name in enumerate(names):
        sched.add_request(req(f"r{i}", lens[i], max_tokens=1 + lens[-1 - i] % 5, lora_name=name, start=10 * i))
    per_step, admitted = run(sched)
    assert all(len(step) <= max_loras for step in per_step)
    assert sorted(admitted) == sorted(f"r{i}" for i in range(len(names)))


def test_no_starvation_under_a_stream_of_active_adapter_requests():
    """Requests of the running adapter keep arriving; the other adapter's request becomes a
    barrier after STARVATION_STEPS passes and is admitted once the running ones drain."""
    sched = make_scheduler(max_loras=1, max_num_seqs=4)
    sched.add_request(req("a0", 4, max_tokens=3, lora_name="A"))
    sched.add_request(req("b", 4, max_tokens=2, lora_name="B"))
    admitted_at = {}
    for step in range(80):
        if step < 60:  # a steady stream of A requests, each ahead of nobody but admissible at once
            sched.add_request(req(f"a{step + 1}", 3, max_tokens=3, lora_name="A", start=50 + step))
        out = sched.schedule()
        for n in out.scheduled_new_reqs:
            admitted_at[n.req_id] = step
        sched.update_from_output(out, fake_output(sched, out))
    assert "b" in admitted_at and admitted_at["b"] <= STARVATION_STEPS + 6
    later = [rid for rid, s in admitted_at.items() if rid.startswith("a") and s > admitted_at["b"]]
    assert later  # A requests resumed after B ran


def test_policy_sees_the_constraint():
    class Aware(FCFSPolicy):
        def bind_lora_slots(self, slots):
            self.slots = slots

    policy = Aware()
    sched = make_scheduler(max_loras=3, policy=policy)
    assert isinstance(policy.slots, LoRASlots) and policy.slots.max_loras == 3 and sched.lora_slots is policy.slots
    assert make_scheduler().lora_slots is None  # max_loras=0: no constraint, nothing bound


def test_max_loras_is_checked():
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_loras=-1)
