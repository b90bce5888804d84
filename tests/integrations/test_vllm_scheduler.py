"""Differential tests: servelab's Scheduler + policy vs vLLM's real v1 Scheduler + the bridged policy.

Both are driven by the same trace (arrivals on a step counter) and the same fake model (one token
for each request whose computation reached the end of its tokens, nothing for a partial prefill);
every step must schedule the same requests with the same token counts and preempt the same
victims, so admission order, chunking and victim choice all agree.

The traces stay where the two engines' semantics agree (documented in
servelab.integrations.vllm.scheduler): prompts never reach max_model_len, the pool always holds
the longest request alone, vLLM's whole-prompt admission check is off, watermark 0, and prompts
share no prefix across requests (vLLM indexes blocks at allocation, servelab after compute, which
changes hits only between requests admitted in the same step). Prefix caching is on, so a
preempted request's own blocks are found again on both sides.

Skipped without vLLM (the main environment); CI runs them in the vLLM CPU environment
(ci/vllm-cpu/setup.sh).
"""

from __future__ import annotations

import pickle
import random

import pytest

pytest.importorskip("vllm")

from servelab.blocks import FullAttentionSpec, KVCacheManager  # noqa: E402
from servelab.integrations.vllm import make_scheduler_cls  # noqa: E402
from servelab.integrations.vllm.harness import build_scheduler, make_request, model_output  # noqa: E402
from servelab.samplers.params import SamplingParams  # noqa: E402
from servelab.scheduling import ModelRunnerOutput, Request, Scheduler, SchedulerConfig  # noqa: E402
from servelab.scheduling.policies import SchedulingPolicy  # noqa: E402

BLOCK = 16


def make_trace(n: int, seed: int, *, max_prompt: int = 200, max_out: int = 40, per_step: int = 4):
    """(id, prompt, max_tokens, priority, client, arrival step); prompts start with a unique token."""
    rng = random.Random(seed)
    return [(f"r{i}", [1000 + i] + [rng.randrange(10, 32000) for _ in range(rng.randrange(4, max_prompt))],
             rng.randrange(1, max_out), rng.randrange(3), f"c{rng.randrange(3)}", i // per_step) for i in range(n)]


def arrival_time(rid: str, step: int) -> float:
    """Distinct times: vLLM breaks ties of (priority, arrival_time) by request id, servelab by arrival order."""
    return step + int(rid[1:]) * 1e-4


def drive(sched, trace, make, output):
    """Run to completion; per step: ({request id: scheduled tokens}, sorted preempted ids)."""
    log, pending, step = [], list(trace), 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][5] <= step:
            sched.add_request(make(*pending.pop(0)))
        out = sched.schedule()
        log.append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids)))
        sched.update_from_output(out, output(sched, out))
        step += 1
        assert step < 20_000, "no progress"
    return log


def run_servelab(policy, trace, *, num_blocks, max_num_seqs, budget):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=64, dtype="float32")
    kv = KVCacheManager(spec, num_blocks, True, max_model_len=4096, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=4096),
                      kv, policy)

    def make(rid, prompt, max_tokens, priority, client, arrival):
        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_time=arrival_time(rid, arrival), priority=priority, client_id=client)

    def output(s, out):
        ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
                                       for r in ids])

    return drive(sched, trace, make, output)


def run_vllm(scheduler_cls, trace, *, num_blocks, max_num_seqs, budget, native_policy="fcfs"):
    sched = build_scheduler(scheduler_cls, num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=budget, max_model_len=4096, policy=native_policy)

    def make(rid, prompt, max_tokens, priority, client, arrival):
        return make_request(rid, prompt, max_tokens, arrival_time=arrival_time(rid, arrival), priority=priority,
                            client_id=client, block_size=BLOCK)

    return drive(sched, trace, make, model_output)


# Tight pools force preemption; the roomy one checks chunking and admission alone.
SETUPS = [dict(num_blocks=60, max_num_seqs=8, budget=256), dict(num_blocks=40, max_num_seqs=16, budget=128),
          dict(num_blocks=400, max_num_seqs=4, budget=512)]


def assert_same(a, b):
    assert len(a) == len(b), f"servelab took {len(a)} steps, vLLM {len(b)}"
    for step, (x, y) in enumerate(zip(a, b)):
        assert x == y, f"step {step}: servelab {x} vs vLLM {y}"


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf", "vtc"])
@pytest.mark.parametrize("setup", range(len(SETUPS)))
def test_bridged_policy_schedules_exactly_like_servelab(policy, setup):
    trace = make_trace(60, seed=setup)
    a = run_servelab(policy, trace, **SETUPS[setup])
    b = run_vllm(make_scheduler_cls(policy), trace, **SETUPS[setup])
    assert_same(a, b)
    if setup < 2:
        assert sum(len(p) for _, p in a) > 0, "the tight pools must force preemption (else nothing is tested)"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_vllm_native_policies_match_servelab(policy):
    """vLLM's own FCFS and priority scheduling (no bridge) equal servelab's policies of those names."""
    for setup in SETUPS[:2]:
        trace = make_trace(50, seed=11)
        assert_same(run_servelab(policy, trace, **setup), run_vllm(None, trace, native_policy=policy, **setup))


class LongestPromptFirst(SchedulingPolicy):
    """A user policy with its own victim choice: admit long prompts first, preempt the request with
    the fewest computed tokens (least work lost)."""

    name = "lpf"

    def key(self, request):
        return -request.num_prompt_tokens

    def select_victim(self, running):
        return min(running, key=lambda r: (r.num_computed_tokens, -r.arrival_order))


def test_user_policy_object_with_custom_victim():
    trace = make_trace(60, seed=5)
    a = run_servelab(LongestPromptFirst(), trace, **SETUPS[0])
    b = run_vllm(make_scheduler_cls(LongestPromptFirst()), trace, **SETUPS[0])
    assert_same(a, b)
    assert sum(len(p) for _, p in a) > 0


def test_vtc_differs_from_fcfs_so_the_comparison_can_fail():
    trace = make_trace(60, seed=0)
    fcfs = run_vllm(make_scheduler_cls("fcfs"), trace, **SETUPS[0])
    vtc = run_vllm(make_scheduler_cls("vtc"), trace, **SETUPS[0])
    assert fcfs != vtc


class RaisingVictim(SchedulingPolicy):
    def key(self, request):
        return request.arrival_time

    def select_victim(self, running):
        raise RuntimeError("research bug")


def test_a_raising_victim_choice_falls_back_to_vllms_default():
    trace = make_trace(40, seed=3)
    log = run_vllm(make_scheduler_cls(RaisingVictim()), trace, **SETUPS[0])
    native = run_vllm(None, trace, native_policy="fcfs", **SETUPS[0])
    assert log == native  # FCFS order + vLLM's default victim (latest admitted)


def test_bridged_classes_pickle_resolve_by_path_and_validate_early():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = make_scheduler_cls("vtc", output_weight=4.0)
    clone = pickle.loads(pickle.dumps(cls))
    assert clone._servelab_policy_spec == ("vtc", {"output_weight": 4.0})
    sched = build_scheduler(clone)
    assert sched.servelab_policy.output_weight == 4.0
    by_path = resolve_obj_by_qualname("servelab.integrations.vllm.schedulers.sjf")
    assert by_path._servelab_policy_spec[0] == "sjf" and issubclass(by_path, type(sched).__mro__[-3])
    assert resolve_obj_by_qualname("servelab.integrations.vllm.schedulers.sjf_async").__mro__[2].__name__ == \
        "AsyncScheduler"
    with pytest.raises(ValueError, match="nope"):
        make_scheduler_cls("nope")
    with pytest.raises(ValueError, match="base"):
        make_scheduler_cls("fcfs", base="gpu")


def test_abort_while_waiting_leaves_the_queue_consistent():
    sched = build_scheduler(make_scheduler_cls("sjf"), num_blocks=200, max_num_seqs=1)
    for i in range(4):
        sched.add_request(make_request(f"a{i}", [500 + i] * (10 + i), 3))
    from vllm.v1.request import RequestStatus

    out = sched.schedule()
    sched.update_from_output(out, model_output(sched, out))
    sched.finish_requests(["a1", "a2"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.running] == ["a0"]
    assert [r.request_id for r in sched.waiting] == ["a3"] and len(sched.waiting) == 1
    admitted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        admitted += [r.req_id for r in out.scheduled_new_reqs]
        sched.update_from_output(out, model_output(sched, out))
    assert admitted == ["a3"] and not sched._servelab_views


def test_unsupported_versions_are_refused():
    from servelab.integrations.vllm._compat import UnsupportedVLLMVersion, check_version

    check_version("0.33.0")
    check_version("0.33.2+cpu")
    for bad in ("0.32.9", "0.34.0", "1.0.0"):
        with pytest.raises(UnsupportedVLLMVersion, match="0.33.x"):
            check_version(bad)
