"""Stateful test: random arrivals, aborts, lengths, drafts, stop tokens, tiny KV
pools (forcing preemption) and chunk sizes against the real scheduler and
KV cache manager, with a fake model.

Checked after every ``schedule()``:

- scheduled tokens <= the budget, and add up to ``total_num_scheduled_tokens``;
- running requests <= ``max_num_seqs``;
- every scheduled request holds blocks covering ``num_computed_tokens`` (which
  now includes this step's tokens);
- no request is both waiting and running; waiting + running = unfinished;
  waiting requests hold no blocks; statuses match the queues;
- a preempted request is not scheduled in the same step; per-request caps
  (``long_prefill_token_threshold``, drafts) hold;
- block reference counts equal the blocks requests hold;
- a model runner rebuilding block tables from outputs alone agrees with the
  manager;
- commit after compute: every block findable by prefix lookup holds KV that a
  completed step wrote (a (hash, block) pair seen covered by computed tokens
  after an ``update_from_output``), never a block of the step just scheduled.

Faults are injected too: failed model steps (``rollback_step``), runner
errors for some requests (``ModelRunnerOutput.errors``), ``fail_requests``,
and a "flaky" policy whose ``key`` / hooks / ``select_victim`` raise an
``Exception`` or ``KeyboardInterrupt`` once when armed. After each, the
queues are consistent again.

At the end (teardown drains the scheduler): every request ended exactly once,
and every block but the null block is free.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from sched_helpers import EOS, TOKEN, RunnerMirror, StepClock

from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.samplers.params import SamplingParams
from servelab.scheduling import FCFSPolicy, ModelRunnerOutput, Request, RequestStatus, Scheduler, SchedulerConfig

PREFIXES = [list(range(1000, 1032)), list(range(2000, 2032))]
HOOKS = ["key", "select_victim", "on_request_added", "on_tokens_scheduled", "on_request_finished"]


class FlakyPolicy(FCFSPolicy):
    """FCFS whose ``fault`` = (hook, exception type), when armed, raises once
    from that hook."""

    name = "flaky"

    def __init__(self) -> None:
        self.fault = None

    def _hit(self, hook: str) -> None:
        if self.fault is not None and self.fault[0] == hook:
            exc, self.fault = self.fault[1], None
            raise exc(f"injected fault in {hook}")

    def key(self, request):
        self._hit("key")
        return request.arrival_time

    def select_victim(self, running):
        self._hit("select_victim")
        return max(running, key=lambda r: (r.arrival_time, r.arrival_order))

    def on_request_added(self, request):
        self._hit("on_request_added")

    def on_tokens_scheduled(self, request, num_new_tokens):
        self._hit("on_tokens_scheduled")

    def on_request_finished(self, request):
        self._hit("on_request_finished")


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        pool_tokens=st.integers(4, 48),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        max_model_len=st.integers(12, 48),
        chunked=st.booleans(),
        threshold=st.sampled_from([0, 0, 1, 3, 8]),
        num_spec=st.sampled_from([0, 0, 1, 3]),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.0, 0.2]),
        policy=st.sampled_from(["fcfs", "priority", "sjf", "vtc", "flaky"]),
    )
    def setup(self, block_size, pool_tokens, budget, max_num_seqs, max_model_len, chunked, threshold, num_spec,
              caching, watermark, policy):
        if not chunked:
            budget, threshold = max(budget, max_model_len), 0
        # Sized in tokens so that most requests fit alone but a few together do not.
        num_blocks = max(pool_tokens // block_size, 1) + 1
        self.config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len, enable_chunked_prefill=chunked,
                                      long_prefill_token_threshold=threshold, num_speculative_tokens=num_spec)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=4, dtype="float32")
        self.kv = KVCacheManager(spec, num_blocks, caching, watermark=watermark)
        self.sched = Scheduler(self.config, self.kv, FlakyPolicy() if policy == "flaky" else policy,
                               clock=StepClock())
        self.mirror = RunnerMirror()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.next_id = 0
        self.added: set[str] = set()
        self.ended: dict[str, str] = {}
        self.reqs: dict[str, Request] = {}
        self.written: set[tuple[object, int]] = set()  # (block hash, block id) whose KV a finished step wrote
        self.rolled_back = False  # the next output may reschedule what it lists as preempted

    # ---- rules ---------------------------------------------------------------

    @rule(batch=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 12), st.integers(0, 2),
                                   st.sampled_from([None, 0, 1]), st.integers(0, 2), st.sampled_from("ab"),
                                   st.booleans()), min_size=1, max_size=3))
    def add(self, batch):
        for args in batch:
            self.add_one(*args)

    def add_one(self, prompt_len, max_tokens, min_tokens, prefix, priority, client, ignore_eos):
        rid = f"r{self.next_id}"
        self.next_id += 1
        base = PREFIXES[prefix] if prefix is not None else []
        prompt = (base + list(range(5000 + 50 * self.next_id, 5000 + 50 * self.next_id + prompt_len)))[:prompt_len]
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos)
        request = Request(rid, prompt, params, priority=priority, client_id=client, eos_token_id=EOS,
                          arrival_time=self.sched.clock())
        unfinished = self.sched.get_num_unfinished_requests()
        if prompt_len > self.config.max_model_len:
            try:
                self.sched.add_request(request)
            except ValueError as exc:
                assert "max_model_len" in str(exc)
            else:
                raise AssertionError("a prompt over max_model_len was accepted")
            assert self.sched.get_num_unfinished_requests() == unfinished
            return
        try:
            self.sched.add_request(request)
        except (RuntimeError, ValueError, KeyboardInterrupt) as exc:
            assert "injected fault" in str(exc), exc
            assert rid not in self.sched.requests and self.sched.get_num_unfinished_requests() == unfinished
            self.check_queues()
            return
        self.added.add(rid)
        self.reqs[rid] = request

    @rule(prompt_lens=st.lists(st.integers(4, 12), min_size=3, max_size=4), rnd=st.randoms(use_true_random=False))
    def burst(self, prompt_lens, rnd):
        """Several long-running requests at once, then steps: memory pressure."""
        for n in prompt_lens:
            self.add_one(n, 12, 0, rnd.choice([None, 0]), rnd.randint(0, 2), rnd.choice("ab"), True)
        self.step(rnd, 8, 0.0, False, False)

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data(), go=st.integers(0, 2))
    def add_duplicate(self, data, go):
        if go:  # keep this rare: it changes nothing
            return
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        try:
            self.sched.add_request(Request(rid, [1, 2], SamplingParams(max_tokens=1)))
        except ValueError as exc:
            assert "duplicate request id" in str(exc)
        else:
            raise AssertionError("a duplicate id was accepted")

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data(), go=st.integers(0, 2))
    def abort_one(self, data, go):
        if go:  # rarer than steps, so most requests run to their end
            return
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.abort(rid)

    def abort(self, rid):
        """abort_request; an interrupted on_request_finished still ends the request."""
        try:
            assert self.sched.abort_request(rid)
        except KeyboardInterrupt:
            assert rid not in self.sched.requests
        self.check_queues()

    @rule(rnd=st.randoms(use_true_random=False), num_steps=st.integers(1, 6), eos_rate=st.sampled_from([0.0, 0.2]),
          abort_midstep=st.sampled_from([False, False, True]), drop_one=st.sampled_from([False, False, True]))
    def step(self, rnd, num_steps, eos_rate, abort_midstep, drop_one):
        for _ in range(num_steps):
            out = self.schedule()
            if out is None:
                return
            if abort_midstep and out.num_scheduled_tokens:
                rid = rnd.choice(sorted(out.num_scheduled_tokens))
                if rid in self.sched.requests:
                    self.abort(rid)
            self.finish_step(out, rnd, eos_rate, drop_one)

    @rule(go=st.integers(0, 3))
    def failed_step(self, go):
        """The model runner fails after taking the step: roll it back."""
        if go:  # faults are rarer than steps, so requests still meet memory pressure
            return
        event("rollback_step")
        out = self.schedule()
        if out is None:
            return
        try:
            self.sched.rollback_step(out)
        except KeyboardInterrupt:
            pass
        self.rolled_back = True
        self.check_queues()
        for rid in out.num_scheduled_tokens:
            r = self.reqs[rid]
            if not r.is_finished:
                assert r.num_computed_tokens == 0 and self.kv.get_block_ids(rid) == ([],)

    @rule(rnd=st.randoms(use_true_random=False), go=st.integers(0, 3))
    def runner_errors(self, rnd, go):
        """The runner reports errors for some scheduled requests."""
        if go:
            return
        out = self.schedule()
        if out is None:
            return
        errors = {rid: f"runner error {rid}" for rid in out.num_scheduled_tokens if rnd.random() < 0.3}
        self.finish_step(out, rnd, errors=errors)
        for rid in errors:
            r = self.reqs[rid]
            assert r.is_finished, f"{rid} named in errors is still unfinished"
            assert self.ended.get(rid, "error") == "error"

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data(), go=st.integers(0, 3))
    def fail_some(self, data, go):
        if go:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.sched.requests) + ["nope"]), max_size=2))
        try:
            outs = self.sched.fail_requests(ids, "failed from outside")
        except KeyboardInterrupt:  # on_request_finished: the outputs come with the next update
            outs = []
        for o in outs:
            self.record_end(o)
        self.check_queues()

    @precondition(lambda self: isinstance(self.sched.policy, FlakyPolicy))
    @rule(hook=st.sampled_from(HOOKS), exc=st.sampled_from([RuntimeError, ValueError, KeyboardInterrupt]))
    def arm_fault(self, hook, exc):
        event(f"armed {hook}")
        self.sched.policy.fault = (hook, exc)

    # ---- helpers ----------------------------------------------------------------

    def model_output(self, out, rnd, eos_rate, drop_one) -> ModelRunnerOutput:
        ids, sampled, drafts = [], [], []
        for rid in out.num_scheduled_tokens:
            r = self.sched.requests.get(rid)
            if r is None:
                continue
            if drop_one and rnd.random() < 0.3:
                continue  # the runner lost this one: its last position is recomputed
            ids.append(rid)
            if r.num_computed_tokens < r.num_tokens:
                sampled.append([])
            else:
                proposed = out.scheduled_spec_decode_tokens.get(rid, [])
                accepted = proposed[:rnd.randint(0, len(proposed))]
                sampled.append(accepted + [EOS if rnd.random() < eos_rate else TOKEN])
            k = self.config.num_speculative_tokens
            drafts.append([rnd.choice([TOKEN, 11, EOS]) for _ in range(rnd.randint(0, k))] if k else [])
        return ModelRunnerOutput(ids, sampled, spec_token_ids=drafts)

    def schedule(self):
        """``schedule()`` and its checks; None when a policy fault interrupted it."""
        try:
            out = self.sched.schedule()
        except KeyboardInterrupt:
            self.rolled_back = True
            self.check_queues()
            return None
        self.check_step(out)
        return out

    def record_end(self, o):
        assert o.request_id not in self.ended, f"{o.request_id} ended twice"
        assert o.finish_reason in ("stop", "length", "abort", "error")
        self.ended[o.request_id] = o.finish_reason

    def finish_step(self, out, rnd=None, eos_rate=0.0, drop_one=False, errors=None):
        import random

        rnd = rnd or random.Random(0)
        held = {rid: self.kv.get_block_ids(rid) for rid in out.num_scheduled_tokens}
        model_output = self.model_output(out, rnd, eos_rate, drop_one)
        model_output.errors = {rid: m for rid, m in (errors or {}).items() if rid in self.sched.requests}
        try:
            results = self.sched.update_from_output(out, model_output)
        except KeyboardInterrupt:  # requests it had not reached are rolled back, as after a failed step
            results = []
            self.rolled_back = True
            self.check_queues()
        for o in results:
            if o.finished:
                self.record_end(o)
        self.note_written(held)
        self.sched.clock.now += 1.0

    def note_written(self, held):
        """After an update: blocks covered by computed tokens hold written KV."""
        bs = self.block_size
        for rid, ids_before in held.items():
            r = self.reqs[rid]
            ids = self.kv.get_block_ids(rid) if r.status is RequestStatus.RUNNING else ids_before
            n = min(r.num_computed_tokens, r.num_tokens) // bs
            for h, b in zip(r.block_hashes[:n], ids[0][:n]):  # one KV-cache group
                self.written.add((h, b))

    def check_queues(self):
        """The partition of unfinished requests, and block accounting."""
        sched, kv = self.sched, self.kv
        running = {r.request_id for r in sched.running}
        waiting = [r.request_id for r in sched.waiting]
        assert len(waiting) == len(set(waiting)) == len(sched.waiting)
        assert not running & set(waiting), "a request is both waiting and running"
        assert running | set(waiting) == set(sched.requests), "a request is in no queue (orphan)"
        assert len(running) == len(sched.running)
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert kv.get_block_ids(r) == ([],) and r.num_computed_tokens == 0
        held = sum(len(b) for b in kv.req_to_blocks.values())
        refs = sum(b.ref_cnt for b in kv.block_pool.blocks[1:])
        assert held == refs, "block reference counts do not match the blocks requests hold"
        assert set(kv.req_to_blocks) <= running, "a request that is not running holds blocks"

    def check_step(self, out):
        sched, cfg, kv = self.sched, self.config, self.kv
        nst = out.num_scheduled_tokens
        assert sum(nst.values()) == out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert all(n > 0 for n in nst.values())
        assert len(sched.running) <= cfg.max_num_seqs
        self.check_queues()
        if not self.rolled_back:
            assert not out.preempted_req_ids & nst.keys()
        self.rolled_back = False
        for h, block in kv.block_pool.cached_block_hash_to_block.items():
            assert (h, block.block_id) in self.written, "an uncomputed block is findable by prefix lookup"
        self.mirror.apply(out)
        for rid, n in nst.items():
            r = sched.requests[rid]
            assert len(kv.get_block_ids(rid)[0]) * self.block_size >= r.num_computed_tokens, "blocks do not cover"
            assert r.num_computed_tokens <= min(r.num_tokens_with_spec, cfg.max_model_len)
            if cfg.long_prefill_token_threshold:
                assert n <= cfg.long_prefill_token_threshold
            assert len(out.scheduled_spec_decode_tokens.get(rid, ())) <= cfg.num_speculative_tokens
            assert self.mirror.rows[rid] == kv.get_block_ids(rid), "runner's block table diverged"
        assert kv.num_free_blocks + sum(1 for b in kv.block_pool.blocks[1:] if b.ref_cnt > 0) == self.num_blocks - 1

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        if isinstance(self.sched.policy, FlakyPolicy):
            self.sched.policy.fault = None
        for _ in range(5000):
            if not self.sched.has_unfinished_requests():
                break
            out = self.schedule()
            self.finish_step(out)
        else:
            raise AssertionError(f"scheduler did not drain: {self.sched.requests}")
        self.finish_step(self.sched.schedule())  # collect ends noted after the last update
        assert set(self.ended) == self.added, "some request never ended"
        assert not self.sched.running and len(self.sched.waiting) == 0
        assert self.kv.num_free_blocks == self.num_blocks - 1, "blocks leaked"
        # Coverage signals (--hypothesis-show-statistics): the pools must force preemption and failures.
        event(f"preempted: {self.sched.num_preemptions > 0}")
        for reason in sorted(set(self.ended.values())):
            event(f"ended by {reason}")
        if self.kv.prefix_cache_stats.hit_tokens:
            event("prefix hits")


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerStateful = SchedulerMachine.TestCase
