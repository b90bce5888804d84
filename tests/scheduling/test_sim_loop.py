"""The one simulation loop: what it skips changes nothing (backlog, lazy reading, prefix hashes computed once)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.scheduling.policies import FCFSPolicy
from servelab.scheduling.request import Request
from servelab.scheduling.simulator import LengthDist, TraceRequest, WorkloadSpec, generate_workload, simulate
from servelab.scheduling.simulator.loop import RequestFactory, is_arrival_ordered, step_timer
from servelab.scheduling.simulator.workload import iter_workload

BUSY = WorkloadSpec(num_requests=400, rate=300, prompt_len=LengthDist("lognormal", 96, 0.6),
                    output_len=LengthDist("lognormal", 24, 0.6), num_prefix_groups=3, prefix_len=40, seed=11)


class _FCFSWithoutBacklog(FCFSPolicy):
    """fcfs, but not recognised as arrival-ordered: every arrival goes straight to the scheduler."""


def _figures(res):
    return (res.num_steps, res.num_preemptions, np.sort(res.ttft), np.sort(res.e2e), res.prefix_hit_rate)


def test_the_fcfs_backlog_changes_no_figure_of_an_overloaded_run():
    assert is_arrival_ordered(FCFSPolicy()) and not is_arrival_ordered(_FCFSWithoutBacklog())
    fed = simulate(BUSY, "fcfs", num_blocks=160)
    direct = simulate(BUSY, _FCFSWithoutBacklog(), num_blocks=160)
    assert fed.num_preemptions > 0 and max(fed.ttft) > 1.0, "the run must queue and preempt"
    for a, b in zip(_figures(fed), _figures(direct)):
        np.testing.assert_array_equal(a, b)


def test_a_generator_a_list_and_a_spec_give_the_same_run():
    requests = generate_workload(BUSY)
    assert [r.request_id for r in iter_workload(BUSY)] == [r.request_id for r in requests]
    from_list = simulate(requests, num_blocks=160)
    from_spec = simulate(BUSY, num_blocks=160)
    from_stream = simulate((r for r in requests), num_blocks=160)
    for a, b, c in zip(_figures(from_list), _figures(from_spec), _figures(from_stream)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_a_stream_out_of_arrival_order_or_invalid_is_refused_naming_the_request():
    late = [TraceRequest("a", 1.0, [1, 2], 2), TraceRequest("b", 0.5, [1, 2], 2)]
    with pytest.raises(ValueError, match=r"workload\[1\] \(request 'b'\) arrives at 0.5"):
        simulate(iter(late))
    with pytest.raises(ValueError, match="max_tokens=0"):
        simulate(iter([TraceRequest("a", 0.0, [1], 0)]))
    with pytest.raises(TypeError, match="cost_model must have time_of"):
        step_timer(object())


@settings(max_examples=40, deadline=None)
@given(block_size=st.integers(1, 20), prefix_len=st.integers(0, 70), rest=st.integers(1, 50),
       seed=st.integers(0, 2 ** 16))
def test_shared_prefix_hashes_reused_equal_hashing_from_scratch(block_size, prefix_len, rest, seed):
    spec = WorkloadSpec(num_requests=3, rate=10, prompt_len=LengthDist("fixed", rest), output_len=LengthDist("fixed", 2),
                        num_prefix_groups=1 if prefix_len else 0, prefix_len=prefix_len, seed=seed)
    build = RequestFactory(block_size=block_size)
    for trace in generate_workload(spec):
        for fast in (build(trace), build.decode_half(trace)):
            slow = Request("x", list(fast.prompt_token_ids), hash_fn="xxhash")
            slow.init_block_hasher(block_size)
            assert fast.block_hashes == slow.block_hashes
            assert len(fast.block_hashes) == len(fast.prompt_token_ids) // block_size
    with pytest.raises(ValueError, match="known_hashes has 2 blocks"):
        Request("y", [1, 2, 3], hash_fn="xxhash").init_block_hasher(2, [b"a", b"b"])


def test_the_vllm_step_view_reads_as_the_scheduler_output_it_mirrors():
    from servelab.blocks import FullAttentionSpec, KVCacheManager
    from servelab.scheduling import Scheduler, SchedulerConfig
    from servelab.scheduling.output import ModelRunnerOutput
    from servelab.scheduling.simulator.features import step_features
    from servelab.scheduling.simulator.vllm_engine import StepView

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16")
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=300), KVCacheManager(spec, 64, True, max_model_len=8192))
    build = RequestFactory()
    for trace in generate_workload(WorkloadSpec(num_requests=6, rate=10, seed=1)):
        sched.add_request(build(trace))
    seen = 0
    while sched.requests and seen < 40:
        out = sched.schedule()
        assert step_features(StepView(out, sched.requests)) == step_features(out)
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(ids, [[7]] * len(ids)))
        seen += 1
    assert seen > 5


class _FakeVllmScheduler:
    """vLLM's scheduler surface that simulate(engine="vllm") drives, played by servelab's own
    scheduler: the adapter and the loop around it must then reproduce servelab's figures exactly."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
                 enable_prefix_caching, watermark, **_):
        from types import SimpleNamespace

        from servelab.blocks import FullAttentionSpec, KVCacheManager
        from servelab.scheduling import Scheduler, SchedulerConfig

        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype="float16")
        self.kv = KVCacheManager(spec, num_blocks, enable_prefix_caching, max_model_len=max_model_len,
                                 watermark=watermark)
        self.inner = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                               max_num_batched_tokens=max_num_batched_tokens), self.kv)
        self.requests = self.inner.requests
        self._ns = SimpleNamespace

    waiting = property(lambda self: self._ns(peek_request=lambda: None, __bool__=lambda: False))
    running = property(lambda self: self.inner.running)

    def add_request(self, request):
        self.inner.add_request(request)

    def schedule(self):
        out = self.inner.schedule()
        new = [self._ns(req_id=d.req_id, num_computed_tokens=d.num_computed_tokens) for d in out.scheduled_new_reqs]
        return self._ns(num_scheduled_tokens=out.num_scheduled_tokens, scheduled_new_reqs=new, inner=out,
                        total_num_scheduled_tokens=out.total_num_scheduled_tokens)

    def update_from_output(self, out, model_output):
        outs = self.inner.update_from_output(out.inner, model_output)
        return {0: self._ns(outputs=[self._ns(request_id=o.request_id, new_token_ids=o.new_token_ids,
                                              finish_reason=o.finish_reason) for o in outs])}

    def get_kv_cache_usage(self):
        return self.kv.usage


def test_the_vllm_engine_adapter_on_the_one_loop_reproduces_the_scheduler_it_drives(monkeypatch):
    import sys
    from types import ModuleType, SimpleNamespace

    from servelab.scheduling.output import ModelRunnerOutput

    harness = ModuleType("servelab.integrations.vllm.harness")
    harness.build_scheduler = lambda cls, **kw: _FakeVllmScheduler(**kw)
    harness.make_request = lambda rid, prompt, max_tokens, *, arrival_time, priority, client_id, block_size: \
        Request(rid, prompt, RequestFactory().params(max_tokens), arrival_time=arrival_time, priority=priority,
                client_id=client_id, hash_fn="xxhash")
    harness.model_output = lambda sched, out, token: ModelRunnerOutput(list(out.num_scheduled_tokens),
                                                                       [[token]] * len(out.num_scheduled_tokens))
    request_mod = ModuleType("vllm.v1.request")
    request_mod.RequestStatus = SimpleNamespace(FINISHED_ERROR="error")
    package = ModuleType("servelab.integrations.vllm")
    package.make_scheduler_cls = lambda policy: None
    for name, module in (("servelab.integrations.vllm", package),
                         ("servelab.integrations.vllm.harness", harness), ("vllm", ModuleType("vllm")),
                         ("vllm.v1", ModuleType("vllm.v1")), ("vllm.v1.request", request_mod)):
        monkeypatch.setitem(sys.modules, name, module)
    from servelab.scheduling.simulator.cost_model import StepCostModel

    cost = StepCostModel(2e-3, 3e-5, 1e-7, per_seq_s=1e-3, per_decode_restart_s=2e-3)
    too_long = TraceRequest("too-long", 0.05, [1] * 9000, 4)  # over max_model_len: refused at arrival
    trace = sorted([*generate_workload(BUSY), too_long], key=lambda r: r.arrival_time)
    via_vllm = simulate(trace, "vllm-fcfs", engine="vllm", num_blocks=160, cost_model=cost)
    ours = simulate(trace, "fcfs", num_blocks=160, cost_model=cost)
    assert via_vllm.policy == "vllm-fcfs" and via_vllm.num_failed == ours.num_failed == 1
    for a, b in zip(_figures(via_vllm), _figures(ours)):
        np.testing.assert_allclose(a, b, rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), max_size=30), batch=st.integers(1, 7), seed=st.integers(0, 1000))
def test_inter_token_gaps_equal_the_per_request_diffs_concatenated(lengths, batch, seed):
    from servelab.scheduling.request import RequestMetrics
    from servelab.scheduling.simulator.metrics import inter_token_gaps

    rng = np.random.default_rng(seed)
    ms = [RequestMetrics(f"r{i}", "c", 0, "length", 4, n, 0, 0, 0, 0, 0.0, 0.0, None, 1.0,
                         np.cumsum(rng.random(n)).tolist()) for i, n in enumerate(lengths)]
    want = [np.diff(m.token_times) for m in ms if len(m.token_times) > 1]
    got = inter_token_gaps(ms, batch=batch)
    np.testing.assert_array_equal(got, np.concatenate(want) if want else np.array([]))
    assert got.dtype == np.float64
