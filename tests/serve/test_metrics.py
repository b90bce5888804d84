"""Prometheus rendering: histogram buckets are cumulative counts of observations <= le (held to a
naive count), names carry the servelab: prefix and vLLM's names, and the text parses line by line."""

import math

from hypothesis import given, strategies as st

from servelab.serve.metrics import TTFT_BUCKETS, Histogram, ServeMetrics


@given(st.lists(st.floats(0, 5000, allow_nan=False), max_size=50))
def test_histogram_buckets_are_cumulative_counts(values):
    hist = Histogram(TTFT_BUCKETS)
    for v in values:
        hist.observe(v)
    lines = hist.lines("x")
    buckets = {line.split('"')[1]: int(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("x_bucket")}
    for bound in TTFT_BUCKETS:
        assert buckets[repr(float(bound))] == sum(v <= bound for v in values)
    assert buckets["+Inf"] == len(values) == int(lines[-1].rsplit(" ", 1)[1])
    assert math.isclose(float(lines[-2].rsplit(" ", 1)[1]), sum(values), rel_tol=1e-9, abs_tol=1e-9)


def test_render_names_and_values():
    metrics = ServeMetrics()
    metrics.set_gauges(3, 2, 0.25)
    metrics.record_first_token(0.05, 7)
    metrics.record_generated(4)
    metrics.record_inter_token(0.02)
    text = metrics.render()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples["servelab:num_requests_running"] == "3" and samples["servelab:num_requests_waiting"] == "2"
    assert samples["servelab:kv_cache_usage_perc"] == "0.25" and samples["servelab:prompt_tokens_total"] == "7"
    assert samples["servelab:generation_tokens_total"] == "4"
    assert samples['servelab:time_to_first_token_seconds_bucket{le="0.04"}'] == "0"
    assert samples['servelab:time_to_first_token_seconds_bucket{le="0.06"}'] == "1"
    assert "# TYPE servelab:inter_token_latency_seconds histogram" in text
