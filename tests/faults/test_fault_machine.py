"""Fault injection: random requests through a ``Pipeline`` while faults fire at every stage.

A hypothesis state machine drives a pipeline on a tiny model (prefix caching
on, a KV pool small enough that requests get preempted, n-gram speculation
through a user drafter and verifier in some examples) with ``add_request`` /
``step`` / ``abort_request`` and whole ``generate`` calls, and arms one-shot
faults — an exception or a ``KeyboardInterrupt`` — at every stage of
``fault_helpers.STAGES``: the scheduler, the user policy's key / victim /
hooks, block allocation, the model forward (before or after it wrote the
KV), a logits processor, the verifier, the drafter, the detokenizer and the
stop check. The invariants are those of ``fault_driver.Driver``: no fault in
user code escapes a step, every request ends exactly once, greedy outputs
agree with a fresh pipeline's, and once faults stop: no leaked block, no
zombie, no orphan, no poisoned prefix cache.
"""

from __future__ import annotations

from fault_driver import MAX_TOKENS, PROMPTS, Driver
from fault_helpers import SPEC_STAGES, STAGES, Fault, uninstrument
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

_KINDS = st.sampled_from(["error", "interrupt"])
_WHEN = st.sampled_from(["before", "after"])
# Stages that see request ids (the others fire on the next call, whoever it is for).
_PER_REQUEST = frozenset(STAGES) - {"schedule", "forward", "verifier", "detokenize"}


class PipelineUnderFaults(RuleBasedStateMachine):
    """See the module docstring. Subclasses choose the attention backend."""

    backend = "torch"

    def __init__(self) -> None:
        super().__init__()
        self.driver: Driver | None = None

    @initialize(pool_slack=st.integers(0, 6), max_num_seqs=st.integers(1, 4), budget=st.integers(4, 24),
                spec=st.sampled_from([0, 0, 1, 2, 3]))
    def build(self, pool_slack, max_num_seqs, budget, spec):
        self.driver = Driver(self.backend, pool_slack=pool_slack, max_num_seqs=max_num_seqs, budget=budget,
                             spec=spec)

    def teardown(self) -> None:
        if self.driver is None:
            return
        try:
            self.driver.drain_and_check(probe=0)
        finally:
            uninstrument(self.driver.pipe)  # the model object is shared with later examples

    def _stage(self, stage: str) -> str:
        return "forward" if stage in SPEC_STAGES and not self.driver.spec else stage

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), kind=st.sampled_from(["greedy", "greedy", "sampled", "stop"]),
          max_tokens=st.integers(1, MAX_TOKENS))
    def add(self, prompt, kind, max_tokens):
        self.driver.add(prompt, kind, max_tokens)

    @rule(n=st.integers(1, 6))
    def run(self, n):
        for _ in range(n):
            self.driver.step()

    @precondition(lambda self: self.driver is not None and self.driver.live)
    @rule(which=st.integers(0, 100))
    def abort(self, which):
        live = sorted(self.driver.live)
        self.driver.abort(live[which % len(live)])
        self.driver.step()  # the abort's final event comes with the next step

    @rule(stage=st.sampled_from(STAGES), kind=_KINDS, pick=st.integers(0, 100), when=_WHEN)
    def arm(self, stage, kind, pick, when):
        stage = self._stage(stage)
        live = sorted(self.driver.live)
        rid = live[pick % len(live)] if stage in _PER_REQUEST and live and pick % 3 else None
        self.driver.plan.arm(Fault(stage, kind, rid, when if stage in ("schedule", "forward") else "before"))

    @precondition(lambda self: self.driver is not None and not self.driver.live)
    @rule(prompts=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=3),
          stage=st.sampled_from(STAGES), kind=_KINDS, when=_WHEN)
    def generate_under_fault(self, prompts, stage, kind, when):
        stage = self._stage(stage)
        self.driver.plan.arm(Fault(stage, kind, None, when if stage in ("schedule", "forward") else "before"))
        try:
            self.driver.generate(prompts)
        finally:
            self.driver.plan.disarm()

    @rule(probe=st.integers(0, len(PROMPTS) - 1))
    def drain_and_check(self, probe):
        self.driver.drain_and_check(probe)

    @invariant()
    def consistent(self):
        if self.driver is not None:
            self.driver.check_consistent()


_SETTINGS = dict(deadline=None, stateful_step_count=15,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class TorchAttentionMachine(PipelineUnderFaults):
    backend = "torch"


class SdpaAttentionMachine(PipelineUnderFaults):
    backend = "sdpa"


TestFaultsTorchAttention = TorchAttentionMachine.TestCase
TestFaultsTorchAttention.settings = settings(max_examples=70, **_SETTINGS)
TestFaultsSdpaAttention = SdpaAttentionMachine.TestCase
TestFaultsSdpaAttention.settings = settings(max_examples=130, **_SETTINGS)
