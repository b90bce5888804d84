"""Serving metrics in Prometheus' text format, under vLLM's names with a ``servelab:`` prefix.

The names, meanings and histogram buckets are vLLM's (``vllm:num_requests_running``
-> ``servelab:num_requests_running``...), so a Grafana board or a scraper
written for vLLM reads a servelab server by changing the prefix. Written here
rather than with ``prometheus_client``: eleven series do not justify a
dependency, and the text format (version 0.0.4) is small.

- Gauges: ``num_requests_running``, ``num_requests_waiting`` (the scheduler's
  queues after the last step), ``kv_cache_usage_perc`` (a fraction in [0, 1],
  as vLLM's: 1 means every block is in use).
- Counters: ``prompt_tokens_total``, ``generation_tokens_total``,
  ``request_success_total{finished_reason=...}``.
- Histograms (seconds): ``time_to_first_token_seconds``,
  ``inter_token_latency_seconds`` (one observation per step that gave a
  completion tokens), ``e2e_request_latency_seconds`` (arrival at the engine
  to the last output).

Observations come from the engine thread, renders from the event loop: one
lock guards both.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

__all__ = ["PREFIX", "Histogram", "ServeMetrics"]

PREFIX = "servelab:"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """A cumulative Prometheus histogram over fixed upper bounds (``le``)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*map(repr, map(float, self.buckets)), "+Inf"), self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        out += [f"{name}_sum {self.total!r}", f"{name}_count {self.count}"]
        return out


class ServeMetrics:
    """The server's metrics (see the module docstring); :meth:`render` gives the text format."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {reason: 0 for reason in FINISH_REASONS}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def set_gauges(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        with self._lock:
            self.num_running, self.num_waiting, self.kv_cache_usage = running, waiting, kv_cache_usage

    def record_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)
            self.prompt_tokens += num_prompt_tokens

    def record_inter_token(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def record_generated(self, num_tokens: int) -> None:
        with self._lock:
            self.generation_tokens += num_tokens

    def record_finished(self, output: Any, e2e_s: float) -> None:
        """A request ended (``output`` is its GenerationOutput)."""
        reason = output.finish_reason if output.finish_reason in self.finished else "error"
        with self._lock:
            self.finished[reason] += 1
            self.e2e.observe(e2e_s)

    def render(self) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        p = PREFIX
        with self._lock:
            lines = [
                f"# HELP {p}num_requests_running Requests in the running batch.",
                f"# TYPE {p}num_requests_running gauge", f"{p}num_requests_running {self.num_running}",
                f"# HELP {p}num_requests_waiting Requests waiting to be admitted.",
                f"# TYPE {p}num_requests_waiting gauge", f"{p}num_requests_waiting {self.num_waiting}",
                f"# HELP {p}kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
                f"# TYPE {p}kv_cache_usage_perc gauge", f"{p}kv_cache_usage_perc {self.kv_cache_usage!r}",
                f"# HELP {p}prompt_tokens_total Prefill tokens processed (prompt tokens of requests that started).",
                f"# TYPE {p}prompt_tokens_total counter", f"{p}prompt_tokens_total {self.prompt_tokens}",
                f"# HELP {p}generation_tokens_total Generation tokens processed.",
                f"# TYPE {p}generation_tokens_total counter", f"{p}generation_tokens_total {self.generation_tokens}",
                f"# HELP {p}request_success_total Finished requests, by finish reason.",
                f"# TYPE {p}request_success_total counter",
                *(f'{p}request_success_total{{finished_reason="{reason}"}} {count}'
                  for reason, count in self.finished.items()),
            ]
            for name, hist, what in (("time_to_first_token_seconds", self.ttft, "Time to first token."),
                                     ("inter_token_latency_seconds", self.itl, "Inter-token latency."),
                                     ("e2e_request_latency_seconds", self.e2e, "End-to-end request latency.")):
                lines += [f"# HELP {p}{name} {what}", f"# TYPE {p}{name} histogram", *hist.lines(p + name)]
        return "\n".join(lines) + "\n"
