"""Exact streaming percentiles (simulator/quantiles.py) against np.percentile, and the
simulator's ITL summary against the summary of the materialised gaps."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.scheduling.simulator.quantiles import streaming_percentiles

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.one_of(finite, st.sampled_from([0.0, 1.0, 0.068, 1e-300, -2.5])), min_size=1,
                       max_size=300),
       cuts=st.lists(st.integers(0, 300), max_size=6),
       qs=st.lists(st.sampled_from([0, 1, 25, 50, 90, 99, 99.9, 100]), min_size=1, max_size=4))
def test_streaming_percentiles_equal_numpy_bit_for_bit(values, cuts, qs):
    a = np.array(values, dtype=np.float64)
    bounds = sorted({0, len(a), *(c for c in cuts if c < len(a))})
    chunks = [a[lo:hi] for lo, hi in zip(bounds, bounds[1:])]
    count, mean, got = streaming_percentiles(lambda: iter(chunks), qs)
    assert count == len(a)
    want = np.percentile(a, qs)
    np.testing.assert_array_equal(np.array(got), want)
    if np.isfinite(a).all() and np.abs(a).max() < 1e300:
        np.testing.assert_allclose(mean, a.mean(), rtol=1e-9, atol=1e-300)


def test_streaming_percentiles_of_nothing_are_nan():
    count, mean, got = streaming_percentiles(lambda: iter([np.array([])]), (50, 99))
    assert count == 0 and np.isnan(mean) and all(np.isnan(g) for g in got)


def test_the_simulator_itl_summary_equals_the_summary_of_the_gaps():
    from servelab.scheduling.simulator import WorkloadSpec, simulate
    from servelab.scheduling.simulator.metrics import LatencySummary

    r = simulate(WorkloadSpec(num_requests=60, rate=20.0, seed=3), "fcfs")
    got, want = r.latency("itl"), LatencySummary.of(r.itl, failed=r.num_failed)
    assert (got.p50, got.p90, got.p99, got.count, got.failed) == (want.p50, want.p90, want.p99, want.count,
                                                                   want.failed)
    assert got.count > 1000 and abs(got.mean - want.mean) <= 1e-12 * abs(want.mean)


def test_the_simulator_reads_ends_only_and_runs_the_same_without_running_outputs(monkeypatch):
    """The loop turns the scheduler's per-step outputs of running requests off
    (``Scheduler.emit_running_outputs``): same results as with them on."""
    from servelab.scheduling.simulator import WorkloadSpec, loop, simulate

    spec = WorkloadSpec(num_requests=80, rate=40.0, seed=5)
    seen: list[bool] = []
    original = loop.Replica.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self.sched.emit_running_outputs)

    monkeypatch.setattr(loop.Replica, "__init__", record)
    quiet = simulate(spec, "fcfs")

    def emit(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.sched.emit_running_outputs = True

    monkeypatch.setattr(loop.Replica, "__init__", emit)
    loud = simulate(spec, "fcfs")
    assert seen == [False]
    a, b = quiet.summary(), loud.summary()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b and a["requests"] == 80
