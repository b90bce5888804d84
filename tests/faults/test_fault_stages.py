"""One fault at one stage, every stage: the fault matrix (stage x exception/interrupt).

A pipeline with a warm prefix cache runs four requests (greedy, one with a
stop string, sampled) in a KV pool small enough to preempt, and one fault is
armed at a stage (see ``fault_helpers.STAGES``), aimed at the stop-string
request where the stage sees request ids. Each case checks that the fault
fired, then every invariant of ``fault_driver.Driver`` (no escaping user
fault, every request ended exactly once, greedy outputs agree with a fresh
pipeline, no leak / zombie / orphan, no poisoned cache). The same faults are
also injected into whole ``generate`` calls. Failures name the stage, so this
matrix says where a regression is; the state machine
(``test_fault_machine.py``) finds the combinations.
"""

from __future__ import annotations

import pytest
from fault_driver import DRAIN_STEPS, Driver
from fault_helpers import SPEC_STAGES, STAGES, Fault, uninstrument

_PER_REQUEST = frozenset(STAGES) - {"schedule", "forward", "verifier", "detokenize", "policy_key", "policy_victim"}
CASES = [(stage, kind, when) for stage in STAGES for kind in ("error", "interrupt")
         for when in (("before", "after") if stage in ("schedule", "forward") else ("before",))]


def _driver(stage: str) -> Driver:
    driver = Driver("torch", pool_slack=1, max_num_seqs=3, budget=10, spec=2 if stage in SPEC_STAGES else 0)
    driver.generate([0])  # warm: the prefix blocks of prompt 0 are cached
    return driver


def _run(driver: Driver) -> None:
    for _ in range(DRAIN_STEPS):
        if not driver.pipe.has_unfinished_requests():
            break
        driver.step()
        driver.check_consistent()


@pytest.mark.parametrize("stage,kind,when", CASES)
def test_fault_in_steps(stage, kind, when):
    driver = _driver(stage)
    try:
        if stage == "policy_key":  # key() runs when a request is queued: the add itself fails
            driver.plan.arm(Fault(stage, kind, None, when))
        rids = [driver.add(0, "greedy"), driver.add(3, "stop"), driver.add(6, "greedy"), driver.add(1, "sampled")]
        target = rids[1] if stage in _PER_REQUEST else None
        if stage != "policy_key":
            driver.plan.arm(Fault(stage, kind, target, when))
        _run(driver)
        assert driver.plan.fired, f"the scenario never reached stage {stage!r}"
        driver.drain_and_check(probe=3)
    finally:
        uninstrument(driver.pipe)


@pytest.mark.parametrize("stage,kind,when", [c for c in CASES if c[0] != "stop"])
def test_fault_in_generate(stage, kind, when):
    """``generate`` with a fault armed returns or raises with nothing left
    behind; the next ``generate`` gives a fresh pipeline's output."""
    driver = _driver(stage)
    try:
        driver.plan.arm(Fault(stage, kind, None, when))
        driver.generate([0, 3, 6, 1])
        assert driver.plan.fired, f"generate never reached stage {stage!r}"
        driver.drain_and_check(probe=0)
    finally:
        uninstrument(driver.pipe)


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_an_interrupt_while_failing_a_delivery_keeps_the_other_outputs(backend):
    """Found by the state machine: a step delivers two requests' tokens; the first's
    detokenizer raises, and failing that request is interrupted in its policy's
    ``on_request_finished``. The second request's token (already applied by the
    scheduler) must still reach the caller, not vanish from its output."""
    driver = Driver(backend, pool_slack=1, max_num_seqs=2, budget=14)
    try:
        driver.generate([0])  # warm: the second request's prefill is then one step
        rids = [driver.add(0, "greedy", max_tokens) for max_tokens in (5, 3, 5, 4)]
        driver.step()
        driver.plan.arm(Fault("policy_finish", "interrupt", rids[0]))
        driver.plan.arm(Fault("detokenize", "error"))
        _run(driver)
        assert [f.stage for f in driver.plan.fired] == ["detokenize", "policy_finish"]
        driver.drain_and_check(probe=0)
    finally:
        uninstrument(driver.pipe)


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_a_request_ended_by_an_interrupted_schedule_is_still_delivered(backend):
    """Found by the state machine: ``schedule()`` is interrupted in ``on_tokens_scheduled``, and
    putting the request back fails in ``key()``, so the scheduler ends it (its final output kept
    for the next step) and holds nothing else. ``has_unfinished_requests()`` must still say so,
    or a loop on it stops with the request never ended."""
    driver = Driver(backend, pool_slack=0, max_num_seqs=1, budget=4)
    try:
        rid = driver.add(0, "greedy", 1)
        driver.plan.arm(Fault("policy_key", "error"))
        driver.plan.arm(Fault("policy_tokens", "interrupt"))
        driver.step()
        assert [f.stage for f in driver.plan.fired] == ["policy_tokens", "policy_key"]
        assert driver.pipe.has_unfinished_requests()
        driver.drain_and_check(probe=0)
        assert driver.ended[rid] == 1
    finally:
        uninstrument(driver.pipe)
